"""Router replay (R3, arXiv 2510.11370): replayed indices, own gates, live fallback, validation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osworld_jax.model import RouterReplayError, forward, validate_replay
from osworld_jax.model.moe import route, router_stats
from tests.model.conftest import TINY_CFG, TINY_RT, jforward, tiny_policy

B, S = 2, 10


def _ids(seed=0):
    return jnp.asarray(np.random.RandomState(seed).randint(0, 64, (B, S)), jnp.int32)


def _shifted_replay(live: np.ndarray, start: int) -> np.ndarray:
    """Routes (e + 1) % E on MoE layers for tokens >= start; -1 (live) everywhere else."""
    replay = np.full_like(live, -1)
    for layer in TINY_CFG.moe_layers:
        replay[:, start:, layer] = (live[:, start:, layer] + 1) % TINY_CFG.num_experts
    return replay


def test_replaying_own_routes_gives_identical_logits():
    policy, ids = tiny_policy(), _ids()
    live = jforward(policy, ids)
    validate_replay(np.asarray(live.routed_experts), TINY_CFG)  # own routes are valid rows
    rep = jforward(policy, ids, replay_experts=live.routed_experts)
    np.testing.assert_allclose(rep.logits, live.logits, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(rep.routed_experts, live.routed_experts)


def test_different_routes_change_logits_and_are_reported_minus_one_rows_route_live():
    policy, ids = tiny_policy(), _ids(1)
    live = jforward(policy, ids)
    live_routes = np.asarray(live.routed_experts)
    replay = _shifted_replay(live_routes, start=5)
    validate_replay(replay, TINY_CFG)
    rep = jforward(policy, ids, replay_experts=jnp.asarray(replay))
    got = np.asarray(rep.routed_experts)
    moe = list(TINY_CFG.moe_layers)
    np.testing.assert_array_equal(got[:, 5:, moe], replay[:, 5:, moe])  # replayed ids reported
    # Tokens 0..4 have all -1 rows and (causal) unchanged inputs: live routing, same logits.
    np.testing.assert_array_equal(got[:, :5], live_routes[:, :5])
    np.testing.assert_allclose(rep.logits[:, :5], live.logits[:, :5], rtol=1e-6, atol=1e-6)
    diff = np.abs(np.asarray(rep.logits[:, 5:]) - np.asarray(live.logits[:, 5:])).max(-1)
    assert (diff > 1e-4).all(), diff
    # An all -1 replay tensor is live routing.
    none = jforward(policy, ids, replay_experts=jnp.full_like(live.routed_experts, -1))
    np.testing.assert_allclose(none.logits, live.logits, rtol=1e-6, atol=1e-6)


def test_router_gets_gradient_under_replay():
    policy, ids = tiny_policy(), _ids(2)
    replay = _shifted_replay(np.asarray(jforward(policy, ids).routed_experts), start=0)
    w = jax.random.normal(jax.random.key(0), (B, S, TINY_CFG.vocab_size))

    @jax.jit
    def grads(params):
        def loss(p):
            out = forward(p, TINY_CFG, TINY_RT, ids, replay_experts=jnp.asarray(replay))
            return jnp.sum(out.logits * w)

        return jax.grad(loss)(params)

    g = grads(policy.params())
    norms = np.linalg.norm(np.asarray(g["moe"]["router"]).reshape(2, -1), axis=-1)
    assert (norms > 1e-6).all(), norms  # every MoE layer's router learns under replay


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_gates_are_own_softmax_at_replayed_ids_and_lb_stats_use_live_routes(norm_topk_prob):
    rng = np.random.RandomState(0)
    x = jnp.asarray(rng.randn(6, 16), jnp.float32)
    w = jnp.asarray(rng.randn(16, 8), jnp.float32)
    replay = np.array([[3, 5], [-1, -1], [0, 7], [7, 0], [-1, -1], [1, 2]], np.int32)
    live = route(x, w, top_k=2, norm_topk_prob=norm_topk_prob)
    rep = route(x, w, top_k=2, norm_topk_prob=norm_topk_prob, replay=jnp.asarray(replay))
    probs = np.asarray(jax.nn.softmax(np.asarray(x) @ np.asarray(w), axis=-1))
    expect_ids = np.where(replay[:, :1] < 0, np.asarray(live.experts), replay)
    np.testing.assert_array_equal(rep.experts, expect_ids)
    gates = np.take_along_axis(probs, expect_ids, axis=-1)
    if norm_topk_prob:
        gates = gates / gates.sum(-1, keepdims=True)
    np.testing.assert_allclose(rep.weights, gates, rtol=1e-5)
    # Live top-k is the top-2 of the softmax; the load-balancing statistics ignore the replay.
    np.testing.assert_array_equal(np.sort(live.experts, -1), np.sort(np.argsort(-probs)[:, :2], -1))
    valid = jnp.ones(6)
    for a, b in zip(router_stats(rep, valid), router_stats(live, valid), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def _rows(**bad):
    r = np.tile(np.array([0, 1], np.int32), (2, 3, TINY_CFG.num_hidden_layers, 1))
    r[:, :, 0] = -1  # dense layer: no route
    r[1, 2] = -1  # the last token: no route
    for (b, s, layer), row in bad.get("rows", {}).items():
        r[b, s, layer] = row
    return r


@pytest.mark.parametrize(
    "row, match",
    [
        ([-1, 3], "negative ids"),
        ([-2, -2], "negative ids"),
        ([2, 8], "out of range"),
        ([4, 4], "duplicate"),
    ],
)
def test_validate_replay_rejects_corrupt_rows(row, match):
    validate_replay(_rows(), TINY_CFG)  # the uncorrupted tensor is fine
    with pytest.raises(RouterReplayError, match=match) as e:
        validate_replay(_rows(rows={(1, 1, 2): row}), TINY_CFG)
    assert "[1, 1, 2]" in str(e.value)  # names the offending (row, token, layer)


def test_validate_replay_rejects_wrong_shape_and_dtype():
    with pytest.raises(RouterReplayError, match="shape"):
        validate_replay(np.zeros((2, 3, 2, 2), np.int32), TINY_CFG)
    with pytest.raises(RouterReplayError, match="dtype"):
        validate_replay(_rows().astype(np.float32), TINY_CFG)
