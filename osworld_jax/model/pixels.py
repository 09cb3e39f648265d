"""Screenshots' float32 patches made on the device from uint8 patch levels.

The image processor's values are a per-channel function of each uint8 level (rescale, then
normalise): a host sends the levels (`ImageProcessor.levels`, 1 / (4 T) of the float32 patches'
bytes) with the processor's 256-entry table per channel, and the device looks them up. The
trainer's upload (`trainer/images.py`) and the server's vision tower
(`server/image_embeddings.py`) both do.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.jit, static_argnames="frames")
def patches_from_levels(
    levels: jax.Array, counts: jax.Array, table: jax.Array, *, frames: int
) -> jax.Array:
    """The processor's float32 patches of uint8 patch levels, on the device.

    Args:
      levels: u8[n, Np, C, PP] rows' patch levels (`RowImages.levels`).
      counts: i32[n] real patches per row; the rest are padding (0.0).
      table: f32[C, 256] the processor's value of each level per channel (`value_table`).
      frames: T, the temporal patch size (each frame the same image).

    Returns:
      f32[n, Np, C * T * PP], equal bit for bit to `RowImages.pixel_values` (a lookup).
    """
    n, np_, c, pp = levels.shape
    channel = jnp.arange(c)[None, None, :, None]  # [1, 1, C, 1]
    values = table[channel, levels.astype(jnp.int32)]  # [n, Np, C, PP] f32
    values = jnp.broadcast_to(values[:, :, :, None], (n, np_, c, frames, pp))
    real = jnp.arange(np_)[None, :] < counts[:, None]  # [n, Np]
    values = jnp.where(real[:, :, None, None, None], values, 0.0)  # [n, Np, C, T, PP]
    return values.reshape(n, np_, c * frames * pp)
