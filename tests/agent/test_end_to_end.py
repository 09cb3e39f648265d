"""Slow: a tiny model behind the embedded server -> OwnerAgent -> rows the policy agrees with.

The rows must be exactly what the engine computed: re-running the policy on a packed row (with
the row's routes replayed, R3) reproduces every behaviour logprob at its token.
"""

from __future__ import annotations

import asyncio

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osworld_jax.agent import (
    AgentConfig,
    AgentTokenizer,
    CompactionConfig,
    GroupSelection,
    OwnerAgent,
    OwnerRollout,
    pack_batch,
)
from osworld_jax.env.backend import Observation

pytestmark = pytest.mark.slow


def test_embedded_server_rows_reproduce_behaviour_logprobs(tmp_path):
    from osworld_jax.model import load_hf_checkpoint, make_tiny_checkpoint
    from osworld_jax.rollout import RolloutConfig, SamplingParams, SGLangClient
    from osworld_jax.rollout.launch import launch_embedded

    ckpt = make_tiny_checkpoint(tmp_path / "tiny", seed=3)
    tok = AgentTokenizer.from_model_dir(ckpt)
    policy = load_hf_checkpoint(ckpt, dtype=jnp.float32)
    cfg = policy.config
    layers, top_k = cfg.num_hidden_layers, cfg.num_experts_per_tok
    # Every 2 actions the context is rewritten: 3 calls -> segments {0, 1} and {2}.
    config = AgentConfig(
        a11y_max_chars=300,
        compaction=CompactionConfig(
            every_k_actions=2, max_context_tokens=2048, reserved_generation_tokens=64
        ),
    )
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12, sampling_seed=7)

    def observation(i: int) -> Observation:
        return Observation(
            screenshot=None,
            a11y_tree=f"<window title='editor {i}'><text name='line {i}'/></window>",
            terminal="",
            instruction="Type the word cat into the open editor.",
        )

    async def run(url: str) -> OwnerAgent:
        client = SGLangClient(
            [url],
            RolloutConfig(
                urls=(url,),
                return_routed_experts=True,
                num_layers=layers,
                num_experts_per_tok=top_k,
            ),
        )
        agent = OwnerAgent(client, tok, config, owner_id=0, group_id=0, sampling=sampling)
        try:
            for i in range(3):
                await agent.act(observation(i))
        finally:
            await client.aclose()
        return agent

    with launch_embedded(ckpt, dtype="float32", max_running_requests=2) as srv:
        agent = asyncio.run(run(srv.url))

    owner = OwnerRollout(
        owner_id=0, group_id=0, segments=tuple(agent.segments()), reward=1.0, failed=False
    )
    assert [s.call_indices for s in owner.segments] == [(0, 1), (2,)]
    batch = pack_batch(GroupSelection.of([owner]), [1.0], num_layers=layers, top_k=top_k)
    real = batch.segment_ids > 0
    # Routes: every real position but each row's last has one on the MoE layers (dense layer 0
    # is -1 by the server contract); the last token of a row was never an input.
    moe = [i for i in range(layers) if i not in cfg.mlp_only_layers]
    for r, seg in enumerate(owner.segments):
        n = seg.length
        assert np.all(batch.routed_experts[r, : n - 1][:, moe] >= 0)
        assert np.all(batch.routed_experts[r, n - 1 :] == -1)
    out = policy(
        jnp.asarray(batch.tokens),
        positions=jnp.asarray(batch.positions),
        segment_ids=jnp.asarray(batch.segment_ids),
        replay_experts=jnp.asarray(batch.routed_experts),
    )
    logp = jax.nn.log_softmax(out.logits.astype(jnp.float32), axis=-1)  # [R, T, V]
    # logits at t - 1 predict tokens[t]: the trainer's logprob array aligned to tokens.
    ours = np.zeros(batch.tokens.shape, np.float32)
    ours[:, 1:] = np.take_along_axis(np.asarray(logp[:, :-1]), batch.tokens[:, 1:, None], axis=-1)[
        ..., 0
    ]
    m = (batch.loss_mask > 0) & real
    assert m.sum() == sum(c.output_ids.size for c in agent.history.calls)
    # float32 on both sides (observed max difference ~5e-7).
    np.testing.assert_allclose(ours[m], batch.behavior_logprobs[m], atol=1e-4)
