"""The ViT's attention on a GPU: cuDNN's packed kernel vs the XLA path (values and time).

    python benchmarks/vision_attention.py            # checks, then bench-vl's tower timings

1. Checks (bf16, Qwen3-VL-30B-A3B's tower cut to 3 blocks, 2 rows of 3 images of different
   sizes plus padding patches): `vision_tower` with ``attention="cudnn"`` (`packed_attention`)
   against ``attention="xla"`` (`segment_attention`), outputs and gradients w.r.t. every
   parameter, relative error ``|a - b| / |b|``; and a multi-frame grid row (the XLA branch
   of the same program).
2. Timings: the full tower (27 blocks) forward + backward on bench-vl's 4 screenshots
   (4 x 8,160 patches in one row) per ``vision_remat`` policy, cuDNN path; XLA's memory
   analysis of each compiled program (temp bytes: what the tower needs beside its
   parameters and inputs).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_step import CONFIGS  # noqa: E402  # type: ignore[import-not-found]

from osworld_jax.model import Policy  # noqa: E402
from osworld_jax.model.vision import vision_tower  # noqa: E402

GROUPS = ("vision", "vision_blocks", "deepstack")


def _tower_params(config, runtime, depth: int | None = None):
    cfg = config.replace(num_hidden_layers=3)  # the LM is not run: 3 layers (DeepStack levels)
    if depth is not None:
        v = dataclasses.replace(config.vision, depth=depth, deepstack_visual_indexes=(0, 2))
        cfg = cfg.replace(vision=v)
    policy = Policy(cfg, runtime, rngs=nnx.Rngs(0))
    params = policy.params()
    return cfg, {g: params[g] for g in GROUPS}


def _loss_fn(cfg, runtime):
    def loss(params, pixels, grid, w):
        out = vision_tower(params, cfg.vision, runtime, pixels, grid)
        e = out.embeds.astype(jnp.float32)
        return jnp.sum(e * w) + jnp.sum(out.deepstack.astype(jnp.float32) * w[..., None, :, :])

    return loss


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check() -> None:
    bench = CONFIGS["bench-vl"]
    rt_c = dataclasses.replace(bench.runtime, attention="cudnn", vision_remat="none")
    rt_x = dataclasses.replace(rt_c, attention="xla")
    cfg, params = _tower_params(bench.model, rt_c, depth=3)
    v = cfg.vision
    rng = np.random.default_rng(0)
    for name, grids in (
        ("3 images + padding, 2 rows", [[1, 32, 48], [1, 20, 16], [1, 8, 8]]),
        ("a 2-frame clip (XLA branch)", [[2, 16, 16], [1, 8, 8], [0, 0, 0]]),
    ):
        grid = np.array([grids, grids[::-1]], np.int32)
        n = int(grid.prod(-1).sum(-1).max()) + 16
        pixels = jnp.asarray(rng.normal(size=(2, n, v.patch_dim)), jnp.bfloat16)
        m = n // v.spatial_merge_size**2
        w = jnp.asarray(rng.normal(size=(2, m, cfg.hidden_size)), jnp.float32)
        # Only real patches' merged rows count (padding rows are never used).
        real = grid.prod(-1).sum(-1) // v.spatial_merge_size**2
        w = w * (np.arange(m)[None, :, None] < real[:, None, None])
        results = {}
        for label, rt in (("cudnn", rt_c), ("xla", rt_x)):
            f = jax.jit(jax.value_and_grad(_loss_fn(cfg, rt)))
            results[label] = f(params, pixels, jnp.asarray(grid), w)
            fwd = jax.jit(lambda p, x, g, rt=rt: vision_tower(p, cfg.vision, rt, x, g))
            results[label + "_out"] = fwd(params, pixels, jnp.asarray(grid))
        (lc, gc), (lx, gx) = results["cudnn"], results["xla"]
        oc, ox = results["cudnn_out"], results["xla_out"]
        mask = np.arange(m)[None, :] < real[:, None]
        errs = [_rel(np.asarray(oc.embeds)[mask], np.asarray(ox.embeds)[mask])]
        grad_errs = {
            f"{g}.{k}": _rel(gc[g][k], gx[g][k]) for g in gc for k in gc[g] if gx[g][k].size
        }
        worst = max(grad_errs, key=grad_errs.get)
        print(
            f"CHECK {name}: embeds rel err {errs[0]:.2e}, loss {float(lc):.4f} vs "
            f"{float(lx):.4f}, grads max rel err {grad_errs[worst]:.2e} ({worst}), "
            f"median {np.median(list(grad_errs.values())):.2e}",
            flush=True,
        )


def timing(policies: list[str], steps: int) -> None:
    from train_step import SCREENSHOT  # type: ignore[import-not-found]

    from osworld_jax.model import ImageProcessor
    from osworld_jax.model.processor import QWEN3_VL_PREPROCESSOR

    bench = CONFIGS["bench-vl"]
    pixels, grid = ImageProcessor.from_dict(QWEN3_VL_PREPROCESSOR)(SCREENSHOT.read_bytes())
    images = bench.images
    pv = jnp.asarray(np.tile(pixels, (images, 1))[None])  # [1, 4 x 8160, P], as processed
    grids = jnp.asarray(np.broadcast_to(grid[0], (1, images, 3)).copy(), jnp.int32)
    for attention in ("cudnn",):
        for remat in policies:
            rt = dataclasses.replace(bench.runtime, attention=attention, vision_remat=remat)
            cfg, params = _tower_params(bench.model, rt)
            m = pv.shape[1] // cfg.vision.spatial_merge_size**2
            w = jnp.ones((1, m, cfg.hidden_size), jnp.float32) * 1e-3
            f = jax.jit(jax.grad(_loss_fn(cfg, rt)))
            t0 = time.perf_counter()
            compiled = f.lower(params, pv, grids, w).compile()
            ma = compiled.memory_analysis()
            temp = ma.temp_size_in_bytes / 2**30 if ma is not None else float("nan")
            jax.block_until_ready(compiled(params, pv, grids, w))
            first = time.perf_counter() - t0
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                jax.block_until_ready(compiled(params, pv, grids, w))
                times.append(time.perf_counter() - t0)
            print(
                f"TOWER {attention} vision_remat={remat}: fwd+bwd {np.median(times) * 1e3:.1f} ms "
                f"(min {min(times) * 1e3:.1f}; {pv.shape[1]} patches, {images} images), "
                f"XLA temp {temp:.1f} GiB, compile+first {first:.0f} s",
                flush=True,
            )
            del compiled, params


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--remat", default="none,dots,full", help="vision_remat policies to time")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    print(f"devices: {jax.devices()}", flush=True)
    if not args.skip_check:
        check()
    if args.remat:
        timing(args.remat.split(","), args.steps)


if __name__ == "__main__":
    main()
