"""A retried owner's rollout: only the final attempt's model calls reach the trainer."""

import asyncio

import numpy as np

from osworld_jax.agent import AgentConfig, AgentTokenizer, ChatTemplate
from osworld_jax.data import TaskRef
from osworld_jax.env import AgentEnv, AgentEnvConfig, load_task
from osworld_jax.rl import RLConfig, stages
from osworld_jax.rollout import SamplingParams
from osworld_jax.testing.memory import write_word_tasks
from tests.agent.conftest import ScriptedClient, build_tokenizer
from tests.env.test_owner_retries import Breaking

WORD = "cat"
#: The reply to an owner's call c: type the word, wait, DONE (reward 1 in three turns).
REPLIES = [f"```python\npyautogui.typewrite({WORD!r})\n```", "WAIT", "DONE"]


class ByCall(ScriptedClient):
    """Replies ``REPLIES[c]`` to an owner's call c (read from the request id ``...-c<c>``)."""

    async def generate(self, input_ids, sampling, *, rid, **kwargs):
        self.replies = [REPLIES[int(rid.rsplit("-c", 1)[1])]]
        return await super().generate(input_ids, sampling, rid=rid, **kwargs)


def test_retried_owner_trains_on_its_final_attempt_only(tmp_path):
    # Owner 1's desktop dies on its second step (after calls c0 and c1 of attempt 1); it is
    # retried on a fork of the group's base and solves the task in three calls, as owner 0 does.
    tokenizer = AgentTokenizer(build_tokenizer(), ChatTemplate.builtin_qwen())
    client = ByCall(tokenizer, REPLIES)
    backend = Breaking(broken=1)
    env = AgentEnv(backend, AgentEnvConfig(max_turns=3, max_owner_retries=1))
    root = write_word_tasks(tmp_path, [WORD])
    (path,) = (root / "memory_word").glob("*.json")
    ref = TaskRef(task_id=f"memory-word-{WORD}", path=str(path), group_id=WORD)
    rl = RLConfig(num_prompts=1, num_owners=2, max_failed_fraction=0.0)
    step = 3

    raw = asyncio.run(
        stages.rollout_step(
            env,
            client,
            tokenizer,
            AgentConfig(),
            SamplingParams(max_new_tokens=32),
            [ref],
            rl=rl,
            step=step,
            load_task=load_task,
        )
    )
    (results,) = raw.results
    assert [(r.reward, r.failed, r.attempts) for r in results] == [(1.0, False, 1), (1.0, False, 2)]
    assert backend.inventory() == []

    # Every request id is distinct: attempt 1 keeps the step's prefix, the retry gets "a1".
    rids = [rid for _, _, rid in client.requests]
    assert len(rids) == len(set(rids)) == 3 + 2 + 3
    assert sorted(r for r in rids if "-o1-" in r) == [
        "s3-g0-o1-c0", "s3-g0-o1-c1", "s3a1-g0-o1-c0", "s3a1-g0-o1-c1", "s3a1-g0-o1-c2",
    ]  # fmt: skip

    # The rollout is built from the final attempt's agent: its three calls, none of attempt 1.
    assert [c.rid for c in raw.agents[1].history.calls] == [f"s3a1-g0-o1-c{c}" for c in range(3)]
    rollouts = stages.collect_owners(raw, rl, step)
    o0, o1 = rollouts.owners
    assert (o1.reward, o1.failed, rollouts.turns) == (1.0, False, (3, 3))
    assert [s.call_indices for s in o1.segments] == [(0, 1, 2)]
    # Same task, same replies: owner 1's trained tokens are exactly owner 0's (attempt 1's two
    # calls would add a second chain of prompt and output tokens).
    for a, b in zip(o0.segments, o1.segments, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
        np.testing.assert_array_equal(a.behavior_logprobs, b.behavior_logprobs)
    final_calls = raw.agents[1].history.calls
    assert o1.num_trainable == sum(c.output_ids.size for c in final_calls)
