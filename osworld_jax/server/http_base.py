"""What every route module of the embedded server shares: the app's keys, error bodies, bodies.

`EngineHolder` (the served engine, None while it loads), the ``web.AppKey``s, SGLang's error
body, `ready_engine` (503 while starting), `read_json` (a body within `ServerLimits`, 413 when
too large), `parse_body_requests` (a ``/generate`` body's requests, text tokenized and images
processed in threads) and `Submission` (requests handed to the engine thread, their replies
awaited). The native routes (`osworld_jax.server.app`), the read-only ones
(`osworld_jax.server.info`) and the OpenAI-compatible ones (`osworld_jax.server.openai_api`)
import from here; none of them imports another.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from aiohttp import web

from osworld_jax.server import replies
from osworld_jax.server.engine import Engine, GenRequest
from osworld_jax.server.image_memory import ImageBudget
from osworld_jax.server.images import (
    ImageRequestError,
    check_header_tokens,
    decode_image,
    open_body_images,
    request_images,
)
from osworld_jax.server.protocol import (
    BadRequest,
    ServerLimits,
    image_items,
    parse_body,
    parse_generate,
    prompt_count,
    prompt_texts,
)

log = logging.getLogger(__name__)

VERSION = "osworld_jax-embedded 0.1.0 (SGLang HTTP API 0.5.23)"
#: How often a waiting non-streaming handler checks that its client is still connected.
DISCONNECT_POLL_S = 0.25
#: Bodies larger than this are parsed in a worker thread, not on the event loop.
PARSE_IN_THREAD_BYTES = 1 << 20


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
LIMITS_KEY: web.AppKey[ServerLimits] = web.AppKey("limits", ServerLimits)
#: The server's `ImageBudget` (decoded image pixels held across all requests).
BUDGET_KEY: web.AppKey[ImageBudget] = web.AppKey("image_budget", ImageBudget)


def error_response(status: int, message: str) -> web.Response:
    """SGLang's error body ``{"error": {"message", "code"}}``."""
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


def ready_engine(request: web.Request) -> Engine:
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


class TooLarge(Exception):
    """A body over ``max_request_bytes`` (HTTP 413)."""


async def read_json(request: web.Request, *, optional: bool = False) -> Any:
    """The request's JSON body within the app's `ServerLimits`.

    Raises:
      TooLarge: the declared or actual body is larger than ``max_request_bytes``.
      BadRequest: see `parse_body`.
    """
    limits = request.app[LIMITS_KEY]
    declared = request.content_length
    if declared is not None and declared > limits.max_request_bytes:
        raise TooLarge(declared)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:  # chunked bodies: aiohttp counts as it reads
        raise TooLarge(None) from None
    if len(raw) > PARSE_IN_THREAD_BYTES:  # the depth walk is Python: /health keeps answering
        return await asyncio.to_thread(parse_body, raw, limits, optional=optional)
    return parse_body(raw, limits, optional=optional)


def too_large(request: web.Request, size: int | None) -> web.Response:
    """HTTP 413 naming the body's size and ``--max-request-bytes``."""
    limit = request.app[LIMITS_KEY].max_request_bytes
    got = f"{size} bytes" if size is not None else "the body"
    return error_response(413, f"{got} exceeds --max-request-bytes ({limit})")


async def parse_body_requests(
    body: Any,
    engine: Engine,
    limits: ServerLimits,
    budget: ImageBudget | None = None,
    field_names: dict[str, str] | None = None,
) -> tuple[list[GenRequest], bool, bool]:
    """A ``/generate`` body's requests: text tokenized and images read and processed in threads.

    Each distinct ``image_data`` string of the body is read and decoded once (300 prompts
    sharing one image share its patches); the body's decoded pixels must fit
    ``--max-request-image-pixels`` and the server's ``budget`` (checked from the headers before
    any pixel is decoded), and stay reserved until each request is prefilled or finished
    (`Submission` releases them). Every image is decoded completely and its token count taken
    from the decoded pixels before a request reaches the engine. ``field_names``: see
    `parse_generate`.

    Raises:
      BadRequest: naming the field, the request and the image, or the exceeded limit.
    """
    texts = prompt_texts(body, engine)
    tokenized = None
    if texts is not None and engine.tokenizer is not None:
        # encode_batch releases the GIL: /health keeps answering meanwhile
        encs = await asyncio.to_thread(engine.tokenizer.encode_batch, texts)
        tokenized = [e.ids for e in encs]
    items = image_items(body, engine)
    images = None
    hold = None
    if any(items):
        _, batch = prompt_count(body)
        names = [f"request {i}" if batch else "request" for i in range(len(items))]
        processor, ctx = engine.processor, engine.context_length
        try:
            seen, pixels = await asyncio.to_thread(open_body_images, items, names, limits.images)
            await asyncio.to_thread(check_header_tokens, items, names, seen, processor, ctx)
            if budget is not None:
                hold = budget.reserve(pixels, names[0] if not batch else "the body")
            try:  # decoding and patchifying release the GIL for most of their time
                done = await asyncio.gather(
                    *(
                        asyncio.to_thread(decode_image, e, processor, engine.image_cache)
                        for e in seen.values()
                    )
                )
                decoded = dict(zip(seen, done, strict=True))
                images = [
                    request_images(its, decoded, n, ctx)
                    for its, n in zip(items, names, strict=True)
                ]
            except BaseException:
                if hold is not None:
                    hold.release()
                raise
        except ImageRequestError as e:
            raise BadRequest(str(e)) from None
    try:
        reqs, batch, stream = parse_generate(body, engine, limits, tokenized, images, field_names)
    except BaseException:
        if hold is not None:
            hold.release()
        raise
    if hold is not None:
        hold.refs = len(reqs)  # each request gives its share back at its first notify
        for r in reqs:
            r.image_hold = hold
    return reqs, batch, stream


def _disconnected(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


class Submission:
    """Requests handed to the engine; their progress arrives on an asyncio queue.

    Args:
      engine: the engine.
      reqs: validated requests (their ``notify`` is replaced).
      stream: deliver every step's reply (else only the final one of each request).

    Attributes:
      pending: indices of requests not finished yet.
    """

    def __init__(self, engine: Engine, reqs: list[GenRequest], stream: bool) -> None:
        self.engine, self.reqs, self.stream = engine, reqs, stream
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[tuple[int, dict[str, Any], bool]] = asyncio.Queue()
        self.pending = set(range(len(reqs)))
        for i, r in enumerate(reqs):
            r.notify = self._notifier(i)
            engine.submit(r)

    def _notifier(self, i: int) -> Any:
        def notify(r: GenRequest, done: bool) -> None:  # called on the engine thread
            if r.image_hold is not None:  # prefilled or finished: its patches are dropped
                hold, r.image_hold = r.image_hold, None
                hold.release()
            if done or self.stream:
                reply = replies.generate_reply(self.engine, r, done)
                self._loop.call_soon_threadsafe(self._events.put_nowait, (i, reply, done))

        return notify

    async def next(self, request: web.Request | None = None) -> tuple[int, dict[str, Any], bool]:
        """The next (request index, reply so far, finished) event.

        With ``request`` (a streaming handler's), a client that goes away while no event comes
        (its requests queued, prefilling, paused, or their text held back) is noticed within
        ``DISCONNECT_POLL_S``: `ConnectionResetError`, and the handler aborts its requests.
        """
        while self._events.empty() and request is not None:  # no timer while events flow
            try:
                async with asyncio.timeout(DISCONNECT_POLL_S):
                    i, out, done = await self._events.get()
                break
            except TimeoutError:
                if _disconnected(request):
                    raise ConnectionResetError("the client disconnected") from None
        else:
            i, out, done = await self._events.get()
        if done:
            self.pending.discard(i)
        return i, out, done

    def cancel(self, message: str) -> None:
        """Aborts the unfinished requests (only these, not others sharing an rid prefix)."""
        if self.pending:
            log.info("%d request(s) aborted: %s", len(self.pending), message)
            self.engine.cancel([self.reqs[i] for i in self.pending], message)

    async def collect(self, request: web.Request) -> list[dict[str, Any]] | None:
        """Every request's final reply in order; None (requests aborted) if the client left."""
        results: dict[int, dict[str, Any]] = {}
        while self.pending:
            try:
                async with asyncio.timeout(DISCONNECT_POLL_S):
                    i, out, done = await self.next()
            except TimeoutError:
                if _disconnected(request):  # nobody reads the answer: free the slots
                    self.cancel("the client disconnected")
                    return None
                continue
            if done:
                results[i] = out
        return [results[i] for i in range(len(self.reqs))]
