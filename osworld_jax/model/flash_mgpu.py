"""Flash attention at head widths of multiples of 16 (Hopper, Mosaic GPU): the ViT's 72 runs at 80.

cuDNN's Hopper flash kernels tile the head dim at 64 or 128: Qwen3-VL's vision heads (72) run
on the 128 tile, 72 of 128 columns doing work (benchmarks/NOTES.md, issue 31). JAX ships a
FlashAttention-3 style kernel in Mosaic GPU (`jax.experimental.pallas.ops.gpu.attention_mgpu`:
TMA loads, warp-specialized, wgmma; forward and backward) for head dims that are multiples of
64, because its shared-memory tiles use the 128-byte swizzle (64 bf16 columns). wgmma takes K
in steps of 16 bf16 and N in steps of 8, so the same kernel with the 32-byte swizzle (16-column
tiles) serves 80. `kernels` builds that variant from the installed module's source (five
textual changes, each checked: a jax whose source differs fails with the line it missed), so
the kernel's schedule stays JAX's.

`padded_attention` is the interface: softmax(q k^T / sqrt(D)) v per (batch row, head) of
q/k/v [B, T, H, D] (16-bit). It pads D to the next multiple of 16 *above* D (72 -> 80) and T to
the kernel's block unit (8,160 -> 8,192), and spends one spare column on the padded keys' mask:
q's column D is 1, k's is 0 for a real key and ``MASK`` for a padded one, so a padded key scores
``MASK`` (~-30,000) and weighs exactly 0. The scale is applied to q beforehand (the kernel takes
scores as q k^T). Padded queries' rows are computed and dropped; their cotangents are zero, so
they add nothing to dk / dv.

Measured against cuDNN in `benchmarks/vit_attention_mgpu.py` (benchmarks/NOTES.md, seventh
session: 4-13% faster at bench-vl's shapes); the vision tower does not call it yet.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import sys
import types
from collections.abc import Callable

import jax
import jax.numpy as jnp

#: The padded keys' score (bf16-exact; exp of it underflows to 0 in float32).
MASK = -30_000.0

#: (old, new, count) source changes of jax's attention_mgpu: head dims of 16, its input dtype.
_PATCHES = (
    ("if head_dim % 64:", "if head_dim % 16:", 2),
    ("plgpu.TilingTransform((8, 64))", "plgpu.TilingTransform((8, _tile_cols(head_dim)))", 2),
    ("plgpu.SwizzleTransform(128)", "plgpu.SwizzleTransform(2 * _tile_cols(head_dim))", 2),
    ("head_dim), jnp.float16,", "head_dim), dtype,", 5),
    ("head_dim), dtype=jnp.float16)", "head_dim), dtype=dtype)", 1),
)

_HELPER = '''

def _tile_cols(head_dim):
  """Columns of one shared-memory tile: the widest swizzle (128 / 64 / 32 bytes) dividing it."""
  return 64 if head_dim % 64 == 0 else 32 if head_dim % 32 == 0 else 16
'''


@functools.cache
def kernels() -> types.ModuleType:
    """The attention_mgpu module of jax, rebuilt for head dims that are multiples of 16."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    src = inspect.getsource(attention_mgpu)
    src = src[: src.index("\ndef main(")]
    for old, new, count in _PATCHES:
        if src.count(old) != count:
            raise RuntimeError(
                f"jax {jax.__version__}'s pallas/ops/gpu/attention_mgpu.py holds {old!r} "
                f"{src.count(old)} times, not {count}: flash_mgpu needs updating"
            )
        src = src.replace(old, new)
    module = types.ModuleType(f"{__name__}._attention_mgpu")
    module.__file__ = attention_mgpu.__file__
    sys.modules[module.__name__] = module  # its dataclasses look their module up
    code = compile(src + _HELPER, f"{attention_mgpu.__file__} (head dims of 16)", "exec")
    exec(code, module.__dict__)  # noqa: S102 - jax's own source, changed as listed above
    return module


@dataclasses.dataclass(frozen=True)
class FlashConfig:
    """Tiles of the kernels (jax's ``TuningConfig``; measured: benchmarks/vit_attention_mgpu.py).

    The forward runs two warpgroups of ``block_q`` queries a CTA against ``block_kv`` keys a
    step (``max_concurrent_steps`` in flight); the backward's dK/dV kernel ``block_kv_dkv``
    keys against ``block_q_dkv`` queries a step, its dQ kernel the other way round, each with
    ``compute_wgs_bwd`` warpgroups.
    """

    block_q: int = 64
    block_kv: int = 128
    max_concurrent_steps: int = 3
    compute_wgs_bwd: int = 2
    block_q_dkv: int = 64
    block_kv_dkv: int = 64
    block_q_dq: int = 64
    block_kv_dq: int = 64

    @property
    def unit(self) -> int:
        """The sequence length must be a multiple of this (both passes' blocks)."""
        w = self.compute_wgs_bwd
        return math.lcm(
            2 * self.block_q,
            self.block_kv,
            self.block_q_dq * w,
            self.block_kv_dkv * w,
            self.block_q_dkv,
            self.block_kv_dq,
        )

    def tuning(self) -> object:
        """The kernels' ``TuningConfig`` for these tiles."""
        return kernels().TuningConfig(**dataclasses.asdict(self))


def padded_width(head_dim: int) -> int:
    """The kernel's head width: the next multiple of 16 above ``head_dim`` (one spare column).

    >>> [padded_width(d) for d in (64, 72, 80, 128)]
    [80, 80, 96, 144]
    """
    return (head_dim // 16 + 1) * 16


def padded_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    config: FlashConfig | None = None,
    *,
    lengths: jax.Array | None = None,
    kernel: Callable[[jax.Array, jax.Array, jax.Array], jax.Array] | None = None,
) -> jax.Array:
    """Bidirectional attention of q/k/v [B, T, H, D] -> [B, T, H, D], on the padded kernel.

    ``lengths`` (i32[B], traced): row b's keys past ``lengths[b]`` are masked (default: all T
    are real). ``kernel`` (tests): ``(q, k, v) -> softmax(q k^T) v`` at the padded shapes
    [B, T', H, D']; by default jax's Mosaic GPU kernel (`kernels`) with ``config``'s tiles.
    """
    config = config or FlashConfig()
    b, t, h, d = q.shape
    width, length = padded_width(d), -(-t // config.unit) * config.unit
    if kernel is None:
        tuning = config.tuning()

        def kernel(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            return kernels().attention(q, k, v, tuning)

    limit = jnp.full((b,), t, jnp.int32) if lengths is None else lengths.astype(jnp.int32)
    real = jnp.arange(length)[None, :] < limit[:, None]  # [B, T']

    def pad(x: jax.Array, column: jax.Array) -> jax.Array:  # [B, T, H, D] -> [B, T', H, D']
        x = jnp.pad(x, ((0, 0), (0, length - t), (0, 0), (0, 0)))
        col = jnp.broadcast_to(column.astype(x.dtype)[:, :, None, None], (b, length, h, 1))
        rest = jnp.zeros((b, length, h, width - d - 1), x.dtype)
        return jnp.concatenate([x, col, rest], axis=-1)

    scaled = (q.astype(jnp.float32) * d**-0.5).astype(q.dtype)
    out = kernel(
        pad(scaled, jnp.ones((b, length))),  # [B, T', H, D']
        pad(k, jnp.where(real, 0.0, MASK)),  # [B, T', H, D']
        pad(v, jnp.zeros((b, length))),  # [B, T', H, D']
    )
    return out[:, :t, :, :d]  # [B, T, H, D]
