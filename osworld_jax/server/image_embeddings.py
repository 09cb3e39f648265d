"""Image embeddings: the vision tower once per image, kept on the device by content hash.

A prefill with images takes the tower's outputs (`forward`'s ``image_features``), not patches:
each new image runs through the tower alone (`_encode`: one program per image size, so one for
a run's screenshots, compiled once whatever the prompt length or row count), and its embeddings
(``[T, H]`` + DeepStack ``[D, T, H]``) are kept by the sha256 of the image's bytes
(`ImageEmbeddings`, least recently used first out, within a byte budget). The N owners of a
GRPO group start from the same screenshot: it goes through the tower once; a request re-sent
after its slot's prefix was evicted takes its earlier images from here too. The LM prefill
programs no longer hold the 27-block tower, so they compile in seconds and their shapes vary
only with the image *tokens* of a row (`feature_bucket`).

Embeddings depend on the weights: `ImageEmbeddings.clear` runs on every weight change
(`ModelRunner.params`). SGLang keeps multimodal embeddings the same way (its ``MultimodalCache``
by the items' hashes).
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from osworld_jax.contract.errors import EngineError
from osworld_jax.model import ImageProcessor, ModelRuntimeConfig, Qwen3VLMoeConfig
from osworld_jax.model.mrope import mrope_positions
from osworld_jax.model.pixels import patches_from_levels
from osworld_jax.model.vision import vision_tower
from osworld_jax.server.buckets import patch_bucket
from osworld_jax.server.images import RequestImages


def feature_bucket(tokens: int) -> int:
    """Image-token rows of a prefill row's features: `patch_bucket` of the count (unit 1).

    >>> [feature_bucket(n) for n in (1, 2040, 4080, 6120)]
    [1, 2048, 4096, 6144]
    """
    return patch_bucket(max(tokens, 1), 1)


@functools.partial(jax.jit, static_argnames=("config", "runtime", "tokens", "frames"))
def _encode(params, levels, count, table, grid, *, config, runtime, tokens, frames):
    """One image through the tower from its uint8 patch levels (the lookup on the device).

    levels u8[Np, C, PP] (padded), count i32 (real patches), table f32[C, 256] (the processor's
    `value_table`), grid i32[1, 3].
    """
    pixels = patches_from_levels(levels[None], count[None], table, frames=frames)  # [1, Np, P]
    out = vision_tower(params, config.vision, runtime, pixels, grid[None])
    return out.embeds[0, :tokens], out.deepstack[0, :, :tokens]  # [T, H], [D, T, H]


@functools.partial(jax.jit, static_argnames=("rows", "m", "like"))
def _zeros(*, rows, m, like):
    (h, dtype, levels) = like
    return jnp.zeros((rows, m, h), dtype), jnp.zeros((rows, levels, m, h), dtype)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _place(embeds, deep, e, d, row, offset):
    """``e`` [T, H] / ``d`` [D, T, H] at rows ``offset ..`` of prefill row ``row``."""
    zero = jnp.zeros((), jnp.int32)
    embeds = jax.lax.dynamic_update_slice(embeds, e[None], (row, offset, zero))
    deep = jax.lax.dynamic_update_slice(deep, d[None], (row, zero, offset, zero))
    return embeds, deep


class ImageEmbeddings:
    """The tower's outputs of recently seen images, by image digest, within ``max_bytes``.

    Args:
      config: the served Qwen3-VL config.
      runtime: the runner's runtime (dtype, scan, the ViT's attention).
      processor: the checkpoint's image processor: the device looks its values of each uint8
        level up (`ImageProcessor.value_table`), frame by frame (``temporal_patch_size``).
      max_bytes: device bytes kept (embeddings + DeepStack; 0: none kept, each image encoded
        once per prefill).

    Attributes:
      encoded: images run through the tower; hits: images taken from the cache.
    """

    def __init__(
        self,
        config: Qwen3VLMoeConfig,
        runtime: ModelRuntimeConfig,
        max_bytes: int,
        processor: ImageProcessor,
    ) -> None:
        self.config, self.runtime, self.max_bytes = config, runtime, max(0, int(max_bytes))
        self.table, self.frames = processor.value_table(), processor.temporal_patch_size
        self._kept: collections.OrderedDict[bytes, tuple[jax.Array, jax.Array]] = (
            collections.OrderedDict()
        )
        self.bytes = self.encoded = self.hits = 0

    def clear(self) -> None:
        """Forgets every embedding (the weights changed)."""
        self._kept.clear()
        self.bytes = 0

    def get(
        self, params: Any, digest: bytes, levels: np.ndarray | None, grid: np.ndarray
    ) -> tuple[jax.Array, jax.Array]:
        """``(embeds [T, H], deepstack [D, T, H])`` of one image (its levels: u8[N, C, PP])."""
        if digest and digest in self._kept:
            self._kept.move_to_end(digest)
            self.hits += 1
            return self._kept[digest]
        if levels is None:
            raise EngineError("the images' levels were dropped (RequestImages.restore them)")
        n = levels.shape[0]
        unit = self.config.vision.spatial_merge_size**2
        padded = np.zeros((patch_bucket(n, unit), *levels.shape[1:]), np.uint8)
        padded[:n] = levels
        out = _encode(
            params,
            padded,
            np.int32(n),
            self.table,
            np.asarray(grid, np.int32).reshape(1, 3),
            config=self.config,
            runtime=self.runtime,
            tokens=n // unit,
            frames=self.frames,
        )
        self.encoded += 1
        size = out[0].nbytes + out[1].nbytes
        if digest and size <= self.max_bytes:
            while self._kept and self.bytes + size > self.max_bytes:
                _, (e, d) = self._kept.popitem(last=False)
                self.bytes -= e.nbytes + d.nbytes
            self._kept[digest] = out
            self.bytes += size
        return out

    def features(
        self, params: Any, rows: list[list[tuple[bytes, np.ndarray | None, np.ndarray]]], m: int
    ) -> tuple[jax.Array, jax.Array]:
        """``(embeds [R, m, H], deepstack [R, D, m, H])``: row r's images' rows in order.

        ``rows[r]``: the (digest, levels, grid row) of row r's images; rows past
        ``len(rows)`` of ``R = len(rows)`` hold zeros.
        """
        h, depth = self.config.hidden_size, len(self.config.vision.deepstack_visual_indexes)
        dtype = params["vision"]["patch_embed"].dtype  # the tower's output dtype
        embeds, deep = _zeros(rows=len(rows), m=m, like=(h, dtype, depth))
        for r, images in enumerate(rows):
            offset = 0
            for digest, levels, grid in images:
                e, d = self.get(params, digest, levels, grid)
                embeds, deep = _place(
                    embeds, deep, e, d, np.int32(r), np.int32(offset)
                )  # fmt: skip
                offset += e.shape[0]
        return embeds, deep


def new_image_start(
    prompt: list[int], start: int, images: RequestImages, image_token_id: int
) -> int:
    """The first image whose tokens come after ``start`` (a kept prefix holds whole images)."""
    kept = int(np.count_nonzero(np.asarray(prompt[:start]) == image_token_id))
    done = np.cumsum([0, *images.num_tokens])
    first = int(np.searchsorted(done, kept))
    if done[first] != kept:
        raise EngineError(f"a kept prefix of {start} tokens ends inside an image")
    return first


def vision_inputs(
    config: Any,
    embeddings: ImageEmbeddings,
    params: Any,
    prompts: list[list[int]],
    starts: list[int],
    s: int,
    rows: int,
    images: list[RequestImages | None],
) -> tuple[dict[str, Any], list[int]]:
    """Per-row vision inputs of a prefill of ``rows`` x ``s`` tokens, and each row's rope delta.

    The features of the images after ``starts`` (`ImageEmbeddings.features`) and the M-RoPE
    positions [3, rows, s] of the computed tokens.
    """
    if not isinstance(config, Qwen3VLMoeConfig):
        raise EngineError("images need a qwen3_vl_moe checkpoint")
    per_row: list[list[tuple[bytes, np.ndarray | None, np.ndarray]]] = [[] for _ in range(rows)]
    rope = np.broadcast_to(np.arange(s, dtype=np.int32), (3, rows, s)).copy()
    deltas, most = [], 1
    for r, (q, a, im) in enumerate(zip(prompts, starts, images, strict=True)):
        length = len(q)
        if im is None:
            rope[:, r] += a
            deltas.append(0)
            continue
        first = new_image_start(q, a, im, config.image_token_id)
        for i in range(first, im.count):
            levels = None if im.levels is None else im.levels[i]
            digest = im.digests[i] if im.digests else b""
            per_row[r].append((digest, levels, im.grid_thw[i]))
        most = max(most, sum(im.num_tokens[first:]))
        pos = mrope_positions(np.asarray([q], np.int32), im.grid_thw, config)[:, 0]
        top = int(pos.max()) + 1
        rope[:, r, : length - a] = pos[:, a:]
        rope[:, r, length - a :] = np.arange(top, top + s - (length - a), dtype=np.int32)
        deltas.append(top - length)
    embeds, deep = embeddings.features(params, per_row, feature_bucket(most))
    return {"embeds": embeds, "deep": deep, "rope": rope}, deltas
