"""The server's vision tower on one screenshot (`ImageEmbeddings.get`), per attention.

What a new screenshot costs the embedded server before its LM prefill: the uint8 patch levels
looked up on the device, then the ViT (27 blocks at Qwen3-VL-30B-A3B's shapes), for one
1920x1080 screenshot at the checkpoint processor's limits. Best and median of ``--repeats``
calls after one compile, per ``--mm-attention-backend`` (cuDNN's packed kernel, XLA's segment
attention), with the tower's forward FLOPs (`benchmarks/train_step.py`'s ``vision_flops``).

    python benchmarks/vision_encode.py --ckpt-dir /tmp/bvl  # bench-vl (serve.py wrote it)
    python benchmarks/vision_encode.py                      # a tiny VL checkpoint (a CPU check)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    """Prints the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt-dir", default=None, help="a Qwen3-VL checkpoint (default: tiny)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--backends", default="cudnn,xla")
    ap.add_argument("--peak-flops", type=float, default=989e12, help="dense bf16 FLOP/s")
    a = ap.parse_args()

    import jax
    from train_step import vision_flops  # type: ignore[import-not-found]

    from osworld_jax.model.tiny import make_tiny_checkpoint
    from osworld_jax.server.image_embeddings import ImageEmbeddings
    from osworld_jax.server.runner import ModelRunner

    path = a.ckpt_dir or str(
        make_tiny_checkpoint(Path(tempfile.mkdtemp()) / "vl", kind="qwen3_vl_moe")
    )
    dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
    runner = ModelRunner(path, num_slots=1, slot_len=16, dtype=dtype)
    proc, cfg = runner.processor, runner.config
    t, gh, gw = proc.grid_thw(1080, 1920)
    n = t * gh * gw
    rng = np.random.default_rng(0)
    levels = rng.integers(0, 256, size=(n, 3, proc.patch_size**2), dtype=np.uint8)
    grid = np.asarray([t, gh, gw], np.int32)
    flops = vision_flops(cfg.vision, [n]) / 3  # forward only (the helper counts fwd + bwd)
    print(f"{jax.devices()[0].device_kind}, {dtype}; one 1920x1080 screenshot: {n} patches, ")
    print(f"{n // cfg.vision.spatial_merge_size**2} tokens, {flops / 1e12:.3f} TFLOP forward")
    print("| attention | best ms | median ms | TFLOP/s (best) | share of --peak-flops |")
    print("|---|---|---|---|---|")
    for backend in a.backends.split(","):
        runtime = dataclasses.replace(runner.runtime, vision_attention=backend)
        tower = ImageEmbeddings(cfg, runtime, 0, proc)  # keeps nothing: every call encodes

        def encode(tower=tower):
            return tower.get(runner.params, b"", levels, grid)

        jax.block_until_ready(encode())  # compiles
        times = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(encode())
            times.append(time.perf_counter() - t0)
        best, median = min(times), sorted(times)[len(times) // 2]
        print(
            f"| {backend} | {best * 1e3:.1f} | {median * 1e3:.1f} | {flops / best / 1e12:.1f} | "
            f"{flops / best / a.peak_flops:.0%} |"
        )


if __name__ == "__main__":
    main()
