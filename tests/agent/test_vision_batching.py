"""Packing screenshots: each stored once, per-row patches from the processor, M-RoPE positions,
patch buckets."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from osworld_jax.agent import (
    AgentConfig,
    GroupSelection,
    OwnerAgent,
    OwnerRollout,
    PackingError,
    VisionPacking,
    pack_batch,
)
from osworld_jax.batch import RowImages, check_batch, host_nbytes, with_pixel_values
from osworld_jax.env.backend import Observation
from osworld_jax.model import ImageProcessor, Qwen3MoeConfig, mrope_positions
from osworld_jax.rollout import SamplingParams

from .conftest import ScriptedClient, screenshot_png

L, K = 3, 2


def owner(tok, owner_id, shots, *, max_screenshots=2, group_id=0):
    """An owner whose turns show ``shots`` (PNG sizes) -> its rollout."""
    client = ScriptedClient(tok, ["WAIT"], layers=L, top_k=K)
    agent = OwnerAgent(
        client,
        tok,
        # the sliding window (a segment per turn once full): rows that share screenshots
        AgentConfig(max_screenshots=max_screenshots, screenshots_after_compaction=None),
        owner_id=owner_id,
        group_id=group_id,
        sampling=SamplingParams(max_new_tokens=16),
    )

    async def go():
        for i, size in enumerate(shots):
            o = Observation(
                screenshot=screenshot_png(*size, seed=10 * owner_id + i),
                a11y_tree=f"<b id={i}/>",
                terminal="",
                instruction="Do it.",
            )
            await agent.act(o)

    asyncio.run(go())
    from osworld_jax.env.agent_env import OwnerResult

    return agent.to_rollout(
        OwnerResult(
            owner_index=owner_id, reward=1.0, failed=False, error=None, turns=len(shots), actions=()
        )
    )


@pytest.fixture(scope="module")
def vision(vl_model_dir):
    config = Qwen3MoeConfig.from_json(vl_model_dir / "config.json")
    return VisionPacking(processor=ImageProcessor.from_pretrained(vl_model_dir), config=config)


def test_rows_carry_their_images_and_mrope_positions(vl_tokenizer, vision):
    # Owner 0: 3 turns with K = 2 -> segments [img0, img1] and [img1, img2]; owner 1: one
    # 640x480 turn -> [img]; a failed owner -> a masked row without images. Each row's
    # pixel_values are its images' patches back to back, exactly the processor's output.
    o0 = owner(vl_tokenizer, 0, [(1920, 1080)] * 3)
    o1 = owner(vl_tokenizer, 1, [(640, 480)])
    failed = OwnerRollout(owner_id=2, group_id=0, segments=(), reward=None, failed=True)
    sel = GroupSelection.of([o0, o1, failed])
    stored = pack_batch(sel, [1.0, -1.0, 0.0], num_layers=L, top_k=K, dp_size=4, vision=vision)
    check_batch(stored)
    # img1 is in rows 0 and 1: the batch stores 4 distinct PNGs once each.
    assert stored.pixel_values is None and len(stored.images.encoded) == 4
    assert stored.images.index.tolist() == [[0, 1], [1, 2], [3, -1], [-1, -1]]
    batch = with_pixel_values(stored)
    check_batch(batch)
    rows = [o0.segments[0], o0.segments[1], o1.segments[0], None]
    # 1920x1080 -> 18 x 32 = 576 patches; 640x480 (307200 px > 384^2): beta = sqrt(307200 /
    # 147456) = 1.443, floor(480 / beta / 32) 32 = 320, floor(640 / beta / 32) 32 = 416 -> 20 x
    # 26 = 520 patches. Largest row: 2 x 576 = 1152 -> the next power of two, 2048.
    assert batch.pixel_values.shape == (4, 2048, vision.processor.patch_dim)
    assert batch.image_grid_thw.shape == (4, 2, 3)
    assert batch.image_grid_thw[:, :, 0].tolist() == [[1, 1], [1, 1], [1, 0], [0, 0]]
    for r, seg in enumerate(rows):
        if seg is None:
            assert not batch.pixel_values[r].any()
            continue
        want, grid = vision.processor(list(seg.images))
        n = want.shape[0]
        np.testing.assert_array_equal(batch.pixel_values[r, :n], want)
        assert not batch.pixel_values[r, n:].any()
        np.testing.assert_array_equal(batch.image_grid_thw[r, : len(seg.images)], grid)
    assert o1.segments[0].images and vision.processor.grid_thw(480, 640) == (1, 20, 26)
    # Positions: HF's get_rope_index per row (mrope_positions, checked against HF in
    # tests/model), text rows three equal rows.
    want = mrope_positions(
        batch.tokens, batch.image_grid_thw, vision.config, segment_ids=batch.segment_ids
    )
    np.testing.assert_array_equal(batch.positions, want)
    assert batch.positions.shape == (3, 4, batch.tokens.shape[1])
    pad = vision.config.image_token_id
    assert not batch.loss_mask[batch.tokens == pad].any()
    # Without vision the same owners pack as text rows (1-D positions, no pixels).
    text = pack_batch(sel, [1.0, -1.0, 0.0], num_layers=L, top_k=K, dp_size=4)
    assert text.pixel_values is None and text.positions.shape == batch.tokens.shape


def test_patch_buckets_and_image_slots(vl_tokenizer, vision):
    import dataclasses

    o = owner(vl_tokenizer, 0, [(1920, 1080)] * 2)
    sel = GroupSelection.of([o])
    fixed = dataclasses.replace(vision, patch_buckets=(576, 1152, 1728), image_slots=3)
    b = with_pixel_values(pack_batch(sel, [0.5], num_layers=L, top_k=K, vision=fixed))
    assert b.pixel_values.shape[1] == 1152 and b.image_grid_thw.shape[1] == 3
    # A row of image_slots images keeps m = image_slots (one train step shape), not 4.
    three = GroupSelection.of([owner(vl_tokenizer, 0, [(1920, 1080)] * 3, max_screenshots=3)])
    grid = pack_batch(three, [0.5], num_layers=L, top_k=K, vision=fixed).image_grid_thw
    assert grid.shape[1] == 3 and (grid[:, :, 0] > 0).sum(axis=1).max() == 3
    small = dataclasses.replace(vision, patch_buckets=(576,))
    assert pack_batch(sel, [0.5], num_layers=L, top_k=K, vision=small).num_patches == 2048
    with pytest.raises(PackingError, match="multiple of merge_size"):
        dataclasses.replace(vision, patch_buckets=(577,))


def test_packed_segments_restart_positions(vl_tokenizer, vision):
    # pack_segments: owner 0's two segments share one row (segment ids 1, 2); every segment's
    # positions and images equal those of the same segment packed alone.
    o = owner(vl_tokenizer, 0, [(1920, 1080)] * 3)
    sel = GroupSelection.of([o])
    alone = with_pixel_values(pack_batch(sel, [1.0], num_layers=L, top_k=K, vision=vision))
    packed = with_pixel_values(
        pack_batch(
            sel,
            [1.0],
            num_layers=L,
            top_k=K,
            vision=vision,
            pack_segments=True,
            length_buckets=[2048],
        )
    )
    assert alone.tokens.shape[0] == 2 and packed.tokens.shape[0] == 1
    n0, n1 = (s.length for s in o.segments)
    np.testing.assert_array_equal(packed.segment_ids[0, : n0 + n1], [1] * n0 + [2] * n1)
    for k, (lo, n) in enumerate([(0, n0), (n0, n1)]):
        np.testing.assert_array_equal(packed.tokens[0, lo : lo + n], alone.tokens[k, :n])
        np.testing.assert_array_equal(
            packed.positions[:, 0, lo : lo + n], alone.positions[:, k, :n]
        )
        np.testing.assert_array_equal(packed.advantages[0, lo : lo + n], alone.advantages[k, :n])
    assert packed.image_grid_thw[0, :, 0].tolist() == [1, 1, 1, 1]  # 4 images in 4 slots
    np.testing.assert_array_equal(
        packed.pixel_values[0, : 2 * 1152],
        np.concatenate([alone.pixel_values[0, :1152], alone.pixel_values[1, :1152]]),
    )
    text = pack_batch(sel, [1.0], num_layers=L, top_k=K, pack_segments=True, length_buckets=[2048])
    np.testing.assert_array_equal(text.positions[0, n0 : n0 + n1], np.arange(n1))


def test_check_batch_names_bad_image_fields(vl_tokenizer, vision):
    o = owner(vl_tokenizer, 0, [(1920, 1080)])
    stored = pack_batch(GroupSelection.of([o]), [1.0], num_layers=L, top_k=K, vision=vision)
    b = with_pixel_values(stored)
    with pytest.raises(ValueError, match="give both or neither"):
        check_batch(b._replace(image_grid_thw=None))
    with pytest.raises(ValueError, match="give both or neither"):
        check_batch(stored._replace(image_grid_thw=None))
    with pytest.raises(ValueError, match="give one form"):
        check_batch(stored._replace(pixel_values=b.pixel_values))
    with pytest.raises(ValueError, match="row 0's images need 576 patches"):
        check_batch(b._replace(pixel_values=b.pixel_values[:, :512]))
    small = RowImages(
        encoded=stored.images.encoded,
        grid_thw=stored.images.grid_thw,
        index=stored.images.index,
        num_patches=512,
        processor=stored.images.processor,
    )
    with pytest.raises(ValueError, match="row 0's images need 576 patches"):
        check_batch(stored._replace(images=small))
    with pytest.raises(ValueError, match="Batch.images.index"):
        check_batch(stored._replace(image_grid_thw=np.zeros_like(stored.image_grid_thw)))
    other = stored.image_grid_thw.copy()
    other[0, 0, 1] -= 2
    with pytest.raises(ValueError, match="Batch.images.grid_thw"):
        check_batch(stored._replace(image_grid_thw=other))
    with pytest.raises(ValueError, match="M-RoPE"):
        check_batch(b._replace(positions=b.positions[0]))


def test_a_screenshot_shown_in_three_rows_is_stored_once(vl_tokenizer, vision):
    # The sliding window of 3 (a segment per turn once full) over 5 turns: rows [i0, i1, i2],
    # [i1, i2, i3], [i2, i3, i4]: i2 is shown in all three rows. The host batch holds each of
    # the 5 PNGs once (their bytes, not float32 patches); every row's patches made from it equal
    # the former path's (each row's images through the processor, back to back), bit for bit.
    o = owner(vl_tokenizer, 0, [(320, 240)] * 5, max_screenshots=3)
    assert [len(s.images) for s in o.segments] == [3, 3, 3]
    shots = [s.images for s in o.segments]
    assert shots[0][2] == shots[1][1] == shots[2][0]  # the screenshot shown in three rows
    batch = pack_batch(GroupSelection.of([o]), [1.0], num_layers=L, top_k=K, vision=vision)
    images = batch.images
    assert batch.pixel_values is None and images.encoded == (*shots[0], shots[1][2], shots[2][2])
    assert images.index.tolist() == [[0, 1, 2, -1], [1, 2, 3, -1], [2, 3, 4, -1]]
    assert sum(png == shots[0][2] for png in images.encoded) == 1
    # Host bytes: the 5 PNGs and the index, not 9 images' float32 patches.
    patches = sum(int(np.prod(g)) for g in batch.image_grid_thw.reshape(-1, 3))
    assert images.nbytes == sum(map(len, images.encoded)) + images.index.nbytes + 5 * 3 * 4
    assert images.nbytes < patches * vision.processor.patch_dim * 4 / 20
    assert host_nbytes(batch) == sum(a.nbytes for a in batch if isinstance(a, np.ndarray)) + (
        images.nbytes
    )
    dense = with_pixel_values(batch)
    for r, seg in enumerate(o.segments):
        old = [vision.processor(png)[0] for png in seg.images]  # the former _row_vision
        want = np.zeros((batch.num_patches, vision.processor.patch_dim), np.float32)
        want[: sum(p.shape[0] for p in old)] = np.concatenate(old)
        np.testing.assert_array_equal(dense.pixel_values[r], want)
        np.testing.assert_array_equal(images.pixel_values([r])[0], want)
    # Any subset of rows (a device shard) gets the same patches as those rows of the whole.
    np.testing.assert_array_equal(images.pixel_values([2, 0]), dense.pixel_values[[2, 0]])
