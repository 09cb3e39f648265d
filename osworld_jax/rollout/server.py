"""The embedded server's HTTP face: SGLang's native API (see ../shared/SGLANG_API.md) on aiohttp.

Handlers validate the body (a malformed one gets HTTP 400 ``{"error": ...}``), hand requests to
the `Engine` thread, and await its results. Streaming uses ``text/event-stream`` with cumulative
``data: <json>`` events ending in ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from typing import Any

from aiohttp import web

from osworld_jax.rollout.engine import Engine, GenRequest
from osworld_jax.rollout.runner import MAX_BANNED

log = logging.getLogger(__name__)

VERSION = "osworld_jax-embedded 0.1.0 (SGLang HTTP API 0.5.23)"


class EngineHolder:
    """The served engine: None while it loads (endpoints answer 503), or its start-up error.

    Attributes:
      engine: the running `Engine`, or None.
      error: why the engine failed to start, or None.
    """

    def __init__(self, engine: Engine | None = None) -> None:
        self.engine = engine
        self.error: str | None = None


ENGINE_KEY: web.AppKey[EngineHolder] = web.AppKey("engine", EngineHolder)
ARGS_KEY: web.AppKey[Any] = web.AppKey("server_args")

SAMPLING_KEYS = {
    "max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
    "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "custom_params", "stream_interval",
    "logit_bias", "sampling_seed", "stop_regex",
}  # fmt: skip
# Keys the embedded engine does not implement: accepted only at their neutral value.
NEUTRAL = {
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "n": 1,
    "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None, "logit_bias": None,
    "stop_regex": None,
}  # fmt: skip
REQUEST_NEUTRAL = {
    "image_data": None, "audio_data": None, "video_data": None, "input_embeds": None,
    "top_logprobs_num": 0, "token_ids_logprob": None, "lora_path": None,
    "custom_logit_processor": None, "return_hidden_states": False,
}  # fmt: skip


class BadRequest(ValueError):
    """A malformed request body (HTTP 400)."""


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


def _engine(request: web.Request) -> Engine:
    """The ready engine, or HTTP 503 while it starts (500 when it failed to start)."""
    holder = request.app[ENGINE_KEY]
    if holder.error is not None:
        raise web.HTTPInternalServerError(
            text=json.dumps({"error": {"message": holder.error, "code": 500}}),
            content_type="application/json",
        )
    engine = holder.engine
    if engine is None or not engine.ready.is_set() or not engine.alive:
        raise web.HTTPServiceUnavailable(
            text=json.dumps({"error": {"message": "the server is starting", "code": 503}}),
            content_type="application/json",
        )
    return engine


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(d: dict[str, Any], key: str, default: float) -> float:
    v = d.get(key, default)
    v = default if v is None else v
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
        raise BadRequest(f"sampling_params.{key} must be a finite number, got {v!r}")
    return float(v)


def _check_sampling(sp: Any, engine: Engine) -> dict[str, Any]:
    """SGLang's ``SamplingParams.verify`` plus the embedded engine's limits."""
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise BadRequest(f"sampling_params must be an object, got {type(sp).__name__}")
    unknown = sorted(set(sp) - SAMPLING_KEYS)
    if unknown:
        raise BadRequest(f"unknown sampling_params keys {unknown}")
    for key, neutral in NEUTRAL.items():
        if sp.get(key, neutral) not in (neutral, None):
            raise BadRequest(f"sampling_params.{key}={sp[key]!r} is not supported by this server")
    t = _num(sp, "temperature", 1.0)
    if t < 0:
        raise BadRequest(f"temperature must be non-negative, got {t}")
    top_p = _num(sp, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}")
    min_p = _num(sp, "min_p", 0.0)
    if not 0.0 <= min_p <= 1.0:
        raise BadRequest(f"min_p must be in [0, 1], got {min_p}")
    top_k = sp.get("top_k", -1)
    top_k = -1 if top_k is None else top_k
    if not _is_int(top_k) or (top_k != -1 and top_k < 1):
        raise BadRequest(f"top_k must be -1 (disable) or at least 1, got {top_k!r}")
    max_new = sp.get("max_new_tokens", 128)
    max_new = 128 if max_new is None else max_new
    if not _is_int(max_new) or max_new < 0:
        raise BadRequest(f"max_new_tokens must be at least 0, got {max_new!r}")
    min_new = sp.get("min_new_tokens", 0) or 0
    if not _is_int(min_new) or not 0 <= min_new <= max_new:
        raise BadRequest(f"min_new_tokens must be in [0, max_new_tokens], got {min_new!r}")
    stop = sp.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise BadRequest("stop must be a string or a list of strings")
    if stop == "" or (isinstance(stop, list) and "" in stop):
        raise BadRequest("stop strings must be non-empty")
    stop_ids = sp.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids):
        raise BadRequest("stop_token_ids must be a list of ints")
    if min_new and len(set(stop_ids) | set(engine.eos_ids)) > MAX_BANNED:
        raise BadRequest(f"min_new_tokens supports at most {MAX_BANNED} stop + EOS ids")
    seed = sp.get("sampling_seed")
    if seed is not None and (not _is_int(seed) or seed < 0):
        raise BadRequest(f"sampling_seed must be a non-negative int, got {seed!r}")
    for key in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
        if key in sp and sp[key] is not None and not isinstance(sp[key], bool):
            raise BadRequest(f"sampling_params.{key} must be a bool")
    return {
        "temperature": t,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "max_new_tokens": max_new,
        "min_new_tokens": min_new,
        "stop": stop,
        "stop_token_ids": stop_ids,
        "ignore_eos": bool(sp.get("ignore_eos") or False),
        "skip_special_tokens": sp.get("skip_special_tokens") is not False,
        "no_stop_trim": bool(sp.get("no_stop_trim") or False),
        "sampling_seed": seed,
    }


def _per_item(body: dict[str, Any], key: str, n: int, batch: bool, default: Any) -> list[Any]:
    v = body.get(key, default)
    v = default if v is None else v
    if batch and isinstance(v, list) and key != "sampling_params":
        if len(v) != n:
            raise BadRequest(f"{key} has {len(v)} entries for a batch of {n}")
        return v
    if batch and key == "sampling_params" and isinstance(v, list):
        if len(v) != n:
            raise BadRequest(f"sampling_params has {len(v)} entries for a batch of {n}")
        return v
    return [v] * n


def parse_generate(body: Any, engine: Engine) -> tuple[list[GenRequest], bool, bool]:
    """Validates a ``/generate`` body; returns (requests, is_batch, stream)."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    for key, neutral in REQUEST_NEUTRAL.items():
        if body.get(key, neutral) not in (neutral, None, [], False, 0):
            raise BadRequest(f"{key} is not supported by this server (text-only Qwen3-MoE)")
    has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
    if has_text == has_ids:
        raise BadRequest("exactly one of 'text' or 'input_ids' is required")
    if has_ids:
        ids = body["input_ids"]
        if not isinstance(ids, list) or not ids:
            raise BadRequest("input_ids must be a non-empty list of ints or of lists")
        batch = isinstance(ids[0], list)
        prompts = ids if batch else [ids]
    else:
        text = body["text"]
        batch = isinstance(text, list)
        texts = text if batch else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise BadRequest("text must be a string or a non-empty list of strings")
        prompts = [engine.tokenizer.encode(t).ids for t in texts]
    n = len(prompts)
    for i, p in enumerate(prompts):
        where = f"input_ids[{i}]" if batch else "input_ids"
        if not isinstance(p, list) or not p or not all(_is_int(t) for t in p):
            raise BadRequest(f"{where} must be a non-empty list of ints")
        bad = [t for t in p if not 0 <= t < engine.vocab_size]
        if bad:
            raise BadRequest(f"{where} holds token ids outside [0, {engine.vocab_size}): {bad[:5]}")
        if len(p) >= engine.context_length:
            raise BadRequest(
                f"{where}: the input ({len(p)} tokens) is longer than the model's context "
                f"length ({engine.context_length} tokens)"
            )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a bool")
    sps = _per_item(body, "sampling_params", n, batch, {})
    rids = _per_item(body, "rid", n, batch, None)
    lps = _per_item(body, "return_logprob", n, batch, False)
    lp_starts = _per_item(body, "logprob_start_len", n, batch, -1)
    routed = _per_item(body, "return_routed_experts", n, batch, False)
    r_starts = _per_item(body, "routed_experts_start_len", n, batch, 0)
    reqs = []
    for i, prompt in enumerate(prompts):
        sampling = _check_sampling(sps[i], engine)
        rid = rids[i]
        if rid is not None and not isinstance(rid, str):
            raise BadRequest(f"rid must be a string, got {rid!r}")
        if not isinstance(lps[i], bool) or not isinstance(routed[i], bool):
            raise BadRequest("return_logprob / return_routed_experts must be bools")
        lp_start, r_start = lp_starts[i], r_starts[i]
        if not _is_int(lp_start) or not -1 <= lp_start < len(prompt):
            raise BadRequest(f"logprob_start_len must be -1 or in [0, {len(prompt)}): {lp_start!r}")
        if not _is_int(r_start) or not 0 <= r_start < len(prompt):
            raise BadRequest(
                f"routed_experts_start_len must be in [0, {len(prompt)}), got {r_start!r}"
            )
        if routed[i] and not engine.config.enable_return_routed_experts:
            raise BadRequest("return_routed_experts needs --enable-return-routed-experts")
        reqs.append(
            engine.make_request(
                rid=rid,
                input_ids=prompt,
                sampling=sampling,
                return_logprob=lps[i],
                logprob_start_len=lp_start,
                return_routed_experts=routed[i],
                routed_experts_start_len=r_start,
            )
        )
    return reqs, batch, stream


async def _json_body(request: web.Request, *, optional: bool = False) -> Any:
    raw = await request.read()
    if not raw.strip():
        if optional:
            return {}
        raise BadRequest("empty body")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"invalid JSON: {e}") from None


async def generate(request: web.Request) -> web.StreamResponse:
    """``POST /generate``: single or batch, JSON or SSE."""
    engine = _engine(request)
    try:
        reqs, batch, stream = parse_generate(await _json_body(request), engine)
    except BadRequest as e:
        return _error(400, str(e))
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[tuple[int, dict[str, Any], bool]] = asyncio.Queue()

    def notifier(i: int):  # called on the engine thread
        def notify(r: GenRequest, done: bool) -> None:
            if done or stream:
                loop.call_soon_threadsafe(events.put_nowait, (i, engine.response(r, done), done))

        return notify

    for i, r in enumerate(reqs):
        r.notify = notifier(i)
        engine.submit(r)
    pending = set(range(len(reqs)))
    results: dict[int, dict[str, Any]] = {}
    try:
        if not stream:
            while pending:
                i, out, done = await events.get()
                if done:
                    results[i] = out
                    pending.discard(i)
            ordered = [results[i] for i in range(len(reqs))]
            return web.json_response(ordered if batch else ordered[0])
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        while pending:
            i, out, done = await events.get()
            if batch:
                out["index"] = i
            await resp.write(f"data: {json.dumps(out)}\n\n".encode())
            if done:
                pending.discard(i)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
    except (asyncio.CancelledError, ConnectionResetError):
        for i in pending:  # the client went away: free the slots
            engine.abort(reqs[i].rid)
        raise


async def abort_request(request: web.Request) -> web.Response:
    """``POST /abort_request {rid, abort_all}``: prefix match, fire-and-forget."""
    try:
        body = await _json_body(request, optional=True)
    except BadRequest as e:
        return _error(400, str(e))
    if not isinstance(body, dict):
        return _error(400, "the body must be a JSON object")
    rid, abort_all = body.get("rid"), bool(body.get("abort_all", False))
    if not abort_all and not isinstance(rid, str):
        return _error(400, "rid (a string) or abort_all is required")
    _engine(request).abort(rid, abort_all)
    return web.Response()


async def pause_generation(request: web.Request) -> web.Response:
    """``POST /pause_generation {mode}``: abort (default) / retract / in_place."""
    try:
        body = await _json_body(request, optional=True)
    except BadRequest as e:
        return _error(400, str(e))
    mode = body.get("mode", "abort") if isinstance(body, dict) else None
    if mode not in ("abort", "retract", "in_place"):
        return _error(400, f"mode must be abort, retract or in_place, got {mode!r}")
    n = await asyncio.wrap_future(_engine(request).pause(mode))
    return web.json_response({"status": "ok", "message": f"paused ({mode}); {n} requests"})


async def continue_generation(request: web.Request) -> web.Response:
    """``POST /continue_generation``."""
    await asyncio.wrap_future(_engine(request).resume())
    return web.json_response({"status": "ok", "message": "generation continued"})


async def flush_cache(request: web.Request) -> web.Response:
    """``GET|POST /flush_cache``: 200 when idle, 400 while requests run or wait."""
    if await asyncio.wrap_future(_engine(request).is_idle()):
        return web.Response(text="Cache flushed.\n")
    return web.Response(status=400, text="Cache not flushed: requests are running or waiting.\n")


async def update_weights_from_disk(request: web.Request) -> web.Response:
    """``POST /update_weights_from_disk {model_path, weight_version, abort_all_requests, ...}``."""
    engine = _engine(request)
    try:
        body = await _json_body(request)
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
            raise BadRequest("model_path (a string) is required")
        fmt = body.get("load_format")
        if fmt not in (None, "auto", "safetensors"):
            raise BadRequest(f"load_format {fmt!r} is not supported (auto | safetensors)")
        version = body.get("weight_version")
        if version is not None and not isinstance(version, str):
            raise BadRequest("weight_version must be a string")
    except BadRequest as e:
        return web.json_response(
            {"success": False, "message": str(e), "num_paused_requests": 0}, status=400
        )
    ok, message, n = await asyncio.wrap_future(
        engine.update_weights(
            body["model_path"], version, bool(body.get("abort_all_requests", False))
        )
    )
    return web.json_response(
        {"success": ok, "message": message, "num_paused_requests": n}, status=200 if ok else 400
    )


async def model_info(request: web.Request) -> web.Response:
    """``GET /model_info`` (and the deprecated ``/get_model_info``)."""
    engine = _engine(request)
    return web.json_response(
        {
            "model_path": engine.model_path,
            "tokenizer_path": engine.config.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": engine.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "qwen3_moe",
            "architectures": ["Qwen3MoeForCausalLM"],
        }
    )


async def server_info(request: web.Request) -> web.Response:
    """``GET /server_info``: the server args, limits and version."""
    engine = _engine(request)
    return web.json_response(
        {
            **request.app[ARGS_KEY],
            "version": VERSION,
            "weight_version": engine.weight_version,
            "return_original_logprob": engine.config.return_original_logprob,
            "context_length": engine.context_length,
            "max_running_requests": engine.runner.num_slots,
            "max_total_num_tokens": engine.runner.num_slots * engine.runner.slot_len,
            "num_decode_steps": engine.num_decode_steps,
            "num_generated_tokens": engine.num_generated_tokens,
        }
    )


async def health(request: web.Request) -> web.Response:
    """``GET /health``: 200 once the warm-up generation succeeded, 503 before."""
    _engine(request)  # 503 while starting, 500 if the engine failed to start
    return web.Response(text="")


async def health_generate(request: web.Request) -> web.Response:
    """``GET /health_generate``: runs a 1-token generation now (503 while paused / starting)."""
    engine = _engine(request)
    if engine.paused:
        return web.Response(status=503, text="generation is paused")
    loop = asyncio.get_running_loop()
    done: asyncio.Future[GenRequest] = loop.create_future()
    req = engine.make_request(
        rid="HEALTH_CHECK", input_ids=[0], sampling={"max_new_tokens": 1, "temperature": 0.0}
    )

    def notify(r: GenRequest, finished: bool) -> None:
        if finished:
            loop.call_soon_threadsafe(done.set_result, r)

    req.notify = notify
    engine.submit(req)
    try:
        r = await asyncio.wait_for(done, 60)
    except TimeoutError:
        engine.abort("HEALTH_CHECK")
        return web.Response(status=503, text="generation timed out")
    ok = r.finish is not None and r.finish["type"] != "abort"
    return web.Response(status=200 if ok else 503, text="" if ok else "generation aborted")


def build_app(
    engine: Engine | None = None, server_args: dict[str, Any] | None = None
) -> web.Application:
    """The aiohttp application; ``engine`` may be set later on ``app[ENGINE_KEY].engine``."""
    app = web.Application(client_max_size=1 << 30)
    app[ENGINE_KEY] = EngineHolder(engine)
    app[ARGS_KEY] = dict(server_args or {})
    r = app.router
    r.add_post("/generate", generate)
    r.add_post("/abort_request", abort_request)
    r.add_post("/pause_generation", pause_generation)
    r.add_post("/continue_generation", continue_generation)
    r.add_route("*", "/flush_cache", flush_cache)
    r.add_post("/update_weights_from_disk", update_weights_from_disk)
    for path in ("/model_info", "/get_model_info"):
        r.add_get(path, model_info)
    for path in ("/server_info", "/get_server_info"):
        r.add_get(path, server_info)
    r.add_get("/health", health)
    r.add_get("/health_generate", health_generate)
    return app
