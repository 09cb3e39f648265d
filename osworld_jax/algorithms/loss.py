"""The policy-gradient surrogate with an off-policy gate and importance weights."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from osworld_jax.algorithms.aggregation import aggregate_loss
from osworld_jax.algorithms.gates import binary_kl, truncate_is_weights
from osworld_jax.algorithms.registries import GATES, LOSS_AGG_MODES, GateLevel, check_gate_level
from osworld_jax.errors import ConfigError
from osworld_jax.registry import check_choice


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossConfig:
    """The knobs of `policy_loss`: off-policy gate, aggregation and PPO clipping (hashable).

    Frozen and hashable, so it is a static argument under ``jax.jit``. Validated at
    construction: an unknown gate / level / aggregation mode or ratio bounds that are not
    ``0 < low <= 1 <= high`` raise ``ConfigError`` naming the field.

    Attributes:
      gate: off-policy gate (a name of ``GATES``: ``"binary_kl"``, ``"ratio"``, ``"none"``).
      gate_threshold: the gate's threshold (binary-KL mean, or the log-ratio band half-width).
      gate_level: where the gate decides: ``"sequence"`` (one decision per row), ``"owner"``
        (one decision per logical owner over all its rows' loss tokens pooled: its segments
        stand or fall together; needs ``owner_ids``) or ``"token"`` (one per token).
      agg_mode: loss aggregation (a name of ``LOSS_AGG_MODES``).
      ratio_clip: PPO ratio bounds ``(low, high)`` with ``0 < low <= 1 <= high`` (e.g.
        ``(0.8, 1.28)`` for clip epsilons 0.2 / 0.28), or ``None`` (one update per rollout
        batch needs none: the ratio is 1).
      is_weight_cap: truncated importance sampling: every kept token's weight ``exp(pi_old -
        mu)`` is capped at this value (`truncate_is_weights`, verl's rollout correction), or
        ``None`` (the seed's recipes: the gate alone bounds the drift). Must be > 0.
    """

    gate: str = "binary_kl"
    gate_threshold: float = 0.01
    gate_level: GateLevel = "sequence"
    agg_mode: str = "prompt-mean-token-mean"
    ratio_clip: tuple[float, float] | None = None
    is_weight_cap: float | None = None

    def __post_init__(self) -> None:
        GATES.validate(self.gate, "LossConfig.gate")
        LOSS_AGG_MODES.validate(self.agg_mode, "LossConfig.agg_mode")
        check_choice(self.gate_level, GateLevel, "LossConfig.gate_level", "gate level")
        if self.ratio_clip is not None:
            object.__setattr__(self, "ratio_clip", _check_ratio_clip(self.ratio_clip))
        cap = self.is_weight_cap
        finite = isinstance(cap, int | float) and math.isfinite(cap)
        if cap is not None and not (finite and cap > 0):
            raise ConfigError(f"LossConfig.is_weight_cap must be a finite number > 0, got {cap!r}")


def _masked_mean(x: Float[Array, "R T"], mask: Array) -> Float[Array, ""]:
    return jnp.sum(jnp.where(mask, x, 0.0)) / jnp.maximum(jnp.sum(mask), 1)


def _check_ratio_clip(ratio_clip: tuple[float, float]) -> tuple[float, float]:
    try:
        low, high = (float(v) for v in ratio_clip)
        ok = 0.0 < low <= 1.0 <= high
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(
            f"LossConfig.ratio_clip={ratio_clip!r} must be bounds with 0 < low <= 1 <= high, "
            "e.g. (0.8, 1.28) for clip epsilons 0.2/0.28"
        )
    return low, high


def policy_loss(
    logprobs: Float[Array, "R T"],
    behavior_logprobs: Float[Array, "R T"],
    advantages: Float[Array, "R T"],
    loss_mask: Float[Array, "R T"],
    *,
    config: LossConfig = LossConfig(),
    old_logprobs: Float[Array, "R T"] | None = None,
    group_ids: Int[Array, " R"] | None = None,
    num_groups: int | None = None,
    owner_ids: Int[Array, " R"] | None = None,
    num_owners: int | None = None,
    norm_length: float | None = None,
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """Policy-gradient surrogate: gated, importance-weighted ``-ratio * A``, then aggregated.

    With ``pi = logprobs``, ``pi_old = stop_gradient(old_logprobs)`` (or ``stop_gradient(pi)``
    when ``old_logprobs`` is None: one optimizer step per rollout batch, ratio 1) and ``mu`` the
    behaviour (rollout-engine) logprobs:

    - gate: ``(keep, w) = GATES[config.gate](mu, pi_old, mask, threshold, level)`` compares mu
      with pi_old; ``coef = stop_gradient(min(keep * exp(pi_old - mu), C))`` (0 on masked
      tokens; ``C = config.is_weight_cap``, no cap when None: truncated IS);
    - ``ratio = exp(pi - pi_old)``; ``l_t = -coef * ratio * A``, or with
      ``config.ratio_clip=(lo, hi)`` the PPO form ``l_t = -coef * min(ratio A, clip(ratio, lo,
      hi) A)``;
    - ``loss = aggregate_loss(l, mask, mode=config.agg_mode, ...)``: a gated row keeps its
      denominators.

    Hence, at ``pi = pi_old`` (and outside the clipped region),
    ``d loss / d pi_t = -(coef_t * A_t) / D_t`` with ``D_t`` the aggregation denominator of token
    t (e.g. ``B * T_o`` for ``seq-mean-token-mean``).

    References: FlashREINFORCE (OpenRLHF PR #1339), PPO (arXiv 1707.06347), DAPO clip-higher
    (arXiv 2503.14476), verl rollout correction (token-level IS).

    Args:
      logprobs: f32[R, T] trainer logprobs of the tokens (differentiated).
      behavior_logprobs: f32[R, T] rollout-engine logprobs of the same tokens.
      advantages: f32[R, T] advantage of each token (its owner's, fanned out).
      loss_mask: f32[R, T] 1 on trainable tokens.
      config: gate, threshold, level, aggregation mode and ratio clip (`LossConfig`); static.
      old_logprobs: f32[R, T] pi_old when several optimizer steps reuse one rollout batch.
      group_ids: i32[R] prompt group of each row (for ``prompt-mean-token-mean``).
      num_groups: static number of groups.
      owner_ids: i32[R] logical owner of each row (also the owner-level gate's unit).
      num_owners: static number of owners.
      norm_length: constant L of ``seq-mean-token-sum-norm``.

    Returns:
      ``(loss, metrics)``: f32[] and a dict of f32[] scalars: ``gate_rejected_fraction`` (rejected
      fraction of rows with loss tokens; of owners at owner level; of loss tokens at token
      level),
      ``gate_rejected_token_fraction``, ``binary_kl_mean`` (token mean of binary KL(mu, pi_old)
      over loss tokens with finite mu), ``is_weight_mean`` / ``is_weight_max`` (the applied,
      truncated weights over loss tokens), ``ratio_mean``, ``clip_fraction``,
      ``loss_tokens``, ``nonfinite_behavior_tokens``.
    """
    gate_fn = GATES.get(config.gate)
    level = check_gate_level(config.gate_level)
    clip = config.ratio_clip
    logprobs = jnp.asarray(logprobs, jnp.float32)
    behavior = jnp.asarray(behavior_logprobs, jnp.float32)
    advantages = jnp.asarray(advantages, jnp.float32)
    mask_f = jnp.asarray(loss_mask, jnp.float32)
    mask = mask_f > 0
    old = logprobs if old_logprobs is None else jnp.asarray(old_logprobs, jnp.float32)
    pi_old = jax.lax.stop_gradient(old)

    keep, is_weight = gate_fn(
        behavior,
        pi_old,
        mask_f,
        threshold=config.gate_threshold,
        level=level,
        owner_ids=owner_ids,
        num_owners=num_owners,
    )
    is_weight = truncate_is_weights(is_weight, config.is_weight_cap)
    coef = jax.lax.stop_gradient(jnp.where(mask, is_weight, 0.0))
    ratio = jnp.exp(logprobs - pi_old)
    surrogate = ratio * advantages
    if clip is None:
        clipped = jnp.zeros(mask.shape, bool)
    else:
        clipped_surrogate = jnp.clip(ratio, clip[0], clip[1]) * advantages
        clipped = clipped_surrogate < surrogate
        surrogate = jnp.minimum(surrogate, clipped_surrogate)
    token_loss = -coef * surrogate
    loss = aggregate_loss(
        token_loss,
        mask_f,
        mode=config.agg_mode,
        group_ids=group_ids,
        num_groups=num_groups,
        owner_ids=owner_ids,
        num_owners=num_owners,
        norm_length=norm_length,
    )

    finite = jnp.isfinite(behavior)
    kl = binary_kl(jnp.where(finite, behavior, pi_old), pi_old)
    rejected_tok = mask & ~(keep if level == "token" else keep[:, None])
    active_rows = jnp.any(mask, axis=-1)
    if level == "token":
        rejected = _masked_mean(rejected_tok.astype(jnp.float32), mask)
    elif level == "owner":  # the rejected fraction of owners with loss tokens
        assert owner_ids is not None and num_owners is not None  # the gate checked them
        per_owner = lambda x: jax.ops.segment_max(  # noqa: E731
            x.astype(jnp.float32), owner_ids, num_segments=num_owners
        )
        active_o = per_owner(active_rows) > 0
        rejected_o = per_owner(active_rows & ~keep) > 0
        rejected = _masked_mean(rejected_o.astype(jnp.float32), active_o)
    else:
        rejected = _masked_mean((~keep).astype(jnp.float32), active_rows)
    metrics = {
        "gate_rejected_fraction": rejected,
        "gate_rejected_token_fraction": _masked_mean(rejected_tok.astype(jnp.float32), mask),
        "binary_kl_mean": _masked_mean(kl, mask & finite),
        "is_weight_mean": _masked_mean(coef, mask),
        "is_weight_max": jnp.max(jnp.where(mask, coef, 0.0), initial=0.0),
        "ratio_mean": _masked_mean(jax.lax.stop_gradient(ratio), mask),
        "clip_fraction": _masked_mean(clipped.astype(jnp.float32), mask),
        "loss_tokens": jnp.sum(mask_f),
        "nonfinite_behavior_tokens": jnp.sum(mask & ~finite).astype(jnp.float32),
    }
    return loss, metrics
