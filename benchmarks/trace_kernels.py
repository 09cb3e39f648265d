"""Where a profiled step's GPU time goes: kernel time by kind, from a JAX perfetto trace.

    python benchmarks/trace_kernels.py /tmp/prof              # a train_step.py --profile dir
    python benchmarks/trace_kernels.py one/ two/ --top 15     # side by side, largest kernels

Reads the ``*.trace.json.gz`` that ``jax.profiler.trace(..., create_perfetto_trace=True)``
writes, keeps the complete events (``"ph": "X"``) of the GPU processes (process name with
"GPU" or "/device:"), and sums their durations per device by a kind taken from the kernel's
name: NCCL collectives, the Pallas expert GEMMs, cuDNN attention, cuBLAS GEMMs, XLA fusions
and copies. Per device, so a multi-GPU step shows each GPU's share.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
from pathlib import Path

KINDS = (
    ("nccl", re.compile(r"nccl|all.?gather|reduce.?scatter|all.?reduce|all.?to.?all", re.I)),
    ("expert gemm (pallas)", re.compile(r"gmm|mosaic|mm_nn|mm_dw|pallas", re.I)),
    ("attention (cudnn)", re.compile(r"cudnn|fmha|flash|sdpa", re.I)),
    ("gemm (cublas)", re.compile(r"gemm|nvjet|xmma|cutlass|sm90_|cublas", re.I)),
    ("copy / memset", re.compile(r"memcpy|memset|copy", re.I)),
    ("xla fusion", re.compile(r"fusion|loop_|input_|reduce|scatter|gather|transpose|convert")),
)


def kind_of(name: str) -> str:
    """The kind of a kernel name (the first matching pattern of `KINDS`, else "other")."""
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


def load(path: Path) -> dict[str, collections.Counter]:
    """``{device: Counter(kind -> ms), device + "/kernels": Counter(name -> ms)}``."""
    files = sorted(path.rglob("*.trace.json.gz")) if path.is_dir() else [path]
    if not files:
        raise SystemExit(f"{path}: no *.trace.json.gz")
    trace = json.loads(gzip.open(files[-1]).read())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for e in events:
        proc = names.get(e.get("pid"), "")
        if e.get("ph") != "X" or not ("GPU" in proc or "/device:" in proc):
            continue
        ms = float(e.get("dur", 0)) / 1e3
        out[proc][kind_of(e.get("name", ""))] += ms
        out[proc + "/kernels"][e.get("name", "")[:90]] += ms
    if not out:
        raise SystemExit(f"{files[-1]}: no GPU process; processes: {sorted(set(names.values()))}")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("paths", nargs="+", type=Path)
    p.add_argument("--top", type=int, default=10, help="largest kernels to list per device")
    args = p.parse_args(argv)
    for path in args.paths:
        for device, counts in sorted(load(path).items()):
            if device.endswith("/kernels"):
                print(f"  largest: {[(k, round(v, 2)) for k, v in counts.most_common(args.top)]}")
                continue
            total = sum(counts.values())
            parts = ", ".join(f"{k} {v:.1f}" for k, v in counts.most_common())
            print(f"{path} {device}: {total:.1f} ms busy ({parts})")


if __name__ == "__main__":
    main()
