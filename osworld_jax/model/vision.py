"""The Qwen3-VL vision tower as pure functions (HF ``Qwen3VLMoeVisionModel``).

Patches ``x f32[N, C T P P]`` of images packed back to back (HF's order, see `processor`) go
through: patch embedding (HF's Conv3d with stride = kernel, i.e. a linear map of each patch)
plus the learned position table bilinearly resampled (align_corners) to each image's grid;
``depth`` pre-norm blocks ``h += proj(attn(LN1 h)); h += fc2(act(fc1(LN2 h)))`` whose attention
uses a 2-D rotary embedding (row and column halves of the head) and stays within each image
frame (segment ids; no padding to the largest image); the final merger ``fc2(gelu(fc1(LN(h)
grouped by m x m)))`` to LM width; and one DeepStack merger (norm after grouping) per block in
``deepstack_visual_indexes``.

The attention never looks across frames (HF's ``cu_seqlens``). Two exact implementations:
``segment_attention`` (XLA: scores of a query block against the row's patches, other frames
masked; CPU/TPU, and any grid) and ``packed_attention`` (cuDNN flash attention in its packed
"THD" layout: one ragged segment per image, so no score of a pair across images is ever
computed; GPU, with ``ModelRuntimeConfig.attention="cudnn"``). The packed layout describes one
segment per grid row, so it serves images (``t <= 1``, all `ImageProcessor` makes); a grid with a
multi-frame row takes the XLA path inside the same compiled step (``lax.cond``).

Rows of images: ``pixel_values [G, N, P]`` with ``image_grid_thw [G, n, 3]`` run G independent
rows in one call (the trainer's per-row layout; matmuls over all G N patches at once); the flat
``[N, P]`` / ``[n, 3]`` is one row.

Everything that depends on the image sizes (segments, rotary rows/columns, interpolation taps)
is computed inside jit from ``image_grid_thw`` for a static patch count N, so any images fit in
one compiled shape. Patches after the last image's (``N > sum t h w``) are padding: they attend
only to themselves and their merged rows are never used.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from osworld_jax.model.config import ModelRuntimeConfig
from osworld_jax.model.remat import apply_remat
from osworld_jax.model.vl_config import VisionConfig

_NEG = float(jnp.finfo(jnp.float32).min)
_EPS = 1e-6  # every LayerNorm of the ViT (HF nn.LayerNorm(eps=1e-6))


class PatchLayout(NamedTuple):
    """Per-patch facts derived from the image grids (all [N] or [N, 4]).

    Attributes:
      segment: i32[N] attention segment (one per image frame; padding patches unique).
      row: i32[N] patch row within its image (rotary h position).
      col: i32[N] patch column within its image (rotary w position).
      taps: i32[N, 4] rows of the position table the bilinear resampling reads.
      weights: f32[N, 4] their bilinear weights (0 on padding patches).
    """

    segment: jax.Array
    row: jax.Array
    col: jax.Array
    taps: jax.Array
    weights: jax.Array


def patch_layout(
    grid_thw: Int[Array, "n 3"], num_patches: int, vision: VisionConfig
) -> PatchLayout:
    """Segments, rotary positions and interpolation taps of N packed patches.

    Patch ``k`` of image ``i`` (``k < t h w``) has in-frame index ``j = k mod (h w)``, decoded in
    merge-block order: ``row = (j // (m^2 (w/m))) m + (j // m) mod m``,
    ``col = ((j // m^2) mod (w/m)) m + j mod m``. Its position embedding is HF's
    ``F.interpolate(bilinear, align_corners=True)`` of the ``s x s`` table at
    ``(row (s-1)/(h-1), col (s-1)/(w-1))``, as 4 taps.
    """
    m, side = vision.spatial_merge_size, vision.grid_side
    grid = jnp.asarray(grid_thw, jnp.int32).reshape(-1, 3)
    n_images = grid.shape[0]
    k = jnp.arange(num_patches, dtype=jnp.int32)
    if n_images == 0:  # every patch is padding
        zeros = jnp.zeros((num_patches,), jnp.int32)
        return PatchLayout(
            k, zeros, zeros, jnp.zeros((num_patches, 4), jnp.int32), jnp.zeros((num_patches, 4))
        )
    t, h, w = grid[:, 0], grid[:, 1], grid[:, 2]
    ends = jnp.cumsum(t * h * w)  # [n]
    image = jnp.searchsorted(ends, k, side="right")  # [N]; n for padding patches
    valid = image < n_images
    image = jnp.minimum(image, n_images - 1)
    start = ends[image] - (t * h * w)[image]
    hh, ww = h[image], w[image]
    frame_size = jnp.maximum(hh * ww, 1)
    offset = k - start
    within = offset % frame_size
    frame = jnp.cumsum(t)[image] - t[image] + offset // frame_size  # global frame index
    segment = jnp.where(valid, frame, jnp.sum(t) + k)
    blocks_w = jnp.maximum(ww // m, 1)
    row = (within // (m * m * blocks_w)) * m + (within // m) % m
    col = ((within // (m * m)) % blocks_w) * m + within % m
    row, col = jnp.where(valid, row, 0), jnp.where(valid, col, 0)
    h_taps, h_w = _axis_taps(row, hh, side)
    w_taps, w_w = _axis_taps(col, ww, side)
    taps = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)
    weights = jnp.where(valid[:, None], weights, 0.0)
    return PatchLayout(segment, row, col, taps, weights)


def _axis_taps(index: jax.Array, size: jax.Array, side: int) -> tuple[jax.Array, jax.Array]:
    """Bilinear (align_corners) taps [N, 2] and weights [N, 2] along one axis (HF's formula)."""
    src = index.astype(jnp.float32) * (side - 1) / jnp.maximum(size - 1, 1).astype(jnp.float32)
    floor = jnp.floor(src)
    offsets = jnp.arange(2, dtype=jnp.float32)
    taps = jnp.clip(floor.astype(jnp.int32)[:, None] + jnp.arange(2), 0, side - 1)
    distance = jnp.abs(src[:, None] - floor[:, None] - offsets)
    return taps, jnp.maximum(1.0 - distance, 0.0)


def layer_norm(
    x: Float[Array, "... H"], w: Float[Array, " H"], b: Float[Array, " H"]
) -> Float[Array, "... H"]:
    """LayerNorm in float32 (eps 1e-6): ``w (x - mean) / sqrt(var + eps) + b``, in ``x.dtype``."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + _EPS)
    return (y * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


def vision_rope(
    row: Int[Array, " N"], col: Int[Array, " N"], vision: VisionConfig
) -> tuple[Float[Array, "N D"], Float[Array, "N D"]]:
    """cos/sin f32[N, Dh] of the 2-D rotary: ``cat(row f, col f, row f, col f)``.

    ``f = theta^(-2i / (Dh/2))`` for ``i < Dh/4`` (HF ``Qwen3VLMoeVisionRotaryEmbedding``).
    """
    half = vision.head_dim // 2
    inv_freq = 1.0 / (vision.rope_theta ** (np.arange(0, half, 2, dtype=np.float32) / half))
    inv = jnp.asarray(inv_freq.astype(np.float32))
    fr = row.astype(jnp.float32)[:, None] * inv
    fc = col.astype(jnp.float32)[:, None] * inv
    emb = jnp.concatenate([fr, fc, fr, fc], axis=-1)  # [N, Dh]
    return jnp.cos(emb), jnp.sin(emb)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """``x cos + rotate_half(x) sin`` in float32 over [..., N, heads, Dh] (cos/sin [..., N, Dh]);
    back in ``x.dtype``."""  # noqa: D205, D209
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[..., None, :] + rotated * sin[..., None, :]).astype(x.dtype)


def segment_attention(
    q: Float[Array, "N Nh D"],
    k: Float[Array, "N Nh D"],
    v: Float[Array, "N Nh D"],
    segment: Int[Array, " N"],
    chunk: int = 0,
) -> Float[Array, "N Nh D"]:
    """Bidirectional softmax attention within equal ``segment`` ids; float32 scores/softmax.

    ``chunk > 0`` runs blocks of ``chunk`` queries (each rematerialised in backward), so the
    score buffer is [Nh, chunk, N] instead of [Nh, N, N]; the values are the same.
    """
    n, _, d = q.shape
    scale = d**-0.5

    def block(qs: jax.Array, seg_q: jax.Array) -> jax.Array:
        s = jnp.einsum("chd,khd->hck", qs, k, preferred_element_type=jnp.float32) * scale
        s = jnp.where((seg_q[:, None] == segment[None, :])[None], s, _NEG)
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        return jnp.einsum("hck,khd->chd", p, v)

    if chunk <= 0 or chunk >= n:
        return block(q, segment)
    pad = -n % chunk
    qp = jnp.pad(q, ((0, pad), (0, 0), (0, 0)))
    sp = jnp.pad(segment, (0, pad), constant_values=-1)
    qc = qp.reshape(-1, chunk, *q.shape[1:])
    sc = sp.reshape(-1, chunk)
    out = jax.lax.map(jax.checkpoint(lambda a: block(a[0], a[1])), (qc, sc))
    return out.reshape(-1, *q.shape[1:])[:n]


class FrameSpans(NamedTuple):
    """One attention segment per image of a row, as cuDNN's packed layout takes them.

    Attributes:
      offsets: i32[n + 2] first patch of each segment (images in order, then the trailing
        padding patches), -1 for an empty one; the last entry is always -1.
      lengths: i32[n + 1] patches of each segment, -1 for an empty one.
    """

    offsets: jax.Array
    lengths: jax.Array


def frame_spans(grid_thw: Int[Array, "n 3"], num_patches: int) -> FrameSpans:
    """The segments of `packed_attention` for N packed patches of images (``t <= 1``).

    Image i covers patches ``[sum_{j<i} t_j h_j w_j, + t_i h_i w_i)``; the padding patches
    ``[sum t h w, N)`` are one more segment (they attend among themselves; their rows are never
    used). Empty segments (``t = 0`` rows, no padding) get -1, which the packed layout skips.
    A multi-frame row (t > 1) would be one segment here: `vision_tower` never sends one.
    """
    grid = jnp.asarray(grid_thw, jnp.int32).reshape(-1, 3)
    sizes = jnp.prod(grid, axis=-1)  # [n]
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    total = ends[-1] if grid.shape[0] else jnp.int32(0)
    lengths = jnp.append(sizes, num_patches - total)  # [n + 1]
    offsets = jnp.append(starts, total)
    offsets = jnp.where(lengths > 0, offsets, -1)
    lengths = jnp.where(lengths > 0, lengths, -1)
    return FrameSpans(jnp.append(offsets, -1).astype(jnp.int32), lengths.astype(jnp.int32))


def spans_segment(spans: FrameSpans, num_patches: int) -> Int[Array, " N"]:
    """i32[N] segment id of each patch under ``spans`` (-1 outside every span).

    The partition `packed_attention` attends within; the XLA implementation runs
    `segment_attention` over it, and tests compare it with `patch_layout`'s.
    """
    k = jnp.arange(num_patches, dtype=jnp.int32)
    starts, lengths = spans.offsets[:-1], spans.lengths
    inside = (k[:, None] >= starts) & (k[:, None] < starts + lengths) & (lengths > 0)  # [N, S]
    return jnp.where(inside.any(-1), jnp.argmax(inside, axis=-1), -1).astype(jnp.int32)


def packed_attention(
    q: Float[Array, "G N Nh D"],
    k: Float[Array, "G N Nh D"],
    v: Float[Array, "G N Nh D"],
    spans: FrameSpans,
    *,
    implementation: str,
) -> Float[Array, "G N Nh D"]:
    """``softmax(q k^T / sqrt(D)) v`` within each span of each row (bidirectional).

    Args:
      q, k, v: [G, N, Nh, D] patches of G rows.
      spans: `FrameSpans` with a leading [G] dim (``offsets [G, n + 2]``, ``lengths [G, n + 1]``)
        that cover every patch.
      implementation: "cudnn" (cuDNN flash attention, packed "THD" layout: work per span
        ``~ len^2``, never ``N^2``; Hopper or newer, 16-bit inputs) or "xla" (`segment_attention`
        over `spans_segment`: the same values on any platform).
    """
    if implementation == "xla":
        segment = jax.vmap(spans_segment, in_axes=(0, None))(spans, q.shape[1])
        return jax.vmap(segment_attention)(q, k, v, segment)
    from jax._src.cudnn.fused_attention_stablehlo import (
        MaskType,
    )
    from jax._src.cudnn.fused_attention_stablehlo import (
        dot_product_attention as cudnn_attention,
    )

    # The packed layout needs two segment slots at least (``M > 1``); n + 1 >= 2 always.
    return cudnn_attention(
        q,
        k,
        v,
        q_seqlen=spans.lengths,
        kv_seqlen=spans.lengths,
        q_offsets=spans.offsets,
        kv_offsets=spans.offsets,
        scale=q.shape[-1] ** -0.5,
        mask_type=MaskType.NO_MASK,
        qkv_layout="BTNH",
    )


def image_attention(
    q: Float[Array, "G N Nh D"],
    k: Float[Array, "G N Nh D"],
    v: Float[Array, "G N Nh D"],
    segment: Int[Array, "G N"],
    spans: FrameSpans,
    single_frame: jax.Array,
    *,
    fused: bool,
    chunk: int,
) -> Float[Array, "G N Nh D"]:
    """The ViT's attention within frames: cuDNN packed (``fused`` and every grid row one
    frame, ``single_frame``) or XLA `segment_attention` (otherwise; equal values)."""  # noqa: D205, D209

    def xla(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return jax.vmap(functools.partial(segment_attention, chunk=chunk))(q, k, v, segment)

    if not fused:
        return xla(q, k, v)

    def cudnn(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return packed_attention(q, k, v, spans, implementation="cudnn")

    return jax.lax.cond(single_frame, cudnn, xla, q, k, v)


def fused_vision_attention(runtime: ModelRuntimeConfig) -> bool:
    """Whether the ViT's attention runs cuDNN's packed kernel: ``vision_attention`` (else
    ``attention``) "cudnn", on a GPU, 16-bit compute (cuDNN's flash kernels take fp16/bf16
    only)."""  # noqa: D205, D209
    return (
        (runtime.vision_attention or runtime.attention) == "cudnn"
        and jax.default_backend() == "gpu"
        and jnp.dtype(runtime.dtype) in (jnp.bfloat16, jnp.float16)
    )


def _block(
    p: dict[str, jax.Array],
    x: jax.Array,
    *,
    cos: jax.Array,
    sin: jax.Array,
    attend: functools.partial,
    act: str,
) -> jax.Array:
    """One ViT block (HF ``Qwen3VLMoeVisionBlock``) on x [G, N, Hv]."""
    y = layer_norm(x, p["norm1"], p["norm1_bias"])
    qkv = jnp.einsum("gnh,hsad->gnsad", y, p["qkv"]) + p["qkv_bias"]  # [G, N, 3, Nh, Dh]
    q, k = _rotate(qkv[:, :, 0], cos, sin), _rotate(qkv[:, :, 1], cos, sin)
    attn = attend(q, k, qkv[:, :, 2])  # [G, N, Nh, Dh]
    x = x + jnp.einsum("gnad,adh->gnh", attn, p["proj"]) + p["proj_bias"]
    y = layer_norm(x, p["norm2"], p["norm2_bias"])
    y = jax.nn.gelu(y @ p["fc1"] + p["fc1_bias"], approximate=act == "gelu_pytorch_tanh")
    return x + y @ p["fc2"] + p["fc2_bias"]


def merge_patches(
    x: Float[Array, "*G N Hv"],
    norm: jax.Array,
    norm_bias: jax.Array,
    fc1: jax.Array,
    fc1_bias: jax.Array,
    fc2: jax.Array,
    fc2_bias: jax.Array,
    *,
    merge: int,
    postshuffle_norm: bool,
) -> Float[Array, "*G M Ho"]:
    """HF ``Qwen3VLMoeVisionPatchMerger``: m^2 consecutive patches -> one LM-width feature.

    ``fc2(gelu(fc1(LN(x) grouped)))``; the DeepStack mergers (``postshuffle_norm``) normalise
    after grouping, over the m^2 Hv features.
    """
    group = x.shape[-1] * merge * merge
    lead = x.shape[:-2]  # [G] for rows of images
    if postshuffle_norm:
        y = layer_norm(x.reshape(*lead, -1, group), norm, norm_bias)
    else:
        y = layer_norm(x, norm, norm_bias).reshape(*lead, -1, group)
    y = jax.nn.gelu(y @ fc1 + fc1_bias, approximate=False)  # nn.GELU(): the erf form
    return y @ fc2 + fc2_bias


class VisionOut(NamedTuple):
    """The tower's outputs for N patches (M = N / m^2 merged rows).

    Attributes:
      embeds: [M, Ho] merged features (they replace the image tokens' embeddings).
      deepstack: [D, M, Ho] DeepStack features; level j is added after LM layer j.
    """

    embeds: jax.Array
    deepstack: jax.Array


def vision_tower(
    params: dict[str, dict[str, jax.Array]],
    vision: VisionConfig,
    runtime: ModelRuntimeConfig,
    pixel_values: Float[Array, "*G N P"],
    image_grid_thw: Int[Array, "*G n 3"],
) -> VisionOut:
    """The ViT on N packed patches of the images in ``image_grid_thw`` (t, h, w per image).

    Args:
      params: the policy parameter tree (groups ``vision``, ``vision_blocks``, ``deepstack``).
      vision: the vision config.
      runtime: dtype, remat (``vision_remat``, else ``remat``), scan, ``attention`` ("cudnn":
        `packed_attention` on GPU) and ``vision_attention_chunk`` (the XLA path).
      pixel_values: [N, C T P P] patches (`ImageProcessor` order), or [G, N, C T P P] for G
        independent rows; N a multiple of m^2, at least ``sum t h w`` (the rest is padding).
        Any float dtype: converted to the parameters' dtype on the device.
      image_grid_thw: i32[n, 3] (or [G, n, 3]); rows with t = 0 hold no image.

    Returns:
      `VisionOut` (with the leading [G] when the input has it).
    """
    batched = pixel_values.ndim == 3
    if not batched:
        pixel_values, image_grid_thw = pixel_values[None], jnp.asarray(image_grid_thw)[None]
    g, n, dim = pixel_values.shape
    m = vision.spatial_merge_size
    if dim != vision.patch_dim or n % (m * m):
        raise ValueError(
            f"pixel_values [{n}, {dim}]: need [N, {vision.patch_dim}] with N a multiple of {m * m}"
        )
    grid = jnp.asarray(image_grid_thw, jnp.int32).reshape(g, -1, 3)
    top, blocks = params["vision"], params["vision_blocks"]
    dtype = top["patch_embed"].dtype
    layout = jax.vmap(patch_layout, in_axes=(0, None, None))(grid, n, vision)  # [G, N, ...]
    x = pixel_values.astype(dtype) @ top["patch_embed"] + top["patch_bias"]  # [G, N, Hv]
    table = top["pos_embed"].astype(jnp.float32)
    pos = jnp.einsum("gnk,gnkh->gnh", layout.weights, table[layout.taps])  # [G, N, Hv]
    x = x + pos.astype(dtype)
    cos, sin = jax.vmap(vision_rope, in_axes=(0, 0, None))(layout.row, layout.col, vision)
    spans = jax.vmap(frame_spans, in_axes=(0, None))(grid, n)
    attend = functools.partial(
        image_attention,
        segment=layout.segment,
        spans=spans,
        single_frame=jnp.all(grid[..., 0] <= 1),
        fused=fused_vision_attention(runtime),
        chunk=runtime.vision_attention_chunk,
    )
    block = functools.partial(_block, cos=cos, sin=sin, attend=attend, act=vision.hidden_act)

    def body(x: jax.Array, p: dict[str, jax.Array]) -> tuple[jax.Array, None]:
        return block(p, x), None

    body = apply_remat(body, runtime.vision_remat or runtime.remat)
    taps = vision.deepstack_visual_indexes
    deep: list[jax.Array] = []
    start = 0
    for end in sorted({i + 1 for i in taps} | {vision.depth}):
        stack = {k: v[start:end] for k, v in blocks.items()}
        if runtime.scan_layers:
            x, _ = jax.lax.scan(body, x, stack)
        else:
            for i in range(end - start):
                x, _ = body(x, {k: v[i] for k, v in stack.items()})
        if end - 1 in taps:
            j = taps.index(end - 1)
            ds = params["deepstack"]
            deep.append(
                merge_patches(
                    x,
                    *(ds[name][j] for name in _MERGER_NAMES),
                    merge=m,
                    postshuffle_norm=True,
                )
            )
        start = end
    embeds = merge_patches(
        x, *(top[f"merger_{name}"] for name in _MERGER_NAMES), merge=m, postshuffle_norm=False
    )  # [G, M, Ho]
    deepstack = (
        jnp.stack(deep, axis=1) if deep else jnp.zeros((g, 0, *embeds.shape[1:]), embeds.dtype)
    )  # [G, D, M, Ho]
    if not batched:
        return VisionOut(embeds[0], deepstack[0])
    return VisionOut(embeds, deepstack)


_MERGER_NAMES = ("norm", "norm_bias", "fc1", "fc1_bias", "fc2", "fc2_bias")


def scatter_rows(
    features: Float[Array, "G M H"], is_image: jax.Array, x: Float[Array, "G T H"]
) -> Float[Array, "G T H"]:
    """Puts feature row r of group g at the r-th image token of group g of ``x``.

    ``is_image`` bool[G, T]; rows beyond the group's image tokens are unused.
    """
    idx = jnp.clip(jnp.cumsum(is_image, axis=1) - 1, 0, features.shape[1] - 1)  # [G, T]
    rows = jnp.take_along_axis(features, idx[..., None], axis=1)  # [G, T, H]
    return jnp.where(is_image[..., None], rows.astype(x.dtype), x)


def gather_rows(features: Float[Array, "G M H"], is_image: jax.Array) -> Float[Array, "G T H"]:
    """Feature row of each image token (zeros elsewhere), laid out like ``is_image`` [G, T]."""
    idx = jnp.clip(jnp.cumsum(is_image, axis=1) - 1, 0, features.shape[1] - 1)
    rows = jnp.take_along_axis(features, idx[..., None], axis=1)
    return jnp.where(is_image[..., None], rows, jnp.zeros((), rows.dtype))
