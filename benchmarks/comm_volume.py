"""Predicted communication of one bench-moe train step per mesh preset, bytes and link time.

    python benchmarks/comm_volume.py                    # the presets of configs/mesh_*gpu.gin
    python benchmarks/comm_volume.py --mesh 1,2,2,1     # any data,fsdp,expert,tensor
    python benchmarks/comm_volume.py --hlo              # also count XLA's own collectives

The step is ``benchmarks/train_step.py --config bench-moe`` with the global batch scaled with
the GPU count: every GPU holds ``B = 4`` rows of ``S = 4096`` tokens, ``T = 16,384`` tokens
(Qwen3-30B-A3B shape with 8 layers: ``H = 2048``, ``E = 128`` experts of width ``I = 768``,
top ``K = 8``, ``V = 151,936``; 5.61 B parameters, 4.83 B of them experts), bf16 compute
(``c = 2`` bytes per activation and per gradient element: the step differentiates the bf16
compute copy).

Bytes are what one device **sends** per step with ring collectives over a group of ``n``:
all-gather ``(n-1)/n x`` the gathered size, reduce-scatter ``(n-1)/n x`` its input,
all-reduce ``2 (n-1)/n x`` the size. Mesh ``(d, f, e, t)`` = data, fsdp, expert, tensor;
each parameter is split as `osworld_jax.model.ShardingRules` says (experts over ``expert``,
embed dims over ``fsdp``, heads / vocab / widths over ``tensor``); ``P_g`` below is a
parameter's size gathered over ``fsdp`` (its other splits kept).

1. **FSDP all-gathers**: every parameter split over ``fsdp`` is gathered before its forward
   use and again for its backward: ``2 (f-1)/f P_g c``; once for the input embedding (the
   table is gathered before the row lookup, `model.policy`), the lm head (the logprob head
   keeps it for its backward) and the experts under expert parallelism (the layer keeps its
   gathered local experts for the backward under remat "none").
2. **Gradient reduce-scatter** over ``fsdp``: ``(f-1)/f P_g c``.
3. **Gradient all-reduce** over the batch axes the parameter is replicated on (rows differ
   there): ``2 (r-1)/r (P_g/f) c`` with ``r = d e`` for dense parameters and ``r = d`` for the
   experts under expert parallelism (each expert's rows were already sent to its device).
   The lm head's float32 ``dW`` is all-reduced once over all batch axes
   (`trainer.logprobs`): ``2 (n-1)/n P 4`` with ``n = d f e``.
4. **Expert-parallel tokens** (`osworld_jax.model.expert_parallel`), per MoE layer, group
   ``e``: forward all-gather of the ``T`` tokens ``(e-1) T H c`` (+ routes and gate weights,
   ``(e-1) T K (4 + c)``) and reduce-scatter of the partial outputs ``(e-1) T H c``; the
   backward moves the same again (the transposes). ``4 (e-1) T H c`` per layer: at ``e = 2``,
   ``4 x 16384 x 2048 x 2 = 268 MB``, x 8 layers 2.15 GB.
   The all-to-all alternative (routed copies, uniform routing) is ``4 (e-1)/e T K H c``, and
   with each token sent once per device that holds any of its experts,
   ``4 (e-1) p T H c`` with ``p = 1 - C(E - E/e, K) / C(E, K)`` (printed as ``a2a`` /
   ``a2a dedup``): for ``K = 8 >= e`` the all-gather never sends more than the plain
   all-to-all.
5. **Tensor parallelism** (``t > 1``): per layer, all-reduces of ``[T, H]`` after the
   attention output and the MLP/experts, forward and backward: ``4 x 2 (t-1)/t T H c``.

Time = bytes / link bandwidth. The link is NVLink 4 of an H200 SXM: 18 links x 25 GB/s per
direction = **450 GB/s per direction** per GPU (NVIDIA's H200 datasheet gives the
bidirectional 900 GB/s); inside one HGX node every GPU pair goes through NVSwitch at that
rate. It is a bound: NCCL reaches ~80-90% of it on large messages.

The speedup columns compare against one GPU's measured step (``--compute-ms``, default 254.1 ms:
benchmarks/NOTES.md round 3, the default float32 masters): ``n x t1 / (t1 + comm)`` when no
byte overlaps compute, ``n`` when all do. Memory per GPU is `osworld_jax.trainer.memory`'s
estimate with each parameter's real split (expert-parallel row buffers sized for the worst
case).

``--hlo`` compiles the same step (``ragged`` experts; the collectives do not depend on the
expert backend) on fake CPU devices and sums the collectives of XLA's optimized HLO (loop
bodies times their trip counts) as a check of the formulas above: XLA's GPU pipeline may
still combine or reorder them, not change their bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK_GBPS = 450.0  # NVLink 4 (H200 SXM), GB/s per direction
COMPUTE_MS = 254.1  # one H200, bench-moe, float32 masters (benchmarks/NOTES.md, round 3)
AXES = ("data", "fsdp", "expert", "tensor")


@dataclasses.dataclass(frozen=True)
class Volume:
    """Bytes one device sends per step, by kind (see the module docstring)."""

    fsdp_gather: float = 0.0
    grad_scatter: float = 0.0
    grad_allreduce: float = 0.0
    ep_tokens: float = 0.0
    tensor: float = 0.0

    @property
    def total(self) -> float:
        return sum(dataclasses.asdict(self).values())


def _ring(kind: str, n: int, size: float) -> float:
    """Bytes one of ``n`` devices sends in a ring collective over ``size`` bytes."""
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2 * (n - 1) / n * size
    return (n - 1) / n * size  # all-gather (gathered size), reduce-scatter (input size)


def predict(
    model, mesh: dict[str, int], tokens: int, *, expert_parallel: bool = True, c: int = 2
) -> Volume:
    """`Volume` of one train step of ``tokens`` per device on ``mesh`` (module docstring).

    ``c``: bytes of an activation, compute-copy parameter and gradient element (2: bf16; 4
    matches what XLA:CPU compiles, which runs bf16 math in float32).
    """
    from jax.sharding import AbstractMesh

    from osworld_jax.model.params import param_specs
    from osworld_jax.model.sharding import ShardingRules

    d, f, e, t = (mesh.get(a, 1) for a in AXES)
    abstract = AbstractMesh(tuple(mesh.get(a, 1) for a in AXES), AXES)
    sizes, rules = dict(abstract.shape), ShardingRules()
    ep = expert_parallel and e > 1
    gather = scatter = allreduce = 0.0
    for key, spec in param_specs(model).items():
        axes = rules.spec(spec.axes, spec.shape, abstract)
        split = {a for dim in axes if dim for a in ((dim,) if isinstance(dim, str) else dim)}
        split = {a for a in split if sizes[a] > 1}
        is_expert = key in ("moe.gate", "moe.up", "moe.down")
        # Gathered for use: over fsdp; experts without expert parallelism over expert too.
        gathered = split & ({"fsdp"} | ({"expert"} if is_expert and not ep else set()))
        used = math.prod(spec.shape) / math.prod(sizes[a] for a in split - gathered) * c
        n_gather = math.prod(sizes[a] for a in gathered)
        reduce = {a for a in ("data", "fsdp", "expert") if sizes[a] > 1}
        if key == "top.lm_head":  # trainer.logprobs: gathered once, float32 dW summed once
            gather += _ring("all-gather", n_gather, used)
            n_rows = math.prod(sizes[a] for a in reduce)
            allreduce += _ring("all-reduce", n_rows, used / c * 4)
            continue
        # Gathered for the forward and again for the backward; the input embedding (a row
        # lookup) and the experts under expert parallelism (the layer keeps its gathered local
        # experts for its backward under remat "none") once.
        uses = 1 if key == "top.embed" or (is_expert and ep) else 2
        gather += uses * _ring("all-gather", n_gather, used)
        # Gradients sum over the batch axes whose rows differ (not over `expert` for the
        # experts under expert parallelism: their tokens came to them): reduce-scatter where
        # the parameter is split, all-reduce of the shard where it is replicated.
        if is_expert and ep:
            reduce.discard("expert")
        scatter += _ring("reduce-scatter", math.prod(sizes[a] for a in reduce & split), used)
        shard = used / n_gather
        allreduce += _ring("all-reduce", math.prod(sizes[a] for a in reduce - split), shard)
    h, k = model.hidden_size, model.num_experts_per_tok
    n_moe = len(model.moe_layers)
    tokens_bytes = 4 * (e - 1) * tokens * h * c + 2 * (e - 1) * tokens * k * (4 + c)
    ep_tokens = n_moe * tokens_bytes if ep else 0.0
    tp = 4 * model.num_hidden_layers * _ring("all-reduce", t, tokens * h * c)
    return Volume(
        fsdp_gather=gather,
        grad_scatter=scatter,
        grad_allreduce=allreduce,
        ep_tokens=ep_tokens,
        tensor=tp,
    )


def all_to_all_bytes(model, e: int, tokens: int) -> tuple[float, float]:
    """EP token bytes of the all-to-all alternatives: (routed copies, one copy per device)."""
    if e <= 1:
        return 0.0, 0.0
    h, k, num = model.hidden_size, model.num_experts_per_tok, model.num_experts
    n_moe, c = len(model.moe_layers), 2
    copies = 4 * (e - 1) / e * tokens * k * h * c
    hit = 1 - math.comb(num - num // e, k) / math.comb(num, k)
    return n_moe * copies, n_moe * 4 * (e - 1) * hit * tokens * h * c


def memory_gib(model, runtime, mesh: dict[str, int], rows: int, seq: int) -> float:
    """Estimated peak GiB per device (`trainer.memory` with each parameter's real split)."""
    from jax.sharding import AbstractMesh

    from osworld_jax.model.params import param_specs
    from osworld_jax.model.sharding import ShardingRules
    from osworld_jax.trainer import TrainerConfig
    from osworld_jax.trainer.memory import estimate_step_memory

    abstract = AbstractMesh(tuple(mesh.get(a, 1) for a in AXES), AXES)
    total = local = 0.0
    for spec in param_specs(model).values():
        axes = ShardingRules().spec(spec.axes, spec.shape, abstract)
        split = [a for dim in axes if dim for a in ((dim,) if isinstance(dim, str) else dim)]
        total += math.prod(spec.shape)
        local += math.prod(spec.shape) / math.prod(abstract.shape[a] for a in split)
    batch = math.prod(mesh.get(a, 1) for a in ("data", "fsdp", "expert"))
    e = mesh.get("expert", 1) if runtime.expert_parallel else 1
    est = estimate_step_memory(
        model,
        runtime,
        TrainerConfig(logprob_chunk=1024),
        rows=rows * batch,
        seq=seq,
        param_shards=total / local,
        batch_shards=batch,
        expert_parallel=e,
    )
    return est.total / (1 << 30)


# ----------------------------------------------------------------------------------- HLO count

_COLLECTIVE = re.compile(
    r"= (?P<type>\(.*?\)|\S+) (?P<op>all-gather|reduce-scatter|all-reduce|all-to-all|"
    r"collective-permute)(?:-start)?\((?P<rest>.*)$"
)
_SHAPE = re.compile(r"(pred|s8|u8|s16|u16|bf16|f16|s32|u32|f32|s64|u64|f64)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2}
_BYTES |= {"s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


_CALLEE = re.compile(r"(?:body|calls|to_apply|branch_computations)=\{?%([\w.-]+)")


def _type_bytes(text: str) -> float:
    return sum(
        _BYTES[dt] * math.prod(int(x) for x in dims.split(",") if x)
        for dt, dims in _SHAPE.findall(text)
    )


def _group_size(rest: str, devices: int) -> int:
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", rest)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", rest)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", rest)
    if m:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", m.group(2)))
    return devices


def hlo_collective_bytes(hlo: str, devices: int) -> dict[str, float]:
    """Bytes one device sends per execution of ``hlo`` (optimized HLO text), by op kind.

    Every collective counts once per execution of its computation: a while body times its
    ``known_trip_count``, computations called from the entry once.
    """
    comps: dict[str, list[str]] = {}
    name, entry = "", ""
    for line in hlo.splitlines():
        head = re.match(r"(ENTRY )?%(\S+) .*\{$", line)
        if head and not line.startswith(" "):
            name = head.group(2)
            entry = name if head.group(1) else entry
            comps[name] = []
        elif name:
            comps[name].append(line)
    mult: dict[str, float] = {entry: 1.0}
    order = [entry]
    while order:
        comp = order.pop()
        for line in comps.get(comp, []):
            trips = 1.0
            if " while(" in line:
                m = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                trips = float(m.group(1)) if m else 1.0
            for callee in re.findall(
                r"(?:body|calls|to_apply|branch_computations)=\{?%([\w.-]+)", line
            ):
                if callee in comps:
                    mult[callee] = mult.get(callee, 0.0) + mult[comp] * trips
                    order.append(callee)
    out: dict[str, float] = {}
    for comp, lines in comps.items():
        for line in lines:
            m = _COLLECTIVE.search(line)
            if not m or comp not in mult:
                continue
            op, size = m.group("op"), _type_bytes(m.group("type"))
            n = _group_size(m.group("rest"), devices)
            if op == "reduce-scatter":
                sent = (n - 1) * size
            elif op == "collective-permute":
                sent = size
            else:
                sent = _ring(op, n, size)
            out[op] = out.get(op, 0.0) + sent * mult[comp]
    return out


def hlo_bytes(bench, mesh: dict[str, int], rows: int, seq: int) -> dict[str, float]:
    """Collective bytes per device of the compiled bench step on ``mesh`` (fake CPU devices)."""
    import jax
    from flax import nnx

    from osworld_jax.batch import BatchBounds
    from osworld_jax.model import Policy, make_mesh
    from osworld_jax.trainer import OptimizerConfig, Trainer, TrainerConfig

    n = math.prod(mesh.get(a, 1) for a in AXES)
    runtime = dataclasses.replace(bench.runtime, expert_backend="ragged", attention="xla")
    model = bench.model

    def init() -> Policy:
        return Policy(model, runtime, rngs=nnx.Rngs(0))

    batch_devices = math.prod(mesh.get(a, 1) for a in ("data", "fsdp", "expert"))
    b = rows * batch_devices
    config = TrainerConfig(
        optimizer=OptimizerConfig(learning_rate=5e-6), logprob_chunk=bench.logprob_chunk
    )
    trainer = Trainer(
        config,
        nnx.eval_shape(init),
        bounds=BatchBounds(num_owners=b, num_groups=1, norm_length=seq),
        mesh=make_mesh(**mesh, devices=jax.devices()[:n]),
    )
    from train_step import random_batch  # type: ignore[import-not-found]

    fn, batch = trainer.jitted_step(random_batch(model, b, seq))
    with jax.set_mesh(trainer.mesh):
        lowered = fn.lower(trainer.abstract_state, batch, None, None)
    return hlo_collective_bytes(lowered.compile().as_text(), n)


def _rows(
    presets: Iterable[tuple[str, dict[str, int], bool, str]], bench, args
) -> list[dict[str, object]]:
    out = []
    tokens = bench.batch * bench.seq
    for name, mesh, ep, overlap in presets:
        n = math.prod(mesh.get(a, 1) for a in AXES)
        vol = predict(bench.model, mesh, tokens, expert_parallel=ep)
        a2a, dedup = all_to_all_bytes(bench.model, mesh.get("expert", 1) if ep else 1, tokens)
        comm_ms = vol.total / (LINK_GBPS * 1e9) * 1e3
        runtime = dataclasses.replace(bench.runtime, expert_parallel=ep)
        row: dict[str, object] = dict(
            preset=name,
            gpus=n,
            mesh="x".join(f"{a[0]}{mesh.get(a, 1)}" for a in AXES),
            overlap=overlap,
            **{k: v / 1e9 for k, v in dataclasses.asdict(vol).items()},
            total=vol.total / 1e9,
            a2a=a2a / 1e9,
            a2a_dedup=dedup / 1e9,
            comm_ms=comm_ms,
            speedup_exposed=n * args.compute_ms / (args.compute_ms + comm_ms),
            mem_gib=memory_gib(bench.model, runtime, mesh, bench.batch, bench.seq),
        )
        if args.hlo:
            counted = hlo_bytes(bench, mesh, bench.batch, bench.seq)
            cpu = predict(bench.model, mesh, tokens, expert_parallel=ep, c=4)
            row["cpu_predicted"] = cpu.total / 1e9
            row["hlo_total"] = sum(counted.values()) / 1e9
            row["hlo_by_op"] = {k: round(v / 1e9, 3) for k, v in sorted(counted.items())}
        out.append(row)
    return out


def _print(rows: list[dict[str, object]]) -> None:
    cols = [
        ("preset", "{}"),
        ("mesh", "{}"),
        ("ep_tokens", "{:.2f}"),
        ("fsdp_gather", "{:.2f}"),
        ("grad_scatter", "{:.2f}"),
        ("grad_allreduce", "{:.2f}"),
        ("tensor", "{:.2f}"),
        ("total", "{:.2f}"),
        ("comm_ms", "{:.1f}"),
        ("speedup_exposed", "{:.2f}"),
        ("a2a", "{:.2f}"),
        ("a2a_dedup", "{:.2f}"),
        ("mem_gib", "{:.1f}"),
    ]
    if any("hlo_total" in r for r in rows):
        cols += [("cpu_predicted", "{:.2f}"), ("hlo_total", "{:.2f}")]
    print("| " + " | ".join(c for c, _ in cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(fmt.format(r.get(c, "")) for c, fmt in cols) + " |")
    for r in rows:
        if "hlo_by_op" in r:
            print(f"{r['preset']}: XLA's collectives (GB sent per device): {r['hlo_by_op']}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", action="append", default=[], help="gin preset(s) (default all)")
    p.add_argument("--mesh", action="append", default=[], help="data,fsdp,expert,tensor")
    p.add_argument("--no-ep", action="store_true", help="--mesh rows without expert parallelism")
    p.add_argument("--compute-ms", type=float, default=COMPUTE_MS)
    p.add_argument("--hlo", action="store_true", help="also count XLA's compiled collectives")
    p.add_argument("--layers", type=int, help="override bench-moe's layer count")
    p.add_argument("--remat", help="override bench-moe's remat policy (memory column)")
    args = p.parse_args(argv)
    if args.hlo:  # fake devices for the compile, before jax starts
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        flags = os.environ.get("XLA_FLAGS", "")
        if "device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8"
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from mesh_presets import load_preset  # type: ignore[import-not-found]
    from train_step import CONFIGS  # type: ignore[import-not-found]

    bench = CONFIGS["bench-moe"]
    if args.layers:
        bench = dataclasses.replace(bench, model=bench.model.replace(num_hidden_layers=args.layers))
    if args.remat:
        bench = dataclasses.replace(
            bench, runtime=dataclasses.replace(bench.runtime, remat=args.remat)
        )
    presets = []
    for text in args.mesh:
        mesh = dict(zip(AXES, (int(x) for x in text.split(",")), strict=True))
        presets.append((f"mesh {text}", mesh, not args.no_ep, "-"))
    paths = args.preset or ([] if args.mesh else sorted(ROOT.glob("configs/mesh_*gpu.gin")))
    for path in paths:
        path = Path(path) if Path(path).exists() else ROOT / "configs" / path
        mesh, runtime, overlap = load_preset(path)
        presets.append((path.stem, mesh, runtime.expert_parallel, overlap))
    presets.sort(key=lambda x: math.prod(x[1].values()))
    print(
        f"bench-moe, {bench.batch} x {bench.seq} tokens per GPU, bf16; GB sent per GPU per step; "
        f"link {LINK_GBPS:.0f} GB/s per direction; 1-GPU step {args.compute_ms} ms"
    )
    _print(_rows(presets, bench, args))


if __name__ == "__main__":
    main()
