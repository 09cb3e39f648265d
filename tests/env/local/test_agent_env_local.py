"""AgentEnv on the real jailed backend: init once, fork per owner, mixed outcomes, zero leaks."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from osworld_jax.env.agent_env import AgentEnv, AgentEnvConfig
from osworld_jax.env.backend import Observation
from osworld_jax.env.bundled import bundled_task_dir
from osworld_jax.env.local import LocalBackend
from osworld_jax.env.local.desktop import pid_namespace_members
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
