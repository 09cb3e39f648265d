"""Decode throughput of the embedded server vs HF transformers ``generate`` on the same device.

For each concurrency C, C requests of ``--prompt-len`` random tokens each generate exactly
``--max-new-tokens`` tokens (``ignore_eos``, temperature 1). The embedded server is driven over
HTTP (in-process aiohttp server, the real `/generate` path, all C requests in flight at once);
HF generates the same C prompts as one batch (``do_sample``, ``min_new_tokens`` = max). Both are
warmed up at that concurrency first (compiles / CUDA graphs are not timed).
tokens/s = C * max_new_tokens / wall seconds.

  python benchmarks/serve.py                       # tiny model, CPU
  python benchmarks/serve.py --config bench-moe    # mid-size MoE in bf16 (an H200)

Measured 2026-11-30 (prompt 32, 64 new tokens; tokens/s, embedded vs HF generate):
  tiny, float32, 2 shared CPU cores:  C=1 873 vs 36 | C=16 4950 vs 60 | C=64 6395 vs 77
  bench-moe, bf16, one H200 (ragged): C=1 192 vs 57 | C=16 2494 vs 863 | C=64 6295 vs 3238
  bench-moe, bf16, one H200 (--expert-backend dense): C=1 206 | C=16 3269 | C=64 8721
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import tempfile
import time
from pathlib import Path

import numpy as np

CONFIGS = {
    # the test model (make_tiny_checkpoint defaults): hidden 64, 3 layers, 8 experts top-2
    "tiny": {},
    # a mid-size Qwen3-MoE: ~1.7 B parameters, 64 experts top-8 on every layer (the vocabulary
    # is the offline tokenizer's, ~1k, as make_tiny_checkpoint ties it to its tokenizer)
    "bench-moe": dict(
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=512,
        num_hidden_layers=8,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=64,
        num_experts_per_tok=8,
        mlp_only_layers=(),
    ),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    p.add_argument("--expert-backend", default=None, help="dense | ragged | tokamax")
    p.add_argument("--ckpt-dir", default=None, help="reuse / write the checkpoint here")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--json-out", default=None)
    return p.parse_args()


def make_checkpoint(args: argparse.Namespace) -> Path:
    from osworld_jax.model.tiny import make_tiny_checkpoint

    path = Path(args.ckpt_dir or tempfile.mkdtemp(prefix=f"bench_{args.config}_"))
    if not (path / "config.json").exists():
        t = time.perf_counter()
        make_tiny_checkpoint(path, seed=0, **CONFIGS[args.config])
        print(f"wrote {args.config} checkpoint to {path} in {time.perf_counter() - t:.1f}s")
    return path


async def embedded_rate(engine, prompts: list[list[int]], n: int) -> float:
    import aiohttp
    from aiohttp import web

    from osworld_jax.rollout.server import build_app

    runner = web.AppRunner(build_app(engine))
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/generate"
    body = {"sampling_params": {"max_new_tokens": n, "ignore_eos": True, "temperature": 1.0}}
    try:
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as s:

            async def one(ids: list[int]) -> int:
                async with s.post(url, data=json.dumps({**body, "input_ids": ids})) as r:
                    reply = await r.json()
                    assert r.status == 200, reply
                    return int(reply["meta_info"]["completion_tokens"])

            await asyncio.gather(*(one(p) for p in prompts))  # warm-up: compiles the buckets
            t = time.perf_counter()
            counts = await asyncio.gather(*(one(p) for p in prompts))
            dt = time.perf_counter() - t
    finally:
        await runner.cleanup()
    assert all(c == n for c in counts), counts
    return sum(counts) / dt


def hf_rate(model, prompts: list[list[int]], n: int, device: str) -> float:
    import torch

    ids = torch.as_tensor(prompts, device=device)
    kw = dict(
        max_new_tokens=n, min_new_tokens=n, do_sample=True, temperature=1.0, top_k=0, top_p=1.0
    )
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), **kw)  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        if device == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
    assert out.shape[1] - ids.shape[1] == n
    return len(prompts) * n / dt


def main() -> None:
    args = parse_args()
    import jax

    from osworld_jax.rollout.engine import Engine, EngineConfig

    on_gpu = jax.default_backend() == "gpu"
    dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    path = make_checkpoint(args)
    levels = [int(c) for c in args.concurrency.split(",")]
    n = args.max_new_tokens

    def start(c: int) -> Engine:
        # One engine per level, decoding exactly C slots, every bucket compiled before timing.
        engine = Engine(
            EngineConfig(
                model_path=str(path),
                max_running_requests=c,
                min_decode_batch=c,
                context_length=args.prompt_len + n + 1,
                dtype=dtype,
                expert_backend=args.expert_backend or "ragged",
            )
        ).start()
        engine.precompile(args.prompt_len, args.prompt_len + n)
        return engine

    rng = np.random.default_rng(0)
    rows = []
    model = None
    device = "cpu"
    if not args.skip_hf:
        import torch
        from transformers import Qwen3MoeForCausalLM

        device = "cuda" if torch.cuda.is_available() else "cpu"
        torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        model = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch_dtype).to(device).eval()
    for c in levels:
        engine = start(c)
        try:
            prompts = rng.integers(10, engine.vocab_size, size=(c, args.prompt_len)).tolist()
            ours = asyncio.run(embedded_rate(engine, prompts, n))
            theirs = hf_rate(model, prompts, n, device) if model is not None else float("nan")
            rows.append({"concurrency": c, "embedded_tok_s": ours, "hf_generate_tok_s": theirs})
            print(f"C={c}: embedded {ours:.1f} tok/s, HF generate {theirs:.1f} tok/s", flush=True)
        finally:
            engine.shutdown()
    dev = jax.devices()[0].device_kind
    print(f"\n{args.config} ({dtype}) on {dev}; prompt {args.prompt_len}, {n} new tokens/request")
    print("| concurrency | embedded tok/s | HF generate tok/s | speed-up |\n|---|---|---|---|")
    for r in rows:
        ratio = r["embedded_tok_s"] / r["hf_generate_tok_s"]
        print(
            f"| {r['concurrency']} | {r['embedded_tok_s']:.1f} | {r['hf_generate_tok_s']:.1f} | "
            f"{ratio:.2f}x |"
        )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"config": args.config, "rows": rows}))


if __name__ == "__main__":
    main()
