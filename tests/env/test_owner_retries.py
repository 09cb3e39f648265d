"""AgentEnv owner retries: a failed owner re-runs alone on a fork of the group's base."""

import asyncio
import dataclasses
import logging

import pytest

from osworld_jax.env.agent_env import AgentEnv, AgentEnvConfig
from osworld_jax.env.backend import SandboxCreateError, SandboxStepError
from osworld_jax.errors import ConfigError
from osworld_jax.testing.memory import MemoryBackend, word_task

TYPE = "```python\npyautogui.typewrite({!r})\n```"
WORD = "cat"
OWNERS = [0, 1, 2]


def code(word):
    """The code of ``TYPE.format(word)`` as the sandbox receives it."""
    return f"pyautogui.typewrite({word!r})"


class Breaking(MemoryBackend):
    """A memory backend whose sandboxes can die mid-episode; it records forks and steps.

    The sandbox at ``broken`` of the first fork (the owner at that position) and the first
    ``broken_retries`` sandboxes of later ``fork(base, 1)`` calls raise ``SandboxStepError`` on
    their second step (after one good one); ``fail_refork`` makes every later fork raise.
    """

    def __init__(self, *, broken=None, broken_retries=0, fail_refork=False):
        super().__init__()
        self.broken, self.broken_retries, self.fail_refork = broken, broken_retries, fail_refork
        self.base_id = None
        self.fork_calls = []  # (source sandbox id, n)
        self.handed = []  # per fork call, the ids of the sandboxes it returned
        self.steps = {}  # sandbox id -> the actions stepped on it

    async def create(self, task):
        base = await super().create(task)
        self.base_id = base.id
        return base

    async def fork(self, sandbox, n):
        self.fork_calls.append((sandbox.id, n))
        if self.fail_refork and len(self.fork_calls) > 1:
            raise SandboxCreateError("no capacity for a retry")
        forks = await super().fork(sandbox, n)
        self.handed.append([sb.id for sb in forks])
        for j, sb in enumerate(forks):
            first = len(self.fork_calls) == 1
            dies = (first and j == self.broken) or (not first and self.broken_retries > 0)
            if not first and dies:
                self.broken_retries -= 1
            self._record(sb, dies)
        return forks

    def _record(self, sb, dies):
        inner = sb.step
        self.steps[sb.id] = []

        async def step(action):
            if dies and len(self.steps[sb.id]) == 1:
                raise SandboxStepError(f"sandbox {sb.id}: desktop process killed")
            self.steps[sb.id].append(action.code or str(action.kind))
            return await inner(action)

        sb.step = step


class Scripted:
    """Types the group's word (owner 2 types a wrong one), waits, says DONE; records all."""

    def __init__(self, owner, backend):
        word = WORD if owner != 2 else "dog"
        self.replies = [TYPE.format(word), "WAIT", "DONE"]
        self.backend = backend
        self.seen = []
        self.live = []  # the backend's inventory at each act
        self.ended = None

    async def act(self, obs):
        self.seen.append(obs)
        self.live.append(self.backend.inventory())
        await asyncio.sleep(0)  # let the siblings interleave
        return self.replies.pop(0)

    async def on_episode_end(self, result):
        self.ended = result


def run_group(backend, owners=OWNERS, **cfg):
    """One group of ``word_task(WORD)``; returns (results, env, agents made per owner)."""
    env = AgentEnv(backend, AgentEnvConfig(max_turns=3, **cfg))
    agents = {o: [] for o in owners}

    def make(i):
        agents[i].append(Scripted(i, backend))
        return agents[i][-1]

    results = asyncio.run(env.run_group(word_task(WORD), owners, make))
    return results, env, agents


def test_killed_owner_is_retried_from_the_groups_fork_and_siblings_are_untouched(caplog):
    clean, _, clean_agents = run_group(Breaking(), max_owner_retries=2)
    be = Breaking(broken=1)
    with caplog.at_level(logging.WARNING, logger="osworld_jax.env.agent_env"):
        res, env, agents = run_group(be, max_owner_retries=2)

    # One fork of n from the base, then one fork of 1 from the same base for the retry.
    assert be.fork_calls == [(be.base_id, 3), (be.base_id, 1)]
    first, (retry_sb,) = be.handed
    # The first attempt typed the word, then its desktop died on the second step.
    assert be.steps[first[1]] == [code(WORD)]
    # The retry ran on a fresh fork of the initialised state: had it inherited the dead
    # attempt's desktop, the editor would read "catcat" and score 0.
    assert be.steps[retry_sb] == [code(WORD), "WAIT"]
    r = res[1]
    assert (r.reward, r.failed, r.error, r.attempts, r.turns) == (1.0, False, None, 2, 3)
    assert r == dataclasses.replace(clean[1], attempts=2)

    # Two agents for owner 1: the first is dropped (no on_episode_end), the final one ended.
    dead, final = agents[1]
    assert dead.ended is None and len(dead.seen) == 2
    assert final.ended == r and len(final.seen) == 3

    # Siblings: the same results, one agent each, the same calls as without the failure, on
    # their own sandboxes (each stepped exactly as in the clean run).
    for o in (0, 2):
        assert res[o] == clean[o] and res[o].attempts == 1
        assert len(agents[o]) == 1 and agents[o][0].ended == res[o]
        assert agents[o][0].seen == clean_agents[o][0].seen
        assert be.steps[first[o]] == [code("dog" if o == 2 else WORD), "WAIT"]
    assert [x.reward for x in res] == [1.0, 1.0, 0.0]

    # The base stayed open while owners ran, the retry's episode included; nothing is left.
    assert all(be.base_id in live for a in agents.values() for ag in a for live in ag.live)
    assert be.inventory() == []
    m = env.metrics
    assert (m.owner_retries, m.owner_failures, m.forks, m.fork_failures) == (1, 0, 4, 0)
    (rec,) = [x for x in caplog.records if x.levelno == logging.WARNING]
    msg = rec.getMessage()
    assert "owner 1" in msg and "attempt 1 of 3" in msg and "desktop process killed" in msg


def test_no_retries_by_default_is_todays_failure():
    be = Breaking(broken=1)
    res, env, agents = run_group(be)
    assert be.fork_calls == [(be.base_id, 3)]
    r = res[1]
    assert r.failed and r.reward is None and r.attempts == 1 and r.turns == 2
    assert "desktop process killed" in r.error
    assert len(agents[1]) == 1 and agents[1][0].ended == r
    assert [x.reward for x in res] == [1.0, None, 0.0]
    # The base was closed as soon as it was forked (before any owner acted).
    assert all(be.base_id not in live for a in agents.values() for ag in a for live in ag.live)
    assert be.inventory() == []
    assert (env.metrics.owner_failures, env.metrics.owner_retries) == (1, 0)


def test_exhausted_retries_end_failed_after_max_plus_one_attempts():
    be = Breaking(broken=0, broken_retries=2)
    res, env, agents = run_group(be, max_owner_retries=2)
    assert be.fork_calls == [(be.base_id, 3), (be.base_id, 1), (be.base_id, 1)]
    r = res[0]
    assert r.failed and r.reward is None and r.attempts == 3
    assert "desktop process killed" in r.error and be.handed[2][0] in r.error
    # Only the final attempt's agent saw the end of the episode.
    assert [a.ended for a in agents[0]] == [None, None, r]
    assert [x.attempts for x in res[1:]] == [1, 1] and [x.reward for x in res[1:]] == [1.0, 0.0]
    assert be.inventory() == []
    assert (env.metrics.owner_failures, env.metrics.owner_retries) == (1, 2)


def test_retries_stop_at_the_first_success():
    be = Breaking(broken=2, broken_retries=1)
    res, env, _ = run_group(be, max_owner_retries=5)
    assert len(be.fork_calls) == 3 and res[2].attempts == 3
    assert res[2].reward == 0.0 and not res[2].failed  # owner 2 types the wrong word: data
    assert (env.metrics.owner_failures, env.metrics.owner_retries) == (0, 2)


def test_refork_failure_ends_failed_naming_both_errors():
    be = Breaking(broken=1, fail_refork=True)
    res, env, agents = run_group(be, max_owner_retries=3)
    assert be.fork_calls == [(be.base_id, 3), (be.base_id, 1)]
    r = res[1]
    assert r.failed and r.reward is None and r.attempts == 1 and r.turns == 2
    assert r.error.startswith("retry fork failed: SandboxCreateError: no capacity for a retry")
    assert "desktop process killed" in r.error
    assert len(agents[1]) == 1 and agents[1][0].ended == r
    assert [x.reward for x in res] == [1.0, None, 0.0]
    assert be.inventory() == []
    m = env.metrics
    assert (m.owner_failures, m.owner_retries, m.fork_failures) == (1, 0, 1)


def test_low_reward_and_unparsable_actions_are_not_retried():
    be = Breaking()
    env = AgentEnv(be, AgentEnvConfig(max_turns=2, max_owner_retries=3))

    class Says:
        def __init__(self, text):
            self.text = text

        async def act(self, obs):
            return self.text

    texts = {0: "I will not write code", 1: TYPE.format("dog"), 2: "FAIL"}
    res = asyncio.run(env.run_group(word_task(WORD), OWNERS, lambda i: Says(texts[i])))
    assert [(x.reward, x.failed, x.attempts) for x in res] == [(0.0, False, 1)] * 3
    assert be.fork_calls == [(be.base_id, 3)] and env.metrics.owner_retries == 0
    assert be.inventory() == []


def test_cancelled_during_a_retry_leaves_no_sandbox():
    be = Breaking(broken=0)
    env = AgentEnv(be, AgentEnvConfig(max_turns=3, max_owner_retries=1))
    made = []
    retrying = asyncio.Event()

    class HangOnRetry(Scripted):
        async def act(self, obs):
            if len(made) > len(OWNERS):  # the retry's agent: hang
                retrying.set()
                await asyncio.sleep(3600)
            return await super().act(obs)

    def make(i):
        made.append(HangOnRetry(i, be))
        return made[-1]

    async def main():
        job = asyncio.create_task(env.run_group(word_task(WORD), OWNERS, make))
        await asyncio.wait_for(retrying.wait(), 10)
        assert be.base_id in be.inventory() and be.handed[1][0] in be.inventory()
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job

    asyncio.run(main())
    assert be.inventory() == []


def test_max_owner_retries_is_validated():
    with pytest.raises(ConfigError, match="max_owner_retries must be >= 0, got -1"):
        AgentEnvConfig(max_owner_retries=-1)
    assert AgentEnvConfig().max_owner_retries == 0
