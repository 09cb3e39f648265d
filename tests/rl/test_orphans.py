"""``kill -9`` of the trainer leaves nothing running, and a restart cleans what a crash left.

Issue 16 item 8: the embedded server (and the sandboxes' directories) outlived a killed
trainer. ``scripts/train.py`` with the embedded server and jailed ``local`` sandboxes is killed
with SIGKILL while both run: every process it started must be gone within seconds (the reaper
of `osworld_jax.rl.lease` and the jails' ``--die-with-parent``). Then the reaper is killed too:
the next start in the same run directory ends the orphaned server and removes the directories.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from osworld_jax.reaper import LEASE_FILE, process_start
from tests.rl.runs import (
    REPO,
    live_processes_mentioning,
    quick_args,
    quick_tasks,
    run_env,
    train_cmd,
)

LOCAL = ["ExperimentConfig.sandbox = @LocalBackendConfig()", "RLConfig.num_owners = 2"]


def _descendants(root: int) -> dict[int, tuple[int, str]]:
    """``{pid: (start, command line)}`` of every live descendant of ``root``."""
    children: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(p.name))
    out, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        start = process_start(pid)
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if start is not None:
            out[pid] = (start, cmd)
        todo += children.get(pid, [])
    return out


def _start(run_dir: Path, tasks: Path) -> subprocess.Popen:
    return subprocess.Popen(
        train_cmd(run_dir, *quick_args(tasks, *LOCAL), steps=50),
        cwd=REPO,
        env=run_env(run_dir),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def _wait_for_server_and_jail(proc: subprocess.Popen) -> dict[int, tuple[int, str]]:
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        tree = _descendants(proc.pid)
        cmds = [c for _, c in tree.values()]
        if any("osworld_jax.server.serve" in c for c in cmds) and any("bwrap" in c for c in cmds):
            return tree
        time.sleep(0.5)
    raise AssertionError("the embedded server and a jail never ran together")


def _removed(dirs: list[str], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while any(Path(d).exists() for d in dirs):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _gone(tree: dict[int, tuple[int, str]], within_s: float) -> list[str]:
    deadline = time.monotonic() + within_s
    while True:
        alive = [c for pid, (start, c) in tree.items() if process_start(pid) == start]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


@pytest.mark.slow
def test_kill_9_of_the_trainer_leaves_nothing_and_a_restart_cleans_up(tmp_path):
    tasks, run_dir = quick_tasks(tmp_path), tmp_path / "run"

    # 1. kill -9 of the trainer: the reaper and the jails' --die-with-parent end everything.
    trainer = _start(run_dir, tasks)
    tree = _wait_for_server_and_jail(trainer)
    dirs = json.loads((run_dir / LEASE_FILE).read_text())["dirs"]
    assert dirs and all(Path(d).is_dir() for d in dirs)  # the sandboxes' root
    t0 = time.monotonic()
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    assert _gone(tree, within_s=10) == []
    print(f"every child gone {time.monotonic() - t0:.1f} s after kill -9: {len(tree)} processes")
    assert _removed(dirs, within_s=5)
    assert not (run_dir / LEASE_FILE).exists()
    assert "died: ended processes" in (run_dir / "reaper.log").read_text()
    assert not live_processes_mentioning(str(run_dir))

    # 2. The reaper dies with the trainer (kill -9 of both): the orphaned server and the
    # sandboxes' root wait for the next start, which removes them before it starts anything.
    trainer = _start(run_dir, tasks)
    tree = _wait_for_server_and_jail(trainer)
    dirs = json.loads((run_dir / LEASE_FILE).read_text())["dirs"]
    (reaper,) = [p for p, (_, c) in tree.items() if "osworld_jax.reaper" in c]
    server = {p: v for p, v in tree.items() if "osworld_jax.server.serve" in v[1]}
    subprocess.run(["kill", "-9", str(reaper), str(trainer.pid)], check=True)
    trainer.wait()
    jails = {p: v for p, v in tree.items() if "bwrap" in v[1]}
    assert _gone(jails, within_s=10) == []  # --die-with-parent
    time.sleep(1)
    assert len(_gone(server, within_s=0)) == 1 and all(Path(d).is_dir() for d in dirs)

    restart = _start(run_dir, tasks)
    try:
        assert _gone(server, within_s=120) == []
        assert _removed(dirs, within_s=10)
        while "osworld_jax.server.serve" not in " ".join(
            c for _, c in _descendants(restart.pid).values()
        ):  # the restart goes on and starts its own server
            assert restart.poll() is None, restart.stderr.read().decode()[-3000:]
            time.sleep(0.5)
    finally:
        restart.send_signal(signal.SIGINT)
        err = restart.communicate(timeout=180)[1].decode()
    assert "cleaned up after a crashed run: ended processes" in err, err[-3000:]
    assert restart.returncode == 130, err[-3000:]
    time.sleep(1)
    assert not live_processes_mentioning(str(run_dir))
