"""Decode throughput of the embedded server vs HF transformers ``generate`` on the same device.

For each concurrency C, C requests of ``--prompt-len`` random tokens each generate exactly
``--max-new-tokens`` tokens (``ignore_eos``, temperature 1). The embedded server is driven over
HTTP (in-process aiohttp server, the real `/generate` path, all C requests in flight at once);
HF generates the same C prompts as one batch (``do_sample``, ``min_new_tokens`` = max). Both are
warmed up at that concurrency first (compiles / CUDA graphs are not timed).
tokens/s = C * max_new_tokens / wall seconds.

  python benchmarks/serve.py                       # tiny model, CPU
  python benchmarks/serve.py --config bench-moe    # mid-size MoE in bf16 (an H200)
  python benchmarks/serve.py --images              # the image row (tiny Qwen3-VL-MoE)

Image row (``--images``): a tiny Qwen3-VL-MoE (make_tiny_checkpoint kind="qwen3_vl_moe": its
processor turns a 1920x1080 screenshot into 288x512 pixels, 144 image tokens); each request is
a chat turn holding one 1920x1080 PNG screenshot (base64 in ``image_data``, a different one per
request: the desktop image with a per-request box, so no prefix is shared) and generates
``--max-new-tokens``; all C requests stream (SSE) at once. tokens/s = C * new tokens / wall
seconds; time to first token = from a request's POST to its first event (PNG decoding,
resizing and patchifying, the ViT and the prefill included), mean and max over the C requests.
Warm-up (one request alone, then C) compiles every bucket; a compile in the timed run is printed.

Measured 2026-12-01, ``python benchmarks/serve.py --images`` (64 new tokens; tiny, float32, 2 CPU
cores shared with other jobs, load ~8): C=1 390 tok/s, TTFT 0.12 s | C=16 1017 tok/s, TTFT
0.67 s (max 0.86) | C=64 1987 tok/s, TTFT 1.17 s (max 1.58). H200 not measured (no device time).

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
    p.add_argument(
        "--images", action="store_true", help="the image row: one 1920x1080 screenshot a request"
    )
    p.add_argument("--json-out", default=None)
    return p.parse_args()


def make_checkpoint(args: argparse.Namespace) -> Path:
    from osworld_jax.model.tiny import make_tiny_checkpoint

    path = Path(args.ckpt_dir or tempfile.mkdtemp(prefix=f"bench_{args.config}_"))
    if not (path / "config.json").exists():
        t = time.perf_counter()
        kind = "qwen3_vl_moe" if args.images else "qwen3_moe"
        overrides = CONFIGS[args.config]
        if args.images and args.config == "tiny":
            overrides = {}
        make_tiny_checkpoint(path, seed=0, kind=kind, **overrides)
        print(f"wrote {args.config} checkpoint to {path} in {time.perf_counter() - t:.1f}s")
    return path


async def embedded_rate(engine, prompts: list[list[int]], n: int) -> float:
    # The warm-up sends other prompts: the timed ones must not find their KV kept from it
    # (the prefix cache would skip their prefill).
    warm = [[(t + 1) % engine.vocab_size for t in p] for p in prompts]
    import aiohttp
    from aiohttp import web

    from osworld_jax.server.app import build_app

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

            await asyncio.gather(*(one(p) for p in warm))  # warm-up: compiles the buckets
            before = compiled()
            t = time.perf_counter()
            counts = await asyncio.gather(*(one(p) for p in prompts))
            dt = time.perf_counter() - t
            if compiled() != before:
                print(f"  (compiled during the timed run: {before} -> {compiled()})")
    finally:
        await runner.cleanup()
    assert all(c == n for c in counts), counts
    return sum(counts) / dt


SCREENSHOT = Path(__file__).resolve().parents[1] / "tests/model/assets/desktop_1920x1080.png"


def screenshots(c: int, salt: int = 0) -> list[str]:
    """C different 1920x1080 PNG screenshots (base64): the desktop with a box per request
    (another ``salt``, other boxes: the timed run shares no image with the warm-up)."""
    import base64
    import io

    from PIL import Image, ImageDraw

    out = []
    for i in range(c):
        image = Image.open(SCREENSHOT).convert("RGB")
        x, y = 60 * (i % 30), 40 * (i // 30)
        color = (i * 37 % 256, 90 + salt, 200)
        ImageDraw.Draw(image).rectangle((x, y, x + 50, y + 30), fill=color)
        buf = io.BytesIO()
        image.save(buf, "PNG")
        out.append(base64.b64encode(buf.getvalue()).decode())
    return out


async def embedded_image_rates(
    engine, prompt: list[int], warm: list[str], images: list[str], n: int
) -> tuple[float, float, float]:
    """(tokens/s, mean time to first token s, max time to first token s) of C streamed
    requests, one screenshot each (after a warm-up with the ``warm`` screenshots)."""
    import aiohttp
    from aiohttp import web

    from osworld_jax.server.app import build_app

    runner = web.AppRunner(build_app(engine))
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/generate"
    sp = {"max_new_tokens": n, "ignore_eos": True, "temperature": 1.0}
    try:
        conn = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:

            async def one(image: str) -> tuple[float, int]:
                body = {"input_ids": prompt, "image_data": [image], "sampling_params": sp}
                t0, first, last = time.perf_counter(), None, None
                async with s.post(url, json={**body, "stream": True}) as r:
                    assert r.status == 200, await r.text()
                    async for line in r.content:
                        if line.startswith(b"data: {"):
                            first = first or time.perf_counter()
                            last = line
                assert first is not None and last is not None
                done = json.loads(last[6:])
                return first - t0, int(done["meta_info"]["completion_tokens"])

            # warm-up: one request alone (1-row prefills), then all (batched prefills)
            await one(warm[0])
            await asyncio.gather(*(one(im) for im in warm))
            before = compiled()
            t = time.perf_counter()
            res = await asyncio.gather(*(one(im) for im in images))
            dt = time.perf_counter() - t
            if compiled() != before:
                print(f"  (compiled during the timed run: {before} -> {compiled()})")
    finally:
        await runner.cleanup()
    ttft = [r[0] for r in res]
    assert all(r[1] == n for r in res), res
    return len(images) * n / dt, float(np.mean(ttft)), float(np.max(ttft))


def compiled() -> tuple[int, int]:
    """Compiled prefill and decode shapes so far (a timed run should add none)."""
    from osworld_jax.server import runner

    return runner._prefill._cache_size(), runner._decode._cache_size()


def image_rows(args: argparse.Namespace, path: Path, dtype: str, levels: list[int]) -> None:
    from osworld_jax.server.engine import Engine, EngineConfig

    n = args.max_new_tokens
    rows = []
    for c in levels:
        engine = Engine(
            EngineConfig(
                model_path=str(path),
                max_running_requests=c,
                min_decode_batch=c,
                context_length=256,
                dtype=dtype,
                expert_backend=args.expert_backend or "ragged",
            )
        ).start()
        try:
            text = "<|im_start|>user\nWhat should I click?<|vision_start|><|image_pad|>"
            text += "<|vision_end|><|im_end|>\n<|im_start|>assistant\n"
            prompt = engine.tokenizer.encode(text).ids
            rate, mean, worst = asyncio.run(
                embedded_image_rates(engine, prompt, screenshots(c, 0), screenshots(c, 1), n)
            )
        finally:
            engine.shutdown()
        rows.append({"concurrency": c, "tok_s": rate, "ttft_mean_s": mean, "ttft_max_s": worst})
        text_tokens = len(prompt) - 1
        print(f"C={c}: {rate:.1f} tok/s, TTFT mean {mean:.3f}s max {worst:.3f}s", flush=True)
    import jax

    dev = jax.devices()[0].device_kind
    print(f"\n{args.config} Qwen3-VL-MoE ({dtype}) on {dev}; one 1920x1080 screenshot (144 image")
    print(f"tokens) + {text_tokens} text tokens a request, {n} new tokens a request, streamed")
    print("| concurrency | tokens/s | TTFT mean s | TTFT max s |\n|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['concurrency']} | {r['tok_s']:.1f} | {r['ttft_mean_s']:.3f} | "
            f"{r['ttft_max_s']:.3f} |"
        )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"config": args.config, "image_rows": rows}))


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

    from osworld_jax.server.engine import Engine, EngineConfig

    on_gpu = jax.default_backend() == "gpu"
    dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    path = make_checkpoint(args)
    levels = [int(c) for c in args.concurrency.split(",")]
    n = args.max_new_tokens
    if args.images:
        image_rows(args, path, dtype, levels)
        return

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
