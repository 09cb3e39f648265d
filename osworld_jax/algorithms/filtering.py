"""DAPO group filters: drop prompt groups that carry no learning signal."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from osworld_jax.algorithms._groups import as_valid


def dynamic_sampling_keep(
    rewards: Float[Array, " N"],
    group_ids: Int[Array, " N"],
    num_groups: int,
    *,
    valid: Bool[Array, " N"] | None = None,
) -> Bool[Array, " G"]:
    """DAPO dynamic sampling: keep a group iff its valid rewards are not all equal.

    ``keep_g = max_{i in g, valid} r_i > min_{i in g, valid} r_i`` (exact comparison), so a group
    with fewer than 2 valid members, or with all-equal rewards (zero GRPO advantage), is dropped.

    Reference: Yu et al., DAPO (arXiv 2503.14476), dynamic sampling.

    Args:
      rewards: f32[N] one reward per logical owner.
      group_ids: i32[N] prompt group of each owner.
      num_groups: static number of groups G.
      valid: optional bool[N] healthy owners.

    Returns:
      bool[G].
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    valid = as_valid(valid, rewards)
    gmax = jax.ops.segment_max(
        jnp.where(valid, rewards, -jnp.inf), group_ids, num_segments=num_groups
    )
    gmin = jax.ops.segment_min(
        jnp.where(valid, rewards, jnp.inf), group_ids, num_segments=num_groups
    )
    return gmax > gmin


def dapo_band_keep(
    pass_counts: Int[Array, " N"],
    reps: int | Int[Array, " N"],
    *,
    low: int = 0,
    high: int | None = None,
) -> Bool[Array, " N"]:
    """Offline DAPO difficulty band: keep a task iff ``low < passes < high``.

    With the defaults (``low = 0``, ``high = reps``) a task is kept iff ``0 < k < reps``: it is
    neither always failed nor always solved in ``reps`` offline attempts.

    Reference: DAPO (arXiv 2503.14476); the NeMo OSWorld recipes' frozen task band.

    Args:
      pass_counts: i32[N] successes of each task.
      reps: attempts per task (a scalar or i32[N]).
      low: exclusive lower bound on passes.
      high: exclusive upper bound on passes (default ``reps``).

    Returns:
      bool[N].
    """
    passes = jnp.asarray(pass_counts)
    upper = jnp.asarray(reps if high is None else high)
    return (passes > low) & (passes < upper)
