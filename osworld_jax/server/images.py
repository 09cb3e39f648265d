"""Images of a ``/generate`` request, as SGLang takes them (numpy + Pillow, no jax).

SGLang 0.5.x facts followed (``srt/managers/io_struct.py``
``GenerateReqInput._normalize_image_data``, ``srt/utils`` ``load_image``,
``srt/multimodal/processors/base_processor.py`` ``load_mm_data``, ``qwen_vl.py``):

- ``image_data`` of a single request is one image or a list of images; of a batch, a list with
  one entry per request, each a list of images (or one image, or None); a lone string in a batch
  goes to every request; an empty list or None means no image.
- An image is a string: ``http(s)://`` URL (fetched by SGLang; refused here, the embedded server
  reaches no network), a local file path when it ends in ``png``/``jpg``/``jpeg``/``webp``/``gif``
  (any case), a ``data:`` URL (base64 after the first comma) or bare base64 (strict alphabet).
- The prompt marks each image with ``<|vision_start|>`` + one or more ``<|image_pad|>`` +
  ``<|vision_end|>`` (SGLang's ``image_token_regex``), in the images' order; each placeholder is
  replaced by as many ``<|image_pad|>`` as the image processor gives.

Stricter than SGLang, by design: a placeholder that already holds more than one pad must hold
exactly the processor's count (SGLang silently re-expands it), more images than placeholders is
an error (SGLang warns and drops them), and token ids are never re-tokenized (SGLang decodes
``input_ids`` to text and encodes it again).

Bad input raises `ImageRequestError` whose message names the request and the image.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import io
import os
import stat
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from PIL import Image

from osworld_jax.model.errors import ImageInputError

if TYPE_CHECKING:
    from osworld_jax.model.processor import ImageProcessor
    from osworld_jax.model.vl_config import Qwen3VLMoeConfig

#: SGLang's ``load_image``: strings ending so are local file paths.
PATH_SUFFIXES = ("png", "jpg", "jpeg", "webp", "gif")


class ImageRequestError(ValueError):
    """An image of a request cannot be used (the message names the request and the image)."""


@dataclass(frozen=True, kw_only=True)
class ImageLimits:
    """What one request's images may cost the server.

    Attributes:
      max_image_pixels: most pixels (width x height, read from the header before decoding) of
        one image; larger ones are refused before any pixel is decoded (decompression bombs).
      max_image_bytes: largest encoded image (a file path is read only up to this size).
      max_images: most images of one request.
      max_request_image_pixels: most decoded pixels of one body's images (each distinct image
        counted once, plus again per distinct list of several images: their patches are
        concatenated), checked from the headers before any pixel is decoded.
    """

    max_image_pixels: int = 1 << 25
    max_image_bytes: int = 32 << 20
    max_images: int = 64
    max_request_image_pixels: int = 1 << 26

    def __post_init__(self) -> None:
        for name in (
            "max_image_pixels",
            "max_image_bytes",
            "max_images",
            "max_request_image_pixels",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"ImageLimits.{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True, kw_only=True, eq=False)
class RequestImages:
    """The processed images of one request (in prompt order).

    Attributes:
      levels: each image's u8[N_i, C, P P] patch levels (`ImageProcessor.levels`: resized,
        in patch order, before rescale and normalise; shared with every request sending the
        same bytes, read-only), or None once the request is prefilled (see `restore`). The
        device looks the float32 patches up (`image_embeddings`): a 1920x1080 screenshot at
        Qwen3-VL's budget is 6.0 MiB of levels against 47.8 MiB of float32 patches.
      grid_thw: i32[n, 3] patch grid of each image.
      num_tokens: ``<|image_pad|>`` tokens of each image (``t h w / merge^2``).
      digests: sha256 of each image's encoded bytes (prefix-cache keys; equal bytes, equal key).
      encoded: each image's encoded bytes (to recompute the levels).
    """

    levels: tuple[np.ndarray, ...] | None
    grid_thw: np.ndarray
    num_tokens: tuple[int, ...]
    digests: tuple[bytes, ...] = field(default=())
    encoded: tuple[bytes, ...] = field(default=())

    @property
    def count(self) -> int:
        """Number of images."""
        return len(self.num_tokens)

    def without_pixels(self) -> RequestImages:
        """The same images with the levels dropped (they can be recomputed: `restore`)."""
        if not self.encoded:
            return self
        return dataclasses.replace(self, levels=None)

    def restore(self, processor: ImageProcessor, cache: ImageCache | None = None) -> RequestImages:
        """The same images with their levels (from ``cache``, or recomputed from the bytes)."""
        if self.levels is not None:
            return self
        hits = [cache.get(d) for d in self.digests] if cache is not None else []
        found = [h for h in hits if isinstance(h, DecodedImage)]
        if hits and len(found) == len(hits):
            return dataclasses.replace(self, levels=tuple(h.levels for h in found))
        images = [
            Image.open(io.BytesIO(raw), formats=[sniff_format(raw, "a restored image")])
            for raw in self.encoded
        ]
        levels, grid = processor.levels(images)
        ends = np.cumsum(np.prod(grid, axis=-1))[:-1]
        return dataclasses.replace(self, levels=tuple(np.split(levels, ends)))


def normalize_image_data(value: Any, n: int, batch: bool) -> list[list[Any]]:
    """SGLang's ``image_data`` normalisation: one list of images per request.

    Args:
      value: the body's ``image_data``.
      n: number of requests in the body.
      batch: the body is a batch (``text`` / ``input_ids`` is a list of prompts).

    Raises:
      ImageRequestError: a batch's list has the wrong length, or an entry is not a string.
    """
    if value is None or (isinstance(value, list) and not value):
        return [[] for _ in range(n)]
    if not batch:
        items = value if isinstance(value, list) else [value]
        return [_clean(items, "request")]
    if not isinstance(value, list):
        return [_clean([value], f"request {i}") for i in range(n)]
    if len(value) != n:
        raise ImageRequestError(f"image_data has {len(value)} entries for a batch of {n} requests")
    out = []
    for i, entry in enumerate(value):
        items = [] if entry is None else entry if isinstance(entry, list) else [entry]
        out.append(_clean(items, f"request {i}"))
    return out


def _clean(items: list[Any], where: str) -> list[Any]:
    items = [x for x in items if x is not None]  # SGLang: [None] is "no image"
    for j, x in enumerate(items):
        if not isinstance(x, str):
            raise ImageRequestError(
                f"{where} image {j}: image_data entries must be strings (base64, a data: URL "
                f"or a file path), got {type(x).__name__}"
            )
    return items


def read_image_bytes(item: str, where: str, limits: ImageLimits) -> bytes:
    """The encoded bytes of one ``image_data`` string, by SGLang's ``load_image`` rules.

    Raises:
      ImageRequestError: a URL, a missing / unreadable / non-regular / too large file, or
        invalid base64.
    """
    if item.startswith(("http://", "https://")):
        raise ImageRequestError(
            f"{where}: URLs are not fetched by the embedded server; send the image as base64, "
            "a data: URL or a local file path"
        )
    if item.lower().endswith(PATH_SUFFIXES):
        if "\x00" in item:
            raise ImageRequestError(f"{where}: the file path holds a NUL character")
        return _read_file(item, where, limits)
    if item.startswith("data:"):
        comma = item.find(",")
        if comma < 0:
            raise ImageRequestError(f"{where}: a data: URL without a ',' before its data")
        encoded = item[comma + 1 :]
    else:
        encoded = item
    if len(encoded) > 4 * (limits.max_image_bytes // 3 + 1):
        raise ImageRequestError(f"{where}: more than {limits.max_image_bytes} encoded bytes")
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageRequestError(
            f"{where}: not base64, a data: URL or a path ending in {'/'.join(PATH_SUFFIXES)} ({e})"
        ) from None


def _read_file(path: str, where: str, limits: ImageLimits) -> bytes:
    """A regular file's bytes, never blocking on a FIFO or reading a device."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ImageRequestError(f"{where}: no such file {path!r}") from None
    except OSError as e:
        raise ImageRequestError(f"{where}: cannot open {path!r}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ImageRequestError(f"{where}: {path!r} is not a regular file")
        if st.st_size > limits.max_image_bytes:
            raise ImageRequestError(
                f"{where}: {path!r} has {st.st_size} bytes, more than {limits.max_image_bytes}"
            )
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limits.max_image_bytes + 1)
    except OSError as e:
        raise ImageRequestError(f"{where}: cannot read {path!r}: {e.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > limits.max_image_bytes:
        raise ImageRequestError(f"{where}: {path!r} grew past {limits.max_image_bytes} bytes")
    return data


#: Formats a screenshot comes in, each recognised by its magic bytes before Pillow sees the
#: data. Everything else (ICO/ICNS containers that wrap a PNG of another size, EPS that Pillow
#: hands to Ghostscript, TIFF, PSD, ...) is refused unread: Pillow's ~40 plugins are attack
#: surface no screenshot needs. BMP and GIF stay because agents' tools emit them; neither is
#: a container (BMP's size is in its header, a GIF's first frame is used).
ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "BMP", "GIF")
_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"\xff\xd8\xff", "JPEG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
)


def sniff_format(raw: bytes, where: str) -> str:
    """The allowed format of encoded bytes, from their magic bytes (nothing is decoded).

    Raises:
      ImageRequestError: not one of `ALLOWED_FORMATS`.
    """
    for magic, fmt in _MAGIC:
        if raw.startswith(magic):
            return fmt
    if raw[:4] == b"RIFF" and raw[8:12] == b"WEBP":
        return "WEBP"
    raise ImageRequestError(
        f"{where}: not a {', '.join(ALLOWED_FORMATS)} image (first bytes {raw[:8]!r}); "
        "other formats are refused"
    )


def open_image(raw: bytes, where: str, limits: ImageLimits) -> Image.Image:
    """Opens encoded bytes of an allowed format and checks the header size before decoding.

    Raises:
      ImageRequestError: not an allowed format, not decodable, or more than
        ``max_image_pixels`` pixels.
    """
    fmt = sniff_format(raw, where)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw), formats=[fmt])
    except Image.DecompressionBombError as e:
        raise ImageRequestError(f"{where}: refused, {e}") from None
    except Exception as e:  # Pillow raises several types for data it cannot read
        raise ImageRequestError(f"{where}: not a decodable image ({e})") from None
    w, h = image.size
    if w * h > limits.max_image_pixels:
        raise ImageRequestError(
            f"{where}: {w}x{h} = {w * h} pixels, more than --max-image-pixels "
            f"({limits.max_image_pixels})"
        )
    return image


class ImageCache(Protocol):
    """Processed images by digest (`osworld_jax.server.image_memory.ProcessedImageCache`)."""

    def get(self, digest: bytes) -> object:
        """The `DecodedImage` of the bytes with this sha256, or None."""
        ...

    def put(self, image: DecodedImage) -> None:
        """Keeps ``image``."""
        ...


@dataclass(frozen=True, kw_only=True, eq=False)
class EncodedImage:
    """One distinct ``image_data`` string of a body, read and opened (header only).

    Attributes:
      name: its name in error messages (``"request 2 image 0"``: its first use).
      raw: the encoded bytes.
      image: the opened (not decoded) Pillow image.
      pixels: width x height from the header.
    """

    name: str
    raw: bytes
    image: Image.Image
    pixels: int


@dataclass(frozen=True, kw_only=True, eq=False)
class DecodedImage:
    """One image decoded and processed: patch levels (u8[N, C, P P]), grid and token count."""

    levels: np.ndarray
    grid: np.ndarray
    num_tokens: int
    digest: bytes
    raw: bytes


def open_body_images(
    items: Sequence[Sequence[str]], names: Sequence[str], limits: ImageLimits
) -> tuple[dict[str, EncodedImage], int]:
    """Reads and opens each distinct image of a body once (headers only; blocking).

    Args:
      items: each request's ``image_data`` strings.
      names: each request's name in messages (``"request 2"``).
      limits: `ImageLimits`.

    Returns:
      ({image string: `EncodedImage`}, the body's decoded pixels: each distinct image once, plus
      again for each distinct list of several images, whose patches are concatenated).

    Raises:
      ImageRequestError: naming the request and the image, or ``--max-request-image-pixels``.
    """
    seen: dict[str, EncodedImage] = {}
    for its, where in zip(items, names, strict=True):
        if len(its) > limits.max_images:
            raise ImageRequestError(
                f"{where}: {len(its)} images, at most {limits.max_images} are allowed "
                "(--max-images-per-request)"
            )
        for j, item in enumerate(its):
            if item not in seen:
                name = f"{where} image {j}"
                raw = read_image_bytes(item, name, limits)
                image = open_image(raw, name, limits)
                seen[item] = EncodedImage(
                    name=name, raw=raw, image=image, pixels=image.width * image.height
                )
    total = sum(e.pixels for e in seen.values())
    total += sum(
        sum(seen[x].pixels for x in key) for key in {tuple(its) for its in items} if len(key) > 1
    )
    if total > limits.max_request_image_pixels:
        raise ImageRequestError(
            f"{names[0] if len(names) == 1 else 'the body'}: its images decode to {total} "
            f"pixels, more than --max-request-image-pixels ({limits.max_request_image_pixels})"
        )
    return seen, total


def decode_image(
    enc: EncodedImage, processor: ImageProcessor, cache: ImageCache | None = None
) -> DecodedImage:
    """Decodes every pixel of ``enc`` and processes it (blocking: run it in a thread).

    The token count comes from the decoded pixels' grid; a decoded size that differs from the
    header's is refused (the engine would see a grid that does not fill the placeholder).

    ``cache``: the same bytes processed before come from it (checked when first processed);
    what is processed now goes into it.

    Raises:
      ImageRequestError: undecodable (truncated) data, a size or token mismatch, or a size the
        processor refuses.
    """
    digest = hashlib.sha256(enc.raw).digest()
    if cache is not None and isinstance(hit := cache.get(digest), DecodedImage):
        return hit
    image, name = enc.image, enc.name
    header = image.size
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image.load()
    except Exception as e:  # truncated data fails only when the pixels are decoded
        raise ImageRequestError(f"{name}: not a decodable image ({e})") from None
    if image.size != header:
        raise ImageRequestError(
            f"{name}: the header says {header[0]}x{header[1]}, the pixels are "
            f"{image.width}x{image.height}"
        )
    try:
        want = processor.num_image_tokens(image.height, image.width)
        levels, grid = processor.levels(image)
    except ImageInputError as e:
        raise ImageRequestError(f"{name}: {e}") from None
    except Exception as e:
        raise ImageRequestError(f"{name}: not a decodable image ({e})") from None
    tokens = int(np.prod(grid, axis=-1).sum()) // processor.merge_size**2
    if tokens != want or len(grid) != 1:
        raise ImageRequestError(f"{name}: its pixels give {tokens} image tokens, its size {want}")
    out = DecodedImage(
        levels=levels,
        grid=grid.astype(np.int32),
        num_tokens=tokens,
        digest=digest,
        raw=enc.raw,
    )
    if cache is not None:
        cache.put(out)
    return out


def request_images(
    its: Sequence[str], decoded: dict[str, DecodedImage], where: str, max_tokens: int
) -> RequestImages | None:
    """One request's `RequestImages` from the body's decoded images (None without images).

    Each image's levels array is shared with every other request using it (no copy).

    Raises:
      ImageRequestError: the images need more tokens than ``max_tokens``.
    """
    if not its:
        return None
    parts = [decoded[x] for x in its]
    tokens = [d.num_tokens for d in parts]
    if sum(tokens) > max_tokens:
        raise ImageRequestError(
            f"{where}: the images need {sum(tokens)} image tokens ({tokens}), more than the "
            f"context length ({max_tokens})"
        )
    one = len(parts) == 1
    return RequestImages(
        levels=tuple(d.levels for d in parts),
        grid_thw=parts[0].grid if one else np.concatenate([d.grid for d in parts]),
        num_tokens=tuple(tokens),
        digests=tuple(d.digest for d in parts),
        encoded=tuple(d.raw for d in parts),
    )


def load_request_images(
    items: Sequence[str],
    where: str,
    processor: ImageProcessor,
    limits: ImageLimits,
    max_tokens: int,
    cache: ImageCache | None = None,
) -> RequestImages | None:
    """Reads, checks and processes the images of one request (blocking: run it in a thread).

    The body path of the server (`open_body_images`, `decode_image`, `request_images`) in one
    call. Sizes come from the headers first: the images' total ``<|image_pad|>`` count must fit
    ``max_tokens`` (the context) before any pixel is decoded.

    Raises:
      ImageRequestError: naming the request and the image.
    """
    if not items:
        return None
    seen, _ = open_body_images([items], [where], limits)
    check_header_tokens([items], [where], seen, processor, max_tokens)
    decoded = {k: decode_image(e, processor, cache) for k, e in seen.items()}
    return request_images(items, decoded, where, max_tokens)


def check_header_tokens(
    items: Sequence[Sequence[str]],
    names: Sequence[str],
    seen: dict[str, EncodedImage],
    processor: ImageProcessor,
    max_tokens: int,
) -> None:
    """Each request's image tokens, from the headers, must fit ``max_tokens`` (before decoding).

    Raises:
      ImageRequestError: a size the processor refuses, or too many tokens.
    """
    counts: dict[str, int] = {}
    for item, e in seen.items():
        try:
            counts[item] = processor.num_image_tokens(e.image.height, e.image.width)
        except ImageInputError as err:
            raise ImageRequestError(f"{e.name}: {err}") from None
    for its, where in zip(items, names, strict=True):
        tokens = [counts[x] for x in its]
        if sum(tokens) > max_tokens:
            raise ImageRequestError(
                f"{where}: the images need {sum(tokens)} image tokens ({tokens}), more than "
                f"the context length ({max_tokens})"
            )


def expand_image_tokens(
    ids: Sequence[int], num_tokens: Sequence[int], config: Qwen3VLMoeConfig, where: str
) -> list[int]:
    """Expands each image placeholder of ``ids`` to its image's ``<|image_pad|>`` count.

    A placeholder is ``<|vision_start|>``, a run of ``<|image_pad|>``, ``<|vision_end|>``; image
    k fills placeholder k. A run of one pad becomes ``num_tokens[k]`` pads; a longer run must
    already be exactly ``num_tokens[k]`` long. The agent can call this itself (with counts from
    `ImageProcessor.num_image_tokens`) to send expanded, token-exact prompts.

    >>> from types import SimpleNamespace as NS
    >>> cfg = NS(image_token_id=5, vision_start_token_id=3, vision_end_token_id=4,
    ...          video_token_id=6)
    >>> expand_image_tokens([1, 3, 5, 4, 2], [3], cfg, "request")
    [1, 3, 5, 5, 5, 4, 2]

    Raises:
      ImageRequestError: a pad outside a placeholder, a run of the wrong length, more or fewer
        placeholders than images, or a video placeholder.
    """
    pad, start, end = (
        config.image_token_id,
        config.vision_start_token_id,
        config.vision_end_token_id,
    )
    ids = list(ids)
    if config.video_token_id in ids:
        raise ImageRequestError(f"{where}: the prompt holds <|video_pad|>; videos are not served")
    out: list[int] = []
    k, i, n = 0, 0, len(ids)
    while i < n:
        if ids[i] != pad:
            out.append(ids[i])
            i += 1
            continue
        j = i
        while j < n and ids[j] == pad:
            j += 1
        run = j - i
        if i == 0 or ids[i - 1] != start or j == n or ids[j] != end:
            raise ImageRequestError(
                f"{where}: <|image_pad|> at token {i} is not inside <|vision_start|> ... "
                "<|vision_end|>"
            )
        if k >= len(num_tokens):
            raise ImageRequestError(
                f"{where}: the prompt has more image placeholders than image_data has images "
                f"({len(num_tokens)}); placeholder {k} at token {i - 1} has no image"
            )
        want = num_tokens[k]
        if run not in (1, want):
            raise ImageRequestError(
                f"{where} image {k}: its placeholder at token {i - 1} holds {run} <|image_pad|> "
                f"tokens, the image gives {want} (send 1 to have it expanded, or exactly {want})"
            )
        out.extend([pad] * want)
        k += 1
        i = j
    if k < len(num_tokens):
        raise ImageRequestError(
            f"{where}: image_data has {len(num_tokens)} images but the prompt has only {k} "
            "image placeholders (<|vision_start|><|image_pad|><|vision_end|>); image "
            f"{k} has no placeholder"
        )
    return out
