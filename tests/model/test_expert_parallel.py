"""Expert parallelism (`osworld_jax.model.expert_parallel`) computes the one-device MoE.

On the 8 CPU devices of tests/conftest.py: the expert-parallel layer (all-gather dispatch,
local experts, reduce-scatter combine) equals the one-device layer, values and gradients, for
every expert backend (dense, ragged, the Pallas kernels in interpret mode) and uneven loads:
an expert with no token, two experts with every token, every token on one device's experts.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from osworld_jax.model import ModelConfigError, forward, make_mesh
from osworld_jax.model.expert_parallel import expert_parallel, expert_parallel_size
from osworld_jax.model.kernels import GmmConfig, gmm_experts, tile_plan
from osworld_jax.model.kernels.grouped_matmul import padded_rows
from osworld_jax.model.moe import EXPERT_BACKENDS, dense_experts
from tests.model.conftest import TINY_CFG, TINY_RT, tiny_policy

# Small tiles: several row tiles, N tiles, K steps and dw row steps all occur.
CFG = GmmConfig(
    align=8,
    block_m=8,
    block_n=16,
    block_k=16,
    dw_block_m=16,
    dw_block_n=16,
    dw_block_t=4,
    interpret=True,
)
T, K, E, H, I = 32, 2, 8, 32, 16  # noqa: E741
BACKENDS = {
    "dense": dense_experts,
    "ragged": EXPERT_BACKENDS.get("ragged"),
    "pallas": functools.partial(gmm_experts, config=CFG),
}


def _routes(load: str, seed: int = 1) -> jax.Array:
    """i32[T, K] distinct experts per token for a named load pattern."""
    if load == "two_take_all":  # experts 3 and 5 get every token, the other six none
        return jnp.tile(jnp.array([[5, 3]], jnp.int32), (T, 1))
    if load == "one_device":  # experts 0 and 1: all on the first device of any group <= 4
        return jnp.tile(jnp.array([[0, 1]], jnp.int32), (T, 1))
    keys = jax.random.split(jax.random.key(seed), T)  # "no_expert_0": random over 1..7
    return jax.vmap(lambda k: 1 + jax.random.permutation(k, E - 1)[:K])(keys).astype(jnp.int32)


def _inputs(seed: int = 0):
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], (T, H))
    weights = jax.nn.softmax(jax.random.normal(ks[1], (T, K)))
    gate = jax.random.normal(ks[2], (E, H, I)) / 6
    up = jax.random.normal(ks[3], (E, H, I)) / 6
    down = jax.random.normal(ks[4], (E, I, H)) / 4
    return x, weights, gate, up, down


def _value_and_grad(fn, experts, ep: bool):
    def f(x, weights, gate, up, down):
        args = (x, experts, weights, gate, up, down)
        y = expert_parallel(fn, *args) if ep else fn(*args)
        return jnp.sum(jnp.sin(y)), y

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4), has_aux=True))


def _check_layer(mesh_shape: dict, backend: str, load: str) -> None:
    inputs, experts = _inputs(), _routes(load)
    ref = _value_and_grad(dense_experts, experts, ep=False)(*inputs)
    mesh = make_mesh(**mesh_shape)
    with jax.set_mesh(mesh):
        assert expert_parallel_size() == mesh_shape["expert"]
        out = _value_and_grad(BACKENDS[backend], experts, ep=True)(*inputs)
    chex.assert_trees_all_close(out, ref, atol=2e-5, rtol=2e-5)
    # The gradient of an expert no token reached is exactly zero on every device.
    used = np.zeros(E, bool)
    used[np.asarray(experts).reshape(-1)] = True
    for g in out[1][2:]:
        assert float(jnp.abs(g[~used]).max(initial=0.0)) == 0.0


LOADS = ("no_expert_0", "two_take_all", "one_device")


@pytest.mark.parametrize("load", LOADS)
@pytest.mark.parametrize("backend", ["ragged", "pallas"])
def test_expert_parallel_layer_equals_one_device(backend, load):
    # data x fsdp x expert = 2 x 2 x 2: rows split 8 ways, experts 2 ways (4 per device).
    _check_layer(dict(data=2, fsdp=2, expert=2), backend, load)


@pytest.mark.slow
@pytest.mark.parametrize("load", LOADS)
@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize(
    "mesh_shape",
    [dict(expert=2), dict(expert=8), dict(fsdp=2, expert=4), dict(fsdp=2, expert=2, tensor=2)],
    ids=["e2", "e8", "f2e4", "f2e2t2"],
)
def test_expert_parallel_layer_equals_one_device_all_meshes(mesh_shape, backend, load):
    # expert=8: one expert per device (E/n = 1 < K: at most one slot per token is local);
    # tensor=2: the expert width split too, partial outputs summed over `tensor`.
    _check_layer(mesh_shape, backend, load)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_minus_one_slots_are_not_computed_by_any_backend(backend):
    x, weights, gate, up, down = _inputs(3)
    experts = _routes("no_expert_0", seed=4)
    skip = jax.random.bernoulli(jax.random.key(5), 0.4, (T, K))
    marked = jnp.where(skip, -1, experts)
    zeroed = jnp.where(skip, 0.0, weights)  # the reference: those slots weigh nothing

    def loss(fn, ex, w):
        def f(x, w, gate, up, down):
            return jnp.sum(jnp.sin(fn(x, ex, w, gate, up, down)))

        return jax.jit(jax.value_and_grad(f, (0, 2)))(x, w, gate, up, down)

    chex.assert_trees_all_close(
        loss(BACKENDS[backend], marked, zeroed), loss(dense_experts, experts, zeroed), atol=2e-5
    )


def test_tile_plan_gives_minus_one_slots_no_row():
    experts = jnp.array([[0, -1], [-1, 1], [1, 0], [-1, -1]], jnp.int32)  # T=4, K=2, E=2
    plan = jax.tree.map(np.asarray, tile_plan(experts, 2, 8))
    mp = padded_rows(4 * 2, 2, 8)
    assert plan.row_slot.shape == (mp,) and mp == 24
    flat = np.asarray(experts).reshape(-1)
    assert np.all(plan.dest[flat < 0] >= mp)  # out of range: gathers read zero
    assert len(set(plan.dest.tolist())) == flat.size  # still injective (unique scatter)
    np.testing.assert_array_equal(plan.row_slot[plan.dest[flat >= 0]], np.nonzero(flat >= 0)[0])
    assert (plan.row_slot < flat.size).sum() == (flat >= 0).sum()
    np.testing.assert_array_equal(plan.group_tiles, [1, 1])
    # One expert of two local slots per token at most: T min(K, E) rows, not T K.
    assert tile_plan(jnp.zeros((5, 3), jnp.int32), 1, 8).row_slot.shape == (padded_rows(5, 1, 8),)


def test_expert_weights_stay_on_their_devices():
    # The compiled layer gathers tokens (all-gather) and scatters outputs (reduce-scatter) over
    # `expert`; no collective produces the whole [E, H, I] expert stack (a device gathers its
    # own E/4 experts over `fsdp` only), which the non-parallel path (every device runs all
    # experts on its own rows) must all-gather.
    x, weights, gate, up, down = _inputs()
    experts = _routes("no_expert_0")
    mesh = make_mesh(fsdp=2, expert=4)
    stack = f"f32[{E},{H},{I}]"
    # The parameters' layout (ShardingRules): experts over `expert`, the embed dim over `fsdp`.
    w_in = NamedSharding(mesh, PartitionSpec("expert", "fsdp", None))
    w_out = NamedSharding(mesh, PartitionSpec("expert", None, "fsdp"))
    inputs = (x, weights, *jax.device_put((gate, up, down), (w_in, w_in, w_out)))

    def hlo(ep: bool) -> str:
        fn = BACKENDS["pallas"]
        with jax.set_mesh(mesh):
            return _value_and_grad(fn, experts, ep=ep).lower(*inputs).compile().as_text()

    def outputs(op: str, text: str) -> list[str]:  # result shapes of one collective kind
        return re.findall(rf"= (\w+\[[\d,]*\])\S* {op}(?:-start)?\(", text)

    ep_hlo, fsdp_hlo = hlo(True), hlo(False)
    group = f"f32[{T // 2},{H}]"  # the 4 devices of an expert group: 4 x 4 rows of 32
    assert stack not in outputs("all-gather", ep_hlo)
    assert group in outputs("all-gather", ep_hlo)  # dispatch (forward) and dy (backward)
    assert f"f32[{T // 8},{H}]" in outputs("reduce-scatter", ep_hlo)  # combine and dx
    assert stack in outputs("all-gather", fsdp_hlo)


def test_experts_must_divide_by_the_expert_axis():
    x, weights, gate, up, down = _inputs()
    with jax.set_mesh(make_mesh(expert=4)), pytest.raises(ModelConfigError, match="expert"):
        expert_parallel(
            dense_experts, x, _routes("one_device"), weights, gate[:6], up[:6], down[:6]
        )


@pytest.mark.slow
def test_model_forward_and_grads_with_r3_replay_equal_one_device():
    # The whole model (scan over layers, remat) on fsdp x expert = 2 x 4 with R3: the replayed
    # routes decide the dispatch. Rows 0-1 replay skewed routes (layer 1: every token on
    # experts 0 and 1, one device; layer 2: experts 3 and 5), rows 2-3 route live.
    params = tiny_policy().params()
    b, s = 4, 12
    ids = jnp.asarray(np.random.RandomState(0).randint(0, TINY_CFG.vocab_size, (b, s)), jnp.int32)
    replay = np.full((b, s, TINY_CFG.num_hidden_layers, TINY_CFG.num_experts_per_tok), -1)
    replay[:2, :, 1] = [0, 1]
    replay[:2, :, 2] = [5, 3]
    replay = jnp.asarray(replay, jnp.int32)
    runtime = dataclasses.replace(TINY_RT, expert_backend="ragged", scan_layers=True, remat="full")

    def loss(params):
        out = forward(params, TINY_CFG, runtime, ids, replay_experts=replay)
        lp = jax.nn.log_softmax(out.logits[:, :-1], axis=-1)
        nll = -jnp.mean(jnp.take_along_axis(lp, ids[:, 1:, None], axis=-1))
        return nll + 0.01 * out.aux["load_balancing_loss"], out.routed_experts

    fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
    one = fn(params)
    with jax.set_mesh(make_mesh(fsdp=2, expert=4)):
        ep = fn(params)
    chex.assert_trees_all_close(one, ep, atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(ep[0][1][:2, :, 1:], replay[:2, :, 1:])  # replayed as given
    assert float(jnp.linalg.norm(ep[1]["moe"]["gate"])) > 0


def test_mosaic_backend_skips_unused_tiles_only_under_expert_parallelism(monkeypatch):
    # A device's buffer is sized for the worst case: inside expert parallelism the Mosaic
    # forward/dx kernels skip its unused tiles (measured on 2 H200s: 267.5 ms against 292.3
    # computing them); outside, the shipped config is unchanged.
    from osworld_jax.model.kernels import grouped_matmul

    seen = []

    def spy(x, experts, weights, gate, up, down, *, config):
        seen.append(config.mosaic.skip_unused_tiles)
        return dense_experts(x, experts, weights, gate, up, down)

    monkeypatch.setattr(grouped_matmul, "gmm_experts", spy)
    mosaic = EXPERT_BACKENDS.get("pallas_gmm_mosaic")
    (x, weights, gate, up, down), experts = _inputs(), _routes("no_expert_0")
    mosaic(x, experts, weights, gate, up, down)
    with jax.set_mesh(make_mesh(expert=2)):
        jax.jit(lambda *a: expert_parallel(mosaic, *a))(x, experts, weights, gate, up, down)
    assert seen == [False, True]
