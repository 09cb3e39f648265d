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

Image rows (``--images``; ``--config bench-vl`` implies it): a Qwen3-VL-MoE checkpoint
(make_tiny_checkpoint kind="qwen3_vl_moe": ``tiny``'s processor turns a 1920x1080 screenshot into
288x512 pixels, 144 image tokens; ``bench-vl`` is `benchmarks/train_step.py`'s bench-vl model,
Qwen3-VL-30B-A3B's ViT and text layers cut to 8, random bf16 weights, the published processor
limits: 8,160 patches, 2,040 image tokens); each request is a chat turn holding one 1920x1080 PNG
screenshot (base64 in ``image_data``, a different one per request: the desktop image with a
per-request box, so no image is shared) and generates ``--max-new-tokens``; all C requests stream
(SSE) at once (C = 1: ``--rounds`` requests one after another). tokens/s = C * new tokens / wall
seconds; time to first token (TTFT) = from a request's POST to its first event (base64 and PNG
decoding, resizing and patchifying, the ViT and the prefill included), mean and p99 over the
requests. One engine serves every level (``--max-running-requests`` = the largest C); two
warm-ups at each level (other screenshots; the second reuses the text before the image, as the
timed requests do) compile every bucket first; a compile in a timed run fails the benchmark
(exit 1, after the table). Each row also gives the achieved forward TFLOP/s (`request_flops`:
the ViT, the prefill and the decode of each request) and the round's seconds beside its floor,
its FLOPs at ``--peak-flops``.

HF peer of the image rows (``--skip-hf`` to leave it out): transformers
``Qwen3VLMoeForConditionalGeneration`` from the same checkpoint (bf16 on a GPU, sdpa, grouped_mm
experts), ``generate`` on the same token ids (the placeholders expanded to the processor's count)
and the same ``pixel_values`` / ``image_grid_thw`` (made by osworld_jax's image processor from the
same PNG bytes, which equals transformers' Qwen2-VL processor: tests/model/test_processor.py;
timed as part of HF's TTFT, as the server times its own), the C requests as one batch
(``do_sample``, ``min_new_tokens`` = max); TTFT = until ``generate``'s streamer receives the
first new tokens. It runs in a subprocess before JAX touches the GPU.

Measured 2026-12-06 on one H100 80GB (the only device time left: C = 1 only, 2 rounds, 8 new
tokens; HF in the first call, ours in the next on the same warm machine after a missing orjson
stopped the first): ``python3 benchmarks/serve.py --config bench-vl --concurrency 1 --rounds 2
--max-new-tokens 8 --ckpt-dir /tmp/bvl`` -> HF generate TTFT 0.185 s (p99 0.187), 28.3 tok/s;
ours TTFT 0.236 s (p99 0.237), 27.9 tok/s. C = 16 / 64 not measured.

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
    # benchmarks/train_step.py's bench-vl model (filled in by `bench_vl_overrides`)
    "bench-vl": {},
}
#: Context length of the image rows' engine (a screenshot's tokens + text + new tokens).
IMAGE_CONTEXT = {"tiny": 256, "bench-vl": 4096}


def bench_vl_overrides() -> dict:
    """make_tiny_checkpoint arguments for train_step.py's bench-vl model: the text fields, the
    ViT (``vision``) and the processor limits (``preprocessor``), bf16 weights."""  # noqa: D205, D209
    import dataclasses
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from train_step import CONFIGS as TRAIN_CONFIGS  # type: ignore[import-not-found]

    from osworld_jax.model import Qwen3MoeConfig

    bench = TRAIN_CONFIGS["bench-vl"]
    text = {f.name: getattr(bench.model, f.name) for f in dataclasses.fields(Qwen3MoeConfig)}
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        text.pop(key, None)
    return dict(
        text,
        vision=dataclasses.asdict(bench.model.vision),
        preprocessor=dict(bench.preprocessor),
        weights_dtype="bfloat16",
    )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    p.add_argument("--expert-backend", default=None, help="dense | ragged | tokamax")
    p.add_argument("--ckpt-dir", default=None, help="reuse / write the checkpoint here")
    p.add_argument("--decode-steps", type=int, default=1, help="our --num-continuous-decode-steps")
    p.add_argument(
        "--extra-length-buckets", type=int, nargs="*", default=[], help="ours, as the server's"
    )
    p.add_argument("--decode-expert-backend", default=None, help="ours, as the server's")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument(
        "--hf-only", action="store_true", help="image rows: HF's alone (ours in another run)"
    )
    p.add_argument(
        "--warmup-decode-buckets",
        choices=("auto", "on", "off"),
        default="auto",
        help="ours, as the server's (off: decode programs compile in the warm-up rounds)",
    )
    p.add_argument(
        "--images", action="store_true", help="the image row: one 1920x1080 screenshot a request"
    )
    p.add_argument("--rounds", type=int, default=8, help="image rows: requests timed at C = 1")
    p.add_argument("--peer-timeout", type=float, default=900.0, help="HF peer subprocess limit")
    p.add_argument("--hf-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json-out", default=None)
    p.add_argument(
        "--profile-dir", default=None, help="a jax profiler trace of ours' timed image rows here"
    )
    p.add_argument(
        "--peak-flops",
        type=float,
        default=989e12,
        help="the device's dense bf16 FLOP/s (H100 / H200 SXM: 989e12): the image rows' floor",
    )
    args = p.parse_args()
    args.images = args.images or args.config == "bench-vl"
    return args


def make_checkpoint(args: argparse.Namespace) -> Path:
    from osworld_jax.model.tiny import make_tiny_checkpoint

    path = Path(args.ckpt_dir or tempfile.mkdtemp(prefix=f"bench_{args.config}_"))
    if not (path / "config.json").exists():
        t = time.perf_counter()
        kind = "qwen3_vl_moe" if args.images else "qwen3_moe"
        overrides = CONFIGS[args.config]
        if args.images:
            overrides = bench_vl_overrides() if args.config == "bench-vl" else {}
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
    engine,
    prompt: list[int],
    levels: list[int],
    rounds: int,
    n: int,
    flops: float = 0.0,
    profile_dir: str | None = None,
) -> list[dict]:
    """Per concurrency C: tokens/s and the TTFTs of C streamed requests, one screenshot each
    (C = 1: ``rounds`` requests one after another), after a warm-up at that level with other
    screenshots. ``flops``: one request's (`request_flops`): the rows' achieved FLOP/s.
    ``profile_dir``: a jax profiler trace of the timed requests there (one subfolder a level)."""  # noqa: D205, D209
    import aiohttp
    import jax
    from aiohttp import web

    from osworld_jax.server.app import build_app

    runner = web.AppRunner(build_app(engine))
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/generate"
    sp = {"max_new_tokens": n, "ignore_eos": True, "temperature": 1.0}
    rows = []
    try:
        conn = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:

            def payload(image: str) -> bytes:  # serialised before the clock starts, as HF's
                body = {"input_ids": prompt, "image_data": [image], "sampling_params": sp}
                return json.dumps({**body, "stream": True}).encode()

            async def one(data: bytes) -> tuple[float, int]:
                t0, first, last = time.perf_counter(), None, None
                headers = {"Content-Type": "application/json"}
                async with s.post(url, data=data, headers=headers) as r:
                    assert r.status == 200, await r.text()
                    async for line in r.content:
                        if line.startswith(b"data: {"):
                            first = first or time.perf_counter()
                            last = line
                assert first is not None and last is not None
                done = json.loads(last[6:])
                return first - t0, int(done["meta_info"]["completion_tokens"])

            for salt, c in enumerate(levels):
                # Warm-up twice (other screenshots): the second finds the text before the image
                # kept from the first (prefix reuse), as the timed requests do.
                for warm in (3 * salt, 3 * salt + 1):  # C = 1: one after another, as timed
                    shots = [payload(im) for im in screenshots(max(c, rounds), warm)]
                    if c == 1:
                        for data in shots:
                            await one(data)
                    else:
                        await asyncio.gather(*(one(data) for data in shots))
                images = [
                    payload(im) for im in screenshots(max(c, rounds) if c == 1 else c, 3 * salt + 2)
                ]
                before = compiled()
                busy = engine.prefill_seconds, engine.decode_seconds
                if profile_dir:
                    jax.profiler.start_trace(f"{profile_dir}/c{c}", create_perfetto_trace=True)
                t = time.perf_counter()
                if c == 1:
                    res = [await one(im) for im in images]
                else:
                    res = await asyncio.gather(*(one(im) for im in images))
                dt = time.perf_counter() - t
                if profile_dir:
                    jax.profiler.stop_trace()
                after = compiled()
                if after != before:
                    print(f"  COMPILED during the timed run: {before} -> {after}")
                assert all(r[1] == n for r in res), res
                rows.append(_row(c, len(images) * n / dt, [r[0] for r in res]))
                rows[-1].update(
                    flop_s=len(images) * flops / dt,
                    seconds=dt,
                    compiled=after != before,
                    prefill_s=engine.prefill_seconds - busy[0],
                    decode_s=engine.decode_seconds - busy[1],
                )
                print(f"ours C={c}: {_fmt(rows[-1])}", flush=True)
    finally:
        await runner.cleanup()
    return rows


def _row(c: int, rate: float, ttft: list[float]) -> dict:
    return {
        "concurrency": c,
        "tok_s": rate,
        "ttft_mean_s": float(np.mean(ttft)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
    }


def _fmt(r: dict) -> str:
    return f"{r['tok_s']:.1f} tok/s, TTFT mean {r['ttft_mean_s']:.3f}s p99 {r['ttft_p99_s']:.3f}s"


def image_prompt(tokenizer) -> list[int]:
    """The image rows' chat turn: a question, one screenshot placeholder, the reply's header."""
    text = "<|im_start|>user\nWhat should I click?<|vision_start|><|image_pad|>"
    text += "<|vision_end|><|im_end|>\n<|im_start|>assistant\n"
    return tokenizer.encode(text).ids


def hf_sampling(n: int) -> dict:
    """HF ``generate`` sampling as the server's requests: exactly ``n`` tokens, temperature 1."""
    return dict(
        max_new_tokens=n, min_new_tokens=n, do_sample=True, temperature=1.0, top_k=0, top_p=1.0
    )


def hf_image_rows(args: argparse.Namespace, path: Path, levels: list[int]) -> list[dict]:
    """HF transformers ``generate`` on the image rows' prompts and pixels (module docstring)."""
    import base64

    import torch
    from tokenizers import Tokenizer
    from transformers import Qwen3VLMoeForConditionalGeneration
    from transformers.generation.streamers import BaseStreamer

    from osworld_jax.model import Qwen3VLMoeConfig
    from osworld_jax.model.processor import ImageProcessor
    from osworld_jax.server.images import expand_image_tokens

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(
        path, dtype=dtype, attn_implementation="sdpa"
    )
    model = model.to(device).eval()
    if device == "cuda" and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("grouped_mm")
    config = Qwen3VLMoeConfig.from_json(path / "config.json")
    processor = ImageProcessor.from_pretrained(path)
    prompt = image_prompt(Tokenizer.from_file(str(path / "tokenizer.json")))
    n = args.max_new_tokens

    class FirstToken(BaseStreamer):
        def __init__(self) -> None:
            self.calls, self.at = 0, None

        def put(self, value) -> None:  # the prompt first, then each step's new tokens
            self.calls += 1
            if self.calls == 2:
                self.at = time.perf_counter()

        def end(self) -> None:
            pass

    def generate(images: list[str]) -> tuple[float, float]:
        """(time to first token, total) of one batch from its base64 PNGs."""
        t0 = time.perf_counter()
        pixels, grids = processor([base64.b64decode(im) for im in images])
        per_image = [int(np.prod(g)) // config.vision.spatial_merge_size**2 for g in grids]
        ids = [expand_image_tokens(prompt, [k], config, "hf") for k in per_image]
        input_ids = torch.as_tensor(ids, device=device)
        streamer = FirstToken()
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                pixel_values=torch.as_tensor(pixels, device=device, dtype=dtype),
                image_grid_thw=torch.as_tensor(grids, device=device),
                streamer=streamer,
                **hf_sampling(n),
            )
        if device == "cuda":
            torch.cuda.synchronize()
        assert out.shape[1] - input_ids.shape[1] == n and streamer.at is not None
        return streamer.at - t0, time.perf_counter() - t0

    rows = []
    for salt, c in enumerate(levels):
        generate(screenshots(c, 2 * salt))  # warm-up
        if c == 1:
            timed = [generate([im]) for im in screenshots(args.rounds, 2 * salt + 1)]
            rows.append(_row(1, len(timed) * n / sum(t for _, t in timed), [f for f, _ in timed]))
        else:
            first, total = generate(screenshots(c, 2 * salt + 1))
            rows.append(_row(c, c * n / total, [first] * c))
        print(f"HF C={c}: {_fmt(rows[-1])}", flush=True)
    return rows


def run_hf_child(args: argparse.Namespace, path: Path) -> list[dict] | str:
    """The HF image rows in a subprocess (before JAX takes the GPU): rows, or an error line."""
    import subprocess
    import sys

    cmd = [sys.executable, __file__, "--hf-child", "--config", args.config, "--images"]
    cmd += ["--ckpt-dir", str(path), "--concurrency", args.concurrency]
    cmd += ["--max-new-tokens", str(args.max_new_tokens), "--rounds", str(args.rounds)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.peer_timeout)
    except subprocess.TimeoutExpired as e:
        return f"no result within --peer-timeout {e.timeout} s"
    sys.stdout.write(proc.stdout[-3000:])
    for line in proc.stdout.splitlines():
        if line.startswith("HF_RESULT "):
            return json.loads(line[len("HF_RESULT ") :])
    sys.stderr.write(proc.stderr[-4000:])
    return (proc.stderr.strip().splitlines() or ["?"])[-1]


def request_flops(config, prompt_len: int, new_tokens: int, patches: int) -> float:
    """Forward FLOPs of one image request: the ViT over its patches, the LM's prefill of its
    ``prompt_len`` tokens (image tokens included) and ``new_tokens`` decode steps, each over the
    context so far (`benchmarks/train_step.py`'s formulas, forward only: a third)."""  # noqa: D205, D209
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from train_step import active_params, vision_flops  # type: ignore[import-not-found]

    _, active = active_params(config)
    per_key = 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim
    prefill = 2 * active * prompt_len + per_key * prompt_len * prompt_len / 2  # causal
    decode = sum(2 * active + per_key * (prompt_len + t) for t in range(new_tokens))
    return vision_flops(config.vision, [patches]) / 3 + prefill + decode


def compiled() -> tuple[int, int]:
    """Compiled prefill and decode shapes so far (a timed run should add none)."""
    from osworld_jax.server import runner

    return runner._prefill._cache_size(), runner._decode._cache_size()


def image_rows(args: argparse.Namespace, path: Path, levels: list[int]) -> None:
    # The server's imports (aiohttp, orjson) before the peer's minutes: on the device a missing
    # orjson once surfaced only after HF had run. Importing JAX claims no GPU memory yet.
    import osworld_jax.server.app  # noqa: F401

    hf = None if args.skip_hf else run_hf_child(args, path)  # before JAX takes the GPU
    if args.hf_only:
        for r in hf if isinstance(hf, list) else []:
            print(f"HF C={r['concurrency']}: {_fmt(r)}")
        print(hf if isinstance(hf, str) else "")
        return
    import jax

    from osworld_jax.server.engine import Engine, EngineConfig

    dtype = args.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32")

    n = args.max_new_tokens
    engine = Engine(
        EngineConfig(
            model_path=str(path),
            max_running_requests=max(levels),
            context_length=IMAGE_CONTEXT[args.config],
            dtype=dtype,
            expert_backend=args.expert_backend or "auto",
            num_continuous_decode_steps=args.decode_steps,
            extra_length_buckets=tuple(args.extra_length_buckets),
            decode_expert_backend=args.decode_expert_backend,
            warmup_decode_buckets={"auto": None, "on": True, "off": False}[
                args.warmup_decode_buckets
            ],
        )
    ).start()
    try:
        prompt = image_prompt(engine.tokenizer)
        tokens = engine.processor.num_image_tokens(1080, 1920)
        patches = tokens * engine.model_config.vision.spatial_merge_size**2
        flops = request_flops(engine.model_config, len(prompt) - 1 + tokens, n, patches)
        rows = asyncio.run(
            embedded_image_rates(
                engine, prompt, levels, args.rounds, n, flops, profile_dir=args.profile_dir
            )
        )
    finally:
        engine.shutdown()
    dev = jax.devices()[0].device_kind
    print(f"\n{args.config} Qwen3-VL-MoE ({dtype}) on {dev}; one 1920x1080 screenshot ({tokens}")
    print(f"image tokens) + {len(prompt) - 1} text tokens a request, {n} new tokens a request;")
    extra = ",".join(map(str, args.extra_length_buckets)) or "none"
    print(f"ours: {args.decode_steps} decode steps a device call, extra length buckets {extra}")
    print(f"ours: decode expert backend {args.decode_expert_backend or 'as the prefill'}")
    if isinstance(hf, str):
        print(f"HF peer: {hf}")
    peer = {r["concurrency"]: r for r in hf} if isinstance(hf, list) else {}
    print(f"one request: {flops / 1e9:.1f} GFLOP forward (ViT + prefill + decode); the floor of")
    print(f"a round: its FLOPs at --peak-flops {args.peak_flops / 1e12:.0f} TFLOP/s")
    print(
        "| C | ours tok/s | ours TTFT mean / p99 s | HF generate tok/s | HF TTFT mean / p99 s "
        "| ours TFLOP/s | round s / floor s | engine prefill s / decode s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        h = peer.get(r["concurrency"])
        theirs = "- | -" if h is None else (
            f"{h['tok_s']:.1f} | {h['ttft_mean_s']:.3f} / {h['ttft_p99_s']:.3f}"
        )  # fmt: skip
        floor = r["flop_s"] * r["seconds"] / args.peak_flops
        print(
            f"| {r['concurrency']} | {r['tok_s']:.1f} | {r['ttft_mean_s']:.3f} / "
            f"{r['ttft_p99_s']:.3f} | {theirs} | {r['flop_s'] / 1e12:.3f} | "
            f"{r['seconds']:.3f} / {floor:.5f} | {r['prefill_s']:.3f} / {r['decode_s']:.3f} |"
        )
    if args.json_out:
        out = {"config": args.config, "image_rows": rows, "hf_image_rows": hf}
        Path(args.json_out).write_text(json.dumps(out))
    late = [r["concurrency"] for r in rows if r["compiled"]]
    if late:  # the timed numbers include a compile: not a measurement of the server
        raise SystemExit(f"serve.py: a program compiled during the timed run at C = {late}")


def hf_rate(model, prompts: list[list[int]], n: int, device: str) -> float:
    import torch

    ids = torch.as_tensor(prompts, device=device)
    kw = hf_sampling(n)
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
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.hf_child:
        rows = hf_image_rows(args, Path(args.ckpt_dir), levels)
        print("HF_RESULT " + json.dumps(rows), flush=True)
        return
    if args.images:
        image_rows(args, make_checkpoint(args), levels)
        return
    import jax

    from osworld_jax.server.engine import Engine, EngineConfig

    on_gpu = jax.default_backend() == "gpu"
    dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    path = make_checkpoint(args)
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
                num_continuous_decode_steps=args.decode_steps,
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
    print(f"\n{args.config} ({dtype}) on {dev}; prompt {args.prompt_len}, {n} new tokens/request;")
    print(f"ours: {args.decode_steps} decode steps a device call")
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
