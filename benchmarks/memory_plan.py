"""The run's memory plan per compiled program, and (``--measure``) the trainer's measured peak.

  python benchmarks/memory_plan.py --gin_file=configs/gpu_1x_h100.gin [--gin_param=...] \\
      [--measure]

Prints each program's planned per-device bytes (arguments, outputs, aliased, temp, code, peak)
and each pool's need (`osworld_jax.rl.memory_plan.compiled_plan`). ``--measure`` then builds the
trainer with random weights in this process, runs one train step at the largest planned
shape on a zero batch and prints ``device.memory_stats()['peak_bytes_in_use']`` beside that
train step program's planned peak (the number to hold within 10%: benchmarks/NOTES.md). A run
records its pool's measured peak as ``memory/peak_gib`` (trainer and colocated server together)
beside the pool's plan in ``memory_plan.txt``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np


def zero_batch(trainer, rows: int, seq: int, patches: int, slots: int):
    """A valid all-zero batch of the planned shape (every row real, no loss token)."""
    from osworld_jax.trainer.program_memory import abstract_batch

    spec = abstract_batch(
        trainer.model, rows, seq, patches=patches, image_slots=slots,
        routes=trainer.config.router_replay,
    )  # fmt: skip
    fields = {}
    for name, x in zip(spec._fields, spec, strict=True):
        if x is None:
            fields[name] = None
            continue
        fill = {"segment_ids": 1, "row_weight": 1.0, "routed_experts": -1}.get(name, 0)
        fields[name] = np.full(x.shape, fill, x.dtype)
    return spec._replace(**fields)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--gin_file", action="append", default=[])
    p.add_argument("--gin_param", action="append", default=[])
    p.add_argument("--measure", action="store_true", help="run one train step, print its peak")
    args = p.parse_args(argv)
    from osworld_jax import config
    from osworld_jax.model import Qwen3MoeConfig
    from osworld_jax.rl import stages
    from osworld_jax.rl.memory_plan import abstract_trainer, compiled_plan
    from osworld_jax.rl.servers import device_total
    from osworld_jax.trainer.program_memory import GiB

    exp = config.load_experiment(args.gin_file or ["default.gin"], args.gin_param)
    with tempfile.TemporaryDirectory(prefix="memory_plan-") as tmp:
        model_path = stages.prepare_model(exp.model, Path(tmp), weights=False)
        model = Qwen3MoeConfig.from_json(model_path / "config.json")
        vision = stages.vision_packing(model, model_path, exp.agent)
        buckets = vision.patch_buckets if vision is not None else ()
        gib = exp.rl.mesh.device_memory_gib
        device = gib * GiB if gib is not None else device_total()
        trainer = abstract_trainer(exp, model)
        plan = compiled_plan(
            exp, model, model_path=model_path, device_bytes=device, patch_buckets=buckets,
            trainer=trainer,
        )  # fmt: skip
    print("\n".join(plan.table()))
    if not args.measure:
        return 0
    import jax
    from flax import nnx

    from osworld_jax.model import Policy

    rows = exp.rl.num_logical_owners
    seq = max(exp.rl.length_buckets or (exp.agent.compaction.max_context_tokens,))
    patches = max(buckets, default=0)
    state = trainer.init_state(init_fn=lambda: Policy(model, exp.runtime, rngs=nnx.Rngs(0)))
    batch = zero_batch(trainer, rows, seq, patches, exp.agent.max_screenshots)
    state, _ = trainer.train_step(state, batch)
    jax.block_until_ready(state)
    stats = jax.local_devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    # This process holds the trainer alone: its peak is the largest train step program's (the
    # train state is among its arguments); the server's programs run in a run's pool beside it.
    steps = [p for pool in plan.pools for p in pool.programs if p.stream == "trainer"]
    planned = max(steps, key=lambda p: p.peak)
    if peak is None:
        print(f"measured: the {jax.default_backend()} backend reports no peak_bytes_in_use")
        return 0
    print(
        f"{planned.name}: planned peak {planned.peak / GiB:.2f} GiB, measured peak "
        f"{peak / GiB:.2f} GiB after one step {rows}x{seq}"
        + (f" {patches}p" if patches else "")
        + f" ({(planned.peak - peak) / peak:+.1%})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
