"""Every bundled task end to end in the jailed local sandbox.

For each task: create it once (its real setup: downloads from the bundled assets, launching the
editor, sleeps), fork it into two copies, run the scripted correct action sequence in one and the
wrong one in the other (``tests/env/bundled_solutions.json``), and evaluate both with the task's
own evaluator: correct -> 1, wrong -> 0. All sandboxes are closed and none may remain.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from osworld_jax.env.actions import parse_action
from osworld_jax.env.bundled import bundled_task_dir
from osworld_jax.env.capabilities import capabilities
from osworld_jax.env.local import LocalBackend
from osworld_jax.env.local.procfs import pid_namespace_members
from osworld_jax.env.tasks import load_task

SOLUTIONS = Path(__file__).resolve().parents[1] / "bundled_solutions.json"
TASK_FILES = sorted(bundled_task_dir().rglob("*.json"))
TASK_FILES = [p for p in TASK_FILES if "assets" not in p.parts]


def _solutions() -> dict:
    return json.loads(SOLUTIONS.read_text())["tasks"]


def test_every_bundled_task_has_scripted_solutions():
    ids = {load_task(p).id for p in TASK_FILES}
    assert len(ids) >= 20
    assert ids == set(_solutions())


async def _wait_for_app_windows(sandbox, task) -> None:
    """Waits (up to 60 s) for a window per ``launch`` step, as an agent looking at the screen
    would: the task's own sleeps assume an idle machine, CI's may be loaded."""
    launches = sum(1 for s in task.config if s.type == "launch")
    if not launches:
        return
    for _ in range(600):
        res = await sandbox.vm.execute(["wmctrl", "-l"])
        if len(res["output"].strip().splitlines()) >= launches:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{task.id}: launched apps show no window after 60 s")


async def _play(sandbox, texts: list[str]) -> float:
    await _wait_for_app_windows(sandbox, sandbox.task)
    last = None
    for text in texts:
        last = parse_action(text, "pyautogui")
        assert last.parse_error is None, (text, last.parse_error)
        if last.is_terminal:
            break
        await sandbox.step(last)
    return await sandbox.evaluate(last)


@pytest.mark.slow
@pytest.mark.parametrize("path", TASK_FILES, ids=lambda p: p.stem)
def test_bundled_task_scores_correct_1_and_wrong_0(runner, backend: LocalBackend, path: Path):
    task = load_task(path)
    assert capabilities(task, "local"), capabilities(task, "local")
    script = _solutions()[task.id]
    src = runner.run(backend.create(task))
    forks = []
    try:
        forks = runner.run(backend.fork(src, 2))
        assert runner.run(_play(forks[0], script["correct"])) == 1.0
        assert runner.run(_play(forks[1], script["wrong"])) == 0.0
    finally:
        namespaces = [s.desktop.pid_ns for s in (src, *forks)]
        for s in (*forks, src):
            runner.run(s.close())
    assert not set(backend.inventory()) & {s.id for s in (src, *forks)}
    for ns in namespaces:
        assert ns is not None and pid_namespace_members(ns) == []
