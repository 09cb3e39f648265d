"""Micro-batch loss shares with global denominators add up to the full-batch policy_loss."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osworld_jax.algorithms import LOSS_AGG_MODES, LossConfig, policy_loss
from osworld_jax.batch import Batch, BatchBounds
from osworld_jax.trainer import token_loss_weights
from osworld_jax.trainer.step import merge_micro, micro_batch_policy_loss, split_micro

R, T = 12, 7
BOUNDS = BatchBounds(num_owners=7, num_groups=3, norm_length=9)


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    mask = (rng.random((R, T)) < 0.6).astype(np.float32)
    mask[:, 0] = 0.0
    mask[5] = 0.0  # a row with no loss tokens
    row_weight = np.ones(R, np.float32)
    row_weight[11] = 0.0  # padding row
    owners = rng.integers(0, BOUNDS.num_owners, R).astype(np.int32)  # owners span micro-batches
    groups = (owners % BOUNDS.num_groups).astype(np.int32)
    adv = (rng.normal(size=BOUNDS.num_owners)[owners][:, None] * mask).astype(np.float32)
    behavior = np.where(mask > 0, -rng.random((R, T)) * 3, 0.0).astype(np.float32)
    behavior[3, np.argmax(mask[3])] = -40.0  # far off-policy: the binary-KL gate rejects row 3
    z = np.zeros((R, T), np.int32)
    batch = Batch(z, mask, behavior, adv, z, z + 1, owners, groups, row_weight, z[..., None, None])
    logprobs = jnp.asarray(behavior + rng.normal(scale=0.05, size=(R, T)), jnp.float32)
    return batch, logprobs


def _full(logprobs, batch, cfg, old):
    mask = batch.loss_mask * batch.row_weight[:, None]
    loss, _ = policy_loss(
        logprobs,
        batch.behavior_logprobs,
        batch.advantages,
        mask,
        config=cfg,
        old_logprobs=old,
        group_ids=batch.group_ids,
        num_groups=BOUNDS.num_groups,
        owner_ids=batch.owner_ids,
        num_owners=BOUNDS.num_owners,
        norm_length=BOUNDS.norm_length,
    )
    return loss


def _summed(logprobs, batch, cfg, old, m):
    mask = batch.loss_mask * batch.row_weight[:, None]
    w = token_loss_weights(jnp.asarray(mask), batch, BOUNDS, cfg.agg_mode)
    split = lambda x: split_micro(jnp.asarray(x), m)
    mbs = jax.tree.map(split, batch)
    olds = None if old is None else split(old)
    total = 0.0
    for i in range(m):
        mb = jax.tree.map(lambda x, i=i: x[i], mbs)
        o = None if olds is None else olds[i]
        total = total + micro_batch_policy_loss(split(logprobs)[i], mb, split(w)[i], o, cfg)
    return total


CASES = [dict(agg_mode=mode) for mode in LOSS_AGG_MODES.names()] + [
    dict(agg_mode="seq-mean-token-mean", gate_level="token"),
    dict(agg_mode="token-mean", gate="ratio", gate_threshold=0.5),
    dict(agg_mode="prompt-mean-token-mean", gate="none", ratio_clip=(0.8, 1.28)),
]


PARAMS = [(case, 3) for case in CASES] + [(CASES[0], 2), (CASES[0], 4)]  # prompt-mean


@pytest.mark.parametrize(
    ("case", "m"),
    PARAMS,
    ids=lambda c: "-".join(str(v) for v in c.values()) if isinstance(c, dict) else f"m{c}",
)
def test_micro_batch_shares_sum_to_full_loss_and_gradient(case, m):
    batch, logprobs = _batch()
    cfg = LossConfig(**case)
    # With ratio clipping, take an off-policy pi_old so that some tokens are actually clipped.
    old = (
        None
        if cfg.ratio_clip is None
        else logprobs
        - jnp.asarray(np.random.default_rng(1).normal(scale=0.4, size=(R, T)), jnp.float32)
    )
    full, g_full = jax.jit(jax.value_and_grad(_full), static_argnums=2)(logprobs, batch, cfg, old)
    summed, g_sum = jax.jit(jax.value_and_grad(_summed), static_argnums=(2, 4))(
        logprobs, batch, cfg, old, m
    )
    chex.assert_trees_all_close(summed, full, atol=1e-6, rtol=1e-5)
    chex.assert_trees_all_close(g_sum, g_full, atol=1e-7, rtol=1e-5)
    assert np.abs(np.asarray(g_full)).sum() > 0


def test_weights_are_the_aggregation_denominators():
    # prompt-mean-token-mean: W_rt = m_rt / (G_active * T_g) (hand formula).
    batch, _ = _batch()
    mask = batch.loss_mask * batch.row_weight[:, None]
    w = np.asarray(token_loss_weights(jnp.asarray(mask), batch, BOUNDS, "prompt-mean-token-mean"))
    t_g = np.bincount(batch.group_ids, weights=mask.sum(1), minlength=BOUNDS.num_groups)
    expect = mask / ((t_g > 0).sum() * t_g[batch.group_ids][:, None])
    np.testing.assert_allclose(w, expect, rtol=1e-6)


def test_micro_split_is_strided_and_invertible():
    x = jnp.arange(12 * 2).reshape(12, 2)
    s = split_micro(x, 3)
    np.testing.assert_array_equal(s[1, :, 0], [2, 8, 14, 20])  # rows 1, 4, 7, 10
    np.testing.assert_array_equal(merge_micro(s), x)
