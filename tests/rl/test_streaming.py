"""Streaming train (``RLConfig.extra_rollout_groups``, ``min_groups_for_streaming_train``):
a step's rollout returns once enough groups finished, trains the finished ones in launch order,
renumbered, and cancels the stragglers (their clean-up runs)."""

import asyncio
import json
import subprocess

import numpy as np
import pytest

from osworld_jax import config
from osworld_jax.agent import (
    AgentConfig,
    AgentTokenizer,
    ChatTemplate,
    GroupPolicyConfig,
    select_groups,
)
from osworld_jax.data import TaskRef, make_task_stream
from osworld_jax.env import AgentEnvConfig, OwnerResult, SandboxCreateError
from osworld_jax.errors import ConfigError
from osworld_jax.rl import ExperimentConfig, RLConfig, stages
from osworld_jax.rollout import SamplingParams
from tests.agent.conftest import build_tokenizer
from tests.rl.runs import (
    QUICK,
    REPO,
    live_processes_mentioning,
    quick_args,
    quick_tasks,
    run_env,
    train_cmd,
)

STEP = 5


class GroupEnv:
    """An agent_env whose group ``t<g>`` finishes when the test releases it (or raises an
    ``InfraError`` if listed in ``raising``); records which groups started and cleaned up."""

    config = AgentEnvConfig()

    def __init__(self, raising=()):
        self.events: dict[str, asyncio.Event] = {}
        self.raising = set(raising)
        self.started, self.cleaned, self.cancelled = [], [], []

    def event(self, task):
        return self.events.setdefault(task, asyncio.Event())

    async def run_group(self, task, owners, make_agent):
        self.started.append(task)
        for o in owners:
            make_agent(o)
        try:
            await self.event(task).wait()
            if task in self.raising:
                raise SandboxCreateError(f"{task}: no desktop")
            return [
                OwnerResult(
                    owner_index=o, reward=1.0, failed=False, error=None, turns=o + 1, actions=()
                )
                for o in owners
            ]
        except asyncio.CancelledError:
            self.cancelled.append(task)
            raise
        finally:
            self.cleaned.append(task)


def refs(k):
    return [TaskRef(task_id=f"t{g}", path=f"t{g}", group_id=f"t{g}") for g in range(k)]


def rollout(env, rl, finish_order):
    """Runs `stages.rollout_step` over B + e tasks, releasing the groups of each entry of
    ``finish_order`` together, 10 ms apart."""
    tokenizer = AgentTokenizer(build_tokenizer(), ChatTemplate.builtin_qwen())

    async def main():
        async def release():
            for batch in finish_order:
                await asyncio.sleep(0.01)
                for g in batch:
                    env.event(f"t{g}").set()

        releaser = asyncio.create_task(release())
        try:
            return await stages.rollout_step(
                env,
                None,
                tokenizer,
                AgentConfig(),
                SamplingParams(max_new_tokens=8),
                refs(rl.rollout_groups),
                rl=rl,
                step=STEP,
                load_task=lambda path: path,
            )
        finally:
            releaser.cancel()

    return asyncio.run(main())


def check_renumbered(raw, rl, launch_groups):
    """Trained group i is launch group ``launch_groups[i]``, its ids renumbered consistently."""
    n = rl.num_owners
    assert [t.task_id for t in raw.tasks] == [f"t{g}" for g in launch_groups]
    assert sorted(raw.agents) == list(range(len(launch_groups) * n))
    for new, old in enumerate(launch_groups):
        res = raw.results[new]
        if not isinstance(res, BaseException):
            assert [r.owner_index for r in res] == [new * n + j for j in range(n)]
            assert [r.turns for r in res] == [old * n + j + 1 for j in range(n)]  # old's results
        for j in range(n):
            agent = raw.agents[new * n + j]
            assert (agent.owner_id, agent.group_id) == (new * n + j, new)
            assert agent.owner_id // n == agent.group_id
            # The sampling seed stays the launch owner's.
            seed = stages.owner_seed(rl.seed, STEP, old * n + j)
            assert agent.sampling.sampling_seed == seed
    rollouts = stages.collect_owners(raw, rl, STEP)
    assert [o.owner_id for o in rollouts.owners] == list(range(len(launch_groups) * n))
    assert [o.group_id for o in rollouts.owners] == [o // n for o in range(len(launch_groups) * n)]
    assert rollouts.tasks == raw.tasks
    return rollouts


def test_no_extra_groups_and_m_equal_b_is_gather():
    rl = RLConfig(num_prompts=3, num_owners=2)
    assert not rl.streaming and rl.rollout_groups == 3 and rl.min_groups == 3
    env = GroupEnv()
    raw = rollout(env, rl, [[2], [0], [1]])  # finishing order does not matter
    check_renumbered(raw, rl, [0, 1, 2])
    assert raw.group_metrics() == {
        "groups/launched": 3.0,
        "groups/stragglers": 0.0,
        "groups/unused": 0.0,
    }
    assert env.cancelled == []


def test_over_provisioned_groups_train_the_first_b_finished_in_launch_order():
    rl = RLConfig(num_prompts=3, num_owners=2, extra_rollout_groups=2)
    env = GroupEnv()
    raw = rollout(env, rl, [[4], [1], [0], [2, 3]])
    # 4, 1, 0 finished first: trained in launch order, renumbered 0, 1, 2; 2 and 3 cancelled.
    rollouts = check_renumbered(raw, rl, [0, 1, 4])
    assert sorted(env.started) == [f"t{g}" for g in range(5)]
    assert sorted(env.cancelled) == ["t2", "t3"]
    assert sorted(env.cleaned) == [f"t{g}" for g in range(5)]  # the stragglers' clean-up ran
    assert raw.group_metrics() == {
        "groups/launched": 5.0,
        "groups/stragglers": 2.0,
        "groups/unused": 0.0,
    }
    records = stages.owner_records(STEP, rollouts, _all_selected(rollouts), _zeros(rollouts))
    assert [r["task_id"] for r in records] == ["t0", "t0", "t1", "t1", "t4", "t4"]


def test_groups_finished_beyond_b_are_not_trained():
    rl = RLConfig(num_prompts=2, num_owners=2, extra_rollout_groups=2)
    env = GroupEnv()
    raw = rollout(env, rl, [[3, 2, 1]])  # three finish in the same instant, 0 is a straggler
    check_renumbered(raw, rl, [1, 2])
    assert env.cancelled == ["t0"]
    assert raw.group_metrics()["groups/unused"] == 1.0
    assert raw.group_metrics()["groups/stragglers"] == 1.0


def test_m_below_b_returns_once_m_groups_finished():
    rl = RLConfig(
        num_prompts=3, num_owners=2, extra_rollout_groups=1, min_groups_for_streaming_train=2
    )
    env = GroupEnv()
    raw = rollout(env, rl, [[3], [1], [0, 2]])
    check_renumbered(raw, rl, [1, 3])  # B' = 2 groups
    assert sorted(env.cancelled) == ["t0", "t2"]
    assert raw.group_metrics() == {
        "groups/launched": 4.0,
        "groups/stragglers": 2.0,
        "groups/unused": 0.0,
    }


def test_m_below_b_without_extra_groups_streams_too():
    rl = RLConfig(num_prompts=3, num_owners=1, min_groups_for_streaming_train=1)
    assert rl.streaming and rl.rollout_groups == 3
    env = GroupEnv()
    raw = rollout(env, rl, [[2], [0, 1]])
    check_renumbered(raw, rl, [2])
    assert sorted(env.cancelled) == ["t0", "t1"]


def test_a_group_that_raised_an_infra_error_counts_as_finished():
    rl = RLConfig(num_prompts=2, num_owners=2, extra_rollout_groups=1, max_failed_fraction=0.5)
    env = GroupEnv(raising=["t2"])
    raw = rollout(env, rl, [[2], [0], [1]])
    assert env.cancelled == ["t1"]
    assert isinstance(raw.results[1], SandboxCreateError)
    rollouts = check_renumbered(raw, rl, [0, 2])
    assert [o.failed for o in rollouts.owners] == [False, False, True, True]
    assert "t2" in rollouts.owners[2].error and "no desktop" in rollouts.owners[2].error


def test_cancelling_a_streaming_rollout_cancels_every_group():
    rl = RLConfig(num_prompts=2, num_owners=1, extra_rollout_groups=1)
    env = GroupEnv()
    tokenizer = AgentTokenizer(build_tokenizer(), ChatTemplate.builtin_qwen())

    async def main():
        task = asyncio.create_task(
            stages.rollout_step(
                env,
                None,
                tokenizer,
                AgentConfig(),
                SamplingParams(max_new_tokens=8),
                refs(3),
                rl=rl,
                step=STEP,
                load_task=lambda path: path,
            )
        )
        await asyncio.sleep(0.01)
        env.event("t0").set()
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert sorted(env.cancelled) == ["t1", "t2"]
    assert sorted(env.cleaned) == ["t0", "t1", "t2"]


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        (dict(extra_rollout_groups=-1), "RLConfig.extra_rollout_groups"),
        (dict(min_groups_for_streaming_train=0), "RLConfig.min_groups_for_streaming_train"),
        (dict(min_groups_for_streaming_train=3), "RLConfig.min_groups_for_streaming_train"),
        (dict(max_buffered_rollouts=3, extra_rollout_groups=2), "RLConfig.max_buffered_rollouts"),
    ],
)
def test_streaming_config_is_validated(changes, field):
    with pytest.raises(ConfigError, match=field):
        RLConfig(num_prompts=2, num_owners=2, **changes)


def test_m_below_the_step_batch_fraction_is_refused():
    group = GroupPolicyConfig(min_step_batch_fraction=0.5)
    with pytest.raises(ConfigError, match="RLConfig.min_groups_for_streaming_train = 1 .*0.5"):
        ExperimentConfig(rl=RLConfig(num_prompts=4, min_groups_for_streaming_train=1), group=group)
    ExperimentConfig(rl=RLConfig(num_prompts=4, min_groups_for_streaming_train=2), group=group)


def test_streaming_config_accepts_its_bounds():
    rl = RLConfig(
        num_prompts=2,
        num_owners=2,
        extra_rollout_groups=2,
        min_groups_for_streaming_train=2,
        max_buffered_rollouts=4,
    )
    assert (rl.rollout_groups, rl.min_groups, rl.streaming) == (4, 2, True)
    assert RLConfig(num_prompts=2, min_groups_for_streaming_train=1).min_groups == 1


@pytest.mark.slow
def test_streaming_train_end_to_end(tmp_path):
    """QUICK (B = 2, N = 2) with one extra group and k = 1 through scripts/train.py: every step
    launches 3 groups and trains 2 (the third a straggler or unused), no process is left."""
    tasks = quick_tasks(tmp_path)
    run_dir = tmp_path / "run"
    extra = ("RLConfig.extra_rollout_groups = 1", "RLConfig.max_staleness = 1")
    cmd = train_cmd(run_dir, *quick_args(tasks, *extra), steps=3)
    done = subprocess.run(
        cmd, cwd=REPO, env=run_env(run_dir), capture_output=True, text=True, timeout=540
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["groups/launched"] == 3 and r["owners/total"] == 2 * 2
        assert r["groups/stragglers"] + r["groups/unused"] == 1
    owners = [json.loads(x) for x in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert [o["owner"] for o in owners] == [0, 1, 2, 3] * 3
    # Each step draws B + e = 3 tasks and trains 2 of them, in the order drawn.
    exp = config.load_experiment(
        ["default.gin"], [*QUICK, f"DataConfig.task_set = '{tasks}'", *extra]
    )
    stream = make_task_stream(exp.data, 3, process_index=0, process_count=1)
    for step in (1, 2, 3):
        drawn = [t.task_id for t in next(stream)]
        trained = [o["task_id"] for o in owners if o["step"] == step][::2]
        left = iter(drawn)
        assert len(trained) == 2 and all(t in left for t in trained), (step, drawn, trained)
    assert not live_processes_mentioning(str(run_dir))


def _all_selected(rollouts):
    return select_groups(rollouts.owners, GroupPolicyConfig(), len(rollouts.tasks))


def _zeros(rollouts):
    return np.zeros((len(rollouts.owners),), np.float32)
