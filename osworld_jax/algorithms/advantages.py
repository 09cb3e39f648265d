"""Advantage estimators over logical owners: one reward, one advantage per owner.

Every estimator takes one reward per logical owner (a rollout is one owner however many training
rows it becomes) and returns one advantage per owner. ``valid`` marks healthy owners: an invalid
(failed) owner is excluded from every statistic and gets advantage 0. Group reductions are
``jax.ops.segment_sum`` with a static ``num_groups``, so each estimator jits once per shape.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from osworld_jax.algorithms._groups import as_valid, group_stats
from osworld_jax.algorithms.registries import ESTIMATORS, Estimator
from osworld_jax.errors import ConfigError


def grpo_advantages(
    rewards: Float[Array, " N"],
    group_ids: Int[Array, " N"],
    num_groups: int,
    *,
    valid: Bool[Array, " N"] | None = None,
    eps: float = 1e-6,
) -> Float[Array, " N"]:
    """GRPO: the reward standardised within its prompt group.

    ``A_i = (r_i - mean_g) / (std_g + eps)``, ``std_g = sqrt(sum_g (r_j - mean_g)^2 / (n_g - 1))``
    (Bessel-corrected, over the valid members of group g). A group whose valid rewards are all
    exactly equal (``max == min``, decided exactly, never by a std threshold) or that has fewer
    than 2 valid members gets 0; invalid owners get 0.

    Reference: Shao et al., DeepSeekMath (arXiv 2402.03300), eq. for outcome supervision.

    Args:
      rewards: f32[N] one reward per logical owner.
      group_ids: i32[N] prompt group of each owner in ``[0, num_groups)``.
      num_groups: static number of groups G.
      valid: optional bool[N] healthy owners (default all).
      eps: added to the std in the denominator.

    Returns:
      f32[N] advantages.

    >>> import jax.numpy as jnp
    >>> a = grpo_advantages(jnp.array([1.0, 0.0]), jnp.array([0, 0]), 1)
    >>> [round(float(x), 4) for x in a]
    [0.7071, -0.7071]
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    valid = as_valid(valid, rewards)
    st = group_stats(rewards, group_ids, num_groups, valid)
    centred = jnp.where(valid, rewards - st.mean[group_ids], 0.0)
    sq = jax.ops.segment_sum(centred * centred, group_ids, num_segments=num_groups)
    var = sq / jnp.maximum(st.n - 1.0, 1.0)
    std = jnp.sqrt(var)
    degenerate = st.constant | (st.n < 2)
    adv = centred / (std[group_ids] + eps)
    return jnp.where(valid & ~degenerate[group_ids], adv, 0.0)


def dr_grpo_advantages(
    rewards: Float[Array, " N"],
    group_ids: Int[Array, " N"],
    num_groups: int,
    *,
    valid: Bool[Array, " N"] | None = None,
) -> Float[Array, " N"]:
    """Dr.GRPO: the reward minus its group mean, without std normalisation.

    ``A_i = r_i - mean_g`` over the valid members of group g; a constant group gives exactly 0
    (its mean is the common value, not a rounded sum); invalid owners get 0.

    Reference: Liu et al., Understanding R1-Zero-Like Training (Dr.GRPO, arXiv 2503.20783).

    Args:
      rewards: f32[N] one reward per logical owner.
      group_ids: i32[N] prompt group of each owner.
      num_groups: static number of groups G.
      valid: optional bool[N] healthy owners.

    Returns:
      f32[N] advantages; they sum to 0 within each group.
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    valid = as_valid(valid, rewards)
    st = group_stats(rewards, group_ids, num_groups, valid)
    return jnp.where(valid, rewards - st.mean[group_ids], 0.0)


def rloo_advantages(
    rewards: Float[Array, " N"],
    group_ids: Int[Array, " N"],
    num_groups: int,
    *,
    valid: Bool[Array, " N"] | None = None,
) -> Float[Array, " N"]:
    """RLOO: the reward minus the mean of the other valid members of its group.

    ``A_i = r_i - (S_g - r_i) / (n_g - 1) = n_g / (n_g - 1) * (r_i - mean_g)`` (the second form,
    used here, avoids subtracting two large sums). A singleton (``n_g = 1``) keeps its raw reward
    (no baseline); a constant group gives exactly 0; invalid owners get 0.

    Reference: Ahmadian et al., Back to Basics: REINFORCE-style optimisation (arXiv 2402.14740);
    Kool et al., Buy 4 REINFORCE samples, get a baseline for free (2019).

    Args:
      rewards: f32[N] one reward per logical owner.
      group_ids: i32[N] prompt group of each owner.
      num_groups: static number of groups G.
      valid: optional bool[N] healthy owners.

    Returns:
      f32[N] advantages; they sum to 0 within each group of 2 or more valid members.
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    valid = as_valid(valid, rewards)
    st = group_stats(rewards, group_ids, num_groups, valid)
    n = st.n[group_ids]
    scale = n / jnp.maximum(n - 1.0, 1.0)
    adv = jnp.where(n > 1, scale * (rewards - st.mean[group_ids]), rewards)
    return jnp.where(valid, adv, 0.0)


def reinforce_baseline_advantages(
    rewards: Float[Array, " N"],
    group_ids: Int[Array, " N"],
    num_groups: int,
    token_counts: Float[Array, " N"],
    *,
    valid: Bool[Array, " N"] | None = None,
    whiten: bool = True,
) -> Float[Array, " N"]:
    """REINFORCE with a group-mean baseline, then token-weighted whitening over the batch.

    ``a_i = r_i - mean_g``; with ``whiten``: ``A_i = (a_i - mu) / sqrt(max(var, 1e-8))`` where, with
    token weights ``w_i = token_counts_i * valid_i``, ``mu = sum_i w_i a_i / sum_i w_i`` and
    ``var = sum_i w_i (a_i - mu)^2 / sum_i w_i`` (biased). This is the per-token whitening of
    REINFORCE++-baseline, written per owner since every token of an owner carries its advantage.
    Invalid owners get 0.

    Reference: Hu, REINFORCE++ (arXiv 2501.03262), the ``reinforce_plus_plus_baseline`` estimator.

    Args:
      rewards: f32[N] one reward per logical owner.
      group_ids: i32[N] prompt group of each owner.
      num_groups: static number of groups G.
      token_counts: f32[N] trainable tokens of each owner (over all its segments).
      valid: optional bool[N] healthy owners.
      whiten: whiten over the batch (default) or return the group-centred rewards.

    Returns:
      f32[N] advantages.
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    valid = as_valid(valid, rewards)
    centred = dr_grpo_advantages(rewards, group_ids, num_groups, valid=valid)
    if not whiten:
        return centred
    w = jnp.where(valid, jnp.asarray(token_counts, jnp.float32), 0.0)
    wsum = jnp.maximum(jnp.sum(w), 1e-12)
    mu = jnp.sum(w * centred) / wsum
    var = jnp.sum(w * (centred - mu) ** 2) / wsum
    return jnp.where(valid, (centred - mu) / jnp.sqrt(jnp.maximum(var, 1e-8)), 0.0)


def batch_mean_advantages(
    rewards: Float[Array, " N"],
    *,
    valid: Bool[Array, " N"] | None = None,
) -> Float[Array, " N"]:
    """Batch-mean baseline: the reward minus the mean valid reward of the whole rollout batch.

    ``A_i = r_i - mean_{j valid} r_j``, ignoring groups. Call it on the full rollout batch, before
    any micro-batch or data-parallel split. A constant batch gives exactly 0; invalid owners get 0.

    Reference: FlashREINFORCE (OpenRLHF PR #1339), the batch-mean estimator.

    Args:
      rewards: f32[N] one reward per logical owner.
      valid: optional bool[N] healthy owners.

    Returns:
      f32[N] advantages.
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    valid = as_valid(valid, rewards)
    zeros = jnp.zeros(rewards.shape, jnp.int32)
    return dr_grpo_advantages(rewards, zeros, 1, valid=valid)


@ESTIMATORS.register(Estimator.GRPO.value)
def _grpo(rewards, group_ids, num_groups, *, valid, token_counts):
    del token_counts
    return grpo_advantages(rewards, group_ids, num_groups, valid=valid)


@ESTIMATORS.register(Estimator.DR_GRPO.value)
def _dr_grpo(rewards, group_ids, num_groups, *, valid, token_counts):
    del token_counts
    return dr_grpo_advantages(rewards, group_ids, num_groups, valid=valid)


@ESTIMATORS.register(Estimator.RLOO.value)
def _rloo(rewards, group_ids, num_groups, *, valid, token_counts):
    del token_counts
    return rloo_advantages(rewards, group_ids, num_groups, valid=valid)


@ESTIMATORS.register(Estimator.REINFORCE_BASELINE.value)
def _reinforce_baseline(rewards, group_ids, num_groups, *, valid, token_counts):
    if token_counts is None:
        raise ConfigError("estimator 'reinforce_baseline' needs token_counts (f32[N])")
    return reinforce_baseline_advantages(rewards, group_ids, num_groups, token_counts, valid=valid)


@ESTIMATORS.register(Estimator.BATCH_MEAN.value)
def _batch_mean(rewards, group_ids, num_groups, *, valid, token_counts):
    del group_ids, num_groups, token_counts
    return batch_mean_advantages(rewards, valid=valid)


@functools.partial(jax.jit, static_argnames=("name", "num_groups"))
def compute_advantages(
    name: str,
    rewards: Float[Array, " N"],
    group_ids: Int[Array, " N"],
    num_groups: int,
    *,
    valid: Bool[Array, " N"] | None = None,
    token_counts: Float[Array, " N"] | None = None,
) -> Float[Array, " N"]:
    """Advantages by estimator name (a key of ``ESTIMATORS``), jitted; an unknown name raises.

    ``name`` and ``num_groups`` are static: one compile per (estimator, N, G); the RL loop pads
    to its fixed bounds (``N = B x N`` owners with ``valid = False`` padding, ``G = B``), so it
    compiles once per run.

    Args:
      name: estimator name, one of :class:`Estimator` (static).
      rewards: f32[N] one reward per logical owner.
      group_ids: i32[N] prompt group of each owner.
      num_groups: static number of groups G.
      valid: optional bool[N] healthy owners.
      token_counts: f32[N] trainable tokens per owner (needed by ``reinforce_baseline``).

    Returns:
      f32[N] advantages, 0 for invalid owners.
    """
    fn = ESTIMATORS.get(name)
    return fn(rewards, group_ids, num_groups, valid=valid, token_counts=token_counts)
