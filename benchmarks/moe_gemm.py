"""Dropless MoE grouped GEMM on one GPU: useful TFLOP/s forward and backward (dx + dw).

The case (issue 11): R = 16,384 tokens x top-8 = 131,072 routed rows, E = 128 experts,
x[R, 2048] @ w[e][2048, 768] per group, Dirichlet-imbalanced group sizes, bf16 in, f32
accumulation. Useful FLOPs: forward ``2 R K N`` = 412.3 GFLOP, backward ``4 R K N`` (dx + dw).

Variants: ``jax.lax.ragged_dot``, tokamax ``ragged_dot`` (Mosaic GPU; heuristic config and a
few explicit ones), a dropless padded einsum at the largest group, and ours: `gmm` (Pallas
Triton kernels over a tile-aligned permutation, `osworld_jax.model.kernels.grouped_matmul`),
swept over tile configs. The permutation itself is outside every timed region (all variants get rows
already sorted by expert); ours runs on ``Mp = R + E*(align-1)`` padded rows and is credited
only the useful FLOPs.

Usage (GPU)::

    python benchmarks/moe_gemm.py [--alpha 4] [--quick] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from osworld_jax.model.kernels import grouped_matmul as G  # noqa: E402


def bench(fn: Callable, *args, reps: int = 10, warmup: int = 2) -> float:
    """Per-call device time (s): median over 3 batches of ``reps`` back-to-back calls.

    Calls are dispatched asynchronously and synced once per batch, so host dispatch overlaps
    the device work (no per-call launch latency in the number).
    """
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    batches = []
    for _ in range(3):
        t0 = time.perf_counter()
        out = [fn(*args) for _ in range(reps)]
        jax.block_until_ready(out)
        batches.append((time.perf_counter() - t0) / reps)
        del out
    return statistics.median(batches)


def rel_err(a, b) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@dataclasses.dataclass
class Case:
    rows: int
    experts: int
    k: int
    n: int
    sizes: np.ndarray

    @property
    def fwd_flops(self) -> float:
        return 2.0 * self.rows * self.k * self.n

    @property
    def bytes_fwd(self) -> float:
        return 2.0 * (self.rows * self.k + self.experts * self.k * self.n + self.rows * self.n)


def make_sizes(rows: int, experts: int, alpha: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(experts, alpha))
    return rng.multinomial(rows, p).astype(np.int32)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--alpha", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="fewer sweep configs")
    ap.add_argument("--skip-slow", action="store_true", help="skip lax.ragged_dot timing")
    ap.add_argument("--json", type=str, default=None)
    ap.add_argument("--only", default="", help="comma list of variant-name substrings to run")
    ap.add_argument("--best-out", type=str, default=None, help="write the best configs (JSON)")
    ap.add_argument("--ceiling-n", type=int, default=8192, help="dense matmul size (ceiling)")
    args = ap.parse_args()

    rows = args.tokens * args.top_k
    sizes = make_sizes(rows, args.experts, args.alpha, args.seed)
    case = Case(rows, args.experts, args.hidden, args.inter, sizes)
    print(
        f"device={jax.devices()[0].device_kind} jax={jax.__version__} R={rows} E={args.experts} "
        f"K={args.hidden} N={args.inter} alpha={args.alpha} max/mean group="
        f"{sizes.max() / sizes.mean():.2f} min={sizes.min()} max={sizes.max()}",
        flush=True,
    )
    fl = case.fwd_flops
    print(
        f"two numbers: fwd {fl / 1e9:.1f} GFLOP, {case.bytes_fwd / 1e9:.2f} GB min traffic; "
        f"bwd {2 * fl / 1e9:.1f} GFLOP",
        flush=True,
    )
    results: dict[str, dict] = {}

    def record(name, fwd_s=None, bwd_s=None, **extra):
        r = dict(extra)
        if fwd_s is not None:
            r["fwd_ms"] = fwd_s * 1e3
            r["fwd_tflops"] = fl / fwd_s / 1e12
        if bwd_s is not None:
            r["bwd_ms"] = bwd_s * 1e3
            r["bwd_tflops"] = 2 * fl / bwd_s / 1e12
        results[name] = r
        print(
            name, {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}, flush=True
        )

    def attempt(name, fn):
        if args.only and not any(o in name for o in args.only.split(",")):
            return
        try:
            fn()
        except Exception as e:  # keep the remaining variants running
            traceback.print_exc(limit=3)
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(name, "FAILED", results[name]["error"], flush=True)

    keys = jax.random.split(jax.random.key(args.seed), 8)
    dt = jnp.bfloat16
    x = jax.random.normal(keys[0], (rows, args.hidden), dt)
    w = (
        jax.random.normal(keys[1], (args.experts, args.hidden, args.inter), jnp.float32) * 0.02
    ).astype(dt)
    dy = jax.random.normal(keys[2], (rows, args.inter), dt)
    gs = jnp.asarray(sizes)

    # ceiling: dense 8192^3
    def ceiling():
        n = args.ceiling_n
        a = jax.random.normal(keys[3], (n, n), dt)
        b = jax.random.normal(keys[4], (n, n), dt)
        f = jax.jit(lambda a, b: a @ b)
        t = bench(f, a, b, reps=20)
        record("dense_8192^3", tflops=2 * n**3 / t / 1e12, ms=t * 1e3)

    attempt("dense_8192^3", ceiling)

    # copy bandwidth ceiling
    def copy_bw():
        a = jax.random.normal(keys[5], (args.ceiling_n**2 * 16,), dt)  # 2 GiB at 8192
        f = jax.jit(lambda a: a * 2)
        t = bench(f, a, reps=5)
        record("copy_bw", gbps=2 * a.nbytes / t / 1e9)

    attempt("copy_bw", copy_bw)

    def vjp_of(f):
        def g(x, w, dy):
            _, pull = jax.vjp(f, x, w)
            return pull(dy)

        return jax.jit(g)

    ref_out = {}

    # jax.lax.ragged_dot
    def ragged():
        f = jax.jit(lambda x, w: jax.lax.ragged_dot(x, w, gs))
        ref_out["y"] = f(x, w)
        b = vjp_of(lambda x, w: jax.lax.ragged_dot(x, w, gs))
        ref_out["dx"], ref_out["dw"] = b(x, w, dy)
        if args.skip_slow:
            return
        record(
            "lax.ragged_dot", bench(f, x, w, reps=3, warmup=1), bench(b, x, w, dy, reps=2, warmup=1)
        )

    attempt("lax.ragged_dot", ragged)

    # dropless padded einsum at the largest group
    def einsum():
        cap = int(sizes.max())
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        idx = np.full((args.experts, cap), rows, np.int32)
        for e in range(args.experts):
            idx[e, : sizes[e]] = starts[e] + np.arange(sizes[e])
        x_ext = jnp.concatenate([x, jnp.zeros((1, args.hidden), dt)])
        xp = x_ext[jnp.asarray(idx)]  # [E, cap, K]
        dyp = jnp.concatenate([dy, jnp.zeros((1, args.inter), dt)])[jnp.asarray(idx)]
        f = jax.jit(lambda x, w: jnp.einsum("eck,ekn->ecn", x, w))
        b = vjp_of(lambda x, w: jnp.einsum("eck,ekn->ecn", x, w))
        record(
            "einsum_padded_max",
            bench(f, xp, w),
            bench(b, xp, w, dyp),
            padded_rows=args.experts * cap,
        )

    attempt("einsum_padded_max", einsum)

    # tokamax
    def tokamax_variants():
        import tokamax
        from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu as tpm
        from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu_common as tpc

        f = jax.jit(lambda x, w: tokamax.ragged_dot(x, w, gs))
        y = f(x, w)
        b = vjp_of(lambda x, w: tokamax.ragged_dot(x, w, gs))
        dx, dw = b(x, w, dy)
        errs = {}
        if "y" in ref_out:
            errs = dict(
                err_y=rel_err(y, ref_out["y"]),
                err_dx=rel_err(dx, ref_out["dx"]),
                err_dw=rel_err(dw, ref_out["dw"]),
            )
        record("tokamax.ragged_dot(default)", bench(f, x, w), bench(b, x, w, dy), **errs)
        M = tpc.MatmulDimension
        for bm, bn, bk, st, pers, minor, tw in [
            (128, 128, 128, 3, True, M.M, 1),  # best of 4 in the first run (448 fwd)
            (128, 128, 128, 4, True, M.M, 2),
        ][: 1 if args.quick else 2]:
            name = f"tokamax.mosaic bm{bm} bn{bn} bk{bk} st{st} {minor.name}"

            def one(bm=bm, bn=bn, bk=bk, st=st, pers=pers, minor=minor, tw=tw, name=name):
                cfg = tpc.Config(
                    block_m=bm,
                    block_n=bn,
                    block_k=bk,
                    num_stages=st,
                    split_k=1,
                    persistent=pers,
                    grid_minor_dim=minor,
                    grid_tile_width=tw,
                )
                op = tpm.PallasMosaicGpuRaggedDot(config=cfg)
                fo = jax.jit(lambda x, w: op(x, w, group_sizes=gs))
                yo = fo(x, w)
                bo = vjp_of(lambda x, w: op(x, w, group_sizes=gs))
                record(name, bench(fo, x, w), bench(bo, x, w, dy), err_y=rel_err(yo, y))

            attempt(name, one)

    attempt("tokamax", tokamax_variants)

    # ours
    n_layout = {}

    def layout(align):
        if align in n_layout:
            return n_layout[align]
        experts = np.repeat(np.arange(args.experts, dtype=np.int32), sizes)
        plan = jax.jit(functools.partial(G.tile_plan, num_experts=args.experts, align=align))(
            jnp.asarray(experts).reshape(rows, 1)
        )
        # rows are already sorted: slot r of the sorted order is row r of x
        xs = G.dispatch(x, plan.row_slot, plan.dest, 1)
        dys = G.dispatch(dy, plan.row_slot, plan.dest, 1)
        n_layout[align] = (plan, xs, dys)
        return n_layout[align]

    def ours(cfg: GmmConfigT, label: str, check: bool):
        plan, xs, dys = layout(cfg.align)
        groups = (plan.tile_expert, plan.group_start, plan.group_tiles)
        f = jax.jit(lambda xs, w: G.gmm(xs, w, *groups, cfg))
        b = vjp_of(lambda xs, w: G.gmm(xs, w, *groups, cfg))
        y = f(xs, w)
        dxs, dw = b(xs, w, dys)
        extra = {"padded_rows": int(xs.shape[0])}
        if check and "y" in ref_out:
            extra.update(
                err_y=rel_err(y[plan.dest], ref_out["y"]),
                err_dx=rel_err(dxs[plan.dest], ref_out["dx"]),
                err_dw=rel_err(dw, ref_out["dw"]),
            )
        record(label, bench(f, xs, w), bench(b, xs, w, dys), **extra)

    def ours_parts(cfg, label):
        """Time the three kernels separately (fwd nn, dx tn, dw) for the sweep."""
        plan, xs, dys = layout(cfg.align)
        checks: dict[str, float] = {}
        te, gst, gti = plan.tile_expert, plan.group_start, plan.group_tiles
        fwd = jax.jit(lambda xs, w: G._gmm_forward(xs, w, te, cfg))
        dxk = jax.jit(lambda d, w: G._gmm_dx(d, w, te, cfg))
        dwk = jax.jit(lambda xs, d, w: G._gmm_dw(xs, d, gst, gti, w, cfg))
        if "y" in ref_out:  # per-kernel check against lax.ragged_dot
            checks["fwd"] = rel_err(fwd(xs, w)[plan.dest], ref_out["y"])
            checks["dx"] = rel_err(dxk(dys, w)[plan.dest], ref_out["dx"])
            checks["dw"] = rel_err(dwk(xs, dys, w), ref_out["dw"])
        tf, tx, tw = bench(fwd, xs, w), bench(dxk, dys, w), bench(dwk, xs, dys, w)
        record(
            label,
            tf,
            tx + tw,
            dx_ms=tx * 1e3,
            dx_tflops=fl / tx / 1e12,
            dw_ms=tw * 1e3,
            dw_tflops=fl / tw / 1e12,
            **{f"err_{k}": v for k, v in checks.items()},
        )
        return tf, tx, tw

    GmmConfigT = G.GmmConfig
    MC = G.MosaicConfig
    triton_cfgs = [
        # (align, bm, bn, bk, warps, stages) x (dw_bm, dw_bn, dw_bt, warps, stages)
        ((128, 128, 128, 64, 4, 4), (128, 128, 64, 4, 4)),
        ((128, 128, 128, 64, 8, 4), (128, 128, 64, 8, 3)),
        ((128, 128, 256, 64, 8, 3), (128, 256, 64, 8, 3)),
        ((128, 128, 256, 64, 8, 4), (128, 128, 128, 8, 3)),
        ((128, 128, 128, 128, 8, 3), (256, 128, 64, 8, 3)),
        ((128, 64, 256, 64, 4, 4), (64, 256, 64, 4, 4)),
        ((256, 256, 128, 64, 8, 3), (128, 256, 64, 8, 4)),
    ]
    mosaic_cfgs = [
        G.MOSAIC_CONFIG.mosaic,  # the shipped forward (M-minor bands of 4)
        MC(),
        MC(max_concurrent_steps=4, dw_max_concurrent_steps=2),
        MC(grid_minor_n=False, grid_tile_width=4, dw_block_n=256, dw_max_concurrent_steps=3),
        MC(tile_n=64, max_concurrent_steps=5, dw_block_m=64, dw_block_n=256),
    ]
    if args.quick:
        triton_cfgs = [triton_cfgs[i] for i in (0, 2, 4)]
        mosaic_cfgs = mosaic_cfgs[:3]
    sweep: list[tuple[str, G.GmmConfig]] = []
    for (al, bm, bn, bk, nw, ns), (dm, dn, dtt, dnw, dns) in triton_cfgs:
        cfg = G.GmmConfig(
            align=al,
            block_m=bm,
            block_n=bn,
            block_k=bk,
            num_warps=nw,
            num_stages=ns,
            dw_block_m=dm,
            dw_block_n=dn,
            dw_block_t=min(dtt, al),
            dw_num_warps=dnw,
            dw_num_stages=dns,
        )
        sweep.append(
            (f"ours.triton a{al} mm{bm}x{bn}x{bk}w{nw}s{ns} dw{dm}x{dn}x{dtt}w{dnw}s{dns}", cfg)
        )
    for mc in mosaic_cfgs:
        cfg = G.GmmConfig(mosaic_parts=("fwd", "dx", "dw"), mosaic=mc)
        label = (
            f"ours.mosaic {mc.tile_m}x{2 * mc.tile_n}x{mc.tile_k}s{mc.max_concurrent_steps}"
            f"{'N' if mc.grid_minor_n else 'M'}{mc.grid_tile_width} "
            f"dw{mc.dw_block_m}x{mc.dw_block_n}x{mc.dw_block_k}s{mc.dw_max_concurrent_steps}"
        )
        sweep.append((label, cfg))

    best: dict[str, tuple[float, G.GmmConfig | None]] = {
        p: (1e9, None) for p in ("fwd", "dx", "dw", "triton_mm")
    }
    best_triton_dw: list = [1e9, None]
    for label, cfg in sweep:

        def run_parts(cfg=cfg, label=label):
            tf, tx, tw = ours_parts(cfg, label)
            for key, t in (("fwd", tf), ("dx", tx), ("dw", tw)):
                if t < best[key][0]:
                    best[key] = (t, cfg)
            if not cfg.mosaic_parts and tf + tx < best["triton_mm"][0]:
                best["triton_mm"] = (tf + tx, cfg)
            if not cfg.mosaic_parts and tw < best_triton_dw[0]:
                best_triton_dw[:] = [tw, cfg]

        attempt(label, run_parts)

    if all(best[p][1] is not None for p in ("fwd", "dx", "dw")):
        parts = tuple(p for p in ("fwd", "dx", "dw") if best[p][1].mosaic_parts)
        base = best["triton_mm"][1] or G.DEFAULT_CONFIG
        tdw = best["dw"][1] if "dw" not in parts else base
        mos = next((best[p][1].mosaic for p in ("fwd", "dx", "dw") if p in parts), base.mosaic)
        if "dw" in parts:
            mos = dataclasses.replace(
                mos,
                **{
                    f: getattr(best["dw"][1].mosaic, f)
                    for f in ("dw_block_m", "dw_block_n", "dw_block_k", "dw_max_concurrent_steps")
                },
            )
        cfg = dataclasses.replace(
            base,
            dw_block_m=tdw.dw_block_m,
            dw_block_n=tdw.dw_block_n,
            dw_block_t=min(tdw.dw_block_t, base.align),
            dw_num_warps=tdw.dw_num_warps,
            dw_num_stages=tdw.dw_num_stages,
            mosaic_parts=parts,
            mosaic=mos,
        )
        print("best config:", cfg, flush=True)
        results["best_config"] = {"repr": repr(cfg)}
        triton_best = (
            dataclasses.replace(
                base,
                **{
                    f: getattr(best_triton_dw[1], f)
                    for f in (
                        "dw_block_m",
                        "dw_block_n",
                        "dw_block_t",
                        "dw_num_warps",
                        "dw_num_stages",
                    )
                },
            )
            if best_triton_dw[1] is not None
            else base
        )
        if args.best_out:
            Path(args.best_out).write_text(
                json.dumps(
                    {"triton": G.config_to_dict(triton_best), "mosaic": G.config_to_dict(cfg)},
                    indent=1,
                )
            )
            print("wrote", args.best_out, "triton:", triton_best, flush=True)
        attempt("ours.gmm(best)", lambda: ours(cfg, "ours.gmm(best)", check=True))
    attempt("ours.gmm(default)", lambda: ours(G.default_config(), "ours.gmm(default)", check=True))

    print("\n| variant | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s | notes |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        if name == "best_config":
            continue
        notes = {
            k: (round(v, 4) if isinstance(v, float) else v)
            for k, v in r.items()
            if k not in ("fwd_ms", "fwd_tflops", "bwd_ms", "bwd_tflops")
        }

        def fmt(k, r=r):
            return f"{r[k]:.3f}" if k in r else "-"

        print(
            f"| {name} | {fmt('fwd_ms')} | {fmt('fwd_tflops')} | {fmt('bwd_ms')} | "
            f"{fmt('bwd_tflops')} | {notes} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
