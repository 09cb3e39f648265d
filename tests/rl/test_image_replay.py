"""The trainer replays a packed batch with screenshots and reproduces every behaviour logprob.

The real pipeline minus the sandboxes: OwnerAgents (tiny Qwen3-VL-MoE's tokenizer, template
and image processor) talk through the real `SGLangClient` to the embedded server (in-process
engine over HTTP) with screenshots as ``image_data``; their segments (K = 2 screenshots shown,
so calls 0-1 form one segment with two images and the third call's screenshot compaction starts
another) are packed with one owner's segments in one row (`pack_segments`) and the train step
scores them with R3: every behaviour logprob of the server is reproduced (float32) and every
replayed route agrees.
"""

from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest
from PIL import Image

from osworld_jax.agent import (
    AgentConfig,
    AgentTokenizer,
    CompactionConfig,
    GroupSelection,
    OwnerAgent,
    pack_batch,
)
from osworld_jax.batch import BatchBounds, with_pixel_values
from osworld_jax.env.agent_env import OwnerResult
from osworld_jax.env.backend import Observation
from osworld_jax.model import Qwen3MoeConfig, load_hf_checkpoint
from osworld_jax.rl.stages import vision_packing
from osworld_jax.rollout import RolloutConfig, SamplingParams, SGLangClient
from osworld_jax.trainer import Trainer
from tests.rollout.conftest import VL_ENGINE_KW, serving
from tests.trainer._tiny import trainer_config

OWNERS, TURNS = 3, 3
CONFIG = AgentConfig(
    system_prompt="Act.",
    max_screenshots=2,
    screen_width=256,
    screen_height=192,
    compaction=CompactionConfig(max_context_tokens=1024, reserved_generation_tokens=16),
)


def screenshot(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (192, 256, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vl_ckpt(tmp_path_factory):
    from osworld_jax.model.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_vl"), kind="qwen3_vl_moe")


async def roll_out(url, tok, model):
    rollout = RolloutConfig(
        return_routed_experts=True,
        num_layers=model.num_hidden_layers,
        num_experts_per_tok=model.num_experts_per_tok,
    )
    async with SGLangClient([url], rollout) as client:
        agents = [
            OwnerAgent(
                client,
                tok,
                CONFIG,
                owner_id=o,
                group_id=0,
                sampling=SamplingParams(temperature=1.0, max_new_tokens=8, sampling_seed=o),
            )
            for o in range(OWNERS)
        ]

        async def episode(agent):
            for t in range(TURNS):
                obs = Observation(
                    screenshot=screenshot(10 * agent.owner_id + t),
                    a11y_tree=f"<button name='b{t}'/>",
                    terminal="",
                    instruction="Press the button.",
                )
                await agent.act(obs)

        await asyncio.gather(*(episode(a) for a in agents))
    return agents


@pytest.mark.slow
def test_a_packed_batch_with_images_reproduces_every_behaviour_logprob(vl_ckpt):
    tok = AgentTokenizer.from_model_dir(vl_ckpt)
    model = Qwen3MoeConfig.from_json(vl_ckpt / "config.json")
    from osworld_jax.server.engine import Engine, EngineConfig

    kw = dict(VL_ENGINE_KW, context_length=1024)
    engine = Engine(EngineConfig(model_path=str(vl_ckpt), weight_version="v0", **kw)).start()

    async def main():
        async with serving(engine) as url:
            return await roll_out(url, tok, model)

    try:
        agents = asyncio.run(main())
    finally:
        engine.shutdown()
    owners = []
    for a in agents:
        result = OwnerResult(
            owner_index=a.owner_id, reward=float(a.owner_id), failed=False, error=None,
            turns=TURNS, actions=(),
        )  # fmt: skip
        owners.append(a.to_rollout(result))
    # K = 2: calls 0, 1 share a segment (2 screenshots); call 2's screenshot passes the window:
    # the rebuild keeps it alone (the low-water mark, AgentConfig.screenshots_after_compaction).
    assert [[s.call_indices for s in o.segments] for o in owners] == [[(0, 1), (2,)]] * OWNERS
    assert [[len(s.images) for s in o.segments] for o in owners] == [[2, 1]] * OWNERS
    vision = vision_packing(model, vl_ckpt, CONFIG)
    sel = GroupSelection.of(owners)
    batch = pack_batch(
        sel, [0.5, -0.5, 0.0], num_layers=model.num_hidden_layers,
        top_k=model.num_experts_per_tok, pack_segments=True, vision=vision,
        length_buckets=[1024],
    )  # fmt: skip
    assert batch.tokens.shape[0] == OWNERS and batch.segment_ids.max() == 2  # packed rows
    assert batch.pixel_values is None and (batch.image_grid_thw[..., 0] > 0).sum() == 9
    # The host batch holds each distinct screenshot once (its PNG); the trainer makes the
    # patches at its input boundary.
    shown = {png for o in owners for s in o.segments for png in s.images}
    assert set(batch.images.encoded) == shown and len(batch.images.encoded) == len(shown)
    policy = load_hf_checkpoint(vl_ckpt, dtype="float32")
    bounds = BatchBounds(num_owners=OWNERS, num_groups=1, norm_length=64)
    trainer = Trainer(trainer_config(), policy, bounds=bounds)
    state = trainer.init_state()
    lp = np.asarray(trainer.logprobs(state.params, batch))
    # Bit for bit the logprobs of the whole-batch float32 patches (the former host batch).
    np.testing.assert_array_equal(lp, trainer.logprobs(state.params, with_pixel_values(batch)))
    mask = batch.loss_mask > 0
    assert mask.sum() >= OWNERS * TURNS * 4
    diff = np.abs(lp - batch.behavior_logprobs)[mask]
    print(f"|trainer - server| logprob: mean {diff.mean():.2e} max {diff.max():.2e}")
    assert diff.mean() <= 1e-5 and diff.max() <= 1e-4
    _, metrics = trainer.train_step(state, batch)
    assert metrics["route_agreement"] == 1.0
    assert metrics["logprob_abs_diff"] <= 1e-5
