"""The vision tower's pieces: patch layout == transformers' vision_utils; images stay apart."""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from osworld_jax.model import Policy, vision
from osworld_jax.model.vision import patch_layout, segment_attention, vision_tower
from tests.model.conftest import TINY_RT
from tests.model.vl_helpers import PROCESSOR, images, ours_config

# Wide, tall, square, a 2-frame clip, and a 1-block image; the 4x4 table is resampled to each.
GRIDS = np.array([[1, 4, 8], [1, 10, 4], [1, 2, 2], [2, 4, 4], [1, 2, 2]])


def test_patch_layout_equals_transformers_vision_utils():
    import torch
    from transformers.vision_utils import (
        get_vision_interpolation_indices_and_weights,
        get_vision_position_ids,
    )

    v = ours_config().vision
    total = int(GRIDS.prod(-1).sum())
    n = total + 8  # 8 padding patches
    layout = jax.jit(patch_layout, static_argnums=(1, 2))(jnp.asarray(GRIDS), n, v)
    grid = torch.as_tensor(GRIDS)
    pos = get_vision_position_ids(grid, v.spatial_merge_size).numpy()  # [total, 2] (h, w)
    np.testing.assert_array_equal(layout.row[:total], pos[:, 0])
    np.testing.assert_array_equal(layout.col[:total], pos[:, 1])
    taps, weights = get_vision_interpolation_indices_and_weights(
        grid, v.grid_side, mode="bilinear", align_corners=True, spatial_merge_size=2
    )
    np.testing.assert_array_equal(layout.taps[:total], taps.numpy())
    np.testing.assert_array_equal(layout.weights[:total], weights.numpy())
    assert (np.asarray(layout.weights[total:]) == 0).all()
    # One attention segment per image frame (HF's cu_seqlens); padding patches are alone.
    frames = np.repeat(np.arange(6), [32, 40, 4, 16, 16, 4])
    np.testing.assert_array_equal(layout.segment[:total], frames)
    assert len(set(np.asarray(layout.segment[total:]).tolist()) | set(frames.tolist())) == 6 + 8


def test_segment_attention_equals_each_segment_alone():
    rng = np.random.RandomState(0)
    lengths = [5, 12, 3]
    q, k, v = (jnp.asarray(rng.normal(size=(20, 2, 8)), jnp.float32) for _ in range(3))
    seg = jnp.asarray(np.repeat([0, 1, 2], lengths))
    packed = segment_attention(q, k, v, seg)
    start = 0
    for n in lengths:
        sl = slice(start, start + n)
        alone = segment_attention(q[sl], k[sl], v[sl], jnp.zeros(n, jnp.int32))
        chex.assert_trees_all_close(packed[sl], alone, rtol=1e-6, atol=1e-6)
        start += n
    for chunk in (1, 7, 64):  # query blocks: the same values, fewer live scores
        chex.assert_trees_all_close(segment_attention(q, k, v, seg, chunk), packed, atol=1e-6)


@functools.cache
def _params():
    cfg = dataclasses.replace(ours_config(), initializer_range=0.1)
    return cfg, Policy(cfg, TINY_RT, rngs=nnx.Rngs(0)).params()


def test_tower_on_packed_images_equals_each_image_alone():
    """No padding to the largest image: images of different sizes packed in one sequence."""
    cfg, params = _params()
    pixel_values, grid = PROCESSOR(images(0, [(20, 36), (40, 17), (9, 9)]))
    tower = jax.jit(functools.partial(vision_tower, params, cfg.vision, TINY_RT))
    packed = tower(jnp.asarray(pixel_values), jnp.asarray(grid))
    ends = np.cumsum(grid.prod(-1))
    starts = ends - grid.prod(-1)
    for i, (s, e) in enumerate(zip(starts, ends, strict=True)):
        alone = tower(jnp.asarray(pixel_values[s:e]), jnp.asarray(grid[i : i + 1]))
        rows = slice(s // 4, e // 4)
        chex.assert_trees_all_close(packed.embeds[rows], alone.embeds, rtol=1e-5, atol=1e-6)
        chex.assert_trees_all_close(
            packed.deepstack[:, rows], alone.deepstack, rtol=1e-5, atol=1e-6
        )
    assert packed.deepstack.shape == (2, len(pixel_values) // 4, cfg.hidden_size)
    # Trailing padding patches change nothing before them.
    padded = np.concatenate([pixel_values, np.full((8, pixel_values.shape[1]), 3.0, np.float32)])
    more = tower(jnp.asarray(padded), jnp.asarray(grid))
    chex.assert_trees_all_close(more.embeds[: len(pixel_values) // 4], packed.embeds, atol=1e-6)


def test_vision_tower_can_be_frozen_and_is_not_weight_decayed():
    import optax

    from osworld_jax.model import param_labels, router_param_labels
    from osworld_jax.model.params import decay_mask

    cfg, params = _params()
    labels = param_labels(params, freeze_vision=True)
    frozen = {g for g, names in labels.items() for v in names.values() if v == "frozen"}
    assert frozen == {"vision", "vision_blocks", "deepstack"}
    both = param_labels(params, freeze_router=True, freeze_vision=True)
    assert both["moe"]["router"] == "frozen" and both["moe"]["gate"] == "trainable"
    assert router_param_labels(params, freeze_router=False)["vision"]["pos_embed"] == "trainable"
    tx = optax.multi_transform({"trainable": optax.sgd(0.1), "frozen": optax.set_to_zero()}, labels)
    grads = jax.tree.map(jnp.ones_like, params)
    new = optax.apply_updates(params, tx.update(grads, tx.init(params), params)[0])
    chex.assert_trees_all_equal(new["vision_blocks"], params["vision_blocks"])
    assert not np.allclose(new["attn"]["q_proj"], params["attn"]["q_proj"])
    # Stacked norm scales and biases are vectors: no weight decay, whatever their ndim.
    mask = decay_mask(cfg)
    assert mask["vision_blocks"]["qkv"] and mask["vision"]["pos_embed"] and mask["top"]["embed"]
    assert not mask["vision_blocks"]["norm1"] and not mask["vision_blocks"]["qkv_bias"]
    assert not mask["deepstack"]["norm_bias"] and not mask["attn"]["input_norm"]


# Images only (t <= 1: what `ImageProcessor` makes), the shapes cuDNN's packed layout takes.
IMAGE_GRIDS = np.array([[1, 4, 8], [0, 0, 0], [1, 10, 4], [1, 2, 2]])


def test_frame_spans_partition_the_patches_like_patch_layout():
    v = ours_config().vision
    total = int(IMAGE_GRIDS.prod(-1).sum())
    for n in (total, total + 8):  # without and with trailing padding patches
        spans = vision.frame_spans(jnp.asarray(IMAGE_GRIDS), n)
        # 32 + 40 + 4 patches; the t = 0 row and an empty padding span are skipped (-1).
        pad = [total, -1] if n > total else [-1, -1]
        np.testing.assert_array_equal(spans.offsets, [0, -1, 32, 72, *pad])
        np.testing.assert_array_equal(spans.lengths, [32, -1, 40, 4, n - total or -1])
        seg = np.asarray(vision.spans_segment(spans, n))
        layout = np.asarray(patch_layout(jnp.asarray(IMAGE_GRIDS), n, v).segment)
        # The same partition of the images' patches (ids differ: spans count grid rows).
        pairs = set(zip(seg[:total].tolist(), layout[:total].tolist(), strict=True))
        assert len(pairs) == len(set(seg[:total].tolist())) == 3
        assert (seg[total:] == 4).all()  # the padding patches: one segment of their own


def test_packed_attention_equals_segment_attention_per_image():
    rng = np.random.RandomState(1)
    total = int(IMAGE_GRIDS.prod(-1).sum())
    n = total + 4
    q, k, v = (jnp.asarray(rng.normal(size=(2, n, 2, 8)), jnp.float32) for _ in range(3))
    spans = jax.vmap(vision.frame_spans, in_axes=(0, None))(jnp.asarray([IMAGE_GRIDS] * 2), n)
    packed = vision.packed_attention(q, k, v, spans, implementation="xla")
    for g in range(2):
        start = 0
        for size in IMAGE_GRIDS.prod(-1):
            sl = slice(start, start + size)
            alone = segment_attention(q[g, sl], k[g, sl], v[g, sl], jnp.zeros(size, jnp.int32))
            chex.assert_trees_all_close(packed[g, sl], alone, rtol=1e-6, atol=1e-6)
            start += size


def test_tower_with_the_packed_path_equals_the_xla_path(monkeypatch):
    """The fused wiring (spans per row, the single-frame switch) on the CPU: cuDNN's packed
    kernel stood in for by the same spans through XLA (its GPU values: benchmarks/NOTES.md)."""  # noqa: D205, D209
    cfg, params = _params()
    pixel_values, grid = PROCESSOR(images(2, [(20, 36), (40, 17)]))
    rows = np.stack([pixel_values, pixel_values[::-1]])  # [G=2, N, P]
    grids = np.stack([grid, grid[::-1]]).astype(np.int32)  # row 1: the images swapped

    def tower():  # a fresh jit each time: the patched functions are read when tracing
        return jax.jit(functools.partial(vision_tower, params, cfg.vision, TINY_RT))

    plain = tower()(jnp.asarray(rows), jnp.asarray(grids))
    calls, real = [], vision.packed_attention

    def stand_in(q, k, v, spans, *, implementation):
        calls.append(implementation)
        return real(q, k, v, spans, implementation="xla")

    monkeypatch.setattr(vision, "fused_vision_attention", lambda runtime: True)
    monkeypatch.setattr(vision, "packed_attention", stand_in)
    fused = tower()(jnp.asarray(rows), jnp.asarray(grids))
    assert calls and set(calls) == {"cudnn"}
    chex.assert_trees_all_close(fused, plain, rtol=1e-5, atol=1e-6)
    # A multi-frame grid row takes the XLA path inside the same program (equal values).
    clip = np.concatenate([pixel_values[:64], pixel_values[:64]])
    clip_grid = np.array([[2, 4, 8]], np.int32)
    fused_clip = tower()(jnp.asarray(clip), jnp.asarray(clip_grid))
    monkeypatch.undo()
    chex.assert_trees_all_close(
        fused_clip, tower()(jnp.asarray(clip), jnp.asarray(clip_grid)), atol=1e-6
    )
    # Rows are independent: row 0 alone (flat layout) gives row 0's features.
    alone = tower()(jnp.asarray(pixel_values), jnp.asarray(grid))
    chex.assert_trees_all_close(plain.embeds[0], alone.embeds, rtol=1e-5, atol=1e-6)
