"""One Qwen3-MoE decoder layer as pure functions of arrays (HF ``Qwen3MoeDecoderLayer``).

``x = x + o(attn(rope(q_norm(q(n1 x))), rope(k_norm(k(n1 x))), v(n1 x)))``;
``x = x + mlp(n2 x)`` with ``mlp`` the sparse MoE block or the dense SwiGLU MLP.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from osworld_jax.model import moe
from osworld_jax.model.config import ModelRuntimeConfig, Qwen3MoeConfig
from osworld_jax.model.expert_parallel import expert_parallel, expert_parallel_size
from osworld_jax.model.rope import apply_rope

_NEG = float(jnp.finfo(jnp.float32).min)


def rms_norm(x: Float[Array, "... H"], w: Float[Array, " H"], eps: float) -> Float[Array, "... H"]:
    """HF RMSNorm in float32: ``w * x / sqrt(mean(x^2) + eps)``, returned in ``x.dtype``.

    Differentiated by `_rms_norm` (a ``custom_vjp``) whose residuals are ``x`` in its own dtype
    and the float32 ``1/rms`` per row, not the float32 upcast of ``x`` (which a scan over layers
    would stack as ``[L, ..., H]`` float32 buffers).
    """
    return _rms_norm(x, w, eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    return _rms_norm_fwd(x, w, eps)[0]


def _rms_norm_fwd(x, w, eps):
    xf = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)  # [..., 1]
    return (w.astype(jnp.float32) * (xf * r)).astype(x.dtype), (x, w, r)


def _rms_norm_bwd(eps, res, dy):
    """``n = x r``: ``dw = sum dy n``; ``dx = r (dy w - n mean(dy w n))`` (float32)."""
    x, w, r = res
    n = x.astype(jnp.float32) * r
    dyf = dy.astype(jnp.float32)
    dn = dyf * w.astype(jnp.float32)
    dx = r * (dn - n * jnp.mean(dn * n, axis=-1, keepdims=True))
    dw = jnp.sum((dyf * n).reshape(-1, n.shape[-1]), axis=0)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def constrain_batch(x: jax.Array, batch_axes: tuple[str, ...]) -> jax.Array:
    """Shards ``x``'s leading (batch) dim over ``batch_axes`` of the ambient mesh, if any."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    axes = tuple(a for a in batch_axes if a in mesh.axis_names and mesh.shape[a] > 1)
    size = 1
    for a in axes:
        size *= mesh.shape[a]
    if not axes or x.shape[0] % size:
        return x
    spec = jax.sharding.PartitionSpec(axes, *([None] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, spec)


def segment_mask(
    segment_ids: Int[Array, "B S"], positions: Int[Array, "B S"]
) -> Bool[Array, "B S S"]:
    """Query i sees key j iff same non-zero segment and ``pos_j <= pos_i``.

    Padding queries (segment 0) see only themselves so their softmax stays finite.
    """
    seg_q, seg_k = segment_ids[:, :, None], segment_ids[:, None, :]
    causal = positions[:, None, :] <= positions[:, :, None]  # [B, S, S]
    same = (seg_q == seg_k) & (seg_q != 0)  # [B, S, S]
    eye = jnp.eye(segment_ids.shape[1], dtype=bool)[None]  # [1, S, S]
    return (same & causal) | eye


def cache_mask(positions: Int[Array, "B S"], max_len: int) -> Bool[Array, "B S M"]:
    """With a KV cache, query at position p sees cache slots ``j <= p``."""
    return jnp.arange(max_len)[None, None, :] <= positions[:, :, None]


def attention(
    q: Float[Array, "B S N D"],
    k: Float[Array, "B T KV D"],
    v: Float[Array, "B T KV D"],
    mask: Bool[Array, "B S T"],
) -> Float[Array, "B S N D"]:
    """GQA softmax attention (query head h uses kv head h // (N / KV)); float32 softmax."""
    b, s, n, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, s, kv, n // kv, d)  # [B, S, KV, G, D]
    scores = jnp.einsum("bskgd,btkd->bkgst", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (d**-0.5)  # [B, KV, G, S, T]
    scores = jnp.where(mask[:, None, None], scores, _NEG)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgst,btkd->bskgd", probs, v)  # [B, S, KV, G, D]
    return out.reshape(b, s, n, d)


def own_causal_attention(
    q: Float[Array, "B S N D"],
    k: Float[Array, "B S KV D"],
    v: Float[Array, "B S KV D"],
    lengths: Int[Array, " B"],
    impl: str,
    chunk: int,
) -> Float[Array, "B S N D"]:
    """Causal attention of a prompt over its own keys, row b's first ``lengths[b]`` real.

    A prefill from cache row 0 (nothing kept before it) attends only to its own tokens, so it
    needs no cache reads: cuDNN's causal flash kernel (``impl="cudnn"`` on a GPU, 16-bit) or
    `chunked_attention` with the causal band skipping. Real queries' outputs equal attending
    over the cache written first; padding queries see the real keys before them.
    """
    from osworld_jax.model.kernels.attention import causal_attention_by_lengths, fused_available

    s, lengths = q.shape[1], jnp.maximum(lengths, 1)  # a padding row: its first token
    if impl == "cudnn" and fused_available(q):
        return causal_attention_by_lengths(q, k, v, lengths, implementation="cudnn")
    key, query = jnp.arange(s)[None, None, :], jnp.arange(s)[None, :, None]
    mask = (key <= query) & (key < lengths[:, None, None])  # [B, S, S]
    if 0 < chunk < s:
        return chunked_attention(q, k, v, mask, chunk, causal=True)
    return attention(q, k, v, mask)


def chunked_attention(
    q: Float[Array, "B S N D"],
    k: Float[Array, "B T KV D"],
    v: Float[Array, "B T KV D"],
    mask: Bool[Array, "B S T"],
    chunk: int,
    causal: bool = False,
) -> Float[Array, "B S N D"]:
    """`attention` over blocks of ``chunk`` queries, each block rematerialised in backward.

    Same values as `attention`; the f32 score buffer is [B, N, chunk, T] instead of
    [B, N, S, T] in the forward pass and (through ``jax.checkpoint`` per block) the backward.

    ``causal`` (self-attention, S = T, and ``mask`` causal by index: query i sees no key j > i,
    as `segment_mask` is over token order): the blocks are grouped into at most `CAUSAL_BANDS`
    bands and a band's queries score only the keys up to the band's end. Every skipped score
    is masked, so the values are `attention`'s (up to float summation order); the work is
    ``(1 + 1/bands) / 2`` of the full square (4 bands: 62.5%).
    """
    b, s, n, d = q.shape
    if causal and k.shape[1] != s:
        raise ValueError(f"causal chunked attention: {s} queries but {k.shape[1]} keys")
    pad = -s % chunk
    qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    mp = jnp.pad(mask, ((0, 0), (0, pad), (0, 0)), constant_values=True)
    nc = (s + pad) // chunk

    def blocks(qs: jax.Array, ms: jax.Array, keys: int) -> jax.Array:
        """Query blocks ``qs [B, c*chunk, N, D]`` against the first ``keys`` keys."""
        kb, vb = k[:, :keys], v[:, :keys]
        qc = jnp.moveaxis(qs.reshape(b, -1, chunk, n, d), 1, 0)  # [c, B, C, N, D]
        mc = jnp.moveaxis(ms[:, :, :keys].reshape(b, -1, chunk, keys), 1, 0)  # [c, B, C, keys]
        block = jax.checkpoint(lambda qm: attention(qm[0], kb, vb, qm[1]))
        out = jax.lax.map(block, (qc, mc))  # [c, B, C, N, D]
        return jnp.moveaxis(out, 0, 1).reshape(b, -1, n, d)

    if not causal:
        return blocks(qp, mp, k.shape[1])[:, :s]
    per_band = -(-nc // min(nc, CAUSAL_BANDS))  # blocks per band
    outs = []
    for c0 in range(0, nc, per_band):
        c1 = min(c0 + per_band, nc)
        rows = slice(c0 * chunk, c1 * chunk)
        outs.append(blocks(qp[:, rows], mp[:, rows], min(c1 * chunk, s)))
    return jnp.concatenate(outs, axis=1)[:, :s]


#: Bands of `chunked_attention` with ``causal``: more skip more of the upper triangle, each one
#: more copy of the block program to compile.
CAUSAL_BANDS = 8


class LayerCache(NamedTuple):
    """KV cache rows: k, v [B, M, KV, D] of one layer, or [L, B, M, KV, D] with a layer index."""

    k: jax.Array
    v: jax.Array


class LayerOut(NamedTuple):
    """What a decoder layer returns besides the new residual stream."""

    routed: jax.Array  # i32[B, S, K] (-1 on dense layers)
    expert_count: jax.Array  # f32[E] live top-k assignments of valid tokens
    prob_sum: jax.Array  # f32[E]
    z_sum: jax.Array  # f32[]
    cache: LayerCache | None
    agreeing_routes: jax.Array  # f32[] replayed routes equal to the live top-k (R3 agreement)
    replayed_routes: jax.Array  # f32[] valid tokens with a replayed route


def _scatter_cache(
    cache: LayerCache, k: jax.Array, v: jax.Array, positions: jax.Array, layer: jax.Array | None
) -> LayerCache:
    """Writes k/v [B, S, KV, D] into cache rows at ``positions`` (out-of-range writes drop),
    of layer ``layer`` when the cache holds every layer's rows."""  # noqa: D205, D209
    rows = jnp.arange(k.shape[0])[:, None]  # [B, 1]
    at = (rows, positions) if layer is None else (layer, rows, positions)
    new_k = cache.k.at[at].set(k.astype(cache.k.dtype), mode="drop")
    new_v = cache.v.at[at].set(v.astype(cache.v.dtype), mode="drop")
    return LayerCache(new_k, new_v)


def attention_block(
    p: dict[str, jax.Array],
    x: Float[Array, "B S H"],
    *,
    config: Qwen3MoeConfig,
    cos: jax.Array,
    sin: jax.Array,
    mask: jax.Array | None,
    positions: jax.Array,
    cache: LayerCache | None,
    impl: str = "xla",
    chunk: int = 0,
    causal: bool = False,
    own_lengths: jax.Array | None = None,
    layer: jax.Array | None = None,
) -> tuple[jax.Array, LayerCache | None]:
    """Self-attention of one layer (input already normed); returns (out [B,S,H], new cache).

    ``impl="cudnn"`` (no cache): fused causal attention of one-segment rows
    (`osworld_jax.model.kernels.attention`). ``chunk > 0`` (XLA path): `chunked_attention`,
    skipping the keys after each band of queries when ``causal`` (no cache; ``mask`` causal by
    token index). ``layer``: the cache holds every layer's rows [L, B, M, KV, D] (the policy's
    layer loops carry it whole); this layer writes its rows there and reads its own window.
    ``own_lengths`` (a cache holding nothing before the call: a fresh prefill): the rows are
    written and the queries attend to their own keys (`own_causal_attention`).
    """
    eps = config.rms_norm_eps
    q = rms_norm(jnp.einsum("bsh,hnd->bsnd", x, p["q_proj"]), p["q_norm"], eps)
    k = rms_norm(jnp.einsum("bsh,hnd->bsnd", x, p["k_proj"]), p["k_norm"], eps)
    v = jnp.einsum("bsh,hnd->bsnd", x, p["v_proj"])
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if cache is not None and own_lengths is not None:
        out = own_causal_attention(q, k, v, own_lengths, impl, chunk)
        cache = _scatter_cache(cache, k, v, positions, layer)
        return jnp.einsum("bsnd,ndh->bsh", out, p["o_proj"]), cache
    if cache is not None:
        cache = _scatter_cache(cache, k, v, positions, layer)
        k, v = (cache.k, cache.v) if layer is None else (cache.k[layer], cache.v[layer])
        k, v = k.astype(q.dtype), v.astype(q.dtype)
        mask = cache_mask(positions, k.shape[1])
    assert mask is not None
    if impl == "cudnn" and cache is None:
        from osworld_jax.model.kernels.attention import padded_causal_attention

        out = padded_causal_attention(q, k, v, mask)
    elif 0 < chunk < q.shape[1]:
        out = chunked_attention(q, k, v, mask, chunk, causal=causal and cache is None)
    else:
        out = attention(q, k, v, mask)
    return jnp.einsum("bsnd,ndh->bsh", out, p["o_proj"]), cache


def decoder_layer(
    attn_p: dict[str, jax.Array],
    mlp_p: dict[str, jax.Array],
    x: Float[Array, "B S H"],
    *,
    is_moe: bool,
    config: Qwen3MoeConfig,
    runtime: ModelRuntimeConfig,
    cos: jax.Array,
    sin: jax.Array,
    mask: jax.Array | None,
    positions: jax.Array,
    valid: Float[Array, "B S"],
    replay: Int[Array, "B S K"] | None,
    cache: LayerCache | None,
    causal: bool = False,
    own_lengths: jax.Array | None = None,
    layer: jax.Array | None = None,
) -> tuple[jax.Array, LayerOut]:
    """One decoder layer; returns (new residual [B,S,H], `LayerOut`).

    ``causal``: the mask is causal by token index; ``own_lengths``: a fresh prefill attends
    to its own keys; ``layer``: the cache holds every layer's rows (see `attention_block`).
    """
    b, s, h = x.shape
    eps = config.rms_norm_eps
    attn_out, cache = attention_block(
        attn_p,
        rms_norm(x, attn_p["input_norm"], eps),
        config=config,
        cos=cos,
        sin=sin,
        mask=mask,
        positions=positions,
        cache=cache,
        impl=runtime.attention,
        chunk=runtime.attention_chunk,
        causal=causal,
        own_lengths=own_lengths,
        layer=layer,
    )
    x = x + attn_out
    y = rms_norm(x, attn_p["post_norm"], eps).reshape(b * s, h)  # [T, H]
    k, e = config.num_experts_per_tok, config.num_experts
    zero = jnp.zeros((), jnp.float32)
    agreeing, replayed = zero, zero
    if is_moe:
        replay_rows = None if replay is None else replay.reshape(b * s, k)  # [T, K]
        routing = moe.route(
            y, mlp_p["router"], top_k=k, norm_topk_prob=config.norm_topk_prob, replay=replay_rows
        )
        agreeing, replayed = moe.replay_agreement(routing, replay_rows, valid.reshape(-1))
        out = _expert_mlp(
            runtime, y, routing.experts, routing.weights.astype(y.dtype), *_experts(mlp_p)
        )  # [T, H]
        count, prob_sum, z_sum = moe.router_stats(routing, valid.reshape(-1))
        routed = routing.experts.reshape(b, s, k).astype(jnp.int32)
    else:
        out = moe.swiglu_mlp(y, mlp_p["gate"], mlp_p["up"], mlp_p["down"])
        count, prob_sum = jnp.zeros((e,), jnp.float32), jnp.zeros((e,), jnp.float32)
        z_sum = jnp.zeros((), jnp.float32)
        routed = jnp.full((b, s, k), -1, jnp.int32)
    x = constrain_batch(x + out.reshape(b, s, h).astype(x.dtype), runtime.activation_batch_axes)
    return x, LayerOut(routed, count, prob_sum, z_sum, cache, agreeing, replayed)


def _expert_mlp(runtime: ModelRuntimeConfig, x: jax.Array, *args: jax.Array) -> jax.Array:
    """The runtime's expert backend, expert-parallel under a mesh with ``expert`` > 1."""
    if not (runtime.expert_parallel and expert_parallel_size() > 1):
        return moe.EXPERT_BACKENDS.get(runtime.expert_backend)(x, *args)
    return expert_parallel(moe.EXPERT_BACKENDS.get(runtime.expert_backend), x, *args)


def _experts(p: dict[str, Any]) -> tuple[jax.Array, jax.Array, jax.Array]:
    return p["gate"], p["up"], p["down"]
