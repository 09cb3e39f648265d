"""Parts of the bench-moe train step, checked and timed alone (issue 19, round 3).

    python benchmarks/train_parts.py --part experts   # GPU: expert layers under a scan
    python benchmarks/train_parts.py --part softmax   # GPU: logprob forward statistics
    python benchmarks/train_parts.py --layers 2 --tokens 64 --experts 8 --hidden 128 \
        --inter 128 --vocab 512 --chunk 16 --reps 1     # CPU smoke run (interpret mode)

``experts``: ``L`` expert MLP layers (the bench-moe shapes: 16,384 tokens, 128 experts, top 8,
2048 -> 768 -> 2048, bf16) under ``jax.lax.scan`` with the weights stacked ``[L, E, ...]``, as
the model runs them; forward + backward of ``sum(r * x_L)``. Variants:

- ``composed``: the previous round's path: dispatch -> `gmm` x 3 (autodiff residuals) ->
  combine, Mosaic forward and dx, Triton dw;
- ``twin, triton dw``: `gmm_experts` (one ``custom_vjp`` whose kernels write a residual-only
  copy), Triton dw;
- ``twin`` (shipped on Hopper): the same with the Mosaic dw;
- ``composed`` and ``twin`` again with XLA's dynamic-slice fusion off.

Checks: every variant against ``composed`` (the same kernels: ~0 expected) and, on one layer of
2048 tokens, the shipped path against the ``ragged`` backend (``jax.lax.ragged_dot``).

``softmax``: the float32 ``[4, 1024, 151936]`` logit block of one logprob chunk: the previous
three passes (max, ``sum exp``, then ``sum p z`` after ``lse``) against `softmax_stats` (one
variadic reduction), each with the ``onehot - p`` write of the saved-residual path.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time

import jax
import jax.numpy as jnp

from osworld_jax.model.kernels import grouped_matmul as G
from osworld_jax.model.moe import ragged_experts
from osworld_jax.trainer import logprobs


def bench(fn, *args, reps: int = 10, warmup: int = 2) -> float:
    """Median seconds of ``fn(*args)`` over ``reps`` synced runs (after ``warmup``)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rel_err(a, b) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def composed_experts(x, experts, weights, gate, up, down, *, config):
    """The previous round's expert path (residuals chosen by autodiff)."""
    plan = G.tile_plan(experts, gate.shape[0], config.align)
    groups = (plan.tile_expert, plan.group_start, plan.group_tiles)
    xs = G.dispatch(x, plan.row_slot, plan.dest, experts.shape[1])
    h = G.swiglu(G.gmm(xs, gate, *groups, config), G.gmm(xs, up, *groups, config))
    ys = G.gmm(h, down, *groups, config)
    return G.combine(ys, weights.astype(ys.dtype), plan.row_slot, plan.dest)


def _expert_inputs(layers, tokens, e, k, h, i, seed=0):
    ks = jax.random.split(jax.random.key(seed), 7)
    bf = jnp.bfloat16
    x = jax.random.normal(ks[0], (tokens, h), bf)
    logits = jax.random.normal(ks[1], (layers, tokens, e))
    experts = jax.lax.top_k(logits, k)[1].astype(jnp.int32)  # [L, T, K], distinct per row
    weights = jax.nn.softmax(jax.random.normal(ks[2], (layers, tokens, k)), axis=-1)
    gate = (jax.random.normal(ks[3], (layers, e, h, i)) * 0.02).astype(bf)
    up = (jax.random.normal(ks[4], (layers, e, h, i)) * 0.02).astype(bf)
    down = (jax.random.normal(ks[5], (layers, e, i, h)) * 0.02).astype(bf)
    r = jax.random.normal(ks[6], (tokens, h), jnp.float32)
    return x, experts, weights, gate, up, down, r


def _stack_grad(fn, dsf: bool = True):
    """``(loss, grads)`` of ``sum(r * x_L)`` through a scan of ``fn`` layers.

    ``dsf=False`` compiles with XLA's dynamic-slice fusion off (weight slices and stacked
    residuals then go through copies; see benchmarks/NOTES.md, round 3).
    """

    def loss(x, gate, up, down, experts, weights, r):
        def body(x, xs):
            g, u, d, ex, w = xs
            return (x + fn(x, ex, w, g, u, d)).astype(x.dtype), None

        out, _ = jax.lax.scan(body, x, (gate, up, down, experts, weights))
        return jnp.sum(r * out.astype(jnp.float32))

    opts = None if dsf else {"xla_gpu_enable_dynamic_slice_fusion": False}
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)), compiler_options=opts)


def part_experts(args) -> list[tuple[str, str]]:
    rows = []
    old_cfg = dataclasses.replace(G.MOSAIC_CONFIG, mosaic_parts=("fwd", "dx"))
    composed = functools.partial(composed_experts, config=old_cfg)
    twin = functools.partial(G.gmm_experts, config=G.MOSAIC_CONFIG)
    variants = {  # name: (fn, XLA dynamic-slice fusion on)
        "composed (round 2: Mosaic fwd/dx, Triton dw)": (composed, True),
        "twin, Triton dw": (functools.partial(G.gmm_experts, config=old_cfg), True),
        "twin, Mosaic dw (shipped)": (twin, True),
        "composed, dynamic-slice fusion off": (composed, False),
        "twin, Mosaic dw, dynamic-slice fusion off": (twin, False),
    }
    dims = (args.experts, args.top_k, args.hidden, args.inter)
    inputs = _expert_inputs(args.layers, args.tokens, *dims)
    x, experts, weights, gate, up, down, r = inputs
    results = {}
    for name, (fn, dsf) in variants.items():
        step = _stack_grad(fn, dsf)
        out = step(x, gate, up, down, experts, weights, r)
        results[name] = out
        t = bench(step, x, gate, up, down, experts, weights, r, reps=args.reps)
        ref = results[next(iter(variants))]
        errs = [rel_err(out[0], ref[0])] + [
            rel_err(a, b) for a, b in zip(out[1], ref[1], strict=True)
        ]
        names = ("loss", "x", "g", "u", "d")
        err = ", ".join(f"{n} {e:.1e}" for n, e in zip(names, errs, strict=True))
        label = f"experts x{args.layers} fwd+bwd: {name}"
        rows.append((label, f"{t * 1e3:.2f} ms; vs composed {err}"))
        print(rows[-1], flush=True)
    # One layer of 2048 tokens against the ragged backend (lax.ragged_dot; dense on a GPU).
    x1, ex1, w1, g1, u1, d1, r1 = _expert_inputs(1, min(2048, args.tokens), *dims, seed=1)

    def one(fn):
        def f(x, g, u, d):
            y = fn(x, ex1[0], w1[0], g, u, d)
            return jnp.sum(r1 * y.astype(jnp.float32)), y

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))

    (_, y), grads = one(functools.partial(G.gmm_experts, config=G.MOSAIC_CONFIG))(
        x1, g1[0], u1[0], d1[0]
    )
    (_, y_ref), grads_ref = one(ragged_experts)(x1, g1[0], u1[0], d1[0])
    errs = [rel_err(y, y_ref)] + [rel_err(a, b) for a, b in zip(grads, grads_ref, strict=True)]
    rows.append(
        (
            f"check: shipped vs ragged_dot, 1 layer x {x1.shape[0]} tokens",
            "rel err " + ", ".join(f"{e:.1e}" for e in errs) + " (y, dx, dgate, dup, ddown)",
        )
    )
    print(rows[-1], flush=True)
    return rows


def part_softmax(args) -> list[tuple[str, str]]:
    rows = []
    ks = jax.random.split(jax.random.key(2), 2)
    shape = (4, args.chunk, args.vocab)
    z = jax.random.normal(ks[0], shape, jnp.float32) * 3
    y = jax.random.randint(ks[1], shape[:2], 0, args.vocab, jnp.int32)

    def three_pass(z, y):
        lse = jax.nn.logsumexp(z, axis=-1)
        p = jnp.exp(z - lse[..., None])
        ent = lse - jnp.sum(p * z, axis=-1)
        return lse, ent, logprobs._onehot_minus_p(z, lse, y, jnp.bfloat16)

    def one_pass(z, y):
        lse, ent = logprobs.softmax_stats(z)
        return lse, ent, logprobs._onehot_minus_p(z, lse, y, jnp.bfloat16)

    stats3 = jax.jit(lambda z: three_pass(z, y)[:2])
    stats1 = jax.jit(logprobs.softmax_stats)
    full3, full1 = jax.jit(three_pass), jax.jit(one_pass)
    a, b = stats3(z), stats1(z)
    err = f"lse {rel_err(b[0], a[0]):.1e}, entropy {rel_err(b[1], a[1]):.1e}"
    gb = z.nbytes / 1e9
    for name, fn, args_ in (
        ("stats, 3 passes (round 2)", stats3, (z,)),
        ("stats, softmax_stats (1 pass)", stats1, (z,)),
        ("stats + onehot-p, 3 passes", full3, (z, y)),
        ("stats + onehot-p, softmax_stats", full1, (z, y)),
    ):
        t = bench(fn, *args_, reps=args.reps)
        rows.append((f"softmax chunk {list(shape)}: {name}", f"{t * 1e3:.3f} ms ({gb:.2f} GB z)"))
        print(rows[-1], flush=True)
    rows.append(("check: softmax_stats vs 3 passes", err))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--part", choices=("experts", "softmax", "all"), default="all")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--chunk", type=int, default=1024, help="logprob chunk (positions per row)")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    print(f"device={jax.devices()[0].device_kind} jax={jax.__version__}", flush=True)
    rows = []
    if args.part in ("experts", "all"):
        rows += part_experts(args)
    if args.part in ("softmax", "all"):
        rows += part_softmax(args)
    print("\n| part | result |\n|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")


if __name__ == "__main__":
    main()
