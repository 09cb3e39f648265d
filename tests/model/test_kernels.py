"""Pallas grouped-matmul kernels (interpret mode on CPU) equal the dense reference in float32."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osworld_jax.model import ModelRuntimeConfig, make_mesh
from osworld_jax.model.kernels import GmmConfig, gmm, gmm_experts, tile_plan
from osworld_jax.model.kernels.attention import padded_causal_attention
from osworld_jax.model.layers import attention, segment_mask
from osworld_jax.model.moe import EXPERT_BACKENDS, dense_experts

# Small tiles so that several row tiles, N tiles, K steps and dw row steps all occur.
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
T, K, E, H, I = 20, 3, 6, 32, 16  # noqa: E741


def _routes(key, t=T, k=K, e=E):
    keys = jax.random.split(key, t)
    return jax.vmap(lambda kk: jax.random.permutation(kk, e)[:k])(keys).astype(jnp.int32)


def _inputs(seed=0):
    ks = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(ks[0], (T, H))
    experts = _routes(ks[1])
    experts = experts.at[:, 0].set(jnp.where(experts[:, 0] == 5, 0, experts[:, 0]))
    experts = jnp.where(experts == 5, 0, experts)  # expert 5 empty: its dw must be 0
    experts = jnp.sort(experts, axis=-1)  # distinct per row still
    weights = jax.nn.softmax(jax.random.normal(ks[2], (T, K)))
    gate = jax.random.normal(ks[3], (E, H, I)) / 6
    up = jax.random.normal(ks[4], (E, H, I)) / 6
    down = jax.random.normal(ks[5], (E, I, H)) / 4
    return x, experts, weights, gate, up, down


def test_tile_plan_is_an_aligned_expert_sort():
    experts = np.asarray(_routes(jax.random.key(1)))
    plan = jax.jit(tile_plan, static_argnums=(1, 2))(jnp.asarray(experts), E, 8)
    plan = jax.tree.map(np.asarray, plan)
    flat = experts.reshape(-1)
    n = flat.size
    assert len(set(plan.dest.tolist())) == n  # injective
    np.testing.assert_array_equal(plan.row_slot[plan.dest], np.arange(n))
    assert (plan.row_slot == n).sum() == plan.row_slot.size - n  # the rest is padding
    sizes = np.bincount(flat, minlength=E)
    np.testing.assert_array_equal(plan.group_tiles, -(-sizes // 8))
    for e in range(E):  # every slot of expert e sits in e's tiles, in token order
        rows = plan.dest[flat == e]
        assert np.all(plan.tile_expert[rows // 8] == e)
        assert np.all(np.diff(rows) == 1)
        assert rows.size == 0 or rows[0] == plan.group_start[e] * 8
    used = plan.group_tiles.sum()
    assert np.all(plan.tile_expert[used:] == -1)


def test_gmm_and_its_vjp_equal_per_row_matmuls():
    x, experts, _, gate, _, _ = _inputs()
    plan = tile_plan(experts, E, CFG.align)
    xs = jnp.concatenate([x, jnp.zeros((1, H))])[plan.row_slot // K]  # padding rows zero
    row_e = jnp.maximum(plan.tile_expert, 0)[jnp.arange(xs.shape[0]) // CFG.align]
    groups = (plan.tile_expert, plan.group_start, plan.group_tiles)

    def ref(xs, w):  # each row times its tile's expert; padding rows are zero anyway
        return jnp.einsum("rh,rhi->ri", xs, w[row_e], precision="highest")

    def ours(xs, w):
        return gmm(xs, w, *groups, CFG)

    @jax.jit
    def both(xs, w, dy):
        (y, pull), (y_ref, pull_ref) = jax.vjp(ours, xs, w), jax.vjp(ref, xs, w)
        return y, y_ref, pull(dy), pull_ref(dy)

    dy = jax.random.normal(jax.random.key(3), (xs.shape[0], I))
    y, y_ref, (dxs, dw), (dxs_ref, dw_ref) = both(xs, gate, dy)
    chex.assert_trees_all_close(y, y_ref, atol=1e-5, rtol=1e-5)
    real = plan.row_slot < x.shape[0] * K  # dx on padding rows is unused
    chex.assert_trees_all_close(dxs[real], dxs_ref[real], atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(dw, dw_ref, atol=1e-5, rtol=1e-5)
    assert float(jnp.abs(dw[5]).max()) == 0.0  # the empty expert


def test_gmm_experts_equals_dense_reference_with_gradients():
    x, experts, weights, gate, up, down = _inputs(seed=2)

    def loss(fn):
        def f(x, weights, gate, up, down):
            y = fn(x, experts, weights, gate, up, down)
            return jnp.sum(jnp.sin(y)), y

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4), has_aux=True))

    (_, y), grads = loss(lambda *a: gmm_experts(*a, config=CFG))(x, weights, gate, up, down)
    (_, y_ref), grads_ref = loss(dense_experts)(x, weights, gate, up, down)
    chex.assert_trees_all_close(y, y_ref, atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(grads, grads_ref, atol=2e-5, rtol=2e-5)


def test_pallas_backends_are_registered():
    for name in ("pallas_gmm", "pallas_gmm_mosaic"):
        assert name in EXPERT_BACKENDS.names()
        ModelRuntimeConfig(expert_backend=name)


def test_gmm_experts_under_a_mesh_is_sharded_and_equal():
    x, experts, weights, gate, up, down = _inputs(seed=4)
    mesh = make_mesh(data=2, fsdp=2, devices=jax.devices()[:4])

    def loss(fn):
        def f(x, gate, up, down):
            return jnp.sum(jnp.sin(fn(x, experts, weights, gate, up, down)))

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))

    ref = loss(dense_experts)(x, gate, up, down)
    with jax.set_mesh(mesh):
        got = loss(lambda *a: gmm_experts(*a, config=CFG))(x, gate, up, down)
    chex.assert_trees_all_close(got, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("lengths", [(12, 12), (12, 7)])
def test_padded_causal_attention_equals_masked_attention_on_real_tokens(lengths):
    b, s, n, kv, d = 2, 12, 4, 2, 8
    ks = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(ks[0], (b, s, n, d))
    k = jax.random.normal(ks[1], (b, s, kv, d))
    v = jax.random.normal(ks[2], (b, s, kv, d))
    seg = (jnp.arange(s)[None] < jnp.asarray(lengths)[:, None]).astype(jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    mask = segment_mask(seg, pos)
    out, ref = jax.jit(
        lambda q, k, v, m: (
            padded_causal_attention(q, k, v, m, implementation="xla"),
            attention(q, k, v, m),
        )
    )(q, k, v, mask)
    real = seg.astype(bool)
    chex.assert_trees_all_close(out[real], ref[real], atol=1e-5, rtol=1e-5)
    chex.assert_tree_all_finite(out)


def test_attention_switch_keeps_real_token_logits():
    import dataclasses

    from osworld_jax.model import forward
    from tests.model.conftest import TINY_CFG, TINY_RT, tiny_policy

    params = tiny_policy().params()
    ids = jax.random.randint(jax.random.key(6), (2, 10), 0, TINY_CFG.vocab_size)
    seg = (jnp.arange(10)[None] < jnp.asarray([[10], [6]])).astype(jnp.int32)
    run = jax.jit(
        lambda params, rt: forward(params, TINY_CFG, rt, ids, segment_ids=seg).logits,
        static_argnums=1,
    )
    ref = run(params, TINY_RT)
    got = run(params, dataclasses.replace(TINY_RT, attention="cudnn"))
    real = seg.astype(bool)
    chex.assert_trees_all_close(got[real], ref[real], atol=1e-5, rtol=1e-5)


def test_swiglu_custom_vjp_equals_autodiff_and_keeps_input_dtype_residuals():
    from osworld_jax.model.kernels.grouped_matmul import swiglu

    ks = jax.random.split(jax.random.key(9), 3)
    g, u, dh = (jax.random.normal(k, (40, 24)) * 3 for k in ks)
    plain = lambda g, u: jax.nn.silu(g) * u  # noqa: E731
    got, pull = jax.vjp(swiglu, g, u)
    ref, pull_ref = jax.vjp(plain, g, u)
    chex.assert_trees_all_close(got, ref, atol=1e-6, rtol=1e-6)
    chex.assert_trees_all_close(pull(dh), pull_ref(dh), atol=1e-5, rtol=1e-5)
    # bf16 in, bf16 residuals: the linearized function holds no float32 [40, 24] array.
    gb, ub = g.astype(jnp.bfloat16), u.astype(jnp.bfloat16)
    _, lin = jax.linearize(swiglu, gb, ub)
    consts = [x for x in jax.tree.leaves(lin) if hasattr(x, "shape") and x.shape == (40, 24)]
    assert consts and all(x.dtype == jnp.bfloat16 for x in consts)


def test_rms_norm_custom_vjp_equals_autodiff_of_the_formula():
    from osworld_jax.model.layers import rms_norm

    ks = jax.random.split(jax.random.key(10), 3)
    x = jax.random.normal(ks[0], (3, 5, 4, 16)) * 2
    w = 1 + jax.random.normal(ks[1], (16,)) / 3
    dy = jax.random.normal(ks[2], x.shape)

    def plain(x, w):
        return w * x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)

    got, pull = jax.vjp(lambda x, w: rms_norm(x, w, 1e-6), x, w)
    ref, pull_ref = jax.vjp(plain, x, w)
    chex.assert_trees_all_close(got, ref, atol=1e-6, rtol=1e-6)
    chex.assert_trees_all_close(pull(dy), pull_ref(dy), atol=1e-5, rtol=1e-5)


def test_twin_forward_kernel_returns_the_product_twice():
    """The residual-only copy of `_expert_mlp` (Triton kernel, interpret mode)."""
    from osworld_jax.model.kernels import grouped_matmul as G

    x, experts, _, gate, _, _ = _inputs(seed=5)
    plan = tile_plan(experts, E, CFG.align)
    xs = jnp.concatenate([x, jnp.zeros((1, H))])[plan.row_slot // K]
    one = G._mm(xs, gate, plan.tile_expert, CFG, trans_rhs=False)
    a, b = G._mm(xs, gate, plan.tile_expert, CFG, trans_rhs=False, twin=True)
    assert jnp.array_equal(a, one) and jnp.array_equal(b, one)


@pytest.mark.slow  # the Mosaic GPU interpreter runs its warpgroups as threads: ~15-45 s on CPU
def test_mosaic_twin_forward_kernel_in_the_gpu_interpreter():
    from osworld_jax.model.kernels import grouped_matmul_mgpu as M

    # bf16, tiles the interpreter can run (2 row tiles of 64, one 128-wide N tile).
    mp, kd, n, e, align = 128, 64, 128, 3, 64
    cfg = M.MosaicConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2)
    ks = jax.random.split(jax.random.key(6), 2)
    xb = jax.random.normal(ks[0], (mp, kd), jnp.bfloat16)
    wb = jax.random.normal(ks[1], (e, kd, n), jnp.bfloat16)
    te = jnp.array([2, -1], jnp.int32)  # second tile unused: computed with expert 0
    y, y2 = M.mm_nn(xb, wb, te, align, cfg, twin=True, interpret=True)
    rows_w = wb[jnp.maximum(te, 0)[jnp.arange(mp) // align]].astype(jnp.float32)
    ref = jnp.einsum("rk,rkn->rn", xb.astype(jnp.float32), rows_w, precision="highest")
    assert jnp.array_equal(y, y2)
    err = jnp.linalg.norm(y.astype(jnp.float32) - ref) / jnp.linalg.norm(ref)
    assert float(err) < 4e-3, float(err)  # bf16 output rounding


@pytest.mark.slow  # the Mosaic GPU interpreter: ~15-45 s on CPU
def test_mosaic_forward_kernel_can_skip_unused_tiles_in_the_gpu_interpreter():
    # skip_unused_tiles (expert parallelism): the used tiles are the same product; the unused
    # tile (-1) is neither computed nor read from expert -1.
    from osworld_jax.model.kernels import grouped_matmul_mgpu as M

    mp, kd, n, e, align = 128, 64, 128, 3, 64
    cfg = M.MosaicConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2)
    ks = jax.random.split(jax.random.key(7), 2)
    xb = jax.random.normal(ks[0], (mp, kd), jnp.bfloat16)
    wb = jax.random.normal(ks[1], (e, kd, n), jnp.bfloat16)
    te = jnp.array([1, -1], jnp.int32)
    full = M.mm_nn(xb, wb, te, align, cfg, interpret=True)
    skipping = dataclasses.replace(cfg, skip_unused_tiles=True)
    skip = M.mm_nn(xb, wb, te, align, skipping, interpret=True)
    assert jnp.array_equal(skip[:align], full[:align])
