"""Parity with transformers' Qwen3VLMoeForConditionalGeneration (float32, random weights).

The reference: a tiny random HF model (3 LM layers, 8 experts top-2, 3 ViT blocks with DeepStack
after blocks 0 and 2; non-trivial norms and biases), loaded into our policy from the
checkpoint HF itself saved. Images of different sizes and aspect ratios go through our
`ImageProcessor`; HF and we get the same pixel values and grids.
"""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from osworld_jax.model import load_hf_checkpoint, mrope_positions
from tests.model.conftest import jforward, rel_err
from tests.model.vl_helpers import IMG, PROCESSOR, build_hf_vl_model, hf_logits, images, prompt


@pytest.fixture(scope="module")
def hf_vl(tmp_path_factory):
    """(torch model, our float32 policy) of the tiny HF Qwen3-VL-MoE."""
    path = tmp_path_factory.mktemp("hf_vl")
    model = build_hf_vl_model(path)
    return model, load_hf_checkpoint(path, dtype=jnp.float32)


def _topk(router_logits: np.ndarray, k: int) -> np.ndarray:
    return np.sort(np.argsort(-router_logits, axis=-1, kind="stable")[:, :k], axis=-1)


def _check(model, policy, ids, pixel_values=None, grid=None):
    """Our logits / routes / aux against HF's on the same inputs; returns our output."""
    ref, ref_router = hf_logits(model, ids, pixel_values, grid)
    kw = {}
    if pixel_values is not None:
        positions = mrope_positions(ids, grid, policy.config)
        kw = dict(
            positions=jnp.asarray(positions),
            pixel_values=jnp.asarray(pixel_values),
            image_grid_thw=jnp.asarray(grid),
        )
    out = jforward(policy, jnp.asarray(ids), **kw)
    err = rel_err(out.logits, ref)
    print(f"Qwen3-VL parity: {ids.shape}, {0 if grid is None else len(grid)} images: {err:.2e}")
    assert err <= 1e-4
    cfg = policy.config
    routed = np.asarray(out.routed_experts)  # [B, S, L, K]
    for m, layer in enumerate(cfg.moe_layers):  # router top-k equal on every (token, layer)
        ours = np.sort(routed[:, :, layer].reshape(-1, cfg.num_experts_per_tok), axis=-1)
        np.testing.assert_array_equal(ours, _topk(ref_router[m], cfg.num_experts_per_tok))
    for layer in cfg.dense_layers:
        assert (routed[:, :, layer] == -1).all()
    return out


def test_one_and_two_images_in_a_batch(hf_vl):
    model, policy = hf_vl
    pixel_values, grid = PROCESSOR(images(0, [(20, 36), (40, 17), (9, 9)]))
    assert grid.tolist() == [[1, 4, 8], [1, 10, 4], [1, 2, 2]]  # wide, tall, square
    rng = np.random.RandomState(0)
    a, b = prompt(rng, grid[:1]), prompt(rng, grid[1:])
    a += list(rng.randint(0, 100, len(b) - len(a)))
    ids = np.array([a, b], np.int32)
    out = _check(model, policy, ids, pixel_values, grid)
    assert (np.asarray(out.routed_experts)[ids == IMG][:, policy.config.moe_layers] >= 0).all()


def test_three_images_of_different_shapes(hf_vl):
    model, policy = hf_vl
    pixel_values, grid = PROCESSOR(images(1, [(48, 10), (16, 40), (33, 33)]))
    ids = np.array([prompt(np.random.RandomState(1), grid)], np.int32)
    _check(model, policy, ids, pixel_values, grid)


def test_text_only_prompts(hf_vl):
    model, policy = hf_vl
    ids = np.random.RandomState(2).randint(0, 120, (2, 19)).astype(np.int32)
    out = _check(model, policy, ids)
    # No pixels: HF's load-balancing loss (no mask) equals ours with every token valid.
    import torch

    with torch.no_grad():
        aux = float(model(input_ids=torch.as_tensor(ids), output_router_logits=True).aux_loss)
    np.testing.assert_allclose(float(out.aux["load_balancing_loss"]), aux, rtol=1e-5)


@pytest.mark.slow  # the eager (unjitted) call: ~20-40 s of op-by-op dispatch on CPU
def test_policy_call_computes_mrope_positions_like_hf(hf_vl):
    """Without positions the call derives them from the ids and grids (HF's behaviour)."""
    model, policy = hf_vl
    pixel_values, grid = PROCESSOR(images(3, [(24, 24)]))
    ids = np.array([prompt(np.random.RandomState(3), grid)], np.int32)
    ref, _ = hf_logits(model, ids, pixel_values, grid)
    out = policy(jnp.asarray(ids), pixel_values=jnp.asarray(pixel_values), image_grid_thw=grid)
    assert rel_err(out.logits, ref) <= 1e-4


def test_packed_conversations_equal_each_alone(hf_vl):
    """Two conversations with images in one row (segment ids) == each in its own row."""
    _, policy = hf_vl
    pv_a, grid_a = PROCESSOR(images(4, [(20, 36)]))
    pv_b, grid_b = PROCESSOR(images(5, [(40, 17), (16, 16)]))
    rng = np.random.RandomState(4)
    a, b = prompt(rng, grid_a), prompt(rng, grid_b)
    cfg = policy.config
    grid = np.concatenate([grid_a, grid_b])
    kw = dict(pixel_values=jnp.asarray(np.concatenate([pv_a, pv_b])), image_grid_thw=grid)

    def run(ids, seg):
        pos = mrope_positions(ids, grid, cfg, segment_ids=seg)
        return jforward(
            policy,
            jnp.asarray(ids),
            positions=jnp.asarray(pos),
            segment_ids=jnp.asarray(seg),
            **kw,
        )

    ids = np.array([a + b + [0, 0, 0]], np.int32)
    seg = np.array([[1] * len(a) + [2] * len(b) + [0, 0, 0]], np.int32)
    packed = run(ids, seg)
    n = len(a) + len(b) + 3  # alone: row 0 = a, row 1 = b, each followed by padding
    alone_ids = np.array([a + [0] * (n - len(a)), b + [0] * (n - len(b))], np.int32)
    alone_seg = np.array([[1] * len(a) + [0] * (n - len(a)), [1] * len(b) + [0] * (n - len(b))])
    alone = run(alone_ids, alone_seg.astype(np.int32))
    for row, (lo, hi) in enumerate(((0, len(a)), (len(a), len(a) + len(b)))):
        one = alone.logits[row, : hi - lo]
        chex.assert_trees_all_close(packed.logits[0, lo:hi], one, rtol=1e-5, atol=1e-5)
        routes = alone.routed_experts[row, : hi - lo]
        np.testing.assert_array_equal(packed.routed_experts[0, lo:hi], routes)


def test_per_row_pixel_layout_equals_the_flat_layout(hf_vl):
    """[B, Np, P] pixels (row b's images, padding patches after them) == HF's flat layout."""
    _, policy = hf_vl
    pixel_values, grid = PROCESSOR(images(6, [(20, 36), (40, 17), (9, 9)]))
    rng = np.random.RandomState(6)
    a, b = prompt(rng, grid[:1]), prompt(rng, grid[1:])
    a += list(rng.randint(0, 100, len(b) - len(a)))
    ids = np.array([a, b], np.int32)
    pos = jnp.asarray(mrope_positions(ids, grid, policy.config))
    flat = jforward(
        policy,
        jnp.asarray(ids),
        positions=pos,
        pixel_values=jnp.asarray(pixel_values),
        image_grid_thw=jnp.asarray(grid),
    )
    n0 = int(grid[0].prod())
    np_rows = 64  # >= the 44 patches of row 1, a multiple of merge^2; the rest is padding
    rows = np.full((2, np_rows, pixel_values.shape[1]), 7.0, np.float32)  # padding: any values
    rows[0, :n0], rows[1, : len(pixel_values) - n0] = pixel_values[:n0], pixel_values[n0:]
    grids = np.zeros((2, 2, 3), np.int32)  # unused slot: t = 0
    grids[0, 0], grids[1] = grid[0], grid[1:]
    per_row = jforward(
        policy,
        jnp.asarray(ids),
        positions=pos,
        pixel_values=jnp.asarray(rows),
        image_grid_thw=jnp.asarray(grids),
    )
    chex.assert_trees_all_close(per_row.logits, flat.logits, rtol=1e-5, atol=1e-5)


def test_three_equal_position_rows_are_bitwise_the_1d_rope(hf_vl):
    """Text-only M-RoPE (three equal rows) is exactly today's 1-D rope, packed rows included."""
    _, policy = hf_vl
    rng = np.random.RandomState(7)
    ids = rng.randint(0, 120, (2, 16)).astype(np.int32)
    seg = np.ones((2, 16), np.int32)
    seg[0, 9:] = 2
    seg[1, 13:] = 0
    pos = np.tile(np.arange(16), (2, 1)).astype(np.int32)
    pos[0, 9:] -= 9
    one = jforward(
        policy, jnp.asarray(ids), positions=jnp.asarray(pos), segment_ids=jnp.asarray(seg)
    )
    three = jforward(
        policy,
        jnp.asarray(ids),
        positions=jnp.asarray(np.stack([pos] * 3)),
        segment_ids=jnp.asarray(seg),
    )
    np.testing.assert_array_equal(three.logits, one.logits)
    np.testing.assert_array_equal(three.routed_experts, one.routed_experts)


def test_pixels_reach_only_later_tokens(hf_vl):
    """Changing image 2's pixels changes logits from its first token on, never before."""
    _, policy = hf_vl
    pixel_values, grid = PROCESSOR(images(8, [(20, 36), (16, 16)]))
    ids = np.array([prompt(np.random.RandomState(8), grid)], np.int32)
    pos = jnp.asarray(mrope_positions(ids, grid, policy.config))
    n0 = int(grid[0].prod())
    other = pixel_values.copy()
    other[n0:] = -other[n0:]

    def run(pv):
        return jforward(
            policy,
            jnp.asarray(ids),
            positions=pos,
            pixel_values=jnp.asarray(pv),
            image_grid_thw=jnp.asarray(grid),
        ).logits[0]

    a, b = run(pixel_values), run(other)
    first = int(np.flatnonzero(ids[0] == IMG)[n0 // 4])  # image 2's first token
    np.testing.assert_array_equal(a[:first], b[:first])
    assert float(jnp.abs(a[first:] - b[first:]).max()) > 1e-3


def test_router_replay_on_image_prompts(hf_vl):
    """R3: every token, image tokens included, has routes; replaying them is the same model."""
    _, policy = hf_vl
    pixel_values, grid = PROCESSOR(images(9, [(20, 36)]))
    ids = np.array([prompt(np.random.RandomState(9), grid)], np.int32)
    kw = dict(
        positions=jnp.asarray(mrope_positions(ids, grid, policy.config)),
        pixel_values=jnp.asarray(pixel_values),
        image_grid_thw=jnp.asarray(grid),
    )
    live = jforward(policy, jnp.asarray(ids), **kw)
    routes = np.asarray(live.routed_experts)
    replayed = jforward(policy, jnp.asarray(ids), replay_experts=jnp.asarray(routes), **kw)
    np.testing.assert_array_equal(replayed.logits, live.logits)
    # Other routes at the image tokens only: those are used, the text before stays live.
    moe = list(policy.config.moe_layers)
    shifted = np.full_like(routes, -1)
    image = ids[0] == IMG
    e = policy.config.num_experts
    shifted[0][np.ix_(image, moe)] = (routes[0][np.ix_(image, moe)] + 1) % e
    out = jforward(policy, jnp.asarray(ids), replay_experts=jnp.asarray(shifted), **kw)
    got = np.asarray(out.routed_experts)
    np.testing.assert_array_equal(got[0][np.ix_(image, moe)], shifted[0][np.ix_(image, moe)])
    first = int(np.flatnonzero(image)[0])
    np.testing.assert_array_equal(out.logits[0, :first], live.logits[0, :first])
    assert not np.allclose(out.logits[0, first:], live.logits[0, first:])


def test_kv_cache_prefill_and_decode_with_mrope(hf_vl):
    """The server's path: prefill an image prompt into a cache, decode the next token."""
    from osworld_jax.model import init_kv_cache

    _, policy = hf_vl
    cfg = policy.config
    pixel_values, grid = PROCESSOR(images(10, [(20, 36)]))
    ids = prompt(np.random.RandomState(10), grid)
    s = len(ids)
    full = np.array([ids + [17]], np.int32)
    pos = mrope_positions(full, grid, cfg)  # the decoded token continues at max + 1
    assert (pos[:, 0, s] == pos[:, 0, :s].max() + 1).all()
    vis = dict(pixel_values=jnp.asarray(pixel_values), image_grid_thw=jnp.asarray(grid))
    ref = jforward(policy, jnp.asarray(full), positions=jnp.asarray(pos), **vis).logits
    cache = init_kv_cache(cfg, 1, 64, jnp.float32)
    pre = jforward(
        policy,
        jnp.asarray(full[:, :s]),
        positions=jnp.asarray(pos[:, :, :s]),
        cache_positions=jnp.arange(s, dtype=jnp.int32)[None],
        kv_cache=cache,
        **vis,
    )
    chex.assert_trees_all_close(pre.logits, ref[:, :s], rtol=1e-5, atol=1e-5)
    dec = jforward(
        policy,
        jnp.asarray(full[:, s:]),
        positions=jnp.asarray(pos[:, :, s:]),
        cache_positions=jnp.asarray([[s]], jnp.int32),
        kv_cache=pre.kv_cache,
    )
    chex.assert_trees_all_close(dec.logits[:, 0], ref[:, s], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="cache_positions"):
        jforward(
            policy, jnp.asarray(full[:, s:]), positions=jnp.asarray(pos[:, :, s:]), kv_cache=cache
        )


def test_scanned_and_rematerialised_layers_compute_the_same(hf_vl):
    """scan_layers + remat (LM layers and ViT blocks, split at the DeepStack taps) == unrolled."""
    import dataclasses

    _, policy = hf_vl
    pixel_values, grid = PROCESSOR(images(11, [(20, 36), (16, 16)]))
    ids = np.array([prompt(np.random.RandomState(11), grid)], np.int32)
    kw = dict(
        positions=jnp.asarray(mrope_positions(ids, grid, policy.config)),
        pixel_values=jnp.asarray(pixel_values),
        image_grid_thw=jnp.asarray(grid),
    )
    base = jforward(policy, jnp.asarray(ids), **kw)
    runtime = dataclasses.replace(policy.runtime, scan_layers=True, remat="full")
    scanned = jforward(
        policy.params(), jnp.asarray(ids), config=policy.config, runtime=runtime, **kw
    )
    chex.assert_trees_all_close(scanned.logits, base.logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(scanned.routed_experts, base.routed_experts)
