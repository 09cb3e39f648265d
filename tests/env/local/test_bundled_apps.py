"""The bundled application tasks end to end in the jailed local sandbox, with the real apps.

For each task (``osworld_jax/env/bundled/apps``: two per domain, real OSWorld task format, files
made by the applications): create it (its real setup: downloads, ``open`` of the document in
LibreOffice, ``launch`` of Chromium/GIMP/VLC/Thunderbird as OSWorld's tasks launch them, Chrome
tabs through DevTools), fork it once, run the scripted correct action sequence in the source and
the wrong one in the fork at the same time (``tests/env/bundled_app_solutions.json``), and
evaluate both with the task's own evaluator (postconfig included: the window activated and
Ctrl+S as upstream's office tasks do): correct -> 1, wrong -> 0. Forking also shows that an
app task's copy starts its app on the copied files (lock files left out). Nothing may remain.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from osworld_jax.env.actions import parse_action
from osworld_jax.env.bundled import bundled_app_task_dir
from osworld_jax.env.capabilities import capabilities, unknown_types
from osworld_jax.env.evaluators import GETTERS
from osworld_jax.env.evaluators.registry import EvalContext
from osworld_jax.env.local import LocalBackend, apps
from osworld_jax.env.local.procfs import pid_namespace_members
from osworld_jax.env.tasks import iter_task_files, load_task

SOLUTIONS = Path(__file__).resolve().parents[1] / "bundled_app_solutions.json"
TASK_FILES = sorted(iter_task_files(bundled_app_task_dir()))
#: The window each domain's app shows (what an agent waits for before acting).
WINDOWS = {
    "calc": "LibreOffice Calc",
    "writer": "LibreOffice Writer",
    "impress": "LibreOffice Impress",
    "chrome": "Chromium",
    "gimp": "GIMP",  # "[landscape] (imported)-1.0 (RGB color ...) 160x120 – GIMP"
    "vlc": "VLC media player",
    "thunderbird": "Thunderbird",
}


# Real applications typed into on a clock (the task's own postconfig saves, then waits 3 s):
# run alone, after the parallel part of scripts/test.sh.
pytestmark = pytest.mark.serial


def _solutions() -> dict:
    return json.loads(SOLUTIONS.read_text())["tasks"]


def test_two_tasks_per_app_domain_with_solutions():
    tasks = [load_task(p) for p in TASK_FILES]
    domains = [t.domain for t in tasks]
    assert {d: domains.count(d) for d in WINDOWS} == dict.fromkeys(WINDOWS, 2)
    assert {t.id for t in tasks} == set(_solutions())
    for t in tasks:
        assert not unknown_types(t), t.id
        for f in t.evaluator.func:
            assert f not in ("exact_match", "infeasible"), t.id  # real app-state metrics


def _apps_installed() -> bool:
    return all(apps.installed(a) for a in apps.APPS if a.name in ("libreoffice", "chrome"))


async def _wait_for_window(sandbox, title: str) -> None:
    """Waits (up to 90 s) for the app's window to have the keyboard focus, as an agent looking
    at the screen would (keys typed before that would reach another window)."""
    for _ in range(900):
        res = await sandbox.vm.execute(["xdotool", "getactivewindow", "getwindowname"])
        if title in res["output"]:
            await asyncio.sleep(2.0)  # (a window shows before its app takes keys)
            return
        await asyncio.sleep(0.1)
    listed = (await sandbox.vm.execute(["wmctrl", "-l"]))["output"]
    raise AssertionError(f"{sandbox.task.id}: no focused {title!r} window after 90 s: {listed}")


async def _tabs(sandbox) -> list[str]:
    ctx = EvalContext(work_dir=sandbox.work_dir)
    infos = await GETTERS.get("open_tabs_info")(sandbox.vm, {}, ctx)
    return sorted(t["url"] for t in infos)


async def _play(sandbox, texts: list[str]) -> float:
    await _wait_for_window(sandbox, WINDOWS[sandbox.task.domain])
    last = None
    for text in texts:
        last = parse_action(text, "pyautogui")
        assert last.parse_error is None, (text, last.parse_error)
        if last.is_terminal:
            break
        await sandbox.step(last)
    await asyncio.sleep(1.0)  # (the app reacts to the last key)
    return await sandbox.evaluate(last)


def _play_once(runner, backend: LocalBackend, task, script) -> list[float]:
    """Creates the task, forks it once, plays the correct solution in the source and the wrong
    one in the fork side by side; returns both scores after everything is closed and gone."""
    src = runner.run(backend.create(task))
    forks = []
    try:
        forks = runner.run(backend.fork(src, 1))
        if task.domain == "chrome":  # the fork re-ran the tab steps: the same tabs
            tabs = [runner.run(_tabs(s)) for s in (src, forks[0])]
            assert tabs[0] == tabs[1] and tabs[0], tabs

        async def both() -> list[float]:  # two desktops, played side by side
            return list(
                await asyncio.gather(
                    _play(src, script["correct"]), _play(forks[0], script["wrong"])
                )
            )

        scores = runner.run(both())
    finally:
        namespaces = [s.desktop.pid_ns for s in (src, *forks)]
        for s in (*forks, src):
            runner.run(s.close())
    assert not set(backend.inventory()) & {s.id for s in (src, *forks)}
    for ns in namespaces:
        assert ns is not None and pid_namespace_members(ns) == []
    return scores


@pytest.mark.slow
@pytest.mark.parametrize("path", TASK_FILES, ids=lambda p: p.stem)
def test_bundled_app_task_scores_correct_1_and_wrong_0(runner, backend: LocalBackend, path: Path):
    if not _apps_installed():
        pytest.fail("the applications are not installed (bash scripts/setup.sh --apps)")
    task = load_task(path)
    assert capabilities(task, "local"), capabilities(task, "local")
    script = _solutions()[task.id]
    scores = _play_once(runner, backend, task, script)
    # The wrong solution must score 0 on every play (a false 1 would be a reward leak). A
    # correct solution scored 0 is played once more from a fresh task: calc-sum-column's correct
    # keys left the sheet unsaved in about half of the full suite runs of 2026-12-03 (never
    # alone, once in the serial pass too; cause not found), which the first play prints.
    assert scores[1] == 0.0, scores
    if scores[0] != 1.0:
        print(f"{task.id}: the correct solution scored {scores[0]}; played once more")
        scores = _play_once(runner, backend, task, script)
    assert scores == [1.0, 0.0]
