"""binary_kl accuracy and the off-policy gates (binary-KL, ratio band, none)."""

import decimal
import math

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from osworld_jax.algorithms import binary_kl, flash_reinforce_gate, ratio_band_gate
from osworld_jax.algorithms.gates import no_gate
from osworld_jax.errors import ConfigError

SETTINGS = settings(max_examples=40, deadline=None)
jit_flash = jax.jit(flash_reinforce_gate, static_argnames=("threshold", "level"))
jit_ratio = jax.jit(ratio_band_gate, static_argnames=("threshold", "level"))
jit_kl = jax.jit(binary_kl)
_CTX = decimal.Context(prec=40)
_EPS = 1e-6


def kl_exact(b: float, t: float, eps: float = _EPS) -> float:
    """40-digit decimal evaluation of the defining formula (inputs are the float32 values)."""
    d = decimal.Decimal
    lo, hi = d(eps), 1 - d(eps)
    mu = min(max(_CTX.exp(d(float(b))), lo), hi)
    pi = min(max(_CTX.exp(d(float(t))), lo), hi)
    return float(mu * _CTX.ln(mu / pi) + (1 - mu) * _CTX.ln((1 - mu) / (1 - pi)))


def kl_float64(b: np.ndarray, t: np.ndarray, eps: float = _EPS) -> np.ndarray:
    """numpy float64 reference of the defining formula, clamped in log space.

    ``log(mu/pi) = lb - lt`` is exact in float64 (no rounded ratio inside a log), and
    ``log((1-mu)/(1-pi)) = log1p((pi - mu)/(1 - pi))`` with ``pi - mu = -pi expm1(lb - lt)``,
    so each term carries ~1e-16 relative error and their cancellation stays below 1e-9 relative.
    """
    lo, hi = np.log(eps), np.log1p(-eps)
    lb, lt = np.clip(b.astype(np.float64), lo, hi), np.clip(t.astype(np.float64), lo, hi)
    d = lb - lt
    mu, pi = np.exp(lb), np.exp(lt)
    return mu * d + (1 - mu) * np.log1p(-pi * np.expm1(d) / -np.expm1(lt))


def test_binary_kl_near_identical_case():
    # mu = e^-1, d = log mu - log pi ~ -1e-5: KL ~ pi d^2 / (2 (1 - pi)) = 0.3679e-10 / 1.264
    # = 2.91e-11. The naive float32 formula gives a negative number here (OpenRLHF PR #1354).
    b, t = np.float32(-1.0), np.float32(-0.99999)
    got = float(binary_kl(jnp.asarray(b), jnp.asarray(t)))
    assert got >= 0.0
    assert got == pytest.approx(2.9e-11, rel=1e-2)
    assert got == pytest.approx(kl_exact(b, t), rel=1e-5)


def test_binary_kl_hand_values():
    # mu = 0.5, pi = 0.25: 0.5 ln 2 + 0.5 ln(0.5 / 0.75) = 0.5 ln(4/3) = 0.1438410.
    got = binary_kl(jnp.log(jnp.array([0.5])), jnp.log(jnp.array([0.25])))
    chex.assert_trees_all_close(got, jnp.array([0.5 * math.log(4 / 3)]), rtol=1e-6)
    # both below eps -> both clamped to eps -> 0; identical -> exactly 0.
    assert float(binary_kl(jnp.float32(-50.0), jnp.float32(-60.0))) == 0.0
    assert float(binary_kl(jnp.float32(-0.7), jnp.float32(-0.7))) == 0.0
    # mu = 1 - eps, pi = eps: (1 - eps) ln((1-eps)/eps) + eps ln(eps/(1-eps))
    # = (1 - 2 eps) ln((1 - eps)/eps) = 13.815482...
    expected = (1 - 2 * _EPS) * math.log((1 - _EPS) / _EPS)
    assert float(binary_kl(jnp.float32(0.0), jnp.float32(-60.0))) == pytest.approx(
        expected, rel=1e-6
    )


def test_binary_kl_sweep_near_identical_never_negative_and_matches_float64():
    rng = np.random.default_rng(0)
    b = rng.uniform(-12.0, -1e-3, 20000).astype(np.float32)
    d = rng.choice([-1.0, 1.0], b.size) * 10 ** rng.uniform(-4.5, -3.5, b.size)  # |d| ~ 1e-4
    t = (b + d).astype(np.float32)
    got = np.asarray(binary_kl(jnp.asarray(b), jnp.asarray(t)))
    assert np.all(got >= 0.0)
    np.testing.assert_allclose(got, kl_float64(b, t), rtol=1e-5, atol=0)
    assert np.all(np.asarray(binary_kl(jnp.asarray(b), jnp.asarray(b))) == 0.0)


def test_binary_kl_far_apart_matches_float64():
    rng = np.random.default_rng(1)
    b = rng.uniform(-13.0, -1e-5, 20000).astype(np.float32)
    t = rng.uniform(-13.0, -1e-5, 20000).astype(np.float32)
    got = np.asarray(binary_kl(jnp.asarray(b), jnp.asarray(t)))
    assert np.all(got >= 0.0)
    np.testing.assert_allclose(got, kl_float64(b, t), rtol=1e-5, atol=0)


@SETTINGS
@given(
    st.floats(-13.0, -(2.0**-10), width=32),
    st.floats(-13.0, 0.0, width=32),
    st.floats(-6.0, -3.0),
    st.sampled_from([-1.0, 1.0, None]),
)
def test_binary_kl_matches_exact_decimal(b, t, log10_d, sign):
    if sign is not None:  # a near-identical pair, |d| in [1e-6, 1e-3]
        t = float(np.float32(b + sign * 10**log10_d))
    got = float(jit_kl(jnp.float32(b), jnp.float32(t)))
    want = kl_exact(np.float32(b), np.float32(t))
    assert got >= 0.0
    assert got == pytest.approx(want, rel=1e-5, abs=1e-30)


# --- gates -----------------------------------------------------------------------------------
L5, L4, L25 = math.log(0.5), math.log(0.4), math.log(0.25)


def _gate_case():
    # row 0: identical policies -> KL 0 -> kept, weights exp(0) = 1 on loss tokens.
    # row 1: mu = 0.5 vs pi = 0.25 on 1 of 3 loss tokens: mean KL = 0.1438410 / 3 = 0.048 > 0.01
    #        -> rejected, weights 0.
    # row 2: no loss tokens (wild, masked logprobs) -> kept.
    # row 3: a NaN behaviour logprob on a loss token -> rejected, weights 0 (finite).
    # row 4: -inf behaviour on a masked token, identical elsewhere -> kept, that weight 0.
    beh = jnp.array(
        [
            [L5, L5, L5],
            [L5, L5, L5],
            [-80.0, 0.0, -3.0],
            [L5, jnp.nan, L5],
            [L5, L5, -jnp.inf],
        ]
    )
    train = jnp.array([[L5, L5, L5], [L25, L5, L5], [0.0, -50.0, -3.0], [L5, L5, L5], [L5] * 3])
    mask = jnp.array([[1, 1, 1], [1, 1, 1], [0, 0, 0], [1, 1, 1], [1, 1, 0]], jnp.float32)
    return beh, train, mask


def test_flash_reinforce_gate_sequence_hand_values():
    beh, train, mask = _gate_case()
    keep, w = flash_reinforce_gate(beh, train, mask, threshold=0.01)
    np.testing.assert_array_equal(np.asarray(keep), [True, False, True, False, True])
    chex.assert_tree_all_finite(w)
    expected = np.zeros((5, 3), np.float32)
    expected[0] = 1.0
    expected[2] = np.exp(np.array([0.0, -50.0, -3.0]) - np.array([-80.0, 0.0, -3.0]))
    expected[4, :2] = 1.0  # keep * exp(train - behavior); the -inf behaviour token gets 0
    chex.assert_trees_all_close(w, expected, rtol=1e-6)
    # the threshold is inclusive: stat 0.048 is kept at threshold 0.05.
    keep2, _ = flash_reinforce_gate(beh, train, mask, threshold=0.05)
    assert bool(keep2[1])


def test_flash_reinforce_gate_token_level_hand_values():
    beh, train, mask = _gate_case()
    keep, w = flash_reinforce_gate(beh, train, mask, threshold=0.01, level="token")
    want = np.ones((5, 3), bool)
    want[1, 0] = False  # KL 0.1438 on that token alone
    want[3, 1] = False  # NaN behaviour
    np.testing.assert_array_equal(np.asarray(keep), want)
    chex.assert_tree_all_finite(w)
    assert float(w[1, 0]) == 0.0 and float(w[1, 1]) == pytest.approx(1.0)
    assert float(w[3, 1]) == 0.0 and float(w[3, 0]) == pytest.approx(1.0)


def test_rejected_extreme_ratio_is_never_exponentiated():
    # exp(0 - (-200)) would overflow float32; the rejected row's weights are exactly 0.
    beh = jnp.full((1, 4), -200.0)
    train = jnp.zeros((1, 4))
    keep, w = jit_flash(beh, train, jnp.ones((1, 4)))
    assert not bool(keep[0]) and np.all(np.asarray(w) == 0.0)
    grad = jax.jit(jax.grad(lambda t: jnp.sum(flash_reinforce_gate(beh, t, jnp.ones((1, 4)))[1])))(
        train
    )
    chex.assert_tree_all_finite(grad)


def test_ratio_band_gate_hand_values():
    # mean log-ratio (pi - mu) over loss tokens: row 0 (0.02 - 0.01)/2 = 0.005 <= 0.01 kept;
    # row 1 (0.03 + 0)/2 = 0.015 rejected; row 2 |(-0.02 + 0.0)/2| = 0.01 kept (inclusive);
    # row 3 the 0.5 token is masked, mean 0 -> kept.
    beh = jnp.full((4, 2), -1.0)
    d = jnp.array([[0.02, -0.01], [0.03, 0.0], [-0.02, 0.0], [0.0, 0.5]])
    mask = jnp.array([[1, 1], [1, 1], [1, 1], [1, 0]], jnp.float32)
    keep, w = ratio_band_gate(beh, beh + d, mask, threshold=0.01 + 1e-7)
    np.testing.assert_array_equal(np.asarray(keep), [True, False, True, True])
    expected = np.exp(np.asarray(d)) * np.array([1, 0, 1, 1])[:, None]
    chex.assert_trees_all_close(w, expected, rtol=1e-5)
    keep_t, _ = ratio_band_gate(beh, beh + d, mask, threshold=0.015, level="token")
    # per token |d| <= 0.015: 0.02, 0.03, 0.02 are rejected; the masked 0.5 token is kept.
    np.testing.assert_array_equal(np.asarray(keep_t), [[0, 1], [0, 1], [0, 1], [1, 1]])


def test_no_gate_keeps_all():
    beh, train, mask = _gate_case()
    keep, w = no_gate(beh, train, mask)
    assert keep.shape == (5,) and bool(jnp.all(keep))
    chex.assert_tree_all_finite(w)
    assert float(w[1, 0]) == pytest.approx(0.5)  # exp(log .25 - log .5)


def test_unknown_level_raises():
    beh, train, mask = _gate_case()
    with pytest.raises(ConfigError, match="gate level"):
        flash_reinforce_gate(beh, train, mask, level="row")


@st.composite
def gate_inputs(draw):
    r, t = 4, 6
    vals = st.floats(-8.0, -(2.0**-7), width=32)
    beh = np.array(draw(st.lists(vals, min_size=r * t, max_size=r * t)), np.float32).reshape(r, t)
    delta = np.array(
        draw(st.lists(st.floats(-0.25, 0.25, width=32), min_size=r * t, max_size=r * t)), np.float32
    ).reshape(r, t)
    mask = np.array(draw(st.lists(st.booleans(), min_size=r * t, max_size=r * t))).reshape(r, t)
    junk = np.array(
        draw(
            st.lists(
                st.sampled_from([np.nan, np.inf, -np.inf, -500.0, 0.0, 3.0]),
                min_size=r * t,
                max_size=r * t,
            )
        ),
        np.float32,
    ).reshape(r, t)
    return beh, beh + delta, mask.astype(np.float32), junk


@SETTINGS
@given(gate_inputs(), st.sampled_from(["sequence", "token"]))
def test_masked_tokens_never_change_the_gate(inputs, level):
    beh, train, mask, junk = inputs
    masked = mask == 0
    beh2, train2 = np.where(masked, junk, beh), np.where(masked, junk[::-1], train)
    for gate in (jit_flash, jit_ratio):
        k1, w1 = gate(beh, train, mask, threshold=0.01, level=level)
        k2, w2 = gate(beh2, train2, mask, threshold=0.01, level=level)
        np.testing.assert_array_equal(np.asarray(k1), np.asarray(k2))
        chex.assert_tree_all_finite((w1, w2))
        np.testing.assert_array_equal(np.asarray(w1)[~masked], np.asarray(w2)[~masked])


@SETTINGS
@given(gate_inputs())
def test_gate_jit_equals_eager(inputs):
    beh, train, mask, _ = inputs
    for level in ("sequence", "token"):
        chex.assert_trees_all_close(
            jit_flash(beh, train, mask, level=level),
            flash_reinforce_gate(beh, train, mask, level=level),
        )


def test_gate_traced_once_per_shape():
    chex.clear_trace_counter()

    @jax.jit
    @chex.assert_max_traces(n=1)
    def f(b, t, m):
        return flash_reinforce_gate(b, t, m)

    rng = np.random.default_rng(0)
    for _ in range(3):
        b = jnp.asarray(-rng.random((3, 5)), jnp.float32)
        f(b, b + 0.01, jnp.asarray(rng.random((3, 5)) > 0.3, jnp.float32))


# --- the gate's direction and the owner level (issue 14 item 3) -----------------------------


def test_gate_direction_is_kl_of_behaviour_from_train():
    # Behaviour mu = 0.01, train pi = 0.03 on one loss token (threshold 0.01):
    # KL(mu || pi) = 0.01 ln(0.01 / 0.03) + 0.99 ln(0.99 / 0.97)
    #             = 0.01 (-1.0986123) + 0.99 (0.0204089) = -0.0109861 + 0.0202048 = 0.0092187
    #   <= 0.01: kept;
    # KL(pi || mu) = 0.03 ln 3 + 0.97 ln(0.97 / 0.99) = 0.0329584 - 0.0197966 = 0.0131618
    #   > 0.01: a gate with the arguments swapped would reject the row.
    mu, pi = math.log(0.01), math.log(0.03)
    forward_kl = float(binary_kl(jnp.float32(mu), jnp.float32(pi)))
    reverse_kl = float(binary_kl(jnp.float32(pi), jnp.float32(mu)))
    assert forward_kl == pytest.approx(0.0092187, rel=1e-4)
    assert reverse_kl == pytest.approx(0.0131618, rel=1e-4)
    beh, train, mask = jnp.full((1, 1), mu), jnp.full((1, 1), pi), jnp.ones((1, 1))
    for level in ("sequence", "token", "owner"):
        keep, w = flash_reinforce_gate(
            beh, train, mask, threshold=0.01, level=level, owner_ids=jnp.zeros(1, int), num_owners=1
        )
        assert bool(np.all(keep)), level  # KL(mu || pi) = 0.0092 <= 0.01
        np.testing.assert_allclose(w, [[3.0]], rtol=1e-5)  # exp(pi - mu) = 0.03 / 0.01
    # The same numbers with the roles swapped are rejected: the direction is pinned.
    keep, w = flash_reinforce_gate(train, beh, mask, threshold=0.01, level="sequence")
    assert not bool(keep[0]) and float(w[0, 0]) == 0.0


def test_owner_level_pools_an_owners_segments():
    # Owner 0 has rows 0 and 1 (two segments), owner 1 has row 2. Per-token binary KL:
    # row 0: mu 0.5 vs pi 0.25 -> KL(0.5 || 0.25) = 0.5 ln(4/3) = 0.1438410 on 1 loss token;
    # row 1: identical -> 0 on 3 loss tokens; row 2: mu 0.48 vs pi 0.5 -> 0.000800 (kept alone).
    # Sequence level (threshold 0.05): row 0 rejected (0.1438), rows 1, 2 kept.
    # Owner level: owner 0 pools 4 tokens: 0.1438410 / 4 = 0.0359602 <= 0.05: rows 0 AND 1
    # kept; at threshold 0.03 owner 0 is rejected as a whole (rows 0 and 1), owner 1 kept.
    h = math.log(0.5)
    beh = jnp.array([[h, 0, 0, 0], [h, h, h, 0], [math.log(0.48), 0, 0, 0]])
    train = jnp.array([[math.log(0.25), 0, 0, 0], [h, h, h, 0], [h, 0, 0, 0]])
    mask = jnp.array([[1.0, 0, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]])
    owners = jnp.array([0, 0, 1])
    kw = dict(owner_ids=owners, num_owners=2)
    seq, _ = flash_reinforce_gate(beh, train, mask, threshold=0.05, level="sequence")
    np.testing.assert_array_equal(seq, [False, True, True])
    own, w = flash_reinforce_gate(beh, train, mask, threshold=0.05, level="owner", **kw)
    np.testing.assert_array_equal(own, [True, True, True])
    np.testing.assert_allclose(w[0, 0], 0.5, rtol=1e-5)  # exp(pi - mu) = 0.25 / 0.5, kept
    own, w = flash_reinforce_gate(beh, train, mask, threshold=0.03, level="owner", **kw)
    np.testing.assert_array_equal(own, [False, False, True])
    assert float(jnp.abs(w[:2]).sum()) == 0.0
    # A non-finite behaviour logprob in one segment rejects the whole owner.
    bad = beh.at[1, 2].set(jnp.nan)
    own, _ = flash_reinforce_gate(bad, train, mask, threshold=1.0, level="owner", **kw)
    np.testing.assert_array_equal(own, [False, False, True])
    # Ratio band at owner level: |mean over the owner's tokens of (pi - mu)| =
    # |ln(0.25/0.5)| / 4 = 0.1732868: rejected at 0.1, kept at 0.2 (row 0 alone: 0.693).
    own, _ = ratio_band_gate(beh, train, mask, threshold=0.1, level="owner", **kw)
    np.testing.assert_array_equal(own, [False, False, True])
    own, _ = ratio_band_gate(beh, train, mask, threshold=0.2, level="owner", **kw)
    np.testing.assert_array_equal(own, [True, True, True])
    with pytest.raises(ConfigError, match="owner_ids"):
        flash_reinforce_gate(beh, train, mask, level="owner")
