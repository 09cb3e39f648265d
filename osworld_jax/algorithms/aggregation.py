"""Loss aggregation: how per-token losses become one scalar (five modes, registry-selected).

Denominator rules (all modes):

- Several rows can belong to one logical owner (its training segments). With ``owner_ids`` the
  "seq" of the ``seq-*`` modes is the logical owner: its tokens are pooled over all its rows.
  Without ``owner_ids`` each row is its own owner.
- A row gated out by ``flash_reinforce_gate`` has its token loss multiplied by 0 by the caller but
  keeps its loss mask, so it **stays in every denominator** (B and T_i keep their counts).
- A row whose loss mask is all zero (padding, a failed owner) contributes nothing, and an owner
  or group with no loss token at all is not counted in B or G.
- With no loss token anywhere the loss is 0.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from osworld_jax.algorithms.registries import LOSS_AGG_MODES, LossAggMode
from osworld_jax.errors import ConfigError


class _Rows(NamedTuple):
    """Per-row sums and the optional ids of one aggregation call."""

    loss: Float[Array, " R"]  # sum_t m_rt * l_rt
    tokens: Float[Array, " R"]  # sum_t m_rt
    group_ids: Int[Array, " R"] | None
    num_groups: int | None
    owner_ids: Int[Array, " R"] | None
    num_owners: int | None
    norm_length: float | None


def _mean_of_active(num: Float[Array, " K"], active: Array) -> Float[Array, ""]:
    """Mean of ``num`` over the active entries (0 when none is active)."""
    return jnp.sum(jnp.where(active, num, 0.0)) / jnp.maximum(jnp.sum(active), 1)


def _per_owner(rows: _Rows) -> tuple[Float[Array, " B"], Float[Array, " B"]]:
    """Loss sums and token counts per logical owner ``[B]`` (rows when no owner ids)."""
    if rows.owner_ids is None:
        return rows.loss, rows.tokens
    if rows.num_owners is None:
        raise ConfigError("aggregate_loss: owner_ids given without num_owners")
    seg = lambda x: jax.ops.segment_sum(x, rows.owner_ids, num_segments=rows.num_owners)
    return seg(rows.loss), seg(rows.tokens)


@LOSS_AGG_MODES.register(LossAggMode.TOKEN_MEAN.value)
def _token_mean(rows: _Rows) -> Float[Array, ""]:
    """``sum_rt m l / sum_rt m``."""
    return jnp.sum(rows.loss) / jnp.maximum(jnp.sum(rows.tokens), 1.0)


@LOSS_AGG_MODES.register(LossAggMode.SEQ_MEAN_TOKEN_MEAN.value)
def _seq_mean_token_mean(rows: _Rows) -> Float[Array, ""]:
    """``1/B sum_o (S_o / T_o)`` over owners with ``T_o > 0``."""
    loss, tokens = _per_owner(rows)
    return _mean_of_active(loss / jnp.maximum(tokens, 1e-12), tokens > 0)


@LOSS_AGG_MODES.register(LossAggMode.SEQ_MEAN_TOKEN_SUM.value)
def _seq_mean_token_sum(rows: _Rows) -> Float[Array, ""]:
    """``1/B sum_o S_o`` over owners with ``T_o > 0``."""
    loss, tokens = _per_owner(rows)
    return _mean_of_active(loss, tokens > 0)


@LOSS_AGG_MODES.register(LossAggMode.SEQ_MEAN_TOKEN_SUM_NORM.value)
def _seq_mean_token_sum_norm(rows: _Rows) -> Float[Array, ""]:
    """Dr.GRPO: ``sum_o S_o / (B * L)`` with the constant ``L = norm_length``."""
    if rows.norm_length is None:
        raise ConfigError("aggregate_loss: mode 'seq-mean-token-sum-norm' needs norm_length")
    loss, tokens = _per_owner(rows)
    num_active = jnp.maximum(jnp.sum(tokens > 0), 1)
    return jnp.sum(loss) / (num_active * jnp.asarray(rows.norm_length, jnp.float32))


@LOSS_AGG_MODES.register(LossAggMode.PROMPT_MEAN_TOKEN_MEAN.value)
def _prompt_mean_token_mean(rows: _Rows) -> Float[Array, ""]:
    """``1/G sum_g (S_g / T_g)`` over groups with ``T_g > 0`` (all rows of a group pooled)."""
    if rows.group_ids is None or rows.num_groups is None:
        raise ConfigError(
            "aggregate_loss: mode 'prompt-mean-token-mean' needs group_ids and num_groups"
        )
    seg = lambda x: jax.ops.segment_sum(x, rows.group_ids, num_segments=rows.num_groups)
    loss, tokens = seg(rows.loss), seg(rows.tokens)
    return _mean_of_active(loss / jnp.maximum(tokens, 1e-12), tokens > 0)


def aggregate_loss(
    token_loss: Float[Array, "R T"],
    loss_mask: Float[Array, "R T"],
    *,
    mode: str,
    group_ids: Int[Array, " R"] | None = None,
    num_groups: int | None = None,
    owner_ids: Int[Array, " R"] | None = None,
    num_owners: int | None = None,
    norm_length: float | None = None,
) -> Float[Array, ""]:
    """Aggregates per-token losses into a scalar.

    With ``S_o = sum_{t in o} m_t l_t`` and ``T_o = sum_{t in o} m_t`` per logical owner o (all its
    rows pooled), ``B`` the owners with ``T_o > 0``, and likewise ``S_g, T_g, G`` per prompt group:

    - ``token-mean``: ``sum_o S_o / sum_o T_o``.
    - ``seq-mean-token-mean``: ``1/B sum_o S_o / T_o``.
    - ``seq-mean-token-sum``: ``1/B sum_o S_o``.
    - ``seq-mean-token-sum-norm``: ``sum_o S_o / (B * L)``, ``L = norm_length`` a constant, never
      the padded length of the batch (Dr.GRPO, arXiv 2503.20783).
    - ``prompt-mean-token-mean``: ``1/G sum_g S_g / T_g``.

    A gated-out row (token loss zeroed, mask kept) stays in B, T_o and T_g; an all-masked row
    leaves them (see the module docstring). References: verl ``agg_loss`` (core_algos.py), DAPO
    (arXiv 2503.14476) for token-mean.

    Args:
      token_loss: f32[R, T] loss of each token.
      loss_mask: f32[R, T] 1 (or a weight) on trainable tokens.
      mode: a key of ``LOSS_AGG_MODES`` (static); unknown modes raise ``ConfigError``.
      group_ids: i32[R] prompt group of each row (``prompt-mean-token-mean``).
      num_groups: static number of groups.
      owner_ids: i32[R] logical owner of each row (default: each row is its own owner).
      num_owners: static number of owners (with ``owner_ids``).
      norm_length: the constant L of ``seq-mean-token-sum-norm``.

    Returns:
      f32[] the loss.
    """
    fn = LOSS_AGG_MODES.get(mode)
    mask = jnp.asarray(loss_mask, jnp.float32)
    masked = jnp.where(mask > 0, jnp.asarray(token_loss, jnp.float32) * mask, 0.0)
    rows = _Rows(
        loss=jnp.sum(masked, axis=-1),
        tokens=jnp.sum(mask, axis=-1),
        group_ids=group_ids,
        num_groups=num_groups,
        owner_ids=owner_ids,
        num_owners=num_owners,
        norm_length=norm_length,
    )
    return fn(rows)
