"""The device batch contract shared by the agent (producer) and the trainer (consumer).

NumPy only: no jax import, so the env/agent side can build batches without a device. A ``Batch``
is a ``NamedTuple`` and therefore already a jax pytree.

Images have two forms. The host step batch (``pack_batch``) stores each distinct screenshot of
the batch once, as the encoded bytes the server was given (`RowImages`: rows refer to them by
index); the trainer makes their uint8 patch levels at its input boundary, per device shard of
rows (`RowImages.levels`), and looks the float32 values up on the device, so the step's
``pixel_values`` never exist on the host (`RowImages.pixel_values`, `with_pixel_values`: the
same lookup on the host, for tests and tools). A device batch has ``pixel_values``
f32[R, Np, P] and ``images=None``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np


class Patchifier(Protocol):
    """Makes one encoded image's patches: the model's ``ImageProcessor`` is one."""

    @property
    def patch_dim(self) -> int:
        """P, the values per patch."""
        ...

    @property
    def temporal_patch_size(self) -> int:
        """T, the frames of a patch (an image is repeated T times)."""
        ...

    def __call__(self, image: bytes, /) -> tuple[np.ndarray, np.ndarray]:
        """``(patches f32[n, P], grid_thw i32[1, 3])`` of one encoded image."""
        ...

    def levels(self, image: bytes, /) -> tuple[np.ndarray, np.ndarray]:
        """``(levels u8[n, C, P / (C T)], grid_thw i32[1, 3])``: patches before the lookup.

        ``patches_from_levels(levels)`` is the ``patches`` of ``__call__`` bit for bit.
        """
        ...

    def value_table(self) -> np.ndarray:
        """f32[C, 256]: channel c's patch value of each uint8 level."""
        ...

    def patches_from_levels(self, levels: np.ndarray, /) -> np.ndarray:
        """u8[n, C, P / (C T)] -> f32[n, P]."""
        ...


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class RowImages:
    """A batch's screenshots, each distinct one stored once, referenced by index from its rows.

    Row r's patches (``pixel_values[r]``) are the patches of images ``index[r, 0], index[r, 1],
    ...`` back to back, zero-padded to ``num_patches``: exactly what the processor makes of each
    encoded image (the same bytes the server processed), so the float32 patches are a pure
    function of this object and are made only where they are needed (`pixel_values`).

    Attributes:
      encoded: the distinct images' encoded bytes (PNG ...), each once.
      grid_thw: i32[n, 3] the patch grid of each of them (``Batch.image_grid_thw[r, k]`` is
        ``grid_thw[index[r, k]]``); the processor must make exactly these.
      index: i32[R, m] row r's k-th image as an index into ``encoded``; -1 = unused slot (where
        ``Batch.image_grid_thw[r, k, 0] == 0``).
      num_patches: Np, the per-row patch bucket of the device ``pixel_values``.
      processor: makes an image's patches (the model's image processor).
    """

    encoded: tuple[bytes, ...]
    grid_thw: np.ndarray
    index: np.ndarray
    num_patches: int
    processor: Patchifier

    @property
    def nbytes(self) -> int:
        """Host bytes held: the encoded images, their grids and the index."""
        return sum(len(b) for b in self.encoded) + int(self.index.nbytes + self.grid_thw.nbytes)

    def to_arrays(self) -> dict[str, np.ndarray]:
        """As arrays (to broadcast): ``index``, ``grid_thw``, ``offsets`` i64[n + 1], ``blob``."""
        offsets = np.cumsum([0, *map(len, self.encoded)]).astype(np.int64)
        blob = np.frombuffer(b"".join(self.encoded), np.uint8)
        return dict(index=self.index, grid_thw=self.grid_thw, offsets=offsets, blob=blob)

    @classmethod
    def from_arrays(
        cls, arrays: dict[str, np.ndarray], *, num_patches: int, processor: Patchifier
    ) -> RowImages:
        """Inverse of `to_arrays`."""
        at, blob = arrays["offsets"].tolist(), np.asarray(arrays["blob"], np.uint8).tobytes()
        return cls(
            encoded=tuple(blob[a:b] for a, b in zip(at[:-1], at[1:], strict=True)),
            grid_thw=np.asarray(arrays["grid_thw"], np.int32),
            index=np.asarray(arrays["index"], np.int32),
            num_patches=num_patches,
            processor=processor,
        )

    def levels(
        self, rows: Sequence[int] | np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """The uint8 patch levels of ``rows`` (default all), each image decoded once.

        Returns:
          (levels u8[len(rows), Np, C, P / (C T)]: row r's images' levels back to back, zero
          beyond them; counts i32[len(rows)]: row r's real patches, the rest is padding whose
          patches are 0.0). The float32 patches are the processor's value table looked up
          (`pixel_values` on the host; the trainer does it on the device, from 1 / (4 T) of
          the bytes).

        Raises:
          ValueError: the processor made another grid than ``grid_thw`` of an image, or a row's
            images need more than ``num_patches`` patches.
        """
        rows = np.arange(self.index.shape[0]) if rows is None else np.asarray(rows, np.int64)
        out: np.ndarray | None = None
        counts = np.zeros((rows.size,), np.int32)
        made: dict[int, np.ndarray] = {}
        for j, r in enumerate(rows.tolist()):
            at = 0
            for i in self.index[r].tolist():
                if i < 0:
                    continue
                if i not in made:
                    made[i], grid = self.processor.levels(self.encoded[i])
                    if not np.array_equal(grid.reshape(-1), self.grid_thw[i]):
                        raise ValueError(
                            f"RowImages: image {i}'s patch grid is {grid.reshape(-1).tolist()}, "
                            f"packed as {self.grid_thw[i].tolist()}"
                        )
                n = made[i].shape[0]
                if at + n > self.num_patches:
                    raise ValueError(
                        f"RowImages: row {r}'s images need more than {self.num_patches} patches"
                    )
                if out is None:  # [R, Np, C, P / (C T)]
                    out = np.zeros((rows.size, self.num_patches, *made[i].shape[1:]), np.uint8)
                out[j, at : at + n] = made[i]
                at += n
            counts[j] = at
        if out is None:  # no image in these rows
            dim = self.processor.patch_dim // self.processor.temporal_patch_size
            out = np.zeros((rows.size, self.num_patches, 3, dim // 3), np.uint8)
        return out, counts

    def pixel_values(self, rows: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
        """f32[len(rows), Np, P]: the patches of ``rows`` (default all), each image made once.

        Raises:
          ValueError: as `levels`.
        """
        levels, counts = self.levels(rows)
        r, np_ = levels.shape[:2]
        out = self.processor.patches_from_levels(levels.reshape(r * np_, *levels.shape[2:]))
        out = out.reshape(r, np_, self.processor.patch_dim)
        out[np.arange(np_)[None, :] >= counts[:, None]] = 0.0  # padding patches
        return out


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
      routed_experts: int[R, T, L, K] engine route when token t was the input; -1 = none. The
        smallest signed integer type that holds the expert ids (`route_dtype`: int8 for 128
        experts, as Qwen3-VL-30B-A3B): with 48 layers x top-8 the routes are most of a step's
        host batch (a 16k-token row: 6 MiB in int8, 24 MiB in int32).
      pixel_values: f32[R, Np, P] row r's image patches back to back (its images in token
        order, each the image processor's patches), zero-padded to a patch bucket; None
        without images. Row r's images fill row r's ``<|image_pad|>`` runs in order.
      image_grid_thw: i32[R, m, 3] the (t, h, w) patch grid of row r's k-th image in slot k;
        t = 0 marks an unused slot. None without images.
      images: the host form of the images (`RowImages`: each distinct screenshot once, rows
        referring to it), given instead of ``pixel_values`` (which is then None);
        `with_pixel_values` or the trainer's upload makes ``pixel_values`` from it. None in a
        device batch and without images.
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
    images: RowImages | None = None

    @property
    def num_image_slots(self) -> int:
        """``m`` of ``image_grid_thw`` (0 without images)."""
        return 0 if self.image_grid_thw is None else int(self.image_grid_thw.shape[1])

    @property
    def num_patches(self) -> int:
        """Np, the per-row patches of ``pixel_values`` (either form; 0 without images)."""
        if self.images is not None:
            return self.images.num_patches
        return 0 if self.pixel_values is None else int(self.pixel_values.shape[1])

    @property
    def has_images(self) -> bool:
        """Whether the batch carries images (in either form)."""
        return self.pixel_values is not None or self.images is not None


def route_dtype(num_experts: int | None) -> np.dtype:
    """The dtype of ``Batch.routed_experts`` for a model of ``num_experts`` experts.

    The smallest signed integer type holding ids ``0 .. num_experts - 1`` and the ``-1`` of no
    route (int32 when ``num_experts`` is unknown).

    >>> route_dtype(128), route_dtype(129), route_dtype(None)
    (dtype('int8'), dtype('int16'), dtype('int32'))
    """
    if num_experts is None:
        return np.dtype(np.int32)
    for dtype in (np.int8, np.int16, np.int32):
        if num_experts - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise ValueError(f"{num_experts} experts: ids beyond int32")


def with_pixel_values(batch: Batch) -> Batch:
    """``batch`` with its images as ``pixel_values`` f32[R, Np, P] (the device form).

    The whole batch's patches at once: for tests and tools; the trainer makes them per device
    shard. A batch without `RowImages` is returned as is.
    """
    if batch.images is None:
        return batch
    return batch._replace(pixel_values=batch.images.pixel_values(), images=None)


def to_arrays(batch: Batch) -> dict[str, np.ndarray]:
    """Every field of a host ``batch`` as named numpy arrays (e.g. to broadcast it).

    Stored images become ``images.index`` / ``images.offsets`` / ``images.blob``
    (`RowImages.to_arrays`) and ``images.num_patches``; their processor is not included.
    """
    out = {k: np.asarray(v) for k, v in zip(Batch._fields, batch, strict=True) if v is not None}
    if batch.images is not None:
        del out["images"]
        out |= {f"images.{k}": v for k, v in batch.images.to_arrays().items()}
        out["images.num_patches"] = np.asarray([batch.images.num_patches], np.int64)
    return out


def from_arrays(arrays: dict[str, np.ndarray], processor: Patchifier | None = None) -> Batch:
    """Inverse of `to_arrays`; ``processor`` makes the stored images' patches (if any)."""
    fields: dict[str, Any] = {k: v for k, v in arrays.items() if not k.startswith("images.")}
    if "images.index" in arrays:
        if processor is None:
            raise ValueError("from_arrays: stored images need their processor")
        stored = {k[7:]: v for k, v in arrays.items() if k.startswith("images.")}
        num_patches = int(stored.pop("num_patches")[0])
        fields["images"] = RowImages.from_arrays(
            stored, num_patches=num_patches, processor=processor
        )
    return Batch(**fields)


def host_nbytes(batch: Batch) -> int:
    """Bytes the batch holds on the host: every array field, and the stored images once."""
    arrays = sum(int(v.nbytes) for v in batch if isinstance(v, np.ndarray))
    return arrays + (0 if batch.images is None else batch.images.nbytes)


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


ROUTE_DTYPES = (np.dtype(np.int8), np.dtype(np.int16), np.dtype(np.int32))


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
    if re_.ndim != 4 or re_.shape[:2] != (r, t) or np.dtype(re_.dtype) not in ROUTE_DTYPES:
        raise ValueError(
            f"Batch.routed_experts: expected int8|int16|int32[{r}, {t}, L, K], got "
            f"{np.dtype(re_.dtype).name}{list(re_.shape)}"
        )
    pv, grid, images = batch.pixel_values, batch.image_grid_thw, batch.images
    if pv is not None and images is not None:
        raise ValueError("Batch.pixel_values and Batch.images: give one form of the images")
    if batch.has_images != (grid is not None):
        raise ValueError(
            "Batch.pixel_values (or Batch.images) and Batch.image_grid_thw: give both or neither"
        )
    if grid is None:
        return
    if grid.ndim != 3 or grid.shape[0] != r or grid.shape[2] != 3 or grid.dtype != np.int32:
        raise ValueError(
            f"Batch.image_grid_thw: expected int32[{r}, m, 3], got "
            f"{np.dtype(grid.dtype).name}{list(grid.shape)}"
        )
    if images is not None:
        _check_row_images(images, grid, r)
    elif pv is not None and (pv.ndim != 3 or pv.shape[0] != r or pv.dtype != np.float32):
        raise ValueError(
            f"Batch.pixel_values: expected float32[{r}, Np, P], got "
            f"{np.dtype(pv.dtype).name}{list(pv.shape)}"
        )
    if np.ndim(batch.positions) != 3:
        raise ValueError("Batch.positions: images need the M-RoPE positions int32[3, R, T]")
    patches = np.prod(grid.astype(np.int64), axis=-1).sum(axis=1)  # [R]
    over = np.flatnonzero(patches > batch.num_patches)
    if over.size:
        raise ValueError(
            f"Batch.image_grid_thw: row {int(over[0])}'s images need {int(patches[over[0]])} "
            f"patches, pixel_values holds {batch.num_patches} per row"
        )


def _check_row_images(images: RowImages, grid: np.ndarray, rows: int) -> None:
    """Raises ``ValueError`` when ``images`` does not match ``image_grid_thw`` of R rows."""
    index = images.index
    if index.ndim != 2 or index.shape != (rows, grid.shape[1]) or index.dtype != np.int32:
        raise ValueError(
            f"Batch.images.index: expected int32[{rows}, {grid.shape[1]}], got "
            f"{np.dtype(index.dtype).name}{list(index.shape)}"
        )
    n = len(images.encoded)
    if ((index >= 0) != (grid[..., 0] > 0)).any() or (index >= n).any():
        raise ValueError(
            f"Batch.images.index: not an image of {n} exactly in the used slots of image_grid_thw"
        )
    if images.grid_thw.shape != (n, 3) or not np.array_equal(
        images.grid_thw[index[index >= 0]], grid[index >= 0]
    ):
        raise ValueError("Batch.images.grid_thw: not the image_grid_thw of the rows' images")
