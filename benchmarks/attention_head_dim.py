"""cuDNN flash attention at the ViT's head dim (72) and zero-padded to 80 / 96 / 128 (GPU).

    python benchmarks/attention_head_dim.py            # bench-vl: 4 images x 8,160 patches

Qwen3-VL's vision tower has 16 heads of 72. cuDNN's Hopper flash kernels come in a few head-dim
tiles; a head dim between two tiles runs at the larger one's cost. Zero-padding q, k and v to a
width D' changes nothing in the result (the padded q/k columns add 0 to every score, the padded
v columns give output columns that are dropped; the scale stays 72^-1/2), so the question is
only which width runs fastest. Prints forward and forward + backward times per layout (one
packed row with a ragged segment per image, as `model.vision.packed_attention` runs it, and the
images as a plain batch) and the largest difference of the padded results from the unpadded.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from jax._src.cudnn.fused_attention_stablehlo import MaskType
from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_attention


def time_ms(fn, *args, reps: int) -> float:
    """Milliseconds a call of ``fn(*args)`` takes (after one untimed call), over ``reps``."""
    out = fn(*args)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    """Times the layouts and widths, prints one table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=4)
    p.add_argument("--patches", type=int, default=8160)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=72)
    p.add_argument("--widths", default="72,80,96,128")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    n, t, h, d = args.images, args.patches, args.heads, args.head_dim
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, g = (jax.random.normal(kk, (n, t, h, d), jnp.bfloat16) for kk in keys)
    scale = d**-0.5
    lengths = jnp.full((1, n + 1), t, jnp.int32).at[0, n].set(-1)
    offsets = jnp.concatenate([jnp.arange(n) * t, jnp.array([-1, -1])]).astype(jnp.int32)[None]

    def batched(q, k, v):
        return cudnn_attention(q, k, v, scale=scale, mask_type=MaskType.NO_MASK, qkv_layout="BTNH")

    def packed(q, k, v):
        flat = [x.reshape(1, n * t, h, x.shape[-1]) for x in (q, k, v)]
        out = cudnn_attention(
            *flat,
            q_seqlen=lengths,
            kv_seqlen=lengths,
            q_offsets=offsets,
            kv_offsets=offsets,
            scale=scale,
            mask_type=MaskType.NO_MASK,
            qkv_layout="BTNH",
        )
        return out.reshape(n, t, h, -1)

    flops_fwd = 4 * n * t * t * h * d
    print(f"{n} images x {t} patches, {h} heads of {d}; forward {flops_fwd / 1e12:.2f} TFLOP")
    print("| layout | width | fwd ms | fwd+bwd ms | TFLOP/s (fwd+bwd, 3.5x fwd) | max diff |")
    print("|---|---|---|---|---|---|")
    ref = None
    for name, attn in (("packed", packed), ("batch", batched)):
        for width in [int(w) for w in args.widths.split(",")]:
            pad = ((0, 0), (0, 0), (0, 0), (0, width - d))

            def fwd(q, k, v, attn=attn, pad=pad):
                out = attn(jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad))
                return out[..., :d]

            def loss(q, k, v, fwd=fwd):
                return jnp.sum(fwd(q, k, v).astype(jnp.float32) * g.astype(jnp.float32))

            f = jax.jit(fwd)
            b = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            out = f(q, k, v)
            if ref is None:
                ref = out
            diff = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
            tf = time_ms(f, q, k, v, reps=args.reps)
            tb = time_ms(b, q, k, v, reps=args.reps)
            rate = 3.5 * flops_fwd / (tb / 1e3) / 1e12
            print(f"| {name} | {width} | {tf:.2f} | {tb:.2f} | {rate:.0f} | {diff:.2e} |")


if __name__ == "__main__":
    main()
