"""M-RoPE position ids of Qwen3-VL (HF ``Qwen3VLMoeModel.get_rope_index``). Numpy only, no jax.

Each token gets three positions (t, h, w). A run of text tokens counts up on all three rows
from the current position ``p``. An image with patch grid (t, H, W) and merge size m occupies
``t (H/m) (W/m)`` consecutive ``<|image_pad|>`` tokens, whose positions are
``(p + ti, p + hi, p + wi)`` over its ``(t, H/m, W/m)`` LLM grid in row-major order; after it
``p`` advances by ``max(H, W) / m``. Every row starts at 0 (and every packed segment restarts
at 0). The server continues decoding at ``max(positions) + 1``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from osworld_jax.model.errors import ImageInputError

if TYPE_CHECKING:
    from osworld_jax.model.vl_config import Qwen3VLMoeConfig


def mrope_positions(
    input_ids: np.ndarray,
    image_grid_thw: np.ndarray | None,
    config: Qwen3VLMoeConfig,
    *,
    segment_ids: np.ndarray | None = None,
) -> np.ndarray:
    """M-RoPE positions i32[3, B, S], equal to HF ``get_rope_index`` on unpadded rows.

    Args:
      input_ids: i32[B, S] token ids; ``config.image_token_id`` marks image tokens.
      image_grid_thw: i32[n, 3] grids of all images in row-major token order (HF's layout),
        or i32[B, m, 3] per row (rows with t = 0 are unused slots), or None (text only).
      config: a `Qwen3VLMoeConfig` (image token id, spatial merge size).
      segment_ids: optional i32[B, S] packed-row segments: positions restart at 0 where a new
        non-zero segment starts; padding (0) continues counting from its row's last position.

    Returns:
      i32[3, B, S]; text-only rows give three equal rows ``0..S-1``.

    Raises:
      ImageInputError: image tokens and grids disagree (a run of image tokens that is not a
        whole number of images, images left over, or too few images); names row and token.
    """
    ids = np.asarray(input_ids)
    if ids.ndim != 2:
        raise ImageInputError(f"mrope_positions: input_ids must be [B, S], got {ids.shape}")
    b, s = ids.shape
    seg = np.ones((b, s), np.int32) if segment_ids is None else np.asarray(segment_ids)
    if seg.shape != ids.shape:
        raise ImageInputError(f"mrope_positions: segment_ids {seg.shape} != input_ids {ids.shape}")
    grids = _grid_iterators(image_grid_thw, b)
    merge = config.vision.spatial_merge_size
    is_image = ids == config.image_token_id
    out = np.zeros((3, b, s), np.int64)
    for row in range(b):
        it = grids[row]
        pos, i = 0, 0
        while i < s:
            if i > 0 and seg[row, i] != 0 and seg[row, i] != seg[row, i - 1]:
                pos = 0  # a new packed segment
            if not is_image[row, i] or seg[row, i] == 0:
                out[:, row, i] = pos
                pos, i = pos + 1, i + 1
                continue
            end = i
            while end < s and is_image[row, end] and seg[row, end] == seg[row, i]:
                end += 1
            while i < end:  # one or more whole images fill this run of image tokens
                grid = next(it, None)
                if grid is None:
                    raise ImageInputError(
                        f"mrope_positions: row {row} token {i}: image tokens without an image grid"
                    )
                t, h, w = (int(x) for x in grid)
                lt, lh, lw = t, h // merge, w // merge
                n = lt * lh * lw
                if n == 0 or i + n > end:
                    raise ImageInputError(
                        f"mrope_positions: row {row} token {i}: {end - i} image tokens left in "
                        f"this run but the next image (grid {t}x{h}x{w}) needs {n}"
                    )
                ti, hi, wi = np.meshgrid(np.arange(lt), np.arange(lh), np.arange(lw), indexing="ij")
                out[0, row, i : i + n] = ti.reshape(-1) + pos
                out[1, row, i : i + n] = hi.reshape(-1) + pos
                out[2, row, i : i + n] = wi.reshape(-1) + pos
                pos += max(h, w) // merge
                i += n
        if image_grid_thw is not None and np.asarray(image_grid_thw).ndim == 3:
            _check_exhausted(it, f"row {row}")
    if image_grid_thw is not None and np.asarray(image_grid_thw).ndim == 2:
        _check_exhausted(grids[0], "the batch")
    return out.astype(np.int32)


def _grid_iterators(image_grid_thw: np.ndarray | None, rows: int) -> list[Iterator[np.ndarray]]:
    """One iterator of (t, h, w) grids per row (a shared one for the flat [n, 3] layout)."""
    if image_grid_thw is None:
        return [iter(()) for _ in range(rows)]
    g = np.asarray(image_grid_thw)
    if g.ndim == 2 and g.shape[-1] == 3:
        shared = iter(list(g))
        return [shared] * rows
    if g.ndim == 3 and g.shape[0] == rows and g.shape[-1] == 3:
        return [iter([x for x in g[r] if x[0] > 0]) for r in range(rows)]
    raise ImageInputError(
        f"mrope_positions: image_grid_thw shape {g.shape}; need [n, 3] or [B={rows}, m, 3]"
    )


def _check_exhausted(it: Iterator[np.ndarray], where: str) -> None:
    left = sum(1 for _ in it)
    if left:
        raise ImageInputError(f"mrope_positions: {left} image grid(s) of {where} have no tokens")


def check_vision_inputs(
    input_ids: np.ndarray,
    pixel_shape: tuple[int, ...],
    image_grid_thw: np.ndarray,
    config: Qwen3VLMoeConfig,
) -> None:
    """Host-side check that image tokens, grids and patches agree (HF raises on a mismatch).

    Flat layout: ``pixel_values [N, P]`` with ``N >= sum t h w``, grids [n, 3] and as many image
    tokens in the batch as ``sum t h w / m^2``. Per-row layout: ``[B, Np, P]``, grids [B, m, 3],
    the same per row.

    Raises:
      ImageInputError: naming the row and the counts that disagree.
    """
    v = config.vision
    grid = np.asarray(image_grid_thw).astype(np.int64)
    ids = np.asarray(input_ids)
    per_row = len(pixel_shape) == 3
    if pixel_shape[-1] != v.patch_dim:
        raise ImageInputError(f"pixel_values {pixel_shape}: patches must have {v.patch_dim} values")
    if grid.ndim != (3 if per_row else 2) or grid.shape[-1] != 3:
        raise ImageInputError(
            f"image_grid_thw {grid.shape} does not fit pixel_values {pixel_shape} "
            "(flat: [N, P] with [n, 3]; per row: [B, Np, P] with [B, m, 3])"
        )
    if np.any(grid < 0) or np.any((grid[..., 1:] % v.spatial_merge_size) != 0):
        raise ImageInputError(
            f"image_grid_thw: every h and w must be a non-negative multiple of "
            f"{v.spatial_merge_size}: {grid.reshape(-1, 3).tolist()}"
        )
    m2 = v.spatial_merge_size**2
    if pixel_shape[-2] % m2:
        raise ImageInputError(f"pixel_values {pixel_shape}: patch count not a multiple of {m2}")
    is_image = ids == config.image_token_id
    groups = (
        [(f"row {r}", grid[r], is_image[r]) for r in range(ids.shape[0])]
        if per_row
        else [("the batch", grid, is_image)]
    )
    for where, g, img in groups:
        patches = int(np.prod(g, axis=-1).sum())
        if patches > pixel_shape[-2]:
            raise ImageInputError(
                f"{where}: image_grid_thw needs {patches} patches, pixel_values has "
                f"{pixel_shape[-2]}"
            )
        if int(img.sum()) != patches // m2:
            raise ImageInputError(
                f"{where}: {int(img.sum())} image tokens but the images give {patches // m2}"
            )
