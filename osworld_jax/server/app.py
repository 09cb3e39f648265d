"""The embedded server's HTTP face: SGLang's native API (see ../shared/SGLANG_API.md) on aiohttp.

Handlers read the body within `ServerLimits` (413 when too large), validate it with
`osworld_jax.server.protocol` (400 ``{"error": ...}`` naming the field), hand requests to the
`Engine` thread, and await its results. Streaming uses ``text/event-stream`` with cumulative
``data: <json>`` events ending in ``data: [DONE]``. A client that goes away mid-generation has
its requests aborted (its slots freed) within ``DISCONNECT_POLL_S``. Work that could hold the
event loop (tokenizing text prompts) runs in a thread that releases the GIL, so ``/health``
keeps answering; so do image decoding and processing (`osworld_jax.server.images`). What the
route modules share (app keys, error bodies, reading bodies, `Submission`) is in
`osworld_jax.server.http_base`; the read-only endpoints live in `osworld_jax.server.info`, the
OpenAI-compatible ones in `osworld_jax.server.openai_api`; `build_app` puts them together.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from osworld_jax.contract.refit import DIGEST_KEY, STAGED_FORMAT
from osworld_jax.server import info, openai_api
from osworld_jax.server.engine import Engine, GenRequest
from osworld_jax.server.http_base import (
    ARGS_KEY,
    BUDGET_KEY,
    ENGINE_KEY,
    LIMITS_KEY,
    EngineHolder,
    Submission,
    TooLarge,
    error_response,
    parse_body_requests,
    read_json,
    ready_engine,
    too_large,
)
from osworld_jax.server.image_memory import ImageBudget
from osworld_jax.server.protocol import BadRequest, ServerLimits
from osworld_jax.server.refit_check import CheckpointMismatch, checkpoint_signature
from osworld_jax.server.staging import Staging
from osworld_jax.server.weights import Refit

#: The in-process staging area of a colocated server (None: a server of its own process).
STAGING_KEY: web.AppKey[Staging | None] = web.AppKey("staging")


async def _parse(request: web.Request, engine: Engine) -> tuple[list[GenRequest], bool, bool]:
    body = await read_json(request)
    return await parse_body_requests(body, engine, request.app[LIMITS_KEY], request.app[BUDGET_KEY])


async def generate(request: web.Request) -> web.StreamResponse:
    """``POST /generate``: single or batch, JSON or SSE."""
    engine = ready_engine(request)
    try:
        reqs, batch, stream = await _parse(request, engine)
    except TooLarge as e:
        return too_large(request, e.args[0])
    except BadRequest as e:
        return error_response(400, str(e))
    sub = Submission(engine, reqs, stream)
    try:
        if not stream:
            results = await sub.collect(request)
            if results is None:
                return web.Response(status=499, text="client closed request")
            return web.json_response(results if batch else results[0])
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        while sub.pending:
            i, out, done = await sub.next(request)
            if batch:
                out["index"] = i
            await resp.write(f"data: {json.dumps(out)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
    except (asyncio.CancelledError, ConnectionResetError):
        sub.cancel("the client disconnected")  # free its slots
        raise


async def _control_body(request: web.Request) -> Any:
    """An optional JSON object body of a control endpoint (400 / 413 as `web.HTTPException`)."""
    try:
        body = await read_json(request, optional=True)
    except TooLarge as e:
        raise web.HTTPRequestEntityTooLarge(
            max_size=request.app[LIMITS_KEY].max_request_bytes,
            actual_size=e.args[0] or 0,
            text=too_large(request, e.args[0]).text,
            content_type="application/json",
        ) from None
    except BadRequest as e:
        raise web.HTTPBadRequest(
            text=error_response(400, str(e)).text, content_type="application/json"
        ) from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(
            text=error_response(400, "the body must be a JSON object").text,
            content_type="application/json",
        )
    return body


async def abort_request(request: web.Request) -> web.Response:
    """``POST /abort_request {rid, abort_all}``: prefix match, fire-and-forget."""
    body = await _control_body(request)
    rid, abort_all = body.get("rid"), bool(body.get("abort_all", False))
    if not abort_all and not isinstance(rid, str):
        return error_response(400, "rid (a string) or abort_all is required")
    ready_engine(request).abort(rid, abort_all)
    return web.Response()


async def pause_generation(request: web.Request) -> web.Response:
    """``POST /pause_generation {mode}``: abort (default) / retract / in_place."""
    body = await _control_body(request)
    mode = body.get("mode", "abort")
    if mode not in ("abort", "retract", "in_place"):
        return error_response(400, f"mode must be abort, retract or in_place, got {mode!r}")
    n = await asyncio.wrap_future(ready_engine(request).pause(mode))
    return web.json_response({"status": "ok", "message": f"paused ({mode}); {n} requests"})


async def continue_generation(request: web.Request) -> web.Response:
    """``POST /continue_generation``."""
    await _control_body(request)
    await asyncio.wrap_future(ready_engine(request).resume())
    return web.json_response({"status": "ok", "message": "generation continued"})


async def flush_cache(request: web.Request) -> web.Response:
    """``GET|POST /flush_cache``: 200 when idle (kept prefixes forgotten), else 400."""
    if await asyncio.wrap_future(ready_engine(request).flush_cache()):
        return web.Response(text="Cache flushed.\n")
    return web.Response(status=400, text="Cache not flushed: requests are running or waiting.\n")


async def update_weights_from_disk(request: web.Request) -> web.Response:
    """``POST /update_weights_from_disk {model_path, weight_version, abort_all_requests, ...}``.

    A checkpoint whose config or tensor names / shapes differ from the served model's is
    refused (400, naming the first difference); the served weights stay in place.
    """
    engine = ready_engine(request)

    def fail(message: str) -> web.Response:
        return web.json_response(
            {"success": False, "message": message, "num_paused_requests": 0}, status=400
        )

    try:
        body = await read_json(request)
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
            raise BadRequest("model_path (a string) is required")
        fmt = body.get("load_format")
        if fmt not in (None, "auto", "safetensors"):
            raise BadRequest(f"load_format {fmt!r} is not supported (auto | safetensors)")
        version = _weight_version(body)
    except TooLarge as e:
        return too_large(request, e.args[0])
    except BadRequest as e:
        return fail(str(e))
    path, limit = body["model_path"], request.app[LIMITS_KEY].refit_read_timeout_s
    # Off the engine thread, with a deadline: a slow or hostile directory fails this request.
    reading = asyncio.ensure_future(asyncio.to_thread(checkpoint_signature, path))
    try:
        async with asyncio.timeout(limit):
            signature = await asyncio.shield(reading)
    except TimeoutError:
        return fail(f"refused {path}: reading it took more than {limit} s")
    except CheckpointMismatch as e:
        return fail(f"refused {path}: {e}")
    refit = await asyncio.wrap_future(
        engine.update_weights(path, version, bool(body.get("abort_all_requests", False)), signature)
    )
    return _refit_response(refit)


def _weight_version(body: dict[str, Any]) -> str | None:
    """A refit body's ``weight_version`` (None: keep the served one); `BadRequest` if not a str."""
    version = body.get("weight_version")
    if version is not None and not isinstance(version, str):
        raise BadRequest("weight_version must be a string")
    return version


def _refit_response(refit: Refit) -> web.Response:
    body: dict[str, Any] = {
        "success": refit.success,
        "message": refit.message,
        "num_paused_requests": refit.num_paused_requests,
    }
    if refit.digest is not None:
        body[DIGEST_KEY] = refit.digest
    return web.json_response(body, status=200 if refit.success else 400)


async def update_weights_from_tensor(request: web.Request) -> web.Response:
    """``POST /update_weights_from_tensor {serialized_named_tensors, load_format, ...}``.

    The embedded server takes one format: `STAGED_FORMAT`, a handle to arrays the trainer in
    this process staged (`osworld_jax.server.staging`; a server of its own process has no
    staging area and refuses it, as it refuses SGLang's serialized torch tensors).
    """
    engine = ready_engine(request)

    def fail(message: str) -> web.Response:
        return web.json_response({"success": False, "message": message}, status=400)

    try:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        fmt = body.get("load_format")
        if fmt != STAGED_FORMAT:
            raise BadRequest(
                f"load_format {fmt!r} is not supported: the embedded server takes "
                f"{STAGED_FORMAT!r} (weights staged in its own process, ServerConfig.launch = "
                "'colocated'); use /update_weights_from_disk otherwise"
            )
        payloads = body.get("serialized_named_tensors")
        if not isinstance(payloads, list) or len(payloads) != 1 or not isinstance(payloads[0], str):
            raise BadRequest("serialized_named_tensors must be a list of one handle (a string)")
        version = _weight_version(body)
    except TooLarge as e:
        return too_large(request, e.args[0])
    except BadRequest as e:
        return fail(str(e))
    staging = request.app[STAGING_KEY]
    if staging is None:
        return fail(
            f"load_format {STAGED_FORMAT!r}: this server runs in its own process and has no "
            "staged weights (ServerConfig.launch = 'colocated' runs it in the trainer's)"
        )
    params = staging.take(payloads[0])
    if params is None:
        return fail(f"no staged weights under {payloads[0]!r} (already taken, or never staged)")
    refit = await asyncio.wrap_future(
        engine.update_weights_from_params(
            params, version, bool(body.get("abort_all_requests", False))
        )
    )
    return _refit_response(refit)


async def health(request: web.Request) -> web.Response:
    """``GET /health``: 200 when ready; 503 while starting or while the engine is stuck.

    Stuck: inside one command or step for longer than ``stall_timeout_s`` (`Engine.stalled_s`).
    """
    engine = ready_engine(request)  # 503 while starting, 500 if the engine failed to start
    stuck = engine.stalled_s()
    if stuck is not None:
        return web.Response(status=503, text=f"the engine has not progressed for {stuck:.0f} s")
    return web.Response(text="")


async def health_generate(request: web.Request) -> web.Response:
    """``GET /health_generate``: runs a 1-token generation now (503 while paused / starting)."""
    engine = ready_engine(request)
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
        async with asyncio.timeout(60):
            r = await done
    except TimeoutError:
        engine.cancel([req], "health check timed out")
        return web.Response(status=503, text="generation timed out")
    ok = r.finish is not None and r.finish["type"] != "abort"
    return web.Response(status=200 if ok else 503, text="" if ok else "generation aborted")


def build_app(
    engine: Engine | None = None,
    server_args: dict[str, Any] | None = None,
    limits: ServerLimits | None = None,
    staging: Staging | None = None,
) -> web.Application:
    """The aiohttp application; ``engine`` may be set later on ``app[ENGINE_KEY].engine``.

    Args:
      engine: the started engine (None: endpoints answer 503 until it is set).
      server_args: the launch flags, reported by ``/server_info`` (``served_model_name`` names
        the model in ``/v1/models``; default the engine's model path).
      limits: request limits (default `ServerLimits()`).
      staging: the in-process staging area (`osworld_jax.server.colocated`); None for a server
        of its own process (``/update_weights_from_tensor`` then refuses staged handles).
    """
    limits = limits or ServerLimits()
    app = web.Application(client_max_size=limits.max_request_bytes)
    app[ENGINE_KEY] = EngineHolder(engine)
    app[ARGS_KEY] = dict(server_args or {})
    app[LIMITS_KEY] = limits
    app[BUDGET_KEY] = ImageBudget(limits.max_server_image_pixels)
    app[STAGING_KEY] = staging
    r = app.router
    r.add_post("/generate", generate)
    r.add_post("/abort_request", abort_request)
    r.add_post("/pause_generation", pause_generation)
    r.add_post("/continue_generation", continue_generation)
    r.add_route("*", "/flush_cache", flush_cache)
    r.add_post("/update_weights_from_disk", update_weights_from_disk)
    r.add_post("/update_weights_from_tensor", update_weights_from_tensor)
    r.add_get("/health", health)
    r.add_get("/health_generate", health_generate)
    info.add_routes(app)
    openai_api.add_routes(app)
    return app
