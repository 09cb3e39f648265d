"""A tiny real Policy and a hand-made RL batch for the trainer tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from osworld_jax.algorithms import LossConfig
from osworld_jax.batch import Batch, BatchBounds
from osworld_jax.model import Policy, Qwen3MoeConfig
from osworld_jax.trainer import OptimizerConfig, TrainerConfig
from tests import tiny

# The tests' tiny config (tests/tiny.py) cut to 2 layers and 4 experts: layer 0 MoE, layer 1
# dense (both kinds), every dimension divisible by 2 for the 8-device mesh.
TINY = tiny.TINY.replace(num_hidden_layers=2, num_experts=4, mlp_only_layers=(1,))
RUNTIME = tiny.RUNTIME

# Rows -> logical owners (owners 0 and 3 have two segments each; row 7 is padding) and groups.
OWNERS = np.array([0, 0, 1, 2, 3, 3, 4, 0], np.int32)
GROUP_OF_OWNER = np.array([0, 0, 0, 1, 1], np.int32)
BOUNDS = BatchBounds(num_owners=5, num_groups=2, norm_length=16)


def make_policy(seed: int = 0, config: Qwen3MoeConfig = TINY) -> Policy:
    return Policy(config, RUNTIME, rngs=nnx.Rngs(seed))


def trainer_config(*, loss: dict | None = None, **overrides) -> TrainerConfig:
    """The tests' trainer config; ``loss`` holds `LossConfig` fields."""
    opt = overrides.pop("optimizer", OptimizerConfig(learning_rate=1e-3, weight_decay=0.01))
    return TrainerConfig(
        optimizer=opt, logprob_chunk=5, loss=LossConfig(**(loss or {})), **overrides
    )


def naive_logprobs(policy: Policy, batch: Batch, *, replay: bool = True):
    """Full-vocabulary log-softmax gather (the reference), aligned to tokens; also entropy."""
    out = policy(
        jnp.asarray(batch.tokens),
        positions=jnp.asarray(batch.positions),
        segment_ids=jnp.asarray(batch.segment_ids),
        replay_experts=jnp.asarray(batch.routed_experts) if replay else None,
    )
    logp = jax.nn.log_softmax(out.logits, axis=-1)
    lp = jnp.take_along_axis(logp[:, :-1], jnp.asarray(batch.tokens)[:, 1:, None], -1)[..., 0]
    ent = -jnp.sum(jnp.exp(logp) * logp, -1)[:, :-1]
    zero = jnp.zeros((lp.shape[0], 1))
    return jnp.concatenate([zero, lp], 1), jnp.concatenate([zero, ent], 1), out


def make_batch(policy: Policy, seed: int = 0, rows: int = 8, length: int = 16) -> Batch:
    """Prompt + generated tokens + padding per row; behaviour = policy logprobs + noise."""
    rng = np.random.default_rng(seed)
    owners = OWNERS if rows == len(OWNERS) else np.arange(rows, dtype=np.int32) % 5
    tokens = np.zeros((rows, length), np.int32)
    loss_mask = np.zeros((rows, length), np.float32)
    segment_ids = np.zeros((rows, length), np.int32)
    row_weight = np.ones((rows,), np.float32)
    for r in range(rows):
        if rows == len(OWNERS) and r == rows - 1:  # padding row
            row_weight[r] = 0.0
            continue
        prompt = int(rng.integers(3, 6))
        total = int(rng.integers(prompt + 3, length + 1))
        tokens[r, :total] = rng.integers(1, TINY.vocab_size, total)
        loss_mask[r, prompt:total] = 1.0
        segment_ids[r, :total] = 1
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length)).copy()
    owner_adv = rng.normal(size=5).astype(np.float32)
    advantages = owner_adv[owners][:, None] * loss_mask
    base = Batch(
        tokens=tokens,
        loss_mask=loss_mask,
        behavior_logprobs=np.zeros((rows, length), np.float32),
        advantages=advantages.astype(np.float32),
        positions=positions,
        segment_ids=segment_ids,
        owner_ids=owners.astype(np.int32),
        group_ids=GROUP_OF_OWNER[owners].astype(np.int32),
        row_weight=row_weight,
        routed_experts=np.full((rows, length, TINY.num_hidden_layers, 2), -1, np.int32),
    )
    lp, _, out = naive_logprobs(policy, base, replay=False)
    routes = np.where(segment_ids[..., None, None] > 0, np.asarray(out.routed_experts), -1)
    noise = rng.normal(scale=0.02, size=lp.shape).astype(np.float32)
    behavior = np.where(loss_mask > 0, np.minimum(np.asarray(lp) + noise, -1e-3), 0.0)
    return base._replace(behavior_logprobs=behavior.astype(np.float32), routed_experts=routes)
