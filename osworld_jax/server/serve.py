r"""``python -m osworld_jax.server.serve``: the embedded SGLang-compatible JAX server.

Flags mirror ``python -m sglang.launch_server`` (those that apply to one JAX process)::

  python -m osworld_jax.server.serve --model-path DIR --host 127.0.0.1 --port 30000 \
      --enable-return-routed-experts --max-running-requests 16 --weight-version step0
  python -m osworld_jax.server.serve --model-path tiny   # a random tiny model, as the configs

``--model-path`` is a Hugging Face checkpoint directory (config.json, *.safetensors,
tokenizer.json), or ``tiny`` (``--tiny-kind``) for the random tiny model the configs' default
``ModelSourceConfig.path = 'tiny'`` builds; a bad one is refused in one line before the port
opens. The port then opens at once; ``/health`` answers 503 until the model is loaded and a
warm-up generation has run, then 200. SIGTERM / SIGINT stop it cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from aiohttp import web

from osworld_jax.model.serving import DEFAULT_MIN_BUCKET
from osworld_jax.server.app import build_app
from osworld_jax.server.engine import Engine, EngineConfig
from osworld_jax.server.http_base import ENGINE_KEY
from osworld_jax.server.protocol import ServerLimits
from osworld_jax.server.staging import Staging

log = logging.getLogger("osworld_jax.server.serve")


def _env_flag(name: str) -> bool:
    """SGLang's ``get_bool_env_var``: "true" / "1" (any case) is set, anything else is not."""
    return os.environ.get(name, "false").lower() in ("true", "1")


class Number:
    """An argparse type: an int or a finite float in ``[lo, hi]`` (``(lo, hi]`` if ``lo_open``).

    A malformed or out-of-range value is refused while the flags are parsed (before anything
    loads), in one line naming the bound it violates.
    """

    def __init__(self, kind: type, lo: float, hi: float, *, lo_open: bool = False) -> None:
        self.kind, self.lo, self.hi, self.lo_open = kind, lo, hi, lo_open

    def __call__(self, text: str) -> Any:
        """The value of ``text``, or `argparse.ArgumentTypeError` saying what is wrong."""
        try:
            v = self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"invalid {self.kind.__name__} value: {text!r}"
            ) from None
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if v < self.lo or (self.lo_open and v == self.lo):
            bound = "greater than" if self.lo_open else "at least"
            raise argparse.ArgumentTypeError(f"must be {bound} {self.lo}, got {text}")
        if v > self.hi:
            raise argparse.ArgumentTypeError(f"must be at most {self.hi}, got {text}")
        return v


def _count(hi: int = 1 << 40) -> Number:
    return Number(int, 1, hi)


#: Every timeout: seconds, finite, above 0 (31 years at most).
SECONDS = Number(float, 0.0, 1e9, lo_open=True)
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


class _OneLineParser(argparse.ArgumentParser):
    """Bad flags end in one line on stderr (``error: --flag: ...``) and exit 2, as argparse."""

    def error(self, message: str) -> NoReturn:
        if message.startswith("argument "):  # "argument --port: ..." -> "--port: ..."
            flag, _, rest = message[len("argument ") :].partition(": ")
            message = f"{flag.split('/')[-1]}: {rest}"
        self.exit(2, f"error: {message}\n")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses the launch flags; each numeric one is checked against its range here.

    Raises:
      SystemExit: 2 after one line on stderr naming the flag, for a malformed, non-finite or
        out-of-range value (before anything loads).
    """
    p = _OneLineParser(
        prog="python -m osworld_jax.server.serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model-path",
        required=True,
        help="HF checkpoint directory, or 'tiny' (a random tiny model)",
    )
    p.add_argument(
        "--tiny-kind",
        choices=("qwen3_moe", "qwen3_vl_moe"),
        default="qwen3_moe",
        help="with --model-path tiny: the text or the screenshot model",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=Number(int, 0, 65535), default=30000, help="0: any free port")
    p.add_argument("--enable-return-routed-experts", action="store_true")
    p.add_argument("--max-running-requests", type=_count(1 << 16), default=16)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "auto"), default="auto")
    p.add_argument(
        "--context-length",
        type=Number(int, 2, 1 << 24),
        default=None,
        help="tokens per request, prompt + output (a prompt needs room for one output token)",
    )
    p.add_argument("--max-total-tokens", type=_count(), default=None)
    p.add_argument(
        "--expert-backend", default=None, help="auto | dense | ragged | pallas_gmm | tokamax"
    )
    p.add_argument(
        "--decode-expert-backend",
        default=None,
        help="the decode steps' expert backend (default: --expert-backend); dense reads every "
        "expert once a step, as a batch routing to most experts does anyway",
    )
    p.add_argument(
        "--mm-attention-backend",
        choices=("cudnn", "xla"),
        default="cudnn",
        help="the vision tower's attention: cudnn (packed flash attention per image on a GPU in "
        "bfloat16; XLA elsewhere) or xla",
    )
    p.add_argument(
        "--vlm-cache-size-mb",
        type=Number(int, 0, 1 << 30),
        default=os.environ.get("SGLANG_VLM_CACHE_SIZE_MB", "2048"),  # a string default is parsed
        help="MiB of processed images kept by content hash: a screenshot sent again (a later "
        "turn, another owner) is not decoded again; 0: none (default: SGLang's environment "
        "variable SGLANG_VLM_CACHE_SIZE_MB, else 2048)",
    )
    p.add_argument(
        "--mm-embedding-cache-mb",
        type=Number(int, 0, 1 << 20),
        default=512,
        help="MiB of device memory for the vision tower's outputs kept by image content: an "
        "image sent again (a later turn, another owner) skips the tower; 0: none kept",
    )
    p.add_argument(
        "--switch-interval-ms",
        type=Number(float, 0.01, 5.0),
        default=0.2,
        help="the process's GIL switch interval (sys.setswitchinterval; Python's is 5 ms): the "
        "engine thread gets the GIL back this soon after each device step while request "
        "threads parse JSON and images",
    )
    p.add_argument(
        "--num-continuous-decode-steps",
        type=Number(int, 1, 64),
        default=1,
        help="decode steps per device call: one dispatch and one scheduling pass per n tokens "
        "(a host-bound decode goes up to n times faster); new requests wait up to n steps",
    )
    p.add_argument(
        "--extra-length-buckets",
        type=_count(1 << 24),
        nargs="*",
        default=[],
        help="prefill lengths and attention windows beside the powers of two (each at most "
        "the context length), e.g. 3072: a one-screenshot prompt of ~2,100 tokens pads to "
        "3,072, not 4,096",
    )
    p.add_argument(
        "--warmup-decode-buckets",
        choices=("auto", "on", "off"),
        default="auto",
        help="compile every decode batch and window bucket at start, as SGLang captures its "
        "CUDA graphs (no request then waits on a decode compile); auto: on accelerators",
    )
    p.add_argument(
        "--scan-layers",
        choices=("auto", "on", "off"),
        default="auto",
        help="layers under lax.scan (faster compiles of deep models); auto: on accelerators",
    )
    p.add_argument("--random-seed", type=Number(int, 0, 2**63 - 1), default=0)
    p.add_argument("--min-bucket", type=_count(1 << 20), default=DEFAULT_MIN_BUCKET)
    p.add_argument("--min-decode-batch", type=_count(1 << 16), default=1)
    p.add_argument("--max-prefill-batch", type=_count(1 << 16), default=8)
    p.add_argument(
        "--max-prefill-tokens",
        type=_count(1 << 30),
        default=16384,
        help="new prompt tokens prefilled before the next decode step (the first waiting "
        "request whatever its length), as SGLang's flag",
    )
    p.add_argument(
        "--return-original-logprob",
        action="store_true",
        default=_env_flag("SGLANG_RETURN_ORIGINAL_LOGPROB"),
        help="output logprobs at temperature 1 instead of the request's temperature (default: "
        "SGLang's environment variable SGLANG_RETURN_ORIGINAL_LOGPROB, true/1)",
    )
    p.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="token ids in, token ids out; no tokenizer files needed (as SGLang's flag)",
    )
    p.add_argument("--served-model-name", default=None, help="the id in /v1/models")
    p.add_argument(
        "--disable-radix-cache",
        action="store_true",
        help="never reuse a kept prefix's KV (every prefill computes the whole sequence)",
    )
    limits = ServerLimits()
    p.add_argument(
        "--max-request-bytes",
        type=_count(),
        default=limits.max_request_bytes,
        help="larger bodies get HTTP 413",
    )
    p.add_argument(
        "--max-json-depth",
        type=_count(1024),
        default=limits.max_json_depth,
        help="deeper-nested bodies get HTTP 400",
    )
    p.add_argument(
        "--max-json-values",
        type=_count(),
        default=limits.max_json_values,
        help="bodies with more values (numbers, strings) get HTTP 400 before they are parsed",
    )
    p.add_argument("--max-stop-strings", type=_count(1 << 20), default=limits.max_stop_strings)
    p.add_argument(
        "--max-stop-length",
        type=_count(1 << 20),
        default=limits.max_stop_length,
        help="longest stop string in characters",
    )
    p.add_argument(
        "--max-image-pixels",
        type=_count(),
        default=limits.max_image_pixels,
        help="largest image (width x height, read from its header before decoding)",
    )
    p.add_argument(
        "--max-images-per-request", type=_count(1 << 20), default=limits.max_images_per_request
    )
    p.add_argument(
        "--max-request-image-pixels", type=_count(), default=limits.max_request_image_pixels
    )
    p.add_argument(
        "--max-server-image-pixels", type=_count(), default=limits.max_server_image_pixels
    )
    p.add_argument(
        "--chat-template-timeout-s", type=SECONDS, default=limits.chat_template_timeout_s
    )
    p.add_argument("--refit-read-timeout-s", type=SECONDS, default=limits.refit_read_timeout_s)
    p.add_argument("--stall-timeout-s", type=SECONDS, default=300.0, help="/health 503 after this")
    p.add_argument("--skip-server-warmup", action="store_true", help="accepted for parity")
    p.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, default="info")
    args = p.parse_args(argv)
    try:
        server_limits(args)
    except ValueError as e:
        p.error(str(e))
    return args


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The `EngineConfig` of parsed flags.

    ``--dtype auto``: bfloat16 on GPU, else float32. The expert backend defaults to ``auto``
    (the Pallas grouped matmul on a GPU, ``ragged`` elsewhere; `osworld_jax.model.moe`).
    """
    import jax

    on_gpu = jax.default_backend() == "gpu"
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if on_gpu else "float32")
    backend = args.expert_backend or "auto"
    return EngineConfig(
        model_path=args.model_path,
        max_running_requests=args.max_running_requests,
        context_length=args.context_length,
        max_total_tokens=args.max_total_tokens,
        dtype=dtype,
        expert_backend=backend,
        weight_version=args.weight_version,
        enable_return_routed_experts=args.enable_return_routed_experts,
        seed=args.random_seed,
        min_bucket=args.min_bucket,
        min_decode_batch=args.min_decode_batch,
        max_prefill_batch=args.max_prefill_batch,
        max_prefill_tokens=args.max_prefill_tokens,
        return_original_logprob=args.return_original_logprob,
        skip_tokenizer_init=args.skip_tokenizer_init,
        enable_prefix_cache=not args.disable_radix_cache,
        stall_timeout_s=args.stall_timeout_s,
        mm_attention_backend=args.mm_attention_backend,
        scan_layers={"auto": None, "on": True, "off": False}[args.scan_layers],
        vlm_cache_size_mb=args.vlm_cache_size_mb,
        mm_embedding_cache_mb=args.mm_embedding_cache_mb,
        switch_interval_ms=args.switch_interval_ms,
        num_continuous_decode_steps=args.num_continuous_decode_steps,
        extra_length_buckets=tuple(args.extra_length_buckets),
        decode_expert_backend=args.decode_expert_backend,
        warmup_decode_buckets={"auto": None, "on": True, "off": False}[args.warmup_decode_buckets],
    )


def server_limits(args: argparse.Namespace) -> ServerLimits:
    """The `ServerLimits` of parsed flags."""
    return ServerLimits(
        max_request_bytes=args.max_request_bytes,
        max_json_depth=args.max_json_depth,
        max_json_values=args.max_json_values,
        max_stop_strings=args.max_stop_strings,
        max_stop_length=args.max_stop_length,
        max_image_pixels=args.max_image_pixels,
        max_images_per_request=args.max_images_per_request,
        max_request_image_pixels=args.max_request_image_pixels,
        max_server_image_pixels=args.max_server_image_pixels,
        chat_template_timeout_s=args.chat_template_timeout_s,
        refit_read_timeout_s=args.refit_read_timeout_s,
    )


async def serve(
    args: argparse.Namespace,
    *,
    stop: asyncio.Event | None = None,
    staging: Staging | None = None,
    config: EngineConfig | None = None,
    on_listening: Callable[[web.Application, str], None] | None = None,
) -> None:
    """Serves until SIGTERM / SIGINT (or ``stop``).

    The port opens at once (``/health`` 503); the engine loads and warms up in a worker thread;
    at a signal the server closes and the engine stops. The keyword arguments are for a server
    inside another process (`osworld_jax.server.colocated`): ``stop`` replaces the signals,
    ``staging`` is its in-process staging area, ``config`` the engine's config (default: the
    flags'), and ``on_listening(app, url)`` is called once the port is open.
    """
    loop = asyncio.get_running_loop()
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    app = build_app(None, dict(vars(args)), server_limits(args), staging=staging)
    holder = app[ENGINE_KEY]
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, args.host, args.port).start()
    except OSError as e:  # taken port, unknown host: one line, as a bad flag
        await runner.cleanup()
        raise ListenError(f"--port {args.port}: cannot listen on {args.host}: {e}") from None
    port = runner.addresses[0][1]  # the port bound (``--port 0``: a free one)
    url = f"http://{args.host}:{port}"
    log.info("listening on %s (loading %s)", url, args.model_path)
    if on_listening is not None:
        on_listening(app, url)
    cfg = config or engine_config(args)
    load_task = loop.run_in_executor(None, lambda: Engine(cfg).start())
    stop_task: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([load_task, stop_task], return_when=asyncio.FIRST_COMPLETED)
        if load_task.done():
            try:
                holder.engine = load_task.result()
                log.info(
                    "ready: weight_version=%s slots=%d",
                    holder.engine.weight_version,
                    holder.engine.runner.num_slots,
                )
            except Exception as e:
                holder.error = f"engine failed to start: {type(e).__name__}: {e}"
                log.error("%s", holder.error)  # one line; the process exits 1
                raise EngineStartError(holder.error) from e
            await stop_task
    finally:
        log.info("shutting down")
        stop_task.cancel()
        await runner.cleanup()
        if holder.engine is not None:
            holder.engine.shutdown()


class EngineStartError(RuntimeError):
    """The engine failed to load or warm up after the port opened."""


class ListenError(RuntimeError):
    """The port could not be opened (nothing was loaded)."""


def model_path_problem(path: str, *, skip_tokenizer_init: bool = False) -> str | None:
    """None when ``path`` is a checkpoint the engine can load, else what is wrong (one line)."""
    p = Path(path).expanduser()
    what = "pass a Hugging Face checkpoint directory, or 'tiny' for a random tiny model"
    if not p.is_dir():
        return f"--model-path {path}: no such directory ({what})"
    missing = [n for n in ("config.json",) if not (p / n).is_file()]
    if not any(p.glob("*.safetensors")):
        missing.append("*.safetensors")
    if not skip_tokenizer_init and not (p / "tokenizer.json").is_file():
        missing.append("tokenizer.json (or pass --skip-tokenizer-init)")
    if missing:
        return f"--model-path {path}: not a checkpoint directory, no {', '.join(missing)} ({what})"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: 0 after a signal, 1 when the engine fails to start, 2 for a bad flag.

    A bad flag (malformed, non-finite, out of range, a port that cannot be opened) is one line
    on stderr, ``error: --flag: ...``, before any model loads.
    """
    args = parse_args(argv)
    level = args.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # jax reports at INFO each accelerator plugin it did not find (libtpu.so on a CPU machine).
    logging.getLogger("jax").setLevel(max(logging.getLevelName(level), logging.WARNING))
    with tempfile.TemporaryDirectory(prefix="osworld_jax-serve-tiny-") as tmp:
        if args.model_path == "tiny":
            from osworld_jax.model.tiny import make_tiny_checkpoint

            args.model_path = str(make_tiny_checkpoint(Path(tmp) / "tiny", kind=args.tiny_kind))
            log.info("model: a random tiny %s in %s", args.tiny_kind, args.model_path)
        problem = model_path_problem(args.model_path, skip_tokenizer_init=args.skip_tokenizer_init)
        if problem is not None:
            print(f"error: {problem}", file=sys.stderr)
            return 2
        try:
            asyncio.run(serve(args))
        except EngineStartError:
            return 1
        except ListenError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
