"""The shell/file bundled tasks under a real shell: solutions and evaluators on this host.

The memory desktop interprets commands itself; this test checks that the scripted solutions
and the evaluators agree under real ``/bin/sh`` and coreutils too (what the jailed local
sandbox runs). ``/home/user`` is rewritten to a temporary directory; editor tasks need a
display and are covered by the local backend's end-to-end test.
"""

import asyncio
import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from osworld_jax.env import bundled_task_dir
from osworld_jax.env.actions import ActionKind, parse_action
from osworld_jax.env.evaluators import evaluate_task
from osworld_jax.env.setup import SetupContext, run_setup
from osworld_jax.env.tasks import iter_task_files, load_task

SOLUTIONS = json.loads((Path(__file__).parent / "bundled_solutions.json").read_text())["tasks"]
FILES = {p.stem: p for p in iter_task_files(bundled_task_dir())}
SHELL_TASKS = sorted(
    tid for tid, p in FILES.items() if not any(s.type == "launch" for s in load_task(p).config)
)


class HostVM:
    """``VMProtocol`` over this host's filesystem and shell (test only, no jail)."""

    async def execute(self, command, *, shell=False):
        r = subprocess.run(
            command,
            shell=shell or isinstance(command, str),
            capture_output=True,
            text=True,
            timeout=30,
        )
        return {
            "status": "success" if r.returncode == 0 else "error",
            "output": r.stdout,
            "error": r.stderr,
            "returncode": r.returncode,
        }

    async def file(self, path):
        return Path(path).read_bytes()

    async def upload(self, path, data):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(data)

    async def terminal(self):
        return ""


@pytest.mark.skipif(shutil.which("sh") is None, reason="needs /bin/sh and coreutils")
@pytest.mark.parametrize("tid", SHELL_TASKS)
def test_shell_solutions_under_a_real_shell(tid, tmp_path):
    path = FILES[tid]

    def home(kind):
        root = tmp_path / kind
        for d in ("Desktop", "Documents"):
            (root / d).mkdir(parents=True)
        return str(root)

    async def episode(kind):
        root = home(kind)
        raw = json.loads(path.read_text().replace("/home/user", root))
        task = load_task(raw)
        vm = HostVM()
        ctx = SetupContext(task_id=task.id, base_dir=path.parent)
        await run_setup(task.config, vm, ctx=ctx)
        last = None
        for text in SOLUTIONS[tid][kind]:
            last = parse_action(text.replace("/home/user", root))
            if last.kind == ActionKind.PYAUTOGUI:
                r = subprocess.run(
                    [sys.executable, "-c", last.code], capture_output=True, text=True, timeout=30
                )
                assert r.returncode == 0, r.stderr
        return await evaluate_task(dataclasses.replace(task, path=path), vm, last)

    assert asyncio.run(episode("correct")) == 1.0
    assert asyncio.run(episode("wrong")) == 0.0


def test_shell_task_selection():
    # every os/csv task is covered here; only editor tasks (launch mousepad) are left out
    assert len(SHELL_TASKS) >= 15
    assert all(not re.match("editor-", t) for t in SHELL_TASKS)
