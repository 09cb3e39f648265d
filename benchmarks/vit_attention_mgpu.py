"""The ViT's attention (16 heads of 72) on a Mosaic GPU flash kernel tiled at 80 vs cuDNN (H100).

    python benchmarks/vit_attention_mgpu.py      # bench-vl: 4 images x 8,160 patches

cuDNN runs head dim 72 on its 128-wide tiles (benchmarks/NOTES.md, issue 31: ~330 TFLOP/s
forward against 658 at the LM's 128). JAX ships a FlashAttention-3 style Mosaic GPU kernel
(`jax.experimental.pallas.ops.gpu.attention_mgpu`, warp-specialized, TMA + wgmma) for head dims
that are multiples of 64 (128-byte swizzle). Hopper's wgmma takes K in steps of 16 for bf16,
so a 32-byte swizzle (16-element tiles) serves 80 = 72 + 8. This script builds that variant
from the installed module's source (`osworld_jax.model.flash_mgpu` does the same), and one of
the 8 spare columns carries the mask of the padded keys (8,160 -> 8,192 patches): q's column
72 is 1, k's is 0 for a real patch and -30,000 for a padded one, so a padded key scores
-30,000 and weighs exactly 0 (the scale is applied to q before).

Prints, per implementation: forward and forward + backward ms, TFLOP/s counted at 72, and the
relative RMS error of the output and gradients against a float32 reference (image 0, heads 0-1).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_head_dim import time_ms  # noqa: E402  # type: ignore[import-not-found]

from osworld_jax.model.flash_mgpu import FlashConfig, padded_attention  # noqa: E402


def _spec(text: str) -> FlashConfig:
    """``bq:bkv:steps:wgs:q_dkv:kv_dkv:q_dq:kv_dq`` -> a `FlashConfig`."""
    names = [f.name for f in dataclasses.fields(FlashConfig)]
    return FlashConfig(**dict(zip(names, (int(x) for x in text.split(":")), strict=True)))


def main() -> None:
    """Times cuDNN and the Mosaic GPU kernel on the same inputs, prints one table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=4)
    p.add_argument("--patches", type=int, default=8160)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=72)
    p.add_argument(
        "--configs",
        default="64:128:2:2:64:64:64:64,64:128:3:2:64:64:64:64,64:256:2:2:64:64:64:64,"
        "64:128:2:1:64:128:128:64,64:128:2:2:128:64:64:128",
        help="FlashConfig tiles, bq:bkv:steps:wgs:q_dkv:kv_dkv:q_dq:kv_dq, comma-separated",
    )
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    n, t, h, d = args.images, args.patches, args.heads, args.head_dim
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, g = (jax.random.normal(kk, (n, t, h, d), jnp.bfloat16) for kk in keys)
    flops = 4 * n * t * t * h * d
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    print(f"{n} images x {t} patches, {h} heads of {d}; forward {flops / 1e12:.2f} TFLOP")

    # float32 reference of image 0, heads 0-1 (its scores fit): each row's error against it
    sub = (slice(0, 1), slice(None), slice(0, 2))
    qs, ks, vs, gs = (x[sub].astype(jnp.float32) for x in (q, k, v, g))

    def reference(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * d**-0.5
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v, precision="highest")

    ref_out = jax.jit(reference)(qs, ks, vs)
    ref_grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(reference(q, k, v) * gs), (0, 1, 2)))(
        qs, ks, vs
    )

    def rel(a, r):  # relative RMS error on the reference's slice
        a = a[sub].astype(jnp.float32)
        return float(jnp.sqrt(jnp.mean((a - r) ** 2) / jnp.mean(r**2)))

    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")

    def grads(attn):
        def loss(q, k, v):
            return jnp.sum(attn(q, k, v).astype(jnp.float32) * g.astype(jnp.float32))

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    rows = [("cudnn (72 on its 128 tile)", cudnn)]
    for spec in args.configs.split(","):
        cfg = _spec(spec)

        def mgpu(q, k, v, cfg=cfg):
            return padded_attention(q, k, v, cfg)

        rows.append((f"mosaic 80 {spec}", mgpu))
    print(
        "| attention | fwd ms | fwd+bwd ms | fwd TFLOP/s | fwd+bwd TFLOP/s (3.5x) "
        "| out rel. err | dq / dk / dv rel. err |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, attn in rows:
        try:
            f, b = jax.jit(attn), grads(attn)
            err = rel(f(q, k, v), ref_out)
            tf = time_ms(f, q, k, v, reps=args.reps)
            gerr, tb = "-", float("nan")
            try:
                gerr = " / ".join(
                    f"{rel(x, r):.1e}" for x, r in zip(b(q, k, v), ref_grads, strict=True)
                )
                tb = time_ms(b, q, k, v, reps=args.reps)
            except Exception as e:  # noqa: BLE001 - the table says what failed
                print(f"backward failed ({name}): {type(e).__name__}: {str(e)[:300]}")
            print(
                f"| {name} | {tf:.2f} | {tb:.2f} | {flops / tf / 1e9:.0f} | "
                f"{3.5 * flops / tb / 1e9:.0f} | {err:.1e} | {gerr} |",
                flush=True,
            )
        except Exception as e:  # noqa: BLE001
            print(f"| {name} | failed: {type(e).__name__}: {str(e)[:400]} |", flush=True)
            traceback.print_exc(limit=3)


if __name__ == "__main__":
    main()
