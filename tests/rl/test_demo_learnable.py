"""The learning demo's toy reward reaches the evaluation through the real AgentEnv."""

from __future__ import annotations

import asyncio

from osworld_jax.demo import learnable
from osworld_jax.env import AgentEnv, AgentEnvConfig, load_task
from osworld_jax.testing.memory import MemoryBackend


class Reply:
    def __init__(self, text: str) -> None:
        self.text = text

    async def act(self, obs):
        return self.text


def test_one_token_replies_score_by_their_first_letter(tmp_path):
    task = load_task(learnable.write_tasks(tmp_path, n=1) / "vowel-0.json")
    replies = ["apple", "tree", " echo", ""]  # a reply that parses as no action (UNPARSED)
    env = AgentEnv(learnable.VowelBackend(), AgentEnvConfig(max_turns=1))
    results = asyncio.run(env.run_group(task, range(4), lambda i: Reply(replies[i])))
    assert [r.reward for r in results] == [1.0, 0.0, 0.0, 0.0]
    assert all(r.num_parse_errors == 1 for r in results)


def test_a_real_backend_never_scores_an_unparsed_reply(tmp_path):
    # Issue 29: the evaluator of every other backend sees only the actions run (None here).
    assert not getattr(MemoryBackend.sandbox_type, "scores_replies", False)
    assert learnable.VowelBackend.name == learnable.BACKEND
