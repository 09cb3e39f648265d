"""The device batch contract shared by the agent (producer) and the trainer (consumer).

NumPy only: no jax import, so the env/agent side can build batches without a device. A ``Batch``
is a ``NamedTuple`` and therefore already a jax pytree.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np


class Batch(NamedTuple):
    """Padded fixed-shape training arrays (see docs/INTERFACES.md for alignment).

    Attributes:
      tokens: i32[R, T] token ids, padding 0.
      loss_mask: f32[R, T] 1 only on model-generated, non-media tokens.
      behavior_logprobs: f32[R, T] rollout engine logprob of ``tokens[r, t]`` (0 elsewhere).
      advantages: f32[R, T] the owner's advantage on its trainable tokens (0 elsewhere).
      positions: i32[R, T] position ids, or for a Qwen3-VL policy the M-RoPE i32[3, R, T]
        (``mrope_positions``: temporal, height, width; text tokens have three equal rows).
      segment_ids: i32[R, T] 1.. on real tokens, 0 on padding.
      owner_ids: i32[R] logical owner in ``[0, num_owners)``.
      group_ids: i32[R] prompt group in ``[0, num_groups)``.
      row_weight: f32[R] 0 for padding rows and failed owners, else 1.
      routed_experts: i32[R, T, L, K] engine route when token t was the input; -1 = none.
      pixel_values: f32[R, Np, P] row r's image patches back to back (its images in token
        order, each the image processor's patches), zero-padded to a patch bucket; None
        without images. Row r's images fill row r's ``<|image_pad|>`` runs in order.
      image_grid_thw: i32[R, m, 3] the (t, h, w) patch grid of row r's k-th image in slot k;
        t = 0 marks an unused slot. None without images.
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    behavior_logprobs: np.ndarray
    advantages: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    owner_ids: np.ndarray
    group_ids: np.ndarray
    row_weight: np.ndarray
    routed_experts: np.ndarray
    pixel_values: np.ndarray | None = None
    image_grid_thw: np.ndarray | None = None

    @property
    def num_image_slots(self) -> int:
        """``m`` of ``image_grid_thw`` (0 without images)."""
        return 0 if self.image_grid_thw is None else int(self.image_grid_thw.shape[1])


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchBounds:
    """The static sizes a compiled train step is built for (one set per run, from the config).

    Owner and group ids are segment indices: the loss aggregation counts only the owners and
    groups that have loss tokens, so a batch may use fewer ids than the bounds (dropped groups,
    failed owners) without changing the result or the compiled step.

    Attributes:
      num_owners: owner ids lie in ``[0, num_owners)``: B x N logical owners per step.
      num_groups: group ids lie in ``[0, num_groups)``: B prompt groups per step.
      norm_length: the constant L of the ``seq-mean-token-sum-norm`` aggregation (Dr.GRPO).
    """

    num_owners: int
    num_groups: int
    norm_length: int

    def __post_init__(self) -> None:
        for name in ("num_owners", "num_groups", "norm_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"BatchBounds.{name} must be >= 1, got {getattr(self, name)}")

    def check(self, batch: Batch) -> None:
        """Raises ``ValueError`` naming the field when an id of ``batch`` is out of bounds."""
        for name, field in (("owner_ids", "num_owners"), ("group_ids", "num_groups")):
            ids, bound = np.asarray(getattr(batch, name)), getattr(self, field)
            if ids.size and (ids.min() < 0 or ids.max() >= bound):
                raise ValueError(
                    f"Batch.{name}: ids in [{ids.min()}, {ids.max()}] are outside "
                    f"[0, BatchBounds.{field} = {bound})"
                )


def check_batch(batch: Batch) -> None:
    """Raises ``ValueError`` naming the field when shapes or dtypes break the contract."""
    r, t = batch.tokens.shape
    pos_shape = (3, r, t) if np.ndim(batch.positions) == 3 else (r, t)
    expect = {
        "tokens": ((r, t), np.int32),
        "loss_mask": ((r, t), np.float32),
        "behavior_logprobs": ((r, t), np.float32),
        "advantages": ((r, t), np.float32),
        "positions": (pos_shape, np.int32),
        "segment_ids": ((r, t), np.int32),
        "owner_ids": ((r,), np.int32),
        "group_ids": ((r,), np.int32),
        "row_weight": ((r,), np.float32),
    }
    for name, (shape, dtype) in expect.items():
        arr = getattr(batch, name)
        if tuple(arr.shape) != shape or np.dtype(arr.dtype) != np.dtype(dtype):
            raise ValueError(
                f"Batch.{name}: expected {np.dtype(dtype).name}{list(shape)}, "
                f"got {np.dtype(arr.dtype).name}{list(arr.shape)}"
            )
    re_ = batch.routed_experts
    if re_.ndim != 4 or re_.shape[:2] != (r, t) or np.dtype(re_.dtype) != np.int32:
        raise ValueError(f"Batch.routed_experts: expected int32[{r}, {t}, L, K], got {re_.shape}")
    pv, grid = batch.pixel_values, batch.image_grid_thw
    if (pv is None) != (grid is None):
        raise ValueError("Batch.pixel_values and Batch.image_grid_thw: give both or neither")
    if pv is None or grid is None:
        return
    if pv.ndim != 3 or pv.shape[0] != r or np.dtype(pv.dtype) != np.float32:
        raise ValueError(
            f"Batch.pixel_values: expected float32[{r}, Np, P], got "
            f"{np.dtype(pv.dtype).name}{list(pv.shape)}"
        )
    if grid.ndim != 3 or grid.shape[0] != r or grid.shape[2] != 3 or grid.dtype != np.int32:
        raise ValueError(
            f"Batch.image_grid_thw: expected int32[{r}, m, 3], got "
            f"{np.dtype(grid.dtype).name}{list(grid.shape)}"
        )
    if np.ndim(batch.positions) != 3:
        raise ValueError("Batch.positions: images need the M-RoPE positions int32[3, R, T]")
    patches = np.prod(grid.astype(np.int64), axis=-1).sum(axis=1)  # [R]
    over = np.flatnonzero(patches > pv.shape[1])
    if over.size:
        raise ValueError(
            f"Batch.image_grid_thw: row {int(over[0])}'s images need {int(patches[over[0]])} "
            f"patches, pixel_values holds {pv.shape[1]} per row"
        )
