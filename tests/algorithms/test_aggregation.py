"""aggregate_loss: hand values for every mode, denominator rules, a plain-Python reference."""

import collections

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from osworld_jax.algorithms import LOSS_AGG_MODES, LossAggMode, aggregate_loss
from osworld_jax.errors import ConfigError

SETTINGS = settings(max_examples=30, deadline=None)

# rows: 0 and 1 belong to owner 0 (two segments); row 2 is owner 1, gated out (loss zeroed, mask
# kept); row 3 is owner 2, all masked (padding / failed owner). Groups: rows 0, 1 -> 0; 2, 3 -> 1.
TOKEN_LOSS = jnp.array([[1.0, 2, 3], [4, 5, 6], [0, 0, 0], [7, 8, 9]])
MASK = jnp.array([[1.0, 1, 0], [1, 0, 0], [1, 1, 0], [0, 0, 0]])
OWNERS = jnp.array([0, 0, 1, 2])
GROUPS = jnp.array([0, 0, 1, 1])
# row sums S_r = [3, 4, 0, 0], row tokens T_r = [2, 1, 2, 0]
# owners: S_o = [7, 0, 0], T_o = [3, 2, 0] -> owner 2 leaves the denominators, B = 2
# rows as owners: B = 3 (row 3 leaves)
# groups: S_g = [7, 0], T_g = [3, 2], G = 2


def _agg(mode, **kw):
    return float(aggregate_loss(TOKEN_LOSS, MASK, mode=mode, **kw))


def test_token_mean():
    # (3 + 4 + 0) / (2 + 1 + 2) = 7/5
    assert _agg("token-mean") == pytest.approx(1.4)


def test_seq_mean_token_mean():
    # owners: (7/3 + 0/2) / 2 = 7/6; rows: (3/2 + 4/1 + 0/2) / 3 = 11/6
    assert _agg("seq-mean-token-mean", owner_ids=OWNERS, num_owners=3) == pytest.approx(7 / 6)
    assert _agg("seq-mean-token-mean") == pytest.approx(11 / 6)


def test_seq_mean_token_sum():
    # owners: (7 + 0) / 2 = 3.5; rows: (3 + 4 + 0) / 3 = 7/3
    assert _agg("seq-mean-token-sum", owner_ids=OWNERS, num_owners=3) == pytest.approx(3.5)
    assert _agg("seq-mean-token-sum") == pytest.approx(7 / 3)


def test_seq_mean_token_sum_norm():
    # Dr.GRPO with L = 4: owners 7 / (2 * 4) = 0.875; rows 7 / (3 * 4) = 7/12
    kw = dict(norm_length=4)
    assert _agg("seq-mean-token-sum-norm", owner_ids=OWNERS, num_owners=3, **kw) == 0.875
    assert _agg("seq-mean-token-sum-norm", **kw) == pytest.approx(7 / 12)
    # L is the constant, never the padded length: padding columns change nothing
    padded = aggregate_loss(
        jnp.pad(TOKEN_LOSS, ((0, 0), (0, 5)), constant_values=3.0),
        jnp.pad(MASK, ((0, 0), (0, 5))),
        mode="seq-mean-token-sum-norm",
        norm_length=4,
    )
    assert float(padded) == pytest.approx(7 / 12)


def test_prompt_mean_token_mean():
    # (7/3 + 0/2) / 2 = 7/6; an extra empty group 2 leaves G unchanged
    assert _agg("prompt-mean-token-mean", group_ids=GROUPS, num_groups=2) == pytest.approx(7 / 6)
    assert _agg("prompt-mean-token-mean", group_ids=GROUPS, num_groups=3) == pytest.approx(7 / 6)


@pytest.mark.parametrize("mode", [m.value for m in LossAggMode])
def test_no_loss_tokens_gives_zero(mode):
    kw = dict(group_ids=GROUPS, num_groups=2, owner_ids=OWNERS, num_owners=3, norm_length=4)
    got = aggregate_loss(TOKEN_LOSS, jnp.zeros_like(MASK), mode=mode, **kw)
    assert float(got) == 0.0


def test_missing_arguments_and_unknown_mode_raise():
    with pytest.raises(ConfigError, match="norm_length"):
        _agg("seq-mean-token-sum-norm")
    with pytest.raises(ConfigError, match="group_ids"):
        _agg("prompt-mean-token-mean")
    with pytest.raises(ConfigError, match="num_owners"):
        _agg("seq-mean-token-mean", owner_ids=OWNERS)
    with pytest.raises(ConfigError, match="unknown loss aggregation mode 'seq-mean'"):
        _agg("seq-mean")


def test_registry_matches_enum():
    assert LOSS_AGG_MODES.names() == sorted(m.value for m in LossAggMode)


# --- plain-Python reference ------------------------------------------------------------------
def reference(token_loss, mask, mode, groups, owners, norm_length):
    """Loops over rows and tokens; owners/groups pool their rows; empty ones are skipped."""
    s_o, t_o = collections.defaultdict(float), collections.defaultdict(float)
    s_g, t_g = collections.defaultdict(float), collections.defaultdict(float)
    for r in range(len(token_loss)):
        for t in range(len(token_loss[r])):
            if mask[r][t] > 0:
                s_o[owners[r]] += mask[r][t] * token_loss[r][t]
                t_o[owners[r]] += mask[r][t]
                s_g[groups[r]] += mask[r][t] * token_loss[r][t]
                t_g[groups[r]] += mask[r][t]
    owners_live = [o for o in t_o if t_o[o] > 0]
    groups_live = [g for g in t_g if t_g[g] > 0]
    if not owners_live:
        return 0.0
    if mode == "token-mean":
        return sum(s_o.values()) / sum(t_o.values())
    if mode == "seq-mean-token-mean":
        return sum(s_o[o] / t_o[o] for o in owners_live) / len(owners_live)
    if mode == "seq-mean-token-sum":
        return sum(s_o[o] for o in owners_live) / len(owners_live)
    if mode == "seq-mean-token-sum-norm":
        return sum(s_o[o] for o in owners_live) / (len(owners_live) * norm_length)
    return sum(s_g[g] / t_g[g] for g in groups_live) / len(groups_live)


R, T, NO, NG = 6, 5, 4, 3


@st.composite
def agg_inputs(draw):
    loss = draw(st.lists(st.floats(-5, 5, width=32), min_size=R * T, max_size=R * T))
    mask = draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=R * T, max_size=R * T))
    empty_rows = draw(st.lists(st.booleans(), min_size=R, max_size=R))
    owners = draw(st.lists(st.integers(0, NO - 1), min_size=R, max_size=R))
    groups = draw(st.lists(st.integers(0, NG - 1), min_size=R, max_size=R))
    mask = np.array(mask, np.float32).reshape(R, T) * ~np.array(empty_rows)[:, None]
    return np.array(loss, np.float32).reshape(R, T), mask, owners, groups


@SETTINGS
@given(agg_inputs(), st.sampled_from([m.value for m in LossAggMode]))
def test_every_mode_equals_reference_loop(inputs, mode):
    loss, mask, owners, groups = inputs
    got = aggregate_loss(
        loss,
        mask,
        mode=mode,
        group_ids=jnp.array(groups),
        num_groups=NG,
        owner_ids=jnp.array(owners),
        num_owners=NO,
        norm_length=7,
    )
    want = reference(loss.tolist(), mask.tolist(), mode, groups, owners, 7)
    assert float(got) == pytest.approx(want, rel=1e-5, abs=1e-5)
    # each row its own owner
    got_rows = aggregate_loss(
        loss, mask, mode=mode, group_ids=jnp.array(groups), num_groups=NG, norm_length=7
    )
    want_rows = reference(loss.tolist(), mask.tolist(), mode, groups, list(range(R)), 7)
    assert float(got_rows) == pytest.approx(want_rows, rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("mode", [m.value for m in LossAggMode])
def test_jit_once_and_equal_to_eager(mode):
    chex.clear_trace_counter()
    kw = dict(num_groups=NG, num_owners=NO, norm_length=7)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def f(loss, mask, groups, owners):
        return aggregate_loss(loss, mask, mode=mode, group_ids=groups, owner_ids=owners, **kw)

    rng = np.random.default_rng(0)
    for _ in range(3):
        args = (
            jnp.asarray(rng.normal(size=(R, T)), jnp.float32),
            jnp.asarray(rng.random((R, T)) > 0.4, jnp.float32),
            jnp.asarray(rng.integers(0, NG, R)),
            jnp.asarray(rng.integers(0, NO, R)),
        )
        eager = aggregate_loss(
            args[0], args[1], mode=mode, group_ids=args[2], owner_ids=args[3], **kw
        )
        chex.assert_trees_all_close(f(*args), eager, rtol=1e-6)
