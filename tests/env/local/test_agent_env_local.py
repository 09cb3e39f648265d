"""AgentEnv on the real jailed backend: init once, fork per owner, mixed outcomes, zero leaks."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
from pathlib import Path

import pytest

from osworld_jax.env.agent_env import AgentEnv, AgentEnvConfig
from osworld_jax.env.backend import Observation
from osworld_jax.env.bundled import bundled_task_dir
from osworld_jax.env.local import LocalBackend
from osworld_jax.env.local.procfs import pid_namespace_members
from osworld_jax.env.tasks import load_task
from osworld_jax.errors import InfraError

SOLUTIONS = json.loads(
    (Path(__file__).resolve().parents[1] / "bundled_solutions.json").read_text()
)["tasks"]
TASK_ID = "editor-append-the-end"


def _task():
    (path,) = [p for p in bundled_task_dir().rglob(f"{TASK_ID}.json")]
    return load_task(path)


class Scripted:
    def __init__(self, texts: list[str], seen: list[Observation]) -> None:
        self.texts = list(texts)
        self.seen = seen

    async def act(self, observation: Observation) -> str:
        self.seen.append(observation)
        if 'name="mousepad"' not in observation.a11y_tree:
            return "WAIT"  # the editor is still starting (a loaded machine): look again
        return self.texts.pop(0)


class Broken:
    async def act(self, observation: Observation) -> str:
        raise InfraError("rollout server unreachable")


class Stuck:
    def __init__(self, started: asyncio.Event) -> None:
        self.started = started

    async def act(self, observation: Observation) -> str:
        self.started.set()
        await asyncio.sleep(3600)
        return "DONE"


def _namespaces(backend: LocalBackend) -> set[str]:
    return {d.pid_ns for d in backend._desktops.values() if d.pid_ns is not None}


@pytest.mark.slow
def test_run_group_on_local_sandboxes(runner, backend: LocalBackend):
    seen: list[Observation] = []
    agents = {
        0: Scripted(SOLUTIONS[TASK_ID]["correct"], seen),
        1: Scripted(SOLUTIONS[TASK_ID]["wrong"], seen),
        2: Broken(),
    }
    env = AgentEnv(backend, AgentEnvConfig(max_turns=30))
    results = runner.run(env.run_group(_task(), [0, 1, 2], lambda i: agents[i]))
    by_owner = {r.owner_index: r for r in results}
    assert by_owner[0].reward == 1.0 and not by_owner[0].failed
    assert by_owner[1].reward == 0.0 and not by_owner[1].failed
    assert by_owner[2].failed and by_owner[2].reward is None
    assert "rollout server unreachable" in (by_owner[2].error or "")
    assert seen and all(o.screenshot and o.screenshot.startswith(b"\x89PNG") for o in seen)
    assert any("mousepad" in o.a11y_tree for o in seen)
    assert backend.inventory() == []


@pytest.mark.slow
def test_cancelled_group_leaves_no_sandbox(runner, backend: LocalBackend):
    started = asyncio.Event()
    env = AgentEnv(backend, AgentEnvConfig(max_turns=5))
    namespaces: set[str] = set()

    async def main() -> None:
        group = asyncio.ensure_future(env.run_group(_task(), [0, 1], lambda i: Stuck(started)))
        await asyncio.wait_for(started.wait(), 120)
        namespaces.update(_namespaces(backend))
        group.cancel()
        with pytest.raises(asyncio.CancelledError):
            await group

    runner.run(main())
    assert len(namespaces) >= 2  # both forks were running (the source may be closed already)
    assert backend.inventory() == []
    for ns in namespaces:
        assert pid_namespace_members(ns) == []


def _kill_server(sandbox) -> int:
    """SIGKILLs the in-jail server (``vmserver.py``) of a local sandbox; returns its host pid."""
    for pid in sandbox.desktop.host_pids():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"/opt/osworld/vmserver.py" in cmdline:
            os.kill(pid, signal.SIGKILL)
            return pid
    raise AssertionError(f"no vmserver.py among the processes of {sandbox.id}")


@pytest.mark.slow
def test_killed_owner_is_retried_on_a_fork_of_the_base(
    runner, backend: LocalBackend, monkeypatch, caplog
):
    # Owner 1's in-jail server is SIGKILLed after its first action: its next step fails
    # (a SandboxError), the owner re-runs on fork(base, 1) with a fresh agent and solves the
    # task; owner 0 runs once on its own fork, never disturbed.
    handed: list[tuple[str, list]] = []
    inner_fork = backend.fork

    async def fork(sandbox, n):
        forks = await inner_fork(sandbox, n)
        handed.append((sandbox.id, forks))
        return forks

    monkeypatch.setattr(backend, "fork", fork)
    correct = SOLUTIONS[TASK_ID]["correct"]
    seen: list[Observation] = []
    killed: list[int] = []
    live_during_retry: list[list[str]] = []

    class KillsItsServer(Scripted):
        async def act(self, observation: Observation) -> str:
            text = await super().act(observation)
            if len(self.texts) == len(correct) - 2:  # the first action has been stepped
                killed.append(_kill_server(handed[0][1][1]))
            return text

    class Retry(Scripted):
        async def act(self, observation: Observation) -> str:
            live_during_retry.append(backend.inventory())
            return await super().act(observation)

    made: dict[int, list] = {0: [], 1: []}

    def make(i: int):
        if i == 0:
            agent = Scripted(correct, seen)
        else:
            agent = (KillsItsServer if not made[1] else Retry)(correct, seen)
        made[i].append(agent)
        return agent

    env = AgentEnv(backend, AgentEnvConfig(max_turns=30, max_owner_retries=1))
    with caplog.at_level(logging.WARNING, logger="osworld_jax.env.agent_env"):
        r0, r1 = runner.run(env.run_group(_task(), [0, 1], make))
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # The dead server's socket: a dropped connection (a SandboxError), not a timeout.
    assert re.search(r"owner 1: attempt 1 of 2 failed \(Sandbox\w*Error: .*connection", warning)
    assert len(killed) == 1
    (base_id, first), (base_id_2, (retry_sb,)) = handed
    assert base_id_2 == base_id and len(first) == 2
    assert r1.reward == 1.0 and not r1.failed and r1.attempts == 2
    assert len(made[1]) == 2 and made[1][0].texts  # attempt 1 never got to DONE
    assert (r0.reward, r0.failed, r0.error, r0.attempts) == (1.0, False, None, 1)
    assert len(made[0]) == 1 and r0.actions[-1] == "DONE"
    assert live_during_retry and all(
        base_id in live and retry_sb.id in live for live in live_during_retry
    )
    assert env.metrics.owner_retries == 1 and env.metrics.owner_failures == 0
    assert backend.inventory() == []
