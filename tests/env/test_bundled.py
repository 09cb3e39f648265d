"""The bundled offline tasks: load, runnable here, scripted correct -> 1 and wrong -> 0."""

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from osworld_jax.env import bundled_task_dir
from osworld_jax.env.agent_env import AgentEnv, AgentEnvConfig
from osworld_jax.env.capabilities import APP, capabilities, unknown_types
from osworld_jax.env.tasks import load_tasks
from osworld_jax.testing.memory import MemoryBackend

SOLUTIONS = json.loads((Path(__file__).parent / "bundled_solutions.json").read_text())["tasks"]
TASKS = {t.id: t for t in load_tasks(bundled_task_dir())}


def test_at_least_20_tasks_with_solutions_and_real_evaluators():
    assert len(TASKS) >= 20
    assert set(TASKS) == set(SOLUTIONS)
    domains = {t.domain for t in TASKS.values()}
    assert {"os", "text_editor", "spreadsheet_csv"} <= domains
    for t in TASKS.values():
        assert not unknown_types(t)
        # real evaluators: every non-infeasible task reads desktop state through a getter
        if not t.evaluator.is_infeasible:
            assert any(g is not None and g.type.startswith("vm_") for g in t.evaluator.result)


@pytest.mark.parametrize("tid", sorted(TASKS))
def test_runnable_on_local_given_the_apps(tid):
    cap = capabilities(TASKS[tid], "local")
    # the only thing that may be missing on a machine is an app (mousepad, coreutils)
    missing = {r.detail for r in cap.reasons if r.kind == APP}
    assert {r.kind for r in cap.reasons} <= {APP}
    assert all(shutil.which(a) is None for a in missing)
    assert capabilities(TASKS[tid], "memory")


class Scripted:
    def __init__(self, replies):
        self.replies = list(replies)

    async def act(self, obs):
        return self.replies.pop(0)


@pytest.mark.parametrize("tid", sorted(TASKS))
def test_scripted_solutions_on_memory_backend(tid):
    be = MemoryBackend()
    env = AgentEnv(be, AgentEnvConfig(max_turns=10))
    sol = SOLUTIONS[tid]

    async def main():
        return [
            (await env.run_group(TASKS[tid], [0], lambda i, k=kind: Scripted(sol[k])))[0]
            for kind in ("correct", "wrong")
        ]

    good, bad = asyncio.run(main())
    assert not good.failed and not bad.failed, (good.error, bad.error)
    assert good.reward == 1.0
    assert bad.reward == 0.0
    assert be.inventory() == []
