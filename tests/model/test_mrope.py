"""`mrope_positions` equals transformers' Qwen3-VL-MoE ``get_rope_index`` exactly."""

from __future__ import annotations

import numpy as np
import pytest

from osworld_jax.model import ImageInputError, mrope_positions
from tests.model.vl_helpers import END, IMG, START, hf_vl_config, ours_config

GRIDS = np.array([[1, 4, 6], [1, 8, 2], [1, 2, 2], [1, 6, 10]])


def _hf_rope_index(ids: np.ndarray, grids: np.ndarray) -> np.ndarray:
    import torch
    from transformers import Qwen3VLMoeForConditionalGeneration

    model = Qwen3VLMoeForConditionalGeneration(hf_vl_config()).eval()
    types = torch.as_tensor((ids == IMG).astype(np.int64))
    pos, _ = model.model.get_rope_index(
        torch.as_tensor(ids), types, image_grid_thw=torch.as_tensor(grids)
    )
    return pos.numpy()


def _conversation(rng, grids, text=(3, 2)) -> list[int]:
    ids = list(rng.randint(0, 100, text[0]))
    for g in grids:
        ids += [START] + [IMG] * int(np.prod(g) // 4) + [END] + list(rng.randint(0, 100, text[1]))
    return ids


def test_equals_hf_get_rope_index_on_a_batch():
    rng = np.random.RandomState(0)
    rows = [_conversation(rng, GRIDS[:2]), _conversation(rng, GRIDS[2:]), _conversation(rng, [])]
    s = max(map(len, rows))
    ids = np.array([r + list(rng.randint(0, 100, s - len(r))) for r in rows])
    ours = mrope_positions(ids, GRIDS, ours_config())
    assert ours.dtype == np.int32 and ours.shape == (3, 3, s)
    np.testing.assert_array_equal(ours, _hf_rope_index(ids, GRIDS))
    # A text-only row gives three equal rows 0..S-1.
    np.testing.assert_array_equal(ours[:, 2], np.broadcast_to(np.arange(s), (3, s)))
    # Hand-derived: image 0 of row 0 (grid 1x4x6 -> 2x3 LLM grid) starts after 3 text tokens
    # and <|vision_start|> at position 4; text after it resumes at 4 + max(2, 3) = 7.
    first = 4
    np.testing.assert_array_equal(ours[0, 0, first : first + 6], [4] * 6)
    np.testing.assert_array_equal(ours[1, 0, first : first + 6], [4, 4, 4, 5, 5, 5])
    np.testing.assert_array_equal(ours[2, 0, first : first + 6], [4, 5, 6, 4, 5, 6])
    np.testing.assert_array_equal(ours[:, 0, first + 6], [7, 7, 7])  # <|vision_end|>


def test_per_row_grids_equal_the_flat_layout():
    rng = np.random.RandomState(1)
    a, b = _conversation(rng, GRIDS[:2]), _conversation(rng, GRIDS[2:3])
    b += list(rng.randint(0, 100, len(a) - len(b)))
    ids = np.array([a, b])
    per_row = np.zeros((2, 3, 3), np.int64)  # unused slots have t = 0
    per_row[0, :2], per_row[1, :1] = GRIDS[:2], GRIDS[2:3]
    flat = mrope_positions(ids, GRIDS[:3], ours_config())
    np.testing.assert_array_equal(mrope_positions(ids, per_row, ours_config()), flat)


def test_packed_segments_restart_and_padding_continues():
    rng = np.random.RandomState(2)
    a, b = _conversation(rng, GRIDS[:1]), _conversation(rng, GRIDS[1:3])
    ids = np.array([a + b + [0, 0]])
    seg = np.array([[1] * len(a) + [2] * len(b) + [0, 0]])
    got = mrope_positions(ids, GRIDS[:3], ours_config(), segment_ids=seg)
    alone_a = mrope_positions(np.array([a]), GRIDS[:1], ours_config())
    alone_b = mrope_positions(np.array([b]), GRIDS[1:3], ours_config())
    np.testing.assert_array_equal(got[:, 0, : len(a)], alone_a[:, 0])
    np.testing.assert_array_equal(got[:, 0, len(a) : len(a) + len(b)], alone_b[:, 0])
    last = alone_b[:, 0].max()
    np.testing.assert_array_equal(got[:, 0, -2:], [[last + 1, last + 2]] * 3)


def test_mismatches_raise_with_row_and_token():
    rng = np.random.RandomState(3)
    ids = np.array([_conversation(rng, GRIDS[:1])])
    with pytest.raises(ImageInputError, match="row 0 token 4: image tokens without an image grid"):
        mrope_positions(ids, GRIDS[:0], ours_config())
    with pytest.raises(ImageInputError, match="1 image grid"):
        mrope_positions(ids, GRIDS[:2], ours_config())
    with pytest.raises(ImageInputError, match="6 image tokens left in this run .* needs 15"):
        mrope_positions(ids, GRIDS[3:4], ours_config())  # the grid 1x6x10 needs 15 tokens
