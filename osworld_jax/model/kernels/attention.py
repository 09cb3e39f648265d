"""Fused causal attention for the trainer's row layout (cuDNN flash attention on GPU).

The trainer's rows hold one segment each, followed by padding (``pack_batch``: one row per
segment; positions ``0..len-1``, padding continuing). For such rows the model's mask
(`osworld_jax.model.layers.segment_mask`) is exactly "causal, keys < len" for every real query,
so attention can run as ``jax.nn.dot_product_attention(is_causal=True, *_seq_lengths=len)``:
cuDNN's fused flash kernel, which never materialises the [S, S] scores and skips the masked
upper triangle. ``len`` is read off the mask (the last real query sees the whole segment).

Real-token outputs equal `layers.attention`; padding queries differ (they are never trained on).
Rows that pack several segments need the general masked path (``attention="xla"``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def segment_lengths(mask: Bool[Array, "B S T"]) -> jax.Array:
    """i32[B]: keys seen by the row's last real query = its segment length (>= 1)."""
    return jnp.max(jnp.sum(mask, axis=-1, dtype=jnp.int32), axis=-1)


def causal_attention_by_lengths(
    q: Float[Array, "B S N D"],
    k: Float[Array, "B S KV D"],
    v: Float[Array, "B S KV D"],
    lengths: Int[Array, " B"],
    *,
    implementation: str | None = None,
) -> Float[Array, "B S N D"]:
    """GQA ``softmax(q k^T / sqrt(D)) v``, causal, row b's keys ``< lengths[b]``; cuDNN on GPU.

    Args:
      q, k, v: queries [B, S, N, D] and keys/values [B, S, KV, D] (N a multiple of KV).
      lengths: i32[B] real tokens of each row (>= 1).
      implementation: "cudnn", "xla", or None (cuDNN when on GPU with 16-bit inputs).
    """
    if implementation is None:
        implementation = "cudnn" if fused_available(q) else "xla"
    return jax.nn.dot_product_attention(  # type: ignore[call-overload]
        q,
        k,
        v,
        is_causal=True,
        query_seq_lengths=lengths,
        key_value_seq_lengths=lengths,
        implementation=implementation,
    )


def fused_available(q: jax.Array) -> bool:
    """Whether cuDNN's flash kernels serve these queries: on a GPU, 16-bit."""
    return jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)


def padded_causal_attention(
    q: Float[Array, "B S N D"],
    k: Float[Array, "B S KV D"],
    v: Float[Array, "B S KV D"],
    mask: Bool[Array, "B S S"],
    *,
    implementation: str | None = None,
) -> Float[Array, "B S N D"]:
    """`causal_attention_by_lengths` with each row's length read off the model's [B, S, S] mask
    of one-segment-then-padding rows (see module doc)."""  # noqa: D205, D209
    return causal_attention_by_lengths(
        q, k, v, segment_lengths(mask), implementation=implementation
    )
