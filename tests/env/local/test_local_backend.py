"""LocalBackend end to end on a small inline task: create, observe, step, evaluate, fork, close."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from osworld_jax.env.actions import parse_action
from osworld_jax.env.backend import SandboxCreateError
from osworld_jax.env.backends import BACKENDS
from osworld_jax.env.local import LocalBackend, LocalSandbox
from osworld_jax.env.local.procfs import pid_namespace_members
from osworld_jax.env.tasks import load_task

NOTE = "/home/user/Desktop/note.txt"
TASK = {
    "id": "local-test-note",
    "snapshot": "test",
    "instruction": "Replace the text of note.txt with 'final' and save it.",
    "source": "tests",
    "config": [
        {
            "type": "execute",
            "parameters": {
                "command": ["bash", "-c", f"mkdir -p ~/Desktop && printf 'draft\\n' > {NOTE}"]
            },
        },
        {"type": "open", "parameters": {"path": NOTE}},
    ],
    "evaluator": {
        "func": "exact_match",
        "result": {"type": "vm_command_line", "command": ["cat", NOTE]},
        "expected": {"type": "rule", "rules": {"expected": "final\n"}},
    },
}
SOLVE = (
    "```python\npyautogui.hotkey('ctrl', 'a')\npyautogui.typewrite('final\\n')\n"
    "pyautogui.hotkey('ctrl', 's')\ntime.sleep(0.5)\n```"
)


def windows(runner, sandbox: LocalSandbox) -> str:
    return runner.run(sandbox.vm.execute(["wmctrl", "-l"]))["output"]


def test_registered_as_local():
    assert BACKENDS.get("local") is LocalBackend


def test_create_observe_step_evaluate(runner, backend: LocalBackend):
    task = load_task(TASK)
    sb = runner.run(backend.create(task))
    try:
        assert sb.id in backend.inventory()
        obs = runner.run(sb.observe())
        assert obs.instruction == task.instruction
        assert obs.screenshot is not None
        assert Image.open(io.BytesIO(obs.screenshot)).size == (1920, 1080)
        assert '<application name="mousepad"' in obs.a11y_tree
        assert "note.txt" in windows(runner, sb)
        assert runner.run(sb.evaluate(None)) == 0.0

        # Model errors are data: code that raises leaves the sandbox usable.
        obs2 = runner.run(sb.step(parse_action("```python\nraise ValueError('x')\n```")))
        assert obs2.screenshot is not None
        for special in ("WAIT", "DONE"):
            assert runner.run(sb.step(parse_action(special))).screenshot is not None

        obs3 = runner.run(sb.step(parse_action(SOLVE)))
        assert obs3.screenshot != obs.screenshot  # the editor now shows other text
        assert runner.run(sb.vm.file(NOTE)) == b"final\n"
        assert runner.run(sb.evaluate(parse_action("DONE"))) == 1.0
    finally:
        runner.run(sb.close())
    assert sb.id not in backend.inventory()


def test_computer_13_actions_run_through_the_shim(runner, backend: LocalBackend):
    task = load_task({**TASK, "id": "local-test-c13"})
    sb = runner.run(backend.create(task))
    try:
        for text in (
            '{"action_type": "HOTKEY", "keys": ["ctrl", "a"]}',
            '{"action_type": "TYPING", "text": "final"}',
            '{"action_type": "PRESS", "key": "enter"}',
            '{"action_type": "HOTKEY", "keys": ["ctrl", "s"]}',
        ):
            action = parse_action(text, "computer_13")
            assert action.parse_error is None, action.parse_error
            runner.run(sb.step(action))
        runner.run(sb.vm.execute(["sleep", "0.5"]))
        assert runner.run(sb.evaluate(None)) == 1.0
    finally:
        runner.run(sb.close())


def test_fork_gives_independent_copies(runner, backend: LocalBackend):
    task = load_task({**TASK, "id": "local-test-fork"})
    src = runner.run(backend.create(task))
    forks: list = []
    try:
        # State written after setup is part of the snapshot.
        runner.run(src.vm.execute(["bash", "-c", "echo from-source > ~/marker.txt"]))
        forks = runner.run(backend.fork(src, 3))
        ids = {f.id for f in forks}
        assert len(ids) == 3 and src.id not in ids
        assert set(backend.inventory()) >= ids | {src.id}
        namespaces = {f.desktop.pid_ns for f in forks} | {src.desktop.pid_ns}
        assert len(namespaces) == 4  # four separate jails
        for f in forks:
            assert runner.run(f.vm.file("~/marker.txt")) == b"from-source\n"
            assert runner.run(f.vm.file(NOTE)) == b"draft\n"
            assert "note.txt" in windows(runner, f)  # the open step re-ran in the fork
        # Fork 0 solves the task; nothing leaks into its siblings or the source.
        runner.run(forks[0].step(parse_action(SOLVE)))
        runner.run(forks[0].vm.execute(["bash", "-c", "echo mine > ~/only0.txt"]))
        assert runner.run(forks[0].evaluate(None)) == 1.0
        for other in (forks[1], forks[2], src):
            assert runner.run(other.evaluate(None)) == 0.0
            with pytest.raises(FileNotFoundError):
                runner.run(other.vm.file("~/only0.txt"))
    finally:
        for s in (*forks, src):
            runner.run(s.close())
    assert not set(backend.inventory()) & ({f.id for f in forks} | {src.id})
    for ns in namespaces:
        assert pid_namespace_members(ns) == []


def test_fork_of_a_closed_sandbox_fails_cleanly(runner, backend: LocalBackend):
    sb = runner.run(backend.create(load_task({**TASK, "id": "local-test-closed"})))
    runner.run(sb.close())
    before = backend.inventory()
    with pytest.raises(SandboxCreateError, match="not live"):
        runner.run(backend.fork(sb, 2))
    assert backend.inventory() == before


def test_failed_setup_leaves_nothing(runner, backend: LocalBackend):
    bad = load_task(
        {**TASK, "id": "local-test-bad", "config": [{"type": "open", "parameters": {"path": "/x"}}]}
    )
    before = backend.inventory()
    with pytest.raises(SandboxCreateError):
        runner.run(backend.create(bad))
    assert backend.inventory() == before


def test_warm_pool_serves_create_and_fork(runner):
    from osworld_jax.env.local import LocalBackendConfig

    b = LocalBackend(LocalBackendConfig(warm_pool=2))
    pooled_ns: list = []
    try:
        runner.run(b.warm_up())
        assert b.inventory() == []  # idle pool desktops are not sandboxes
        pooled = list(b._pool)
        assert len(pooled) == 2
        pooled_ns = [d.pid_ns for d in pooled]
        src = runner.run(b.create(load_task({**TASK, "id": "local-test-pool"})))
        assert src.desktop in pooled  # taken from the pool
        runner.run(src.vm.execute(["bash", "-c", "echo pooled > ~/marker.txt"]))
        runner.run(b.wait_pool_full())  # no refill in flight: the fork takes one of `idle`
        idle = list(b._pool)
        assert len(idle) == 2
        (fork,) = runner.run(b.fork(src, 1))
        assert fork.desktop in idle
        assert runner.run(fork.vm.file("~/marker.txt")) == b"pooled\n"
        assert runner.run(fork.vm.file(NOTE)) == b"draft\n"
        assert "note.txt" in windows(runner, fork)
        assert sorted(b.inventory()) == sorted([src.id, fork.id])
        runner.run(b.wait_pool_full())
        assert len(b._pool) == 2  # refilled in the background
        pooled_ns += [d.pid_ns for d in (*b._pool, *idle)]
        runner.run(fork.close())
        runner.run(src.close())
        assert b.inventory() == []
    finally:
        runner.run(b.aclose())
    assert b._pool == []
    for ns in pooled_ns:
        assert ns is not None and pid_namespace_members(ns) == []


def test_an_action_that_hangs_is_stopped_as_data(runner):
    """Model code that never returns is killed at step_timeout_s; the sandbox stays usable."""
    import time

    from osworld_jax.env.local import LocalBackendConfig

    b = LocalBackend(LocalBackendConfig(step_timeout_s=1.0, observe_a11y=False))
    try:
        sb = runner.run(b.create(load_task({**TASK, "id": "local-test-hang", "config": []})))
        res = runner.run(sb.run_code("time.sleep(30)"))
        assert res["returncode"] == -9 and "timed out" in res["error"]
        t0 = time.monotonic()
        obs = runner.run(sb.step(parse_action("```python\ntime.sleep(30)\n```")))
        assert time.monotonic() - t0 < 10 and obs.screenshot is not None
        runner.run(sb.close())
    finally:
        runner.run(b.aclose())
    assert b.inventory() == []


def test_capability_reasons_name_files_no_local_app_opens(monkeypatch):
    from osworld_jax.env.local import sysroot

    monkeypatch.setattr(sysroot.shutil, "which", lambda name, path=None: None)
    task = load_task(
        {
            **TASK,
            "config": [
                {"type": "open", "parameters": {"path": "/home/user/a.txt"}},
                {"type": "open", "parameters": {"path": "/home/user/model.blend"}},
            ],
        }
    )
    assert LocalBackend.capability_reasons(task) == [
        "no local application opens '/home/user/model.blend'"
    ]


def test_a_killed_app_is_reaped_at_once(runner, backend: LocalBackend):
    """An app started by a ``launch`` step and killed by the agent leaves no zombie that the
    agent's own ``pgrep`` (waiting for the app to be gone) would still see."""  # noqa: D205, D209
    launch = {"type": "launch", "parameters": {"command": ["sleep", "300"]}}
    sb = runner.run(backend.create(load_task({**TASK, "id": "local-reap", "config": [launch]})))
    try:
        code = (
            "import subprocess\n"
            "subprocess.run(['pkill', '-KILL', '-x', 'sleep'])\n"
            "pg = ['pgrep', '-x', 'sleep']\n"
            "gone = lambda: subprocess.run(pg, capture_output=True).returncode\n"
            "end = time.time() + 5\n"
            "while gone() == 0 and time.time() < end:\n"
            "    time.sleep(0.05)\n"
            "print(gone())"
        )
        res = runner.run(sb.run_code(code))
        assert res["output"].strip() == "1", res  # no process named sleep left
    finally:
        runner.run(sb.close())
