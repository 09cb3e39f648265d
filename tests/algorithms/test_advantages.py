"""Advantage estimators: hand-derived values, exact zeros, invalid owners, properties."""

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from osworld_jax.algorithms import (
    Estimator,
    batch_mean_advantages,
    compute_advantages,
    dr_grpo_advantages,
    grpo_advantages,
    reinforce_baseline_advantages,
    rloo_advantages,
)

# Groups: 0 = [1, 0, 0, 1]; 1 = [2, 4, 9 (invalid)]; 2 = [0.3] (singleton); 3 = empty.
REWARDS = jnp.array([1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 9.0, 0.3])
GROUPS = jnp.array([0, 0, 0, 0, 1, 1, 1, 2])
VALID = jnp.array([True, True, True, True, True, True, False, True])
G = 4
SETTINGS = settings(max_examples=30, deadline=None)


def test_grpo_hand_values():
    # group 0: mean 0.5, squared deviations 4 * 0.25 = 1, Bessel var 1/3, std 1/sqrt(3);
    #   A = +-0.5 / (1/sqrt(3) + 1e-6).
    # group 1 (valid 2, 4): mean 3, var (1 + 1) / 1 = 2, std sqrt(2); A = -+1 / (sqrt(2) + 1e-6).
    # invalid owner -> 0; singleton (fewer than 2 valid) -> 0.
    a0 = 0.5 / (1 / np.sqrt(3) + 1e-6)
    a1 = 1 / (np.sqrt(2) + 1e-6)
    expected = np.array([a0, -a0, -a0, a0, -a1, a1, 0.0, 0.0], np.float32)
    got = grpo_advantages(REWARDS, GROUPS, G, valid=VALID)
    chex.assert_trees_all_close(got, expected, rtol=1e-6)


def test_dr_grpo_hand_values():
    # r - mean_g: group 0 mean 0.5, group 1 mean 3 (over valid), singleton r - r = 0.
    expected = np.array([0.5, -0.5, -0.5, 0.5, -1.0, 1.0, 0.0, 0.0], np.float32)
    chex.assert_trees_all_close(dr_grpo_advantages(REWARDS, GROUPS, G, valid=VALID), expected)


def test_rloo_hand_values():
    # group 0: 1 - mean(0, 0, 1) = 2/3, 0 - mean(1, 0, 1) = -2/3; group 1: 2 - 4, 4 - 2;
    # the invalid owner gets 0; the singleton keeps its raw reward 0.3.
    t = 2.0 / 3.0
    expected = np.array([t, -t, -t, t, -2.0, 2.0, 0.0, 0.3], np.float32)
    chex.assert_trees_all_close(
        rloo_advantages(REWARDS, GROUPS, G, valid=VALID), expected, rtol=1e-6
    )


def test_reinforce_baseline_hand_values():
    # centred a = [.5, -.5, -.5, .5, -1, 1, 0 (invalid), 0]; token weights (invalid -> 0)
    # w = [3, 1, 1, 1, 2, 2, 0, 3], sum 13.
    # mu = (1.5 - .5 - .5 + .5 - 2 + 2 + 0) / 13 = 1/13.
    # E[a^2] = (3*.25 + 3*.25 + 2 + 2) / 13 = 5.5/13; var = 5.5/13 - 1/169 = 70.5/169.
    # A = (a - 1/13) / (sqrt(70.5)/13) = (13 a - 1) / sqrt(70.5); invalid -> 0.
    counts = jnp.array([3.0, 1, 1, 1, 2, 2, 5, 3])
    a = np.array([0.5, -0.5, -0.5, 0.5, -1.0, 1.0, 0.0, 0.0])
    expected = ((13 * a - 1) / np.sqrt(70.5)).astype(np.float32)
    expected[6] = 0.0
    got = reinforce_baseline_advantages(REWARDS, GROUPS, G, counts, valid=VALID)
    chex.assert_trees_all_close(got, expected, rtol=1e-5)
    unwhitened = reinforce_baseline_advantages(
        REWARDS, GROUPS, G, counts, valid=VALID, whiten=False
    )
    chex.assert_trees_all_close(unwhitened, a.astype(np.float32))


def test_batch_mean_hand_values():
    # valid rewards 1, 0, 2 -> mean 1; the invalid 3 is ignored and gets 0.
    got = batch_mean_advantages(
        jnp.array([1.0, 0.0, 3.0, 2.0]), valid=jnp.array([1, 1, 0, 1], bool)
    )
    chex.assert_trees_all_close(got, np.array([0.0, -1.0, 0.0, 1.0], np.float32))


@pytest.mark.parametrize("name", [e.value for e in Estimator])
def test_constant_group_is_exactly_zero(name):
    # eight float32 rewards of 0.95: the float32 sum is not exactly 8 * 0.95, so a mean / std
    # computed by arithmetic leaves a residue; equality is decided exactly, the result is 0.
    rewards = jnp.full((8,), 0.95, jnp.float32)
    got = compute_advantages(name, rewards, jnp.zeros(8, jnp.int32), 1, token_counts=jnp.ones(8))
    assert np.all(np.asarray(got) == 0.0), got


def test_grpo_constant_group_next_to_live_group():
    rewards = jnp.array([0.95] * 8 + [1.0, 0.0])
    groups = jnp.array([0] * 8 + [1, 1])
    got = np.asarray(grpo_advantages(rewards, groups, 2))
    assert np.all(got[:8] == 0.0)
    np.testing.assert_allclose(got[8:], [1 / np.sqrt(2), -1 / np.sqrt(2)], rtol=1e-5)


@pytest.mark.parametrize("name", [e.value for e in Estimator])
def test_invalid_owner_gets_zero_and_is_excluded(name):
    # changing an invalid owner's reward changes nothing, and it gets 0
    r1 = REWARDS.at[6].set(-100.0)
    counts = jnp.ones(8)
    a = compute_advantages(name, REWARDS, GROUPS, G, valid=VALID, token_counts=counts)
    b = compute_advantages(name, r1, GROUPS, G, valid=VALID, token_counts=counts)
    chex.assert_trees_all_close(a, b)
    assert float(a[6]) == 0.0


def test_all_invalid_gives_zero():
    for e in Estimator:
        got = compute_advantages(
            e.value, REWARDS, GROUPS, G, valid=jnp.zeros(8, bool), token_counts=jnp.ones(8)
        )
        assert np.all(np.asarray(got) == 0.0), e


# --- properties ------------------------------------------------------------------------------
N, NG = 12, 3
grid = st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0])


@st.composite
def batches(draw):
    rewards = np.array(draw(st.lists(grid, min_size=N, max_size=N)), np.float32)
    groups = np.array(draw(st.lists(st.integers(0, NG - 1), min_size=N, max_size=N)), np.int32)
    valid = np.array(draw(st.lists(st.booleans(), min_size=N, max_size=N)), bool)
    counts = np.array(draw(st.lists(st.integers(1, 50), min_size=N, max_size=N)), np.float32)
    perm = np.array(draw(st.permutations(range(N))))
    return rewards, groups, valid, counts, perm


_jit_adv = jax.jit(compute_advantages, static_argnums=(0, 3))


def _adv(name, r, g, v, c):
    return np.asarray(_jit_adv(name, r, g, NG, valid=v, token_counts=c))


@SETTINGS
@given(batches())
def test_permutation_equivariance(b):
    r, g, v, c, p = b
    for e in Estimator:
        np.testing.assert_allclose(
            _adv(e.value, r[p], g[p], v[p], c[p]), _adv(e.value, r, g, v, c)[p], atol=1e-5
        )


@SETTINGS
@given(batches())
def test_dr_grpo_and_rloo_sum_to_zero_per_group(b):
    r, g, v, c, _ = b
    n_valid = np.bincount(g[v], minlength=NG)
    for name in ("dr_grpo", "rloo"):
        sums = np.bincount(g, weights=_adv(name, r, g, v, c), minlength=NG)
        live = n_valid >= 2  # an RLOO singleton keeps its raw reward
        np.testing.assert_allclose(sums[live], 0.0, atol=1e-5)


@SETTINGS
@given(batches(), st.sampled_from([-3.0, -0.5, 0.25, 2.0, 7.0]))
def test_grpo_invariant_to_constant_shift(b, c0):
    r, g, v, c, _ = b
    np.testing.assert_allclose(_adv("grpo", r + c0, g, v, c), _adv("grpo", r, g, v, c), atol=1e-5)


@SETTINGS
@given(batches())
def test_jit_equals_eager(b):
    r, g, v, c = (jnp.asarray(x) for x in b[:4])
    for e in Estimator:
        chex.assert_trees_all_close(
            _jit_adv(e.value, r, g, NG, valid=v, token_counts=c),
            compute_advantages(e.value, r, g, NG, valid=v, token_counts=c),
            atol=1e-6,
        )


@pytest.mark.parametrize("name", [e.value for e in Estimator])
def test_traced_once_per_shape(name):
    chex.clear_trace_counter()  # the nested f below shares its code object across parameters

    @jax.jit
    @chex.assert_max_traces(n=1)
    def f(r, g, v, c):
        return compute_advantages(name, r, g, NG, valid=v, token_counts=c)

    rng = np.random.default_rng(0)
    for _ in range(3):
        f(
            jnp.asarray(rng.random(N), jnp.float32),
            jnp.asarray(rng.integers(0, NG, N), jnp.int32),
            jnp.asarray(rng.random(N) > 0.2),
            jnp.asarray(rng.integers(1, 9, N), jnp.float32),
        )
