"""Binary KL and the off-policy gates (FlashREINFORCE binary-KL gate, geometric ratio band).

A gate compares the rollout engine's logprobs (behaviour, ``mu``) with the trainer's pi_old and
returns ``(keep, is_weight)``: ``keep`` per row (``level="sequence"``, or ``"owner"``: one
decision per logical owner, shared by its rows) or per token (``level="token"``), and
``is_weight[r, t] = keep * exp(pi_old - mu)``, the unclipped per-token importance ratio, 0
wherever the decision is "reject" (a rejected ratio is never exponentiated).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from osworld_jax.algorithms.registries import GATES, Gate, check_gate_level
from osworld_jax.errors import ConfigError

#: ``(keep, is_weight)``: keep is bool[R] (sequence level) or bool[R, T] (token level).
GateOutput = tuple[Bool[Array, "R *t"], Float[Array, "R T"]]

# h(d) = d e^d - expm1(d) = sum_{k>=2} (k-1)/k! d^k; Horner coefficients for |d| < _SERIES_CUTOFF.
_H_COEFFS = tuple((k - 1) / math.factorial(k) for k in range(2, 13))
_SERIES_CUTOFF = 0.5
# exp(88) < float32 max (3.4e38) < exp(89)
_MAX_LOG_RATIO = 88.0


def _h(d: Float[Array, "*S"]) -> Float[Array, "*S"]:
    """``h(d) = u log u - u + 1`` at ``u = e^d``, i.e. ``d e^d - expm1(d) >= 0``, accurately.

    Near ``d = 0`` the direct form cancels (two O(d) terms leave an O(d^2) result), so there the
    Taylor series ``d^2/2 + d^3/3 + d^4/8 + ...`` (terms ``(k-1)/k! d^k``, k <= 12, truncation
    below 1e-9 relative at ``|d| < 0.5``) is used; elsewhere the direct form loses < 10 ulp.
    """
    small = jnp.abs(d) < _SERIES_CUTOFF
    ds = jnp.where(small, d, 0.0)
    poly = jnp.zeros_like(ds)
    for c in reversed(_H_COEFFS[1:]):  # static unrolled Horner, not a traced loop
        poly = (poly + c) * ds
    series = ds * ds * (poly + _H_COEFFS[0])
    dd = jnp.where(small, 1.0, d)
    direct = dd * jnp.exp(dd) - jnp.expm1(dd)
    return jnp.maximum(jnp.where(small, series, direct), 0.0)


def binary_kl(
    behavior_logprobs: Float[Array, "*S"],
    train_logprobs: Float[Array, "*S"],
    *,
    eps: float = 1e-6,
) -> Float[Array, "*S"]:
    """Per-token Bernoulli KL of the sampled token, ``KL(Bern(mu) || Bern(pi))``, float32-exact.

    ``KL = mu log(mu/pi) + (1-mu) log((1-mu)/(1-pi))`` with ``mu = exp(behavior)``,
    ``pi = exp(train)``, both clamped to ``[eps, 1-eps]`` (in log space). Evaluated as the sum of
    two non-negative Bregman terms (``sum_i q_i - p_i = 0`` is added):

    ``KL = pi * h(d1) + (1-pi) * h(d2)``, ``h(d) = d e^d - e^d + 1``,
    ``d1 = log mu - log pi``, ``d2 = log((1-mu)/(1-pi)) = log1p(pi expm1(d1) / expm1(log pi))``,

    with ``h`` from its Taylor series near 0, so near-identical policies give small non-negative
    values (behaviour -1.0 vs train -0.99999: about 2.9e-11, where the naive float32 formula is
    negative) and far-apart ones stay accurate. Never negative.

    Reference: OpenRLHF PR #1354 (numerically stable binary KL), FlashREINFORCE PR #1339.

    Args:
      behavior_logprobs: f32[...] rollout-engine logprob of each sampled token.
      train_logprobs: f32[...] trainer logprob of the same token (same shape).
      eps: probability clamp.

    Returns:
      f32[...] KL per token (NaN only where an input is NaN).
    """
    lo = math.log(eps)
    hi = math.log1p(-eps)
    lb = jnp.clip(jnp.asarray(behavior_logprobs, jnp.float32), lo, hi)
    lt = jnp.clip(jnp.asarray(train_logprobs, jnp.float32), lo, hi)
    d1 = lb - lt
    pi = jnp.exp(lt)
    one_minus_pi = -jnp.expm1(lt)
    d2 = jnp.log1p(-pi * jnp.expm1(d1) / one_minus_pi)
    return pi * _h(d1) + one_minus_pi * _h(d2)


def _finite_weights(
    decide: Bool[Array, "R T"],
    behavior: Float[Array, "R T"],
    train: Float[Array, "R T"],
) -> Float[Array, "R T"]:
    """``exp(train - behavior)`` where ``decide``, else exactly 0; always finite.

    A log-ratio that is not finite, or so large that ``exp`` overflows float32 (``> 88``), gives
    0: such a ratio is never exponentiated, so neither the weight nor its gradient is inf/NaN.
    """
    log_ratio = train - behavior
    ok = decide & jnp.isfinite(log_ratio) & (log_ratio < _MAX_LOG_RATIO)
    return jnp.where(ok, jnp.exp(jnp.where(ok, log_ratio, 0.0)), 0.0)


def _gate(
    stat: Float[Array, "R T"],
    behavior: Float[Array, "R T"],
    train: Float[Array, "R T"],
    loss_mask: Float[Array, "R T"],
    threshold: float,
    level: str,
    owner_ids: Int[Array, " R"] | None,
    num_owners: int | None,
    *,
    token_stat: Float[Array, "R T"] | None = None,
    absolute: bool = False,
) -> GateOutput:
    """Keeps where the statistic is ``<= threshold`` and attaches the importance weights.

    Sequence level compares the mean of ``stat`` over a row's loss tokens; owner level the mean
    over all loss tokens of the row's logical owner (every segment pooled: one decision for all
    its rows); token level compares ``token_stat`` (default ``stat``) per loss token, masked
    tokens kept. ``absolute`` compares the mean's absolute value. A loss token whose behaviour
    logprob is not finite rejects its row / owner (or itself); masked tokens never count.
    """
    mask = loss_mask > 0
    bad = mask & ~jnp.isfinite(behavior)
    level = check_gate_level(level)
    if level == "token":
        ts = stat if token_stat is None else token_stat
        keep = ~mask | ((ts <= threshold) & ~bad)
        return keep, _finite_weights(keep, behavior, train)
    num = jnp.sum(jnp.where(mask, stat, 0.0), axis=-1)  # [R]
    den = jnp.sum(mask, axis=-1).astype(jnp.float32)  # [R]
    row_bad = jnp.any(bad, axis=-1).astype(jnp.float32)  # [R]
    if level == "owner":
        if owner_ids is None or num_owners is None:
            raise ConfigError("gate_level 'owner' needs owner_ids and num_owners")
        pool = lambda x: jax.ops.segment_sum(x, owner_ids, num_segments=num_owners)[owner_ids]
        num, den, row_bad = pool(num), pool(den), pool(row_bad)  # each row sees its owner's
    mean = num / jnp.maximum(den, 1.0)
    if absolute:
        mean = jnp.abs(mean)
    keep = (mean <= threshold) & (row_bad == 0)  # [R]
    return keep, _finite_weights(jnp.broadcast_to(keep[:, None], stat.shape), behavior, train)


def flash_reinforce_gate(
    behavior_logprobs: Float[Array, "R T"],
    train_logprobs: Float[Array, "R T"],
    loss_mask: Float[Array, "R T"],
    *,
    threshold: float = 0.01,
    level: str = "sequence",
    owner_ids: Int[Array, " R"] | None = None,
    num_owners: int | None = None,
) -> GateOutput:
    """FlashREINFORCE binary-KL gate: reject rows (or tokens) where the policies drifted apart.

    Sequence level: ``stat_r = sum_t m_rt KL_rt / sum_t m_rt`` (``KL = binary_kl(mu, pi)``,
    ``m`` = loss mask; masked tokens never count; a row without loss tokens has ``stat = 0`` and
    is kept); ``keep_r = stat_r <= threshold``, and a loss token with a non-finite behaviour
    logprob rejects its row. ``is_weight[r, t] = keep_r * exp(train - behavior)`` (unclipped), 0 on
    a rejected row, and 0 wherever ``train - behavior`` is not finite or would overflow float32
    (``> 88``), so weights stay finite.

    Owner level: one decision per logical owner over all its rows (segments),
    ``stat_o = sum_{r in o, t} m_rt KL_rt / sum_{r in o, t} m_rt`` (its tokens pooled, as
    ``prompt-mean-token-mean`` pools a group's); every row of the owner gets ``keep_o``.

    Token level: ``keep_rt = KL_rt <= threshold`` per loss token (masked tokens are kept) and
    ``is_weight[r, t] = keep_rt * exp(train - behavior)``.

    The direction is KL(behaviour || train): mu = 0.01, pi = 0.03 gives KL(mu || pi) = 0.0092
    (kept at 0.01) where KL(pi || mu) = 0.0132 would be rejected (tested).

    Reference: OpenRLHF PR #1339 (FlashREINFORCE); the NeMo OSWorld-v2 recipes use sequence
    level with threshold 0.01.

    Args:
      behavior_logprobs: f32[R, T] rollout-engine logprobs of the tokens.
      train_logprobs: f32[R, T] pi_old logprobs of the same tokens.
      loss_mask: f32[R, T] 1 on trainable tokens.
      threshold: maximum accepted KL statistic.
      level: ``"sequence"`` / ``"owner"`` (keep is bool[R]) or ``"token"`` (keep is
        bool[R, T]); static.
      owner_ids: i32[R] logical owner of each row (owner level).
      num_owners: static owner count (owner level).

    Returns:
      ``(keep, is_weight)``: bool[R] or bool[R, T], and f32[R, T].
    """
    behavior = jnp.asarray(behavior_logprobs, jnp.float32)
    train = jnp.asarray(train_logprobs, jnp.float32)
    finite = jnp.isfinite(behavior)
    kl = binary_kl(jnp.where(finite, behavior, train), train)
    stat = jnp.where(finite & (loss_mask > 0), kl, 0.0)
    return _gate(stat, behavior, train, loss_mask, threshold, level, owner_ids, num_owners)


def ratio_band_gate(
    behavior_logprobs: Float[Array, "R T"],
    train_logprobs: Float[Array, "R T"],
    loss_mask: Float[Array, "R T"],
    *,
    threshold: float = 0.01,
    level: str = "sequence",
    owner_ids: Int[Array, " R"] | None = None,
    num_owners: int | None = None,
) -> GateOutput:
    """Geometric-mean ratio band (seq-mask-tis): keep rows whose mean log-ratio is near 0.

    Sequence level: ``keep_r = |sum_t m_rt (pi_rt - mu_rt) / sum_t m_rt| <= threshold``, i.e. the
    geometric-mean importance ratio lies in ``[exp(-threshold), exp(threshold)]``; token level:
    ``keep_rt = |pi_rt - mu_rt| <= threshold``; owner level: the mean over all the owner's loss
    tokens. Non-finite behaviour rejects, masked tokens never count, and ``is_weight`` is as in
    :func:`flash_reinforce_gate`.

    Reference: verl rollout correction, ``seq-mask-tis`` (geometric sequence-level masking).

    Args:
      behavior_logprobs: f32[R, T] rollout-engine logprobs.
      train_logprobs: f32[R, T] pi_old logprobs.
      loss_mask: f32[R, T] 1 on trainable tokens.
      threshold: half-width of the accepted band of the (mean) log-ratio.
      level: ``"sequence"``, ``"owner"`` or ``"token"`` (static).
      owner_ids: i32[R] logical owner of each row (owner level).
      num_owners: static owner count (owner level).

    Returns:
      ``(keep, is_weight)`` as in :func:`flash_reinforce_gate`.
    """
    behavior = jnp.asarray(behavior_logprobs, jnp.float32)
    train = jnp.asarray(train_logprobs, jnp.float32)
    ok = jnp.isfinite(behavior) & (loss_mask > 0)
    log_ratio = jnp.where(ok, train - behavior, 0.0)
    return _gate(
        log_ratio,
        behavior,
        train,
        loss_mask,
        threshold,
        level,
        owner_ids,
        num_owners,
        token_stat=jnp.abs(log_ratio),
        absolute=True,
    )


def no_gate(
    behavior_logprobs: Float[Array, "R T"],
    train_logprobs: Float[Array, "R T"],
    loss_mask: Float[Array, "R T"],
    *,
    threshold: float = 0.01,
    level: str = "sequence",
    owner_ids: Int[Array, " R"] | None = None,
    num_owners: int | None = None,
) -> GateOutput:
    """No rejection: keep everything, ``is_weight = exp(train - behavior)`` (0 where not finite).

    Args:
      behavior_logprobs: f32[R, T] rollout-engine logprobs.
      train_logprobs: f32[R, T] pi_old logprobs.
      loss_mask: f32[R, T] unused except for its shape.
      threshold: unused.
      level: ``"sequence"`` / ``"owner"`` (keep bool[R]) or ``"token"`` (keep bool[R, T]).
      owner_ids: unused.
      num_owners: unused.

    Returns:
      ``(keep, is_weight)`` with keep all true.
    """
    del threshold, owner_ids, num_owners
    behavior = jnp.asarray(behavior_logprobs, jnp.float32)
    train = jnp.asarray(train_logprobs, jnp.float32)
    shape = loss_mask.shape if check_gate_level(level) == "token" else loss_mask.shape[:1]
    keep = jnp.ones(shape, dtype=bool)
    return keep, _finite_weights(jnp.ones(loss_mask.shape, bool), behavior, train)


def truncate_is_weights(is_weight: Float[Array, "R T"], cap: float | None) -> Float[Array, "R T"]:
    """Truncated importance sampling: each per-token IS weight capped from above.

    ``w'_t = min(w_t, C)`` with ``w_t = keep * exp(pi_old - mu)`` from a gate; ``cap=None`` (no
    truncation) returns ``is_weight`` unchanged. A rare token the engine sampled far below the
    trainer's probability (``mu << pi_old``) would otherwise carry an unbounded weight; the cap
    bounds the variance at the cost of a bias towards the behaviour policy (gated-out tokens stay
    exactly 0).

    Reference: Ionides, Truncated importance sampling (2008); verl rollout correction
    (``rollout_is_threshold``, token-level truncated IS).

    Args:
      is_weight: f32[R, T] per-token IS weights from a gate (>= 0).
      cap: the upper bound C > 0, or None.

    Returns:
      f32[R, T] the truncated weights.

    >>> import jax.numpy as jnp
    >>> [float(x) for x in truncate_is_weights(jnp.array([[0.5, 1.0, 4.0]]), 2.0)[0]]
    [0.5, 1.0, 2.0]
    """
    w = jnp.asarray(is_weight, jnp.float32)
    return w if cap is None else jnp.minimum(w, jnp.float32(cap))


GATES.add(Gate.BINARY_KL.value, flash_reinforce_gate)
GATES.add(Gate.RATIO.value, ratio_band_gate)
GATES.add(Gate.NONE.value, no_gate)
