"""Expert backends / scan / remat compute one function; 8-device sharding equals 1 device."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from osworld_jax.model import (
    ShardingRules,
    forward,
    load_hf_checkpoint,
    make_mesh,
    make_tiny_checkpoint,
    param_shardings,
    router_param_labels,
)
from osworld_jax.model.moe import EXPERT_BACKENDS
from tests.model.conftest import TINY_CFG, TINY_RT, tiny_policy

B, S = 4, 12


def _batch(seed=0):
    rng = np.random.RandomState(seed)
    ids = rng.randint(0, TINY_CFG.vocab_size, (B, S)).astype(np.int32)
    seg = np.ones((B, S), np.int32)
    seg[1, 9:] = 0  # some padding
    seg[2, 6:] = 2  # two packed segments
    pos = np.where(seg[2] == 2, np.arange(S) - 6, np.arange(S))
    positions = np.tile(np.arange(S), (B, 1)).astype(np.int32)
    positions[2] = pos
    return jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(seg)


def _loss_fn(runtime):
    def loss(params, ids, positions, seg, replay=None):
        out = forward(
            params,
            TINY_CFG,
            runtime,
            ids,
            positions=positions,
            segment_ids=seg,
            replay_experts=replay,
        )
        lp = jax.nn.log_softmax(out.logits[:, :-1], axis=-1)
        tok = jnp.take_along_axis(lp, ids[:, 1:, None], axis=-1)[..., 0]
        nll = -jnp.sum(tok * (seg[:, 1:] != 0)) / jnp.sum(seg[:, 1:] != 0)
        total = nll + 0.01 * out.aux["load_balancing_loss"] + 0.001 * out.aux["router_z_loss"]
        return total, out.logits

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


def _assert_same(a, b, rtol=2e-5, atol=2e-6, logits_atol=None):
    (la, logits_a), ga = a
    (lb, logits_b), gb = b
    np.testing.assert_allclose(la, lb, rtol=rtol)
    np.testing.assert_allclose(
        logits_a, logits_b, rtol=rtol, atol=atol if logits_atol is None else logits_atol
    )
    chex.assert_trees_all_close(ga, gb, rtol=rtol, atol=atol)


def test_dense_and_ragged_backends_agree_fwd_and_grad():
    params, batch = tiny_policy().params(), _batch()
    dense = _loss_fn(TINY_RT)(params, *batch)
    ragged = _loss_fn(dataclasses.replace(TINY_RT, expert_backend="ragged"))(params, *batch)
    _assert_same(dense, ragged)
    assert float(jnp.linalg.norm(dense[1]["moe"]["gate"])) > 0


@pytest.mark.slow
def test_scan_layers_and_remat_agree_with_unrolled():
    params, batch = tiny_policy().params(), _batch(1)
    # R3 replay threads through the scan per layer: shifted routes on tokens >= 6, live before.
    routes = np.asarray(forward(params, TINY_CFG, TINY_RT, batch[0]).routed_experts)
    replay = np.full_like(routes, -1)
    moe = list(TINY_CFG.moe_layers)
    replay[:, 6:, moe] = (routes[:, 6:, moe] + 3) % TINY_CFG.num_experts
    replay = jnp.asarray(replay)
    base = _loss_fn(TINY_RT)(params, *batch, replay)
    scanned = _loss_fn(dataclasses.replace(TINY_RT, scan_layers=True, remat="full"))(
        params, *batch, replay
    )
    _assert_same(base, scanned)


def test_tokamax_backend_is_registered_and_imported_lazily():
    assert {"dense", "ragged", "tokamax"} <= set(EXPERT_BACKENDS.names())
    try:
        import tokamax  # noqa: F401
    except ImportError:
        x = jnp.ones((2, 4))
        with pytest.raises(ImportError, match="tokamax"):
            EXPERT_BACKENDS.get("tokamax")(
                x,
                jnp.zeros((2, 1), jnp.int32),
                jnp.ones((2, 1)),
                jnp.ones((1, 4, 2)),
                jnp.ones((1, 4, 2)),
                jnp.ones((1, 2, 4)),
            )


@pytest.mark.slow
def test_sharded_8_devices_equals_one_device():
    assert len(jax.devices()) == 8
    mesh = make_mesh(fsdp=2, expert=2, tensor=2)
    params, batch = tiny_policy().params(), _batch(2)
    shardings = param_shardings(TINY_CFG, mesh)
    # Experts split over `expert`, embed over `fsdp`, expert width over `tensor`.
    assert shardings["moe"]["gate"].spec == PartitionSpec(None, ("expert",), ("fsdp",), ("tensor",))
    sharded = jax.device_put(params, shardings)
    rules = ShardingRules()
    batch_sh = NamedSharding(mesh, rules.batch_spec(B, mesh, 2))
    sharded_batch = jax.device_put(batch, batch_sh)
    # dense: plain GSPMD propagation; ragged: under jax.set_mesh (activations constrained).
    for backend, ambient in (("dense", False), ("ragged", True)):
        fn = _loss_fn(dataclasses.replace(TINY_RT, expert_backend=backend))
        one = fn(params, *batch)
        if ambient:
            with jax.set_mesh(mesh):
                eight = fn(sharded, *sharded_batch)
        else:
            eight = fn(sharded, *sharded_batch)
        assert len(eight[1]["moe"]["gate"].sharding.device_set) == 8
        # The sharded step sums the hidden and expert-width contractions in another order
        # (partial sums reduced over `tensor` and `fsdp`): the logits' f32 rounding error scales
        # with their size (max |logit| ~ 3.9 here; measured gap 3.2e-6, ~7 ulp of the largest),
        # so their absolute tolerance is relative to that scale. Gradients keep the default.
        scale = float(jnp.max(jnp.abs(one[0][1])))
        _assert_same(one, eight, logits_atol=2e-6 * max(1.0, scale))


def test_load_with_mesh_creates_sharded_params(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "tiny")
    mesh = make_mesh(fsdp=2, expert=2, tensor=2)
    plain = load_hf_checkpoint(path, dtype=jnp.float32)
    sharded = load_hf_checkpoint(path, dtype=jnp.float32, mesh=mesh)
    gate = sharded.params()["moe"]["gate"]  # [Lm, E, H, I] = [2, 8, 64, 32]
    assert {s.data.shape for s in gate.addressable_shards} == {(2, 4, 32, 16)}
    chex.assert_trees_all_equal(jax.device_get(sharded.params()), jax.device_get(plain.params()))


def test_frozen_router_labels_leave_router_unchanged():
    params = tiny_policy().params()
    labels = router_param_labels(params, freeze_router=True)
    assert labels["moe"]["router"] == "frozen" and labels["moe"]["gate"] == "trainable"
    assert router_param_labels(params, freeze_router=False)["moe"]["router"] == "trainable"
    tx = optax.multi_transform({"trainable": optax.sgd(0.1), "frozen": optax.set_to_zero()}, labels)
    grads = jax.tree.map(jnp.ones_like, params)
    updates, _ = tx.update(grads, tx.init(params), params)
    new = optax.apply_updates(params, updates)
    np.testing.assert_array_equal(new["moe"]["router"], params["moe"]["router"])
    assert not np.allclose(new["moe"]["gate"], params["moe"]["gate"])
