"""The Qwen2-VL / Qwen3-VL image processor: images -> flat patches + grid. Numpy + Pillow only.

No jax and no torch: the agent room imports this module to count media tokens. The algorithm is
HF transformers' ``Qwen2VLImageProcessor`` (which Qwen3-VL's ``preprocessor_config.json`` names),
computed the way its Pillow backend computes it:

1. convert to RGB (transparency composited onto white);
2. `smart_resize` the (H, W) to multiples of ``factor = patch_size * merge_size`` with
   ``min_pixels <= H' W' <= max_pixels`` (``size.shortest_edge`` / ``size.longest_edge``) and
   the aspect ratio kept, then a Pillow bicubic resize of the uint8 image;
3. rescale ``x = u8 * rescale_factor`` (float64, then float32) and normalise
   ``(x - mean) / std`` in float32;
4. patchify in HF's order: the (H', W') grid of P x P patches is walked in m x m merge blocks
   (row-major over blocks, row-major inside a block), each patch flattened as
   ``[C, T, P, P]`` with the image repeated over the ``T = temporal_patch_size`` frames.

An image gives ``grid_thw = (1, H'/P, W'/P)``, ``prod(grid_thw)`` patch rows and
``prod(grid_thw) / m^2`` LM tokens (``<|image_pad|>``).
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from osworld_jax.model.errors import ImageInputError, ModelConfigError

ImageLike = Image.Image | np.ndarray | bytes | bytearray

PREPROCESSOR_FILE = "preprocessor_config.json"
# The image processor classes whose algorithm this module implements.
KNOWN_PROCESSOR_TYPES = (
    "Qwen2VLImageProcessor",
    "Qwen2VLImageProcessorFast",
    "Qwen2VLImageProcessorPil",
)
PIL_BICUBIC = 3
MAX_ASPECT_RATIO = 200

# Qwen3-VL's published preprocessor_config.json (Qwen/Qwen3-VL-30B-A3B-Instruct).
QWEN3_VL_PREPROCESSOR: dict[str, Any] = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}


def smart_resize(
    height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """HF's ``smart_resize``: the (H', W') an image of (height, width) is resized to.

    ``H' = round(H / f) f`` and ``W' = round(W / f) f`` (Python rounding, half to even); if
    ``H' W' > max_pixels`` both shrink by ``beta = sqrt(H W / max_pixels)`` (floored to
    multiples of f, at least f); if ``H' W' < min_pixels`` both grow by
    ``beta = sqrt(min_pixels / (H W))`` (ceiled to multiples of f).

    >>> smart_resize(1080, 1920, factor=32, min_pixels=65536, max_pixels=16777216)
    (1088, 1920)

    Raises:
      ImageInputError: a non-positive side, or an aspect ratio above 200.
    """
    if height <= 0 or width <= 0:
        raise ImageInputError(f"image size {width}x{height}: both sides must be > 0")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageInputError(
            f"image size {width}x{height}: aspect ratio above {MAX_ASPECT_RATIO} is unsupported"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImageProcessor:
    """HF's Qwen2-VL image processor (the one Qwen3-VL uses); defaults are HF's class defaults.

    Attributes:
      patch_size: P, the spatial patch side in pixels.
      temporal_patch_size: T, frames per temporal patch (an image is repeated T times).
      merge_size: m; the resized sides are multiples of ``P * m``.
      min_pixels: lower bound of ``H' W'`` (HF ``size.shortest_edge``).
      max_pixels: upper bound of ``H' W'`` (HF ``size.longest_edge``).
      image_mean: per-channel mean subtracted after rescaling.
      image_std: per-channel std divided by after subtracting the mean.
      rescale_factor: multiplies the uint8 values (1/255).
      do_resize: apply `smart_resize` (False: the image sides must already be multiples of
        ``P * m``).
      do_rescale: apply ``rescale_factor``.
      do_normalize: apply mean / std.
      do_convert_rgb: convert every image to RGB (alpha composited onto white).
      resample: the Pillow resampling filter (3 = bicubic).
    """

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True
    resample: int = PIL_BICUBIC

    def __post_init__(self) -> None:
        for key in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelConfigError(
                    f"ImageProcessor.{key}: must be a positive int, got {value!r}"
                )
        if self.min_pixels > self.max_pixels:
            raise ModelConfigError(
                f"ImageProcessor.min_pixels: {self.min_pixels} > max_pixels {self.max_pixels}"
            )
        for key in ("image_mean", "image_std"):
            if len(getattr(self, key)) != 3:
                raise ModelConfigError(f"ImageProcessor.{key}: need 3 channel values")
        if any(s == 0 for s in self.image_std):
            raise ModelConfigError("ImageProcessor.image_std: zero std")

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def from_dict(
        cls, d: Mapping[str, Any], *, source: str = "preprocessor_config"
    ) -> ImageProcessor:
        """Reads a HF preprocessor config dict (``size`` + legacy ``min_pixels``/``max_pixels``)."""
        kind = d.get("image_processor_type")
        if kind is not None and kind not in KNOWN_PROCESSOR_TYPES:
            raise ModelConfigError(
                f"{source}: image_processor_type {kind!r} is not one of {KNOWN_PROCESSOR_TYPES}"
            )
        default = cls()
        size = d.get("size") or {}
        if not isinstance(size, Mapping):
            raise ModelConfigError(f"{source}: size: not a dict: {size!r}")
        min_pixels = size.get("shortest_edge", size.get("min_pixels", default.min_pixels))
        max_pixels = size.get("longest_edge", size.get("max_pixels", default.max_pixels))
        if d.get("min_pixels") is not None:
            min_pixels = d["min_pixels"]
        if d.get("max_pixels") is not None:
            max_pixels = d["max_pixels"]
        values: dict[str, Any] = {"min_pixels": min_pixels, "max_pixels": max_pixels}
        for f in dataclasses.fields(cls):
            if f.name in d and f.name not in values:
                values[f.name] = d[f.name]
        for key in ("image_mean", "image_std"):
            if key in values:
                v = values[key]
                values[key] = tuple(
                    float(x) for x in (v if isinstance(v, list | tuple) else [v] * 3)
                )
        try:
            return cls(**values)
        except ModelConfigError as e:
            raise ModelConfigError(f"{source}: {e}") from None

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ImageProcessor:
        """Reads ``path/preprocessor_config.json`` (or ``path`` itself when it is the file)."""
        path = Path(path)
        if path.is_dir():
            path = path / PREPROCESSOR_FILE
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelConfigError(f"{path}: no such preprocessor config") from None
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{path}: invalid JSON ({e})") from None
        if not isinstance(d, dict):
            raise ModelConfigError(f"{path}: not a JSON object")
        return cls.from_dict(d, source=str(path))

    def to_dict(self) -> dict[str, Any]:
        """The HF ``preprocessor_config.json`` dict of this processor."""
        return {
            "size": {"longest_edge": self.max_pixels, "shortest_edge": self.min_pixels},
            "patch_size": self.patch_size,
            "temporal_patch_size": self.temporal_patch_size,
            "merge_size": self.merge_size,
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
            "rescale_factor": self.rescale_factor,
            "do_resize": self.do_resize,
            "do_rescale": self.do_rescale,
            "do_normalize": self.do_normalize,
            "do_convert_rgb": self.do_convert_rgb,
            "resample": self.resample,
            "processor_class": "Qwen3VLProcessor",
            "image_processor_type": "Qwen2VLImageProcessorFast",
        }

    def save_pretrained(self, directory: str | Path) -> Path:
        """Writes ``directory/preprocessor_config.json``; returns its path."""
        out = Path(directory) / PREPROCESSOR_FILE
        out.write_text(json.dumps(self.to_dict(), indent=2))
        return out

    # ---- sizes (no pixels needed) ------------------------------------------------------------
    @property
    def factor(self) -> int:
        """Resized sides are multiples of ``patch_size * merge_size``."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Length of one patch row: ``3 * temporal_patch_size * patch_size^2``."""
        return 3 * self.temporal_patch_size * self.patch_size**2

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """(H', W') of an image of (height, width) pixels."""
        if not self.do_resize:
            if height % self.factor or width % self.factor:
                raise ImageInputError(
                    f"image size {width}x{height}: with do_resize=False both sides must be "
                    f"multiples of {self.factor}"
                )
            return height, width
        return smart_resize(
            height,
            width,
            factor=self.factor,
            min_pixels=self.min_pixels,
            max_pixels=self.max_pixels,
        )

    def grid_thw(self, height: int, width: int) -> tuple[int, int, int]:
        """The ``(1, H'/P, W'/P)`` patch grid of an image of (height, width) pixels."""
        h, w = self.resized_size(height, width)
        return 1, h // self.patch_size, w // self.patch_size

    def num_image_tokens(self, height: int, width: int) -> int:
        """LM tokens (``<|image_pad|>``) of an image of (height, width) pixels."""
        t, gh, gw = self.grid_thw(height, width)
        return t * gh * gw // self.merge_size**2

    # ---- processing --------------------------------------------------------------------------
    def __call__(self, images: ImageLike | Sequence[ImageLike]) -> tuple[np.ndarray, np.ndarray]:
        """Processes one image or a list of images.

        Args:
          images: a PIL image, an ``np.ndarray`` uint8 [H, W, 3] (also [H, W], [H, W, 1] or
            [H, W, 4]), PNG/JPEG bytes, or a list of these.

        Returns:
          (pixel_values f32[N, 3 * T * P * P] in HF's patch order, image_grid_thw i32[n, 3]),
          the patches of the n images concatenated in order.
        """
        levels, grids = self.levels(images)
        return self.patches_from_levels(levels), grids

    def levels(self, images: ImageLike | Sequence[ImageLike]) -> tuple[np.ndarray, np.ndarray]:
        """The images' resized uint8 levels in patch order, before rescale and normalise.

        ``patches_from_levels(levels(x)[0])`` is ``self(x)[0]`` bit for bit; the levels are
        1 / (4 T) of the float32 patches' bytes (a 1920x1080 screenshot at Qwen3-VL's limits:
        6.0 MiB instead of 47.8), so a trainer can send them and look the values up on device.

        Returns:
          (levels u8[N, 3, P * P]: patch n's channel c in HF's pixel order, image_grid_thw
          i32[n, 3]), the patches of the n images concatenated in order.
        """
        if isinstance(images, (Image.Image, np.ndarray, bytes, bytearray)):
            images = [images]
        blocks, grids = [], []
        for i, image in enumerate(images):
            rgb = _to_rgb(image, i, convert=self.do_convert_rgb)
            b, grid = self._one(rgb, i)
            blocks.append(b)
            grids.append(grid)
        if not blocks:
            return np.zeros((0, 3, self.patch_size**2), np.uint8), np.zeros((0, 3), np.int32)
        return np.concatenate(blocks, axis=0), np.asarray(grids, np.int32)

    def _one(self, image: Image.Image, index: int) -> tuple[np.ndarray, tuple[int, int, int]]:
        width, height = image.size
        try:
            h, w = self.resized_size(height, width)
        except ImageInputError as e:
            raise ImageInputError(f"image {index}: {e}") from None
        if self.do_resize:  # HF resizes even when the size is unchanged (a copy then)
            image = image.resize((w, h), resample=self.resample)
        pixels: np.ndarray = np.asarray(image)  # [H', W', 3] uint8
        return self._patch_levels(pixels.transpose(2, 0, 1))

    def value_table(self) -> np.ndarray:
        """f32[3, 256]: each channel's processed value of every uint8 level.

        ``(float32(u8 * rescale_factor in float64) - mean) / std`` in float32, i.e. HF's rescale
        then normalise evaluated once per level, so a lookup gives bit-identical pixels.
        """
        levels = np.arange(256, dtype=np.float64)
        x = (levels * self.rescale_factor if self.do_rescale else levels).astype(np.float32)
        x = np.broadcast_to(x, (3, 256))
        if self.do_normalize:
            mean = np.asarray(self.image_mean, np.float32)[:, None]
            std = np.asarray(self.image_std, np.float32)[:, None]
            x = (x - mean) / std
        return np.ascontiguousarray(x, np.float32)

    def _patch_levels(self, chw: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        """uint8 [C, H', W'] -> (levels u8[gh * gw, C, P * P], (1, gh, gw)), HF's patch order."""
        c, h, w = chw.shape
        p, m = self.patch_size, self.merge_size
        gh, gw = h // p, w // p
        blocks = chw.reshape(c, gh // m, m, p, gw // m, m, p)
        blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, P, P] uint8
        return np.ascontiguousarray(blocks).reshape(gh * gw, c, p * p), (1, gh, gw)

    def patches_from_levels(self, levels: np.ndarray) -> np.ndarray:
        """u8[N, C, P * P] (`levels`) -> f32[N, C * T * P * P]: the value table looked up.

        Each of the T frames is the same image (HF's patch layout).
        """
        n, c, pp = levels.shape
        t = self.temporal_patch_size
        table = self.value_table()
        out = np.empty((n, c, t, pp), np.float32)
        for ch in range(c):
            values = table[ch][levels[:, ch]]  # [N, P * P]
            for frame in range(t):
                out[:, ch, frame] = values
        return out.reshape(n, c * t * pp)


def _to_rgb(image: ImageLike, index: int, *, convert: bool) -> Image.Image:
    """A decoded RGB Pillow image (transparency composited onto white, as HF does)."""
    if isinstance(image, (bytes, bytearray)):
        try:
            decoded = Image.open(io.BytesIO(bytes(image)))
            decoded.load()
        except Exception as e:  # Pillow raises several types for corrupt data
            raise ImageInputError(f"image {index}: not a decodable image ({e})") from None
        image = decoded
    if isinstance(image, np.ndarray):
        image = _array_to_rgb(image, index)
    if not isinstance(image, Image.Image):
        raise ImageInputError(
            f"image {index}: {type(image).__name__} is not a PIL image, uint8 array or bytes"
        )
    if not convert:
        if image.mode != "RGB":
            raise ImageInputError(f"image {index}: mode {image.mode} with do_convert_rgb=False")
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def _array_to_rgb(a: np.ndarray, index: int) -> Image.Image:
    if a.dtype != np.uint8:
        raise ImageInputError(f"image {index}: array dtype {a.dtype}; need uint8 [H, W, 3]")
    if a.ndim == 2:
        a = a[..., None]
    if a.ndim != 3 or a.shape[-1] not in (1, 3, 4):
        raise ImageInputError(f"image {index}: array shape {a.shape}; need [H, W, 3] (or 1 / 4)")
    if a.shape[-1] == 1:
        a = np.repeat(a, 3, axis=-1)
    elif a.shape[-1] == 4:  # HF's numpy path: round(alpha * rgb + (1 - alpha) * 255)
        alpha = a[..., 3:4] / 255
        a = np.round(alpha * a[..., :3] + (1 - alpha) * 255).astype(np.uint8)
    return Image.fromarray(np.ascontiguousarray(a), mode="RGB")
