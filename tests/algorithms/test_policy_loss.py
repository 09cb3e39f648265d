"""policy_loss: hand-derived loss, gradient and metrics; the gradient rule on random inputs."""

import math

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from osworld_jax.algorithms import LossAggMode, LossConfig, flash_reinforce_gate, policy_loss
from osworld_jax.errors import ConfigError

SETTINGS = settings(max_examples=25, deadline=None)
STATIC = ("config", "num_groups", "num_owners", "norm_length")
LOSS_KEYS = ("gate", "gate_threshold", "gate_level", "agg_mode", "ratio_clip", "is_weight_cap")
# the production path is jitted; one compile per configuration is also far faster than eager
_jit_loss = jax.jit(policy_loss, static_argnames=STATIC)
# ((loss, metrics), d loss / d logprobs) in one compile
_loss_and_grad = jax.jit(jax.value_and_grad(policy_loss, has_aux=True), static_argnames=STATIC)


def _with_config(fn):
    """``fn(*args, gate=..., agg_mode=..., **rest)``: the loss keywords become one LossConfig."""

    def call(*args, **kw):
        loss = {k: kw.pop(k) for k in LOSS_KEYS if k in kw}
        return fn(*args, config=LossConfig(**loss), **kw)

    return call


jit_loss = _with_config(_jit_loss)
loss_and_grad = _with_config(_loss_and_grad)

# pi = 0.5 on every token. Behaviour per row: 0.5 (KL 0, coef 1); 0.48 (KL 0.48 ln .96 +
# .52 ln 1.04 = 0.000800 <= 0.01: kept, coef 0.5/0.48 = 1.0416667); 0.25 (KL 0.25 ln .5 +
# .75 ln 1.5 = 0.130812 > 0.01: rejected, coef 0).
LP = jnp.full((3, 2), math.log(0.5))
BEH = jnp.log(jnp.array([[0.5, 0.5], [0.48, 0.48], [0.25, 0.25]]))
ADV = jnp.array([[1.0, -2.0], [0.5, 3.0], [2.0, 2.0]])
MASK = jnp.array([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
C1 = 0.5 / 0.48
KL1 = 0.48 * math.log(0.96) + 0.52 * math.log(1.04)
KL2 = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)


def _loss(lp, **kw):
    return loss_and_grad(lp, BEH, ADV, MASK, agg_mode="seq-mean-token-mean", **kw)


def test_hand_loss_gradient_and_metrics():
    # seq-mean-token-mean, rows are owners; the gated row 2 stays in B = 3.
    # loss = 1/3 [ (-1 + 2)/2 + (-C1 * 0.5)/1 + 0 ] = (0.5 - 0.5208333)/3 = -0.0069444
    # d loss / d lp = -(coef * A) / (B * T_r): row 0 -> -[1, -2]/6, row 1 -> [-C1 * .5 / 3, 0],
    # row 2 (rejected) -> 0.
    (loss, metrics), grad = _loss(LP)
    assert float(loss) == pytest.approx((0.5 - C1 * 0.5) / 3, rel=1e-5)
    expected = np.array([[-1 / 6, 2 / 6], [-C1 * 0.5 / 3, 0.0], [0.0, 0.0]], np.float32)
    chex.assert_trees_all_close(grad, expected, rtol=1e-5)
    assert float(metrics["gate_rejected_fraction"]) == pytest.approx(1 / 3)
    assert float(metrics["gate_rejected_token_fraction"]) == pytest.approx(2 / 5)
    assert float(metrics["binary_kl_mean"]) == pytest.approx((KL1 + 2 * KL2) / 5, rel=1e-4)
    assert float(metrics["ratio_mean"]) == 1.0
    assert float(metrics["clip_fraction"]) == 0.0
    assert float(metrics["loss_tokens"]) == 5.0
    assert float(metrics["is_weight_mean"]) == pytest.approx((2 + C1) / 5, rel=1e-5)
    assert float(metrics["is_weight_max"]) == pytest.approx(C1, rel=1e-6)


def test_is_weight_cap_truncates_the_applied_weight():
    # gate none: uncapped coef = exp(pi - mu) = [[1, 1], [C1, -], [2, 2]]; cap 1.5 ->
    # [[1, 1], [C1, -], [1.5, 1.5]] (C1 = 1.0417 < 1.5 stays). token-mean over 5 tokens:
    # loss = -(1 - 2 + C1 * 0.5 + 1.5 * 2 + 1.5 * 2) / 5; is_weight max 1.5,
    # mean (3.5 + C1 + 1.5) / 5
    kw = dict(gate="none", agg_mode="token-mean", is_weight_cap=1.5)
    (loss, m), grad = loss_and_grad(LP, BEH, ADV, MASK, **kw)
    assert float(loss) == pytest.approx(-(5 + C1 * 0.5) / 5, rel=1e-5)
    coef = np.array([[1, 1], [C1, 0], [1.5, 1.5]])
    chex.assert_trees_all_close(grad, (-coef * np.asarray(ADV) / 5).astype(np.float32), rtol=1e-5)
    assert float(m["is_weight_max"]) == pytest.approx(1.5)
    assert float(m["is_weight_mean"]) == pytest.approx((2 + C1 + 3) / 5, rel=1e-5)
    (_, uncapped), _ = loss_and_grad(LP, BEH, ADV, MASK, gate="none", agg_mode="token-mean")
    assert float(uncapped["is_weight_max"]) == pytest.approx(2.0)
    with pytest.raises(ConfigError, match="is_weight_cap"):
        LossConfig(is_weight_cap=0.0)


def test_hand_token_mean_and_gate_none():
    # gate none: coef = exp(pi - mu) = [1, C1, 2]; token-mean over 5 tokens:
    # loss = -(1 - 2 + C1 * 0.5 + 2 * 2 + 2 * 2) / 5; grad = -(coef * A) / 5
    (loss, m), grad = loss_and_grad(LP, BEH, ADV, MASK, gate="none", agg_mode="token-mean")
    assert float(loss) == pytest.approx(-(7 + C1 * 0.5) / 5, rel=1e-5)
    coef = np.array([[1, 1], [C1, 0], [2, 2]])
    chex.assert_trees_all_close(grad, (-coef * np.asarray(ADV) / 5).astype(np.float32), rtol=1e-5)
    assert float(m["gate_rejected_fraction"]) == 0.0


def test_old_logprobs_ratio_and_clipping():
    # pi = 0.6, pi_old = mu = 0.5: coef 1, ratio 1.2. Token loss -ratio * A, token-mean over 2.
    lp = jnp.full((1, 2), math.log(0.6))
    old = beh = jnp.full((1, 2), math.log(0.5))
    adv = jnp.array([[1.0, -1.0]])
    mask = jnp.ones((1, 2))

    def f(lp, clip):
        return loss_and_grad(
            lp, beh, adv, mask, old_logprobs=old, agg_mode="token-mean", ratio_clip=clip
        )

    (loss, m), grad = f(lp, None)
    assert float(loss) == pytest.approx(0.0, abs=1e-6)  # -(1.2 - 1.2) / 2
    assert float(m["ratio_mean"]) == pytest.approx(1.2, rel=1e-6)
    # d/dlp (-ratio A / 2) = -ratio A / 2 = [-0.6, 0.6]
    chex.assert_trees_all_close(grad, jnp.array([[-0.6, 0.6]]))
    # clip (0.8, 1.1): A = +1 takes min(1.2, 1.1) = 1.1 (clipped, no gradient);
    # A = -1 takes min(-1.2, -1.1) = -1.2 (unclipped). loss = -(1.1 - 1.2) / 2 = 0.05
    (loss, m), grad = f(lp, (0.8, 1.1))
    assert float(loss) == pytest.approx(0.05, rel=1e-5)
    assert float(m["clip_fraction"]) == 0.5
    chex.assert_trees_all_close(grad, jnp.array([[0.0, 0.6]]), rtol=1e-6)


def test_rejected_extreme_and_nonfinite_rows_stay_finite():
    # row 0: behaviour -200 vs pi 0 (ratio e^200) -> rejected; row 1: NaN behaviour -> rejected;
    # row 2: identical -> kept. token-mean over 6 tokens: loss = -(A2 sum) / 6 = -3/6.
    lp = jnp.array([[0.0, 0.0], [-1.0, -1.0], [-1.0, -1.0]])
    beh = jnp.array([[-200.0, -200.0], [jnp.nan, -1.0], [-1.0, -1.0]])
    adv = jnp.array([[1.0, 1.0], [1.0, 1.0], [1.0, 2.0]])
    (loss, m), grad = loss_and_grad(lp, beh, adv, jnp.ones((3, 2)), agg_mode="token-mean")
    assert float(loss) == pytest.approx(-0.5)
    chex.assert_tree_all_finite((loss, m, grad))
    chex.assert_trees_all_close(grad, jnp.array([[0.0, 0.0], [0.0, 0.0], [-1 / 6, -2 / 6]]))
    assert float(m["gate_rejected_fraction"]) == pytest.approx(2 / 3)
    assert float(m["nonfinite_behavior_tokens"]) == 1.0


def test_token_level_gate_and_ratio_gate():
    # token level: only the two 0.25 tokens (KL 0.1308 each) are rejected: 2 of 5 loss tokens.
    (_, m), _ = _loss(LP, gate_level="token")
    assert float(m["gate_rejected_fraction"]) == pytest.approx(2 / 5)
    # ratio gate, threshold 0.05: |log(.5/.48)| = 0.0408 kept, |log 2| = 0.693 rejected.
    (loss, m), _ = _loss(LP, gate="ratio", gate_threshold=0.05)
    assert float(loss) == pytest.approx((0.5 - C1 * 0.5) / 3, rel=1e-5)
    assert float(m["gate_rejected_fraction"]) == pytest.approx(1 / 3)


def test_bad_configuration_raises():
    with pytest.raises(ConfigError, match="ratio_clip"):
        _loss(LP, ratio_clip=(0.2, 0.28))  # epsilons, not bounds
    with pytest.raises(ConfigError, match="policy-loss gate"):
        _loss(LP, gate="kl")
    with pytest.raises(ConfigError, match="gate level"):
        _loss(LP, gate_level="row")
    with pytest.raises(ConfigError, match="loss aggregation mode"):
        jit_loss(LP, BEH, ADV, MASK, agg_mode="mean")


# --- the gradient rule on random inputs ------------------------------------------------------
R, T, NO, NG, NORM = 6, 5, 4, 3, 9
jit_gate = jax.jit(flash_reinforce_gate, static_argnames=("threshold", "level", "num_owners"))


def denominators(mask, mode, owners, groups):
    """D[r, t] of the stated rule, from plain numpy counts."""
    t_row = mask.sum(1)
    t_o = np.bincount(owners, weights=t_row, minlength=NO)
    t_g = np.bincount(groups, weights=t_row, minlength=NG)
    b, g = (t_o > 0).sum(), (t_g > 0).sum()
    d = {
        "token-mean": np.full(R, mask.sum()),
        "seq-mean-token-mean": b * t_o[owners],
        "seq-mean-token-sum": np.full(R, b),
        "seq-mean-token-sum-norm": np.full(R, b * NORM),
        "prompt-mean-token-mean": g * t_g[groups],
    }[mode]
    return np.broadcast_to(d[:, None], mask.shape)


@st.composite
def loss_inputs(draw):
    def arr(elems):
        return np.array(draw(st.lists(elems, min_size=R * T, max_size=R * T))).reshape(R, T)

    lp = arr(st.floats(-4.0, -0.125, width=32)).astype(np.float32)
    # per-row drift: rows at scale 0 or 0.02 pass the gate, rows at scale 1 mostly do not
    scale = np.array(draw(st.lists(st.sampled_from([0.0, 0.02, 1.0]), min_size=R, max_size=R)))
    beh = (lp + scale[:, None] * arr(st.sampled_from([-1.0, -0.5, 0.5, 1.0]))).astype(np.float32)
    adv = arr(st.floats(-2.0, 2.0, width=32)).astype(np.float32)
    mask = arr(st.booleans()).astype(np.float32)
    owners = np.array(draw(st.lists(st.integers(0, NO - 1), min_size=R, max_size=R)))
    groups = np.array(draw(st.lists(st.integers(0, NG - 1), min_size=R, max_size=R)))
    return lp, beh, adv, mask, owners, groups


@SETTINGS
@given(
    loss_inputs(),
    st.sampled_from([m.value for m in LossAggMode]),
    st.sampled_from(["sequence", "token", "owner"]),
)
def test_gradient_is_minus_coef_times_advantage_over_denominator(inputs, mode, level):
    lp, beh, adv, mask, owners, groups = inputs
    kw = dict(
        agg_mode=mode,
        gate_level=level,
        owner_ids=jnp.asarray(owners),
        num_owners=NO,
        group_ids=jnp.asarray(groups),
        num_groups=NG,
        norm_length=NORM,
    )
    _, grad = loss_and_grad(jnp.asarray(lp), beh, adv, mask, **kw)
    keep, _ = jit_gate(beh, lp, mask, level=level, owner_ids=jnp.asarray(owners), num_owners=NO)
    keep = np.asarray(keep) if level == "token" else np.asarray(keep)[:, None]
    coef = keep * mask * np.exp(lp.astype(np.float64) - beh)
    den = denominators(mask, mode, owners, groups)
    want = np.where(mask > 0, -coef * adv / np.maximum(den, 1), 0.0)
    np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-5, atol=1e-7)


def test_owner_level_rejected_fraction_counts_owners():
    # Rows 0, 1 belong to owner 0, row 2 to owner 1. Row 0's token: mu 0.25 vs pi 0.5,
    # KL(0.25 || 0.5) = 0.1308; row 1's: identical (KL 0); pooled over owner 0: 0.0654 > 0.01:
    # owner 0 (both rows) rejected, owner 1 kept -> 1 of 2 owners, 2 of 3 rows' tokens.
    lp = jnp.full((3, 1), math.log(0.5))
    beh = jnp.log(jnp.array([[0.25], [0.5], [0.5]]))
    adv, mask = jnp.ones((3, 1)), jnp.ones((3, 1))
    owners = jnp.array([0, 0, 1])
    kw = dict(agg_mode="token-mean", owner_ids=owners, num_owners=2)
    (loss, m), grad = loss_and_grad(lp, beh, adv, mask, gate_level="owner", **kw)
    assert float(m["gate_rejected_fraction"]) == pytest.approx(0.5)
    assert float(m["gate_rejected_token_fraction"]) == pytest.approx(2 / 3)
    # token-mean over 3 tokens; only row 2 keeps coef exp(0) = 1: d loss / d lp = -1/3 there.
    chex.assert_trees_all_close(grad, jnp.array([[0.0], [0.0], [-1 / 3]]), atol=1e-7)
    assert float(loss) == pytest.approx(-1 / 3, rel=1e-6)
    with pytest.raises(ConfigError, match="owner_ids"):
        loss_and_grad(lp, beh, adv, mask, gate_level="owner", agg_mode="token-mean")


def test_jit_traced_once_and_equal_to_eager():
    chex.clear_trace_counter()
    kw = dict(owner_ids=jnp.arange(R) % NO, num_owners=NO, group_ids=jnp.arange(R) % NG)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def f(lp, beh, adv, mask):
        return policy_loss(lp, beh, adv, mask, num_groups=NG, **kw)

    rng = np.random.default_rng(0)
    for _ in range(3):
        lp = jnp.asarray(-rng.random((R, T)) - 0.1, jnp.float32)
        args = (lp, lp + 0.01 * rng.normal(size=(R, T)), rng.normal(size=(R, T)))
        mask = jnp.asarray(rng.random((R, T)) > 0.3, jnp.float32)
        chex.assert_trees_all_close(
            f(*args, mask), policy_loss(*args, mask, num_groups=NG, **kw), rtol=1e-5
        )
