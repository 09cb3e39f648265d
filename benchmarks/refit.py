"""Refit: disk vs memory, the trainer's new weights into a running embedded server.

One `ColocatedServer` (the embedded server on a thread of this process, as
``ServerConfig.launch = 'colocated'`` runs it) serves a random checkpoint; the "trainer" holds
float32 master weights of the same model on the same device. Each path is timed end to end
through `SGLangClient.refit` (pause -> flush -> update -> continue -> /model_info check):

- ``disk``: the trainer's export (cast, device -> host, safetensors into a directory, atomic
  rename) + ``/update_weights_from_disk`` (the server reads the files back onto the device);
- ``memory``: the cast on the device (`Trainer.serving_params`' rule), the digest, staging and
  ``/update_weights_from_tensor`` with the staged handle (the server swaps its tree);
- ``host``: the floor of a cross-process fallback through host shared memory (device -> host of
  the bf16 tree + host -> device), measured, not a refit: why the in-process hand-over was chosen.

Every memory refit is checked bit for bit (the server's digest equals the trainer's).

  python3 benchmarks/refit.py --config tiny            # CPU
  python3 benchmarks/refit.py --config gpu-2b,h100-max # one H100 (bf16)

Prints one row per config: parameters, bytes, each path's median (min) seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

#: make_tiny_checkpoint arguments per config (VL models: the tower rides along in the refit).
CONFIGS: dict[str, dict] = {
    # the tests' tiny text model (CPU)
    "tiny": dict(kind="qwen3_moe"),
    # issue 41's ~2B GPU configuration: full vocabulary, 2 MoE layers of 128 experts, 4 ViT blocks
    "gpu-2b": dict(
        kind="qwen3_vl_moe",
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=2, mlp_only_layers=[], num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, num_experts=128, num_experts_per_tok=8, weights_dtype="bfloat16",
        vision={"depth": 4, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                "num_position_embeddings": 2304, "deepstack_visual_indexes": [1, 2]},
    ),
    # the largest of these shapes one H100 holds here (f32 masters + staged + served bf16 +
    # the disk path's export): configs/gpu_1x_h200.gin's model, 8 layers + the 27-block ViT
    "h100-max": dict(
        kind="qwen3_vl_moe",
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=8, mlp_only_layers=[], num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, num_experts=128, num_experts_per_tok=8, weights_dtype="bfloat16",
        vision={"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24]},
    ),
}  # fmt: skip


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="tiny", help=f"comma-separated, of {sorted(CONFIGS)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    p.add_argument("--work-dir", default=None, help="checkpoints and exports (default: a temp dir)")
    p.add_argument("--skip-disk", action="store_true")
    args = p.parse_args()
    unknown = [c for c in args.config.split(",") if c not in CONFIGS]
    if unknown:
        p.error(f"--config: unknown {unknown}; choose from {sorted(CONFIGS)}")
    return args


def bench(name: str, args: argparse.Namespace, work: Path) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from osworld_jax.contract.refit import DiskWeights
    from osworld_jax.model import ModelRuntimeConfig, load_hf_checkpoint, save_hf_checkpoint
    from osworld_jax.model.digest import params_digest
    from osworld_jax.model.tiny import make_tiny_checkpoint
    from osworld_jax.rollout import RolloutConfig, SGLangClient
    from osworld_jax.server.colocated import ColocatedServer
    from osworld_jax.trainer.step import serving_params

    gpu = jax.default_backend() == "gpu"
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if gpu else "float32")
    kw = dict(CONFIGS[name])
    ckpt = work / f"ckpt-{name}"
    if not (ckpt / "config.json").is_file():
        make_tiny_checkpoint(ckpt, **kw)
    flags = ["--model-path", str(ckpt), "--port", "0", "--dtype", dtype,
             "--max-running-requests", "1", "--context-length", "256", "--min-bucket", "64",
             "--mm-attention-backend", "xla"]  # fmt: skip
    runtime = ModelRuntimeConfig(dtype=dtype)  # type: ignore[arg-type]
    masters_policy = load_hf_checkpoint(ckpt, dtype=jnp.float32, runtime=runtime)
    masters = masters_policy.params()  # the trainer's float32 masters
    n = sum(x.size for x in jax.tree.leaves(masters))
    out: dict = {"config": name, "params": n, "bytes": n * jnp.dtype(dtype).itemsize}
    with ColocatedServer(flags) as srv:
        cfg = masters_policy.config
        rollout = RolloutConfig(
            urls=(srv.url,), num_layers=cfg.num_hidden_layers,
            num_experts_per_tok=cfg.num_experts_per_tok, refit_timeout_s=1800.0,
        )  # fmt: skip

        def cast() -> dict:  # the trainer's own refit cast
            return serving_params(masters, dtype)

        async def run() -> None:
            client = SGLangClient(None, rollout)
            try:
                times: dict[str, list[float]] = {"memory": [], "disk": [], "host": []}
                for r in range(args.repeats):
                    t0 = time.perf_counter()
                    params = cast()
                    digest = params_digest(params)
                    await client.refit(srv.stage(params, expected_digest=digest), f"m{r}")
                    jax.block_until_ready(srv.served_params)
                    times["memory"].append(time.perf_counter() - t0)
                    if not args.skip_disk:
                        export = work / f"export-{name}-{r}"
                        t0 = time.perf_counter()
                        view = cast()
                        nnx.update(masters_policy, view)  # the bf16 view the export writes
                        save_hf_checkpoint(masters_policy, export, copy_files_from=ckpt)
                        await client.refit(
                            DiskWeights(path=str(export), expected_digest=params_digest(view)),
                            f"d{r}",
                        )
                        jax.block_until_ready(srv.served_params)
                        times["disk"].append(time.perf_counter() - t0)
                        nnx.update(masters_policy, masters)
                        del view
                    t0 = time.perf_counter()
                    staged = cast()
                    host = jax.device_get(staged)
                    back = jax.block_until_ready(jax.device_put(host))
                    times["host"].append(time.perf_counter() - t0)
                    del staged, host, back
                for k, v in times.items():
                    if v:
                        out[k] = (statistics.median(v), min(v))
            finally:
                await client.aclose()

        asyncio.run(run())
    return out


def main() -> int:
    args = parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="refit-bench-") as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in args.config.split(","):
            rows.append(bench(name, args, work))
            print(rows[-1], file=sys.stderr, flush=True)
    import jax

    print(f"\nrefit, {jax.devices()[0].device_kind}: median (min) s of {args.repeats}")
    print("| config | parameters | served GB | memory | disk | host round trip (floor) |")
    print("|---|---|---|---|---|---|")
    for r in rows:

        def cell(k: str, r: dict = r) -> str:
            return f"{r[k][0]:.3f} ({r[k][1]:.3f})" if k in r else "-"

        print(
            f"| {r['config']} | {r['params'] / 1e9:.2f} B | {r['bytes'] / 1e9:.1f} | "
            f"{cell('memory')} | {cell('disk')} | {cell('host')} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
