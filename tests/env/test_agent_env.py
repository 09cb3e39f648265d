"""AgentEnv: init once, fork exactly N, failures isolate owners, zero residual sandboxes."""

import asyncio

import pytest

from osworld_jax.env.agent_env import AgentEnv, AgentEnvConfig
from osworld_jax.env.backend import SandboxCreateError, SandboxStepError
from osworld_jax.errors import ConfigError, InfraError
from osworld_jax.testing.faults import FaultInjectingBackend
from osworld_jax.testing.memory import MemoryBackend, word_task

TYPE = "```python\npyautogui.typewrite({!r})\n```"


class Spy(MemoryBackend):
    """A memory backend recording create/fork calls (and optionally failing them)."""

    def __init__(self, fail_create=False, fail_fork=False):
        super().__init__()
        self.creates, self.forks = 0, []
        self.fail_create, self.fail_fork = fail_create, fail_fork

    async def create(self, task):
        self.creates += 1
        if self.fail_create:
            raise SandboxCreateError("no desktop today")
        return await super().create(task)

    async def fork(self, sandbox, n):
        self.forks.append(n)
        if self.fail_fork:
            raise SandboxCreateError("fork broke")
        return await super().fork(sandbox, n)


class Scripted:
    def __init__(self, replies):
        self.replies = list(replies)
        self.seen = []
        self.ended = None

    async def act(self, obs):
        self.seen.append(obs)
        return self.replies.pop(0) if self.replies else "DONE"

    async def on_episode_end(self, result):
        self.ended = result


def env_for(backend, **cfg):
    return AgentEnv(backend, AgentEnvConfig(**cfg))


def run(coro):
    return asyncio.run(coro)


def test_fork_exactly_n_and_rewards():
    be = Spy()
    env = env_for(be, max_turns=1)
    agents = {}

    def make(i):
        agents[i] = Scripted([TYPE.format("cat" if i % 2 else "dog")])
        return agents[i]

    res = run(env.run_group(word_task("cat"), [3, 5, 8], make))
    assert be.creates == 1 and be.forks == [3]
    assert [r.owner_index for r in res] == [3, 5, 8]
    # the memory editor auto-saves: typing "cat" makes answer.txt == "cat" -> exact_match 1
    assert [r.reward for r in res] == [1.0, 1.0, 0.0]
    assert not any(r.failed for r in res)
    assert all(r.turns == 1 and len(r.actions) == 1 for r in res)
    assert agents[3].ended == res[0]  # on_episode_end got the result
    assert agents[3].seen[0].instruction.startswith("Type the word cat")
    assert agents[3].seen[0].screenshot.startswith(b"\x89PNG")
    assert be.inventory() == []
    m = env.metrics.as_dict()
    assert m["env/creates"] == 1 and m["env/forks"] == 3 and m["env/evaluations"] == 3


def infeasible_task():
    from osworld_jax.env.tasks import load_task

    return load_task(
        {"id": "os-infeasible-x", "instruction": "Do the impossible.", "config": [],
         "evaluator": {"func": "infeasible"}}
    )  # fmt: skip


def test_gibberish_on_an_infeasible_task_scores_0_a_real_fail_scores_1():
    # A parse failure is its own outcome (UNPARSED): never FAIL, which scores 1 on an infeasible
    # task. The episode continues (upstream: no code parsed, nothing run, next step) to
    # max_turns; the evaluator sees the last action *run* (none), so the reward is 0.
    env = env_for(MemoryBackend(), max_turns=3)
    scripts = {
        0: ["asdf qwer zxcv"] * 5,  # gibberish every turn
        1: ["FAIL"],  # the real answer
        2: ["!!", "```python\ndef (:\n```", "FAIL"],  # two parse errors, then FAIL
        3: ["FAIL.", "x"],  # "FAIL." is not the keyword: unparsed, not an answer
    }
    res = run(env.run_group(infeasible_task(), [0, 1, 2, 3], lambda i: Scripted(scripts[i])))
    assert [(r.reward, r.turns, r.num_parse_errors) for r in res] == [
        (0.0, 3, 3), (1.0, 1, 0), (1.0, 3, 2), (0.0, 3, 2),
    ]  # fmt: skip
    assert res[0].parse_errors[0] and res[1].parse_errors == (None,)
    assert not any(r.failed for r in res)
    assert env.metrics.as_dict()["env/parse_errors"] == 7
    assert env.metrics.as_dict()["env/steps"] == 0  # nothing unparsed was stepped


def test_zero_owners_no_sandbox():
    be = Spy()
    assert run(env_for(be).run_group(word_task("x"), [], lambda i: Scripted([]))) == []
    assert be.creates == 0 and be.forks == []


def test_episode_ends_on_done_fail_or_max_turns():
    env = env_for(MemoryBackend(), max_turns=3)
    scripts = {
        0: [TYPE.format("hi"), "DONE"],  # 2 turns, reward 1
        1: ["WAIT", "WAIT", "WAIT", "never read"],  # max_turns, nothing typed -> 0
        2: [TYPE.format("hi"), "FAIL"],  # FAIL on a feasible task -> 0
        3: ["I refuse to write code"],  # unparsable: a spent turn, then DONE (reward 0)
    }
    res = run(env.run_group(word_task("hi"), [0, 1, 2, 3], lambda i: Scripted(scripts[i])))
    assert [(r.reward, r.turns, r.failed) for r in res] == [
        (1.0, 2, False), (0.0, 3, False), (0.0, 2, False), (0.0, 2, False),
    ]  # fmt: skip
    assert [r.num_parse_errors for r in res] == [0, 0, 0, 1]


def test_failed_owner_isolated_and_unclaimed_fork_closed():
    be = Spy()
    env = env_for(be, max_turns=1)

    class Broken:
        async def act(self, obs):
            raise InfraError("rollout server gone")

    def make(i):
        if i == 1:
            raise InfraError("could not build agent")  # fork 1 is never claimed
        return Broken() if i == 2 else Scripted([TYPE.format("ok")])

    res = run(env.run_group(word_task("ok"), [0, 1, 2], make))
    assert [r.failed for r in res] == [False, True, True]
    assert res[0].reward == 1.0
    assert res[1].reward is None and "could not build agent" in res[1].error
    assert "rollout server gone" in res[2].error
    assert be.inventory() == []
    assert env.metrics.owner_failures == 2


def test_create_and_fork_failures_fail_all_owners_without_leaks():
    for be in (Spy(fail_create=True), Spy(fail_fork=True)):
        env = env_for(be)
        res = run(env.run_group(word_task("x"), [0, 1], lambda i: Scripted([])))
        assert all(r.failed and r.reward is None for r in res)
        assert "failed" in res[0].error
        assert be.inventory() == []


def test_step_timeout_fails_owner():
    class Slow(MemoryBackend):
        async def fork(self, sandbox, n):
            forks = await super().fork(sandbox, n)

            async def hang(action):
                await asyncio.sleep(3600)

            forks[0].step = hang
            return forks

    be = Slow()
    env = env_for(be, max_turns=2, step_timeout_s=0.05)
    res = run(env.run_group(word_task("a"), [0, 1], lambda i: Scripted([TYPE.format("a")] * 2)))
    assert res[0].failed and "SandboxTimeout" in res[0].error
    assert not res[1].failed
    assert be.inventory() == [] and env.metrics.timeouts == 1


def test_cancellation_leaves_no_sandbox():
    be = MemoryBackend()
    env = env_for(be, max_turns=5)
    started = []

    class Hang:
        async def act(self, obs):
            started.append(1)
            await asyncio.sleep(3600)

    async def main():
        job = asyncio.create_task(env.run_group(word_task("a"), [0, 1, 2], lambda i: Hang()))
        while len(started) < 3:
            await asyncio.sleep(0.001)
        assert len(be.inventory()) == 3  # the three forks are live (the base is closed)
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job

    run(main())
    assert be.inventory() == []


def test_bug_in_agent_propagates_after_cleanup():
    be = MemoryBackend()

    class Buggy:
        async def act(self, obs):
            raise ZeroDivisionError("bug")

    with pytest.raises(ZeroDivisionError):
        run(env_for(be).run_group(word_task("a"), [0, 1], lambda i: Buggy()))
    assert be.inventory() == []


class FirstEvalsFail(FaultInjectingBackend):
    """Fails the first ``k`` evaluate calls with an injected transient (503) fault."""

    def __init__(self, inner, k):
        super().__init__(inner, fail_rate=0.0, ops=("evaluate",))
        self.k = k

    def _maybe(self, op, exc, status=None):
        if op == "evaluate" and self.k > 0:
            self.k -= 1
            self.injected[op] += 1
            raise exc("injected evaluate fault", status=status)


def test_transient_eval_error_is_retried():
    inner = MemoryBackend()
    # one blip, then success: the solved task still scores 1
    be = FirstEvalsFail(inner, k=1)
    env = env_for(be, max_turns=1, eval_attempts=3, eval_retry_delay_s=0.0)
    res = run(env.run_group(word_task("a"), [0], lambda i: Scripted([TYPE.format("a")])))
    assert res[0].reward == 1.0 and not res[0].failed
    assert be.injected["evaluate"] == 1 and env.metrics.eval_retries == 1
    # failing every attempt: the owner is failed (masked), never scored 0
    be = FirstEvalsFail(inner, k=3)
    env = env_for(be, max_turns=1, eval_attempts=3, eval_retry_delay_s=0.0)
    res = run(env.run_group(word_task("a"), [0], lambda i: Scripted([TYPE.format("a")])))
    assert res[0].failed and res[0].reward is None
    assert "injected evaluate fault" in res[0].error
    assert be.injected["evaluate"] == 3 and env.metrics.eval_retries == 2
    assert inner.inventory() == []


def test_fault_injection_20_percent_batch_completes():
    inner = MemoryBackend()
    be = FaultInjectingBackend(inner, fail_rate=0.2, seed=1234)
    env = env_for(be, max_turns=2, eval_attempts=2, eval_retry_delay_s=0.0)
    words = [f"w{g}" for g in range(24)]

    def maker(word):
        return lambda i: Scripted([TYPE.format(word if i % 2 == 0 else "no"), "DONE"])

    async def main():
        return await asyncio.gather(
            *(env.run_group(word_task(w), [0, 1, 2, 3], maker(w)) for w in words)
        )

    groups = run(main())
    flat = [r for g in groups for r in g]
    assert len(flat) == 24 * 4
    failed = [r for r in flat if r.failed]
    assert 0 < len(failed) < len(flat)
    assert all(r.reward is None and r.error for r in failed)
    # healthy owners are scored correctly despite their siblings' failures
    for g in groups:
        for r in g:
            if not r.failed:
                assert r.reward == (1.0 if r.owner_index % 2 == 0 else 0.0)
    assert sum(be.injected.values()) > 0 and all(be.injected[k] > 0 for k in ("create", "step"))
    assert be.inventory() == [] and inner.inventory() == []
    assert env.metrics.owner_failures == len(failed)


def test_config_validation():
    with pytest.raises(ConfigError, match="max_turns"):
        AgentEnvConfig(max_turns=0)
    with pytest.raises(ConfigError, match="action_space"):
        AgentEnvConfig(action_space="mouse")


def test_duplicate_owner_indices_rejected():
    with pytest.raises(ValueError, match="duplicate"):
        run(env_for(MemoryBackend()).run_group(word_task("a"), [1, 1], lambda i: Scripted([])))


def test_computer_13_action_space():
    env = AgentEnv(MemoryBackend(), AgentEnvConfig(action_space="computer_13", max_turns=1))
    res = run(
        env.run_group(
            word_task("zz"), [0], lambda i: Scripted(['{"action_type": "TYPING", "text": "zz"}'])
        )
    )
    assert res[0].reward == 1.0


def test_step_error_fails_only_that_owner():
    class BadStep(MemoryBackend):
        async def fork(self, sandbox, n):
            forks = await super().fork(sandbox, n)

            async def boom(action):
                raise SandboxStepError("display died")

            forks[1].step = boom
            return forks

    be = BadStep()
    res = run(
        env_for(be, max_turns=1).run_group(
            word_task("q"), [0, 1], lambda i: Scripted([TYPE.format("q")])
        )
    )
    assert [r.failed for r in res] == [False, True] and res[0].reward == 1.0
    assert "display died" in res[1].error
    assert be.inventory() == []


def test_word_task_bare_call_is_enough():
    # the shortest learnable answer: a bare call (parsed as code; the memory desktop types it)
    env = env_for(MemoryBackend(), max_turns=1)
    res = run(
        env.run_group(
            word_task("ab"),
            [0, 1],
            lambda i: Scripted(["typewrite('ab')" if i == 0 else "typewrite('ba')"]),
        )
    )
    assert [r.reward for r in res] == [1.0, 0.0]


def test_async_agent_factory_and_sync_episode_hook():
    ended = []

    class SyncHook(Scripted):
        def on_episode_end(self, result):  # a plain function is accepted too
            ended.append(result.owner_index)

    async def make(i):
        return SyncHook([TYPE.format("k")])

    res = run(env_for(MemoryBackend(), max_turns=1).run_group(word_task("k"), [4, 2], make))
    assert [r.reward for r in res] == [1.0, 1.0] and sorted(ended) == [2, 4]
