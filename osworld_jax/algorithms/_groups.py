"""Per-group reductions over logical owners (segment sums with a static group count)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


class GroupStats(NamedTuple):
    """Statistics of the valid rewards of each group (all ``[G]``).

    Attributes:
      n: number of valid members ``n_g``.
      total: sum of the valid rewards ``S_g``.
      mean: ``S_g / n_g`` (0 for an empty group); exactly the common value for a constant group.
      constant: true where ``max_g == min_g`` over the valid members (exact comparison) or the
        group has no valid member.
    """

    n: Float[Array, " G"]
    total: Float[Array, " G"]
    mean: Float[Array, " G"]
    constant: Bool[Array, " G"]


def as_valid(valid: Bool[Array, " N"] | None, rewards: Float[Array, " N"]) -> Bool[Array, " N"]:
    """``valid`` as a bool array, all true when ``None``."""
    if valid is None:
        return jnp.ones(rewards.shape, dtype=bool)
    return jnp.asarray(valid, dtype=bool)


def group_stats(
    rewards: Float[Array, " N"],
    group_ids: Int[Array, " N"],
    num_groups: int,
    valid: Bool[Array, " N"],
) -> GroupStats:
    """Counts, sums, means and exact constancy of the valid rewards of each group.

    ``mean_g = sum_{i in g, valid} r_i / n_g``. Equality is decided exactly (``max == min``), and a
    constant group's mean is set to that common value, so ``r - mean_g`` is exactly 0 there (eight
    float32 rewards of 0.95 would otherwise leave a rounding residue of the mean).

    Args:
      rewards: f32[N] one reward per logical owner.
      group_ids: i32[N] group of each owner in ``[0, num_groups)``.
      num_groups: static number of groups G.
      valid: bool[N] healthy owners; invalid ones are excluded from every statistic.

    Returns:
      A :class:`GroupStats` of ``[G]`` arrays.
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    w = valid.astype(jnp.float32)
    count = jax.ops.segment_sum(w, group_ids, num_segments=num_groups)
    total = jax.ops.segment_sum(jnp.where(valid, rewards, 0.0), group_ids, num_segments=num_groups)
    gmax = jax.ops.segment_max(
        jnp.where(valid, rewards, -jnp.inf), group_ids, num_segments=num_groups
    )
    gmin = jax.ops.segment_min(
        jnp.where(valid, rewards, jnp.inf), group_ids, num_segments=num_groups
    )
    constant = (gmax == gmin) | (count == 0)
    mean = jnp.where(count > 0, total / jnp.maximum(count, 1.0), 0.0)
    mean = jnp.where(constant & (count > 0), gmax, mean)
    return GroupStats(n=count, total=total, mean=mean, constant=constant)
