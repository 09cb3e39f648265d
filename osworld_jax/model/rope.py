"""Rotary position embeddings (RoPE) exactly as HF transformers computes them.

The inverse frequencies (and yarn's attention factor) are host-side numpy constants of the
config; `apply_rope` rotates ``x`` by ``positions * inv_freq`` in float32 with HF's
"rotate half" convention: ``x * cos + rotate_half(x) * sin``, cos/sin of ``concat(f, f)``.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from osworld_jax.model.config import Qwen3MoeConfig


def rope_frequencies(config: Qwen3MoeConfig) -> tuple[np.ndarray, float]:
    """(inv_freq f32[D/2], attention_scaling) per HF's ROPE_INIT_FUNCTIONS for the rope type."""
    dim, base = config.head_dim, config.rope_theta
    inv_freq = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    scaling = config.rope_scaling_dict
    if scaling is None:
        return inv_freq.astype(np.float32), 1.0
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return (inv_freq / scaling["factor"]).astype(np.float32), 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if rope_type == "yarn":
        return _yarn(config, scaling)
    raise AssertionError(rope_type)  # config validation rejects other types


def _llama3(inv_freq: np.ndarray, s: dict) -> np.ndarray:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(config: Qwen3MoeConfig, s: dict) -> tuple[np.ndarray, float]:
    dim, base = config.head_dim, config.rope_theta
    old_len = s["original_max_position_embeddings"]
    factor = s.get("factor") or config.max_position_embeddings / old_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention_factor = (
            mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        )
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return (dim * math.log(old_len / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)).astype(np.float32)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1.0 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq.astype(np.float32), float(attention_factor)


def rope_cos_sin(
    positions: Int[Array, "B S"], inv_freq: np.ndarray, attention_scaling: float
) -> tuple[Float[Array, "B S D"], Float[Array, "B S D"]]:
    """cos/sin f32[B, S, D] of ``positions * inv_freq`` (HF: ``emb = cat(freqs, freqs)``)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, S, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [B, S, D]
    return jnp.cos(emb) * attention_scaling, jnp.sin(emb) * attention_scaling


def mrope_cos_sin(
    positions: Int[Array, "3 B S"],
    inv_freq: np.ndarray,
    attention_scaling: float,
    axes: tuple[int, ...],
) -> tuple[Float[Array, "B S D"], Float[Array, "B S D"]]:
    """Interleaved M-RoPE cos/sin f32[B, S, D] (HF Qwen3-VL ``recomposition_frequencies``).

    Frequency ``i`` rotates by position row ``axes[i]`` (0 = t, 1 = h, 2 = w):
    ``f_i = positions[axes[i]] * inv_freq[i]``, then ``emb = cat(f, f)`` as in `rope_cos_sin`.
    Three equal rows give exactly `rope_cos_sin` of that row (the selection copies values).
    """
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [3, B, S, D/2]
    index = jnp.broadcast_to(jnp.asarray(axes, jnp.int32), (1, *freqs.shape[1:]))
    freqs = jnp.take_along_axis(freqs, index, axis=0)[0]  # [B, S, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [B, S, D]
    return jnp.cos(emb) * attention_scaling, jnp.sin(emb) * attention_scaling


def apply_rope(
    x: Float[Array, "B S N D"], cos: Float[Array, "B S D"], sin: Float[Array, "B S D"]
) -> Float[Array, "B S N D"]:
    """Rotates heads ``x`` in float32 and casts back to ``x.dtype``."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    out = xf * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)
