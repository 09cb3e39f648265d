"""OwnerAgent: failure semantics, and a whole group through AgentEnv -> rows."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from osworld_jax.agent import (
    AgentCallError,
    AgentConfig,
    GroupPolicyConfig,
    OwnerAgent,
    build_segments,
    pack_batch,
    select_groups,
)
from osworld_jax.batch import check_batch
from osworld_jax.env.agent_env import AgentEnv, AgentEnvConfig, OwnerResult
from osworld_jax.env.backend import Observation
from osworld_jax.errors import InfraError
from osworld_jax.rl.stages import owner_advantages
from osworld_jax.rollout import SamplingParams, ServerUnavailable
from osworld_jax.testing.memory import MemoryBackend, word_task

from .conftest import ScriptedClient

OBS = Observation(screenshot=None, a11y_tree="<editor/>", terminal="", instruction="Type cat.")


def make(tok, client, owner_id=0, group_id=0):
    return OwnerAgent(
        client,
        tok,
        AgentConfig(),
        owner_id=owner_id,
        group_id=group_id,
        sampling=SamplingParams(max_new_tokens=32),
    )


class Mangling(ScriptedClient):
    """Returns a scripted reply with one field broken by ``mangle``."""

    def __init__(self, tok, mangle):
        super().__init__(tok, ["DONE"])
        self.mangle = mangle

    async def generate(self, input_ids, sampling, *, rid, routed_experts_start_len=0):
        gen = await super().generate(
            input_ids, sampling, rid=rid, routed_experts_start_len=routed_experts_start_len
        )
        return dataclasses.replace(gen, **self.mangle(gen))


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (ServerUnavailable("no healthy server"), ServerUnavailable),
        (ConnectionResetError("peer reset"), AgentCallError),
        (TimeoutError(), AgentCallError),
    ],
)
def test_server_and_transport_failures_are_infra_errors(agent_tokenizer, exc, kind):
    agent = make(agent_tokenizer, ScriptedClient(agent_tokenizer, [exc]), owner_id=5)
    with pytest.raises(kind) as e:
        asyncio.run(agent.act(OBS))
    assert isinstance(e.value, InfraError)
    assert agent.history.num_calls == 0


@pytest.mark.parametrize(
    ("mangle", "match"),
    [
        (lambda g: {"output_logprobs": g.output_logprobs[:-1]}, "logprobs for"),
        (lambda g: {"routed_experts": g.routed_experts[1:]}, "routed_experts shape"),
        (lambda g: {"finish_reason": {"type": "abort", "message": "x"}}, "unusable finish"),
    ],
)
def test_unusable_replies_fail_the_owner(agent_tokenizer, mangle, match):
    agent = make(agent_tokenizer, Mangling(agent_tokenizer, mangle), owner_id=2)
    with pytest.raises(AgentCallError, match=f"owner 2 call 0 .*{match}"):
        asyncio.run(agent.act(OBS))


def test_length_finish_is_data(agent_tokenizer):
    # No <|im_end|>, finish "length": the turn is recorded and its text returned as is.
    agent = make(agent_tokenizer, ScriptedClient(agent_tokenizer, ["pyautogui.cli"], stop=False))
    assert asyncio.run(agent.act(OBS)) == "pyautogui.cli"
    (call,) = agent.history.calls
    assert call.finish_reason["type"] == "length" and call.weight_version == "v1"
    rollout = agent.to_rollout(
        OwnerResult(owner_index=0, reward=0.0, failed=False, error=None, turns=1, actions=())
    )
    assert len(rollout.segments) == 1 and rollout.reward == 0.0


def test_a_group_through_agent_env_becomes_rows(agent_tokenizer):
    # word_task("cat") on the memory backend: owner 0 types "cat" then says DONE (reward 1),
    # owner 1 types "dog" (reward 0), owner 2's server is down (failed), owner 3 types "cat".
    # Group policy keeps the group (3 healthy >= 2); GRPO over {1, 0, 1}: mean 2/3, Bessel std
    # sqrt((1/9 + 4/9 + 1/9) / 2) = 0.57735 -> +0.57735, -1.1547, (failed) 0, +0.57735.
    script = {
        0: ["```python\npyautogui.typewrite('cat')\n```", "DONE"],
        1: ["```python\npyautogui.typewrite('dog')\n```", "DONE"],
        2: [ServerUnavailable("down")],
        3: ["```python\npyautogui.typewrite('cat')\n```", "DONE"],
    }
    agents: dict[int, OwnerAgent] = {}

    def make_agent(i):
        agents[i] = make(agent_tokenizer, ScriptedClient(agent_tokenizer, script[i]), i, 0)
        return agents[i]

    backend = MemoryBackend()
    env = AgentEnv(backend, AgentEnvConfig(max_turns=4))
    results = asyncio.run(env.run_group(word_task("cat"), [0, 1, 2, 3], make_agent))
    assert [r.reward for r in results] == [1.0, 0.0, None, 1.0]
    assert backend.inventory() == []
    owners = [agents[r.owner_index].to_rollout() for r in results]
    assert [len(o.segments) for o in owners] == [1, 1, 0, 1]
    assert owners[2].failed and "ServerUnavailable" in owners[2].error
    sel = select_groups(owners, GroupPolicyConfig(), num_prompts=1)
    adv = owner_advantages(sel, "grpo")
    np.testing.assert_allclose(adv, [0.57735, -1.1547, 0.0, 0.57735], rtol=1e-4)
    batch = pack_batch(sel, adv, num_layers=2, top_k=2, dp_size=2)
    check_batch(batch)
    np.testing.assert_array_equal(batch.owner_ids, [0, 1, 2, 3])
    np.testing.assert_array_equal(batch.row_weight, [1, 1, 0, 1])
    # Two calls per healthy owner, all generated tokens trainable (no media in the replies).
    for i in (0, 1, 3):
        calls = agents[i].history.calls
        assert len(calls) == 2
        assert batch.loss_mask[i].sum() == sum(c.output_ids.size for c in calls)
        np.testing.assert_array_equal(
            batch.tokens[i, : calls[1].length],
            np.concatenate([calls[1].prompt_ids, calls[1].output_ids]),
        )
    assert (len(sel.owners), sel.num_groups) == (4, 1)


def test_real_client_wire_path_gives_exact_rows(agent_tokenizer):
    # The rollout room's fake SGLang server answers with pure functions of the absolute position
    # (token (31p + 7) % 1000, logprob -0.001p - 0.01, route (5p + 3l + k) % 64 for input
    # position p), so the owner's single segment must carry exactly those values: output tokens
    # and logprobs at their positions, routes at every position but the last (-1), whatever
    # routed_experts_start_len the agent asked for and although call 1 was aborted after 2 tokens
    # and resubmitted (the client stitches the parts).
    from osworld_jax.rollout import RolloutConfig, SGLangClient
    from osworld_jax.testing.sglang_server import FakeServer, logprob_at, routes_for, token_at
    from osworld_jax.testing.sglang_server import K as FK
    from osworld_jax.testing.sglang_server import L as FL

    async def main():
        server = await FakeServer(script=["ok", "abort:2", "ok"]).start()
        cfg = RolloutConfig(
            urls=(server.url,),
            return_routed_experts=True,
            num_layers=FL,
            num_experts_per_tok=FK,
            backoff_initial_s=0.01,
            health_check_interval_s=0.2,
        )
        client = SGLangClient([server.url], cfg)
        agent = make(agent_tokenizer, client, owner_id=1, group_id=0)
        agent.sampling = SamplingParams(max_new_tokens=5)
        try:
            for i in range(3):
                await agent.act(dataclasses.replace(OBS, a11y_tree=f"<editor step='{i}'/>"))
        finally:
            await client.aclose()
            await server.stop()
        return agent, server

    agent, server = asyncio.run(main())
    calls = agent.history.calls
    assert len(server.requests) == 4  # 3 calls + 1 resubmission
    sent = [r.get("routed_experts_start_len", 0) for r in server.requests]
    # Call 1's first part starts after call 0's context; its resubmission starts at the end of
    # the stitched prompt (the client's business); call 2 after call 1's context.
    assert sent[0] == 0 and sent[1] == calls[0].length - 1 and sent[-1] == calls[1].length - 1
    (seg,) = build_segments(agent.history)
    n = seg.length
    np.testing.assert_array_equal(seg.routed_experts[: n - 1], routes_for(range(n - 1)))
    np.testing.assert_array_equal(seg.routed_experts[n - 1], -1)
    gen = np.flatnonzero(seg.loss_mask)
    assert gen.size == 15
    np.testing.assert_array_equal(seg.tokens[gen], [token_at(int(p)) for p in gen])
    np.testing.assert_allclose(seg.behavior_logprobs[gen], [logprob_at(int(p)) for p in gen])
