"""OpenAI-compatible endpoints of the embedded server, as SGLang 0.5.x serves them.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (``GET /v1/models`` is in
`osworld_jax.server.info`). Like SGLang (``srt/entrypoints/openai/serving_completions.py``,
``serving_chat.py``, ``protocol.py``, ``sse_utils.py``, ``usage_processor.py``), a request is
turned into a native ``/generate`` body (validated by `osworld_jax.server.protocol`, images
read in threads) and the engine's replies into OpenAI's shapes:

- completions: ``prompt`` a string, strings, token ids or lists of ids (one choice each);
  ``max_tokens`` (default 16), ``echo``, ``logprobs`` (top-k count), ``stop``, ``seed``, the
  SGLang extras (``top_k``, ``min_p``, ``min_tokens``, ``stop_token_ids``, ``ignore_eos``, ...);
- chat: ``messages`` rendered with the checkpoint's own chat template (jinja2 sandbox, HF's
  environment: `osworld_jax.model.chat_template.ChatTemplate`); ``image_url`` content parts
  (``data:`` URLs, base64, file paths) become ``image_data`` and ``{"type": "image"}`` parts for
  templates that iterate over a message's content (SGLang's "openai" content format; other
  templates get the text parts joined by spaces); unset ``temperature`` / ``top_p`` / ``top_k``
  / ``min_p`` come from ``generation_config.json`` (SGLang's ``sampling_defaults=model``);
  ``max_completion_tokens`` or ``max_tokens`` (default: up to the context); ``logprobs`` /
  ``top_logprobs``; ``continue_final_message``; ``chat_template_kwargs``; ``tools`` are handed
  to the template (no tool-call parser, as SGLang without ``--tool-call-parser``);
- ``stream: true``: ``text/event-stream`` chunks (``chat.completion.chunk`` /
  ``text_completion``) ending ``data: [DONE]``; ``stream_options.include_usage`` adds a usage
  chunk with empty ``choices``; streamed text holds back an incomplete UTF-8 tail;
- ``usage`` (``prompt_tokens`` counts image tokens; ``prompt_tokens_details.image_tokens``),
  ``metadata.weight_version``, ``sglext.routed_experts`` with ``return_routed_experts``.

Not served (400 naming the field): ``n`` > 1, penalties, ``logit_bias``, grammars and
``response_format`` other than text, ``tool_choice`` required / named, ``suffix``,
``best_of`` > 1. Errors are SGLang's ``{"object": "error", "message", "type", "param", "code"}``.
Differences: a streamed chat step whose text is held back keeps its logprobs for the next chunk
(SGLang drops them). The request / reply conversions are pure functions in
`osworld_jax.server.openai_protocol`; this module holds the handlers and the SSE plumbing.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from aiohttp import web

from osworld_jax.model.chat_template import ChatTemplate
from osworld_jax.server.http_base import (
    BUDGET_KEY,
    LIMITS_KEY,
    Submission,
    TooLarge,
    parse_body_requests,
    read_json,
    ready_engine,
)
from osworld_jax.server.openai_protocol import (
    NAMES,
    bool_field,
    chat_body,
    chat_logprobs,
    completion_body,
    completion_logprobs,
    echo_texts,
    finish_of,
    generation_defaults,
    sglext,
    stream_usage,
    usage,
)
from osworld_jax.server.protocol import BadRequest

_TEMPLATE_KEY: web.AppKey[dict[str, Any]] = web.AppKey("openai_templates", dict)
# 400 messages name the fields as these routes spell them
_COMPLETION_NAMES = {**NAMES, "top_logprobs_num": "logprobs"}
_CHAT_NAMES = {**NAMES, "top_logprobs_num": "top_logprobs"}


def openai_error(status: int, message: str, kind: str = "BadRequest") -> web.Response:
    """SGLang's ``ErrorResponse``."""
    return web.json_response(
        {"object": "error", "message": message, "type": kind, "param": None, "code": status},
        status=status,
    )


async def completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions``."""
    engine = ready_engine(request)
    try:
        body = await _object_body(request)
        gen, echo, logprobs = completion_body(body)
        stream, include_usage = bool_field(body, "stream"), stream_usage(body)
        gen["stream"] = stream
        echoes = echo_texts(engine, body["prompt"]) if echo else None
        reqs, _, _ = await parse_body_requests(
            gen, engine, request.app[LIMITS_KEY], request.app[BUDGET_KEY], _COMPLETION_NAMES
        )
    except _Refused as e:
        return e.response
    except BadRequest as e:
        return openai_error(400, str(e))
    model = body.get("model") or "default"
    created = int(time.time())
    sub = Submission(engine, reqs, stream)
    try:
        if not stream:
            replies = await sub.collect(request)
            if replies is None:
                return web.Response(status=499, text="client closed request")
            choices = []
            for i, r in enumerate(replies):
                reason, matched = finish_of(r)
                n_out = r["meta_info"]["completion_tokens"]
                choices.append(
                    {
                        "index": i,
                        "text": (echoes[i] if echoes else "") + r["text"],
                        "logprobs": completion_logprobs(r["meta_info"], 0, n_out, echo)
                        if logprobs
                        else None,
                        "finish_reason": reason,
                        "matched_stop": matched,
                    }
                )
            out = {
                "id": replies[0]["meta_info"]["id"],
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": choices,
                "usage": usage(replies),
                "metadata": {"weight_version": replies[0]["meta_info"]["weight_version"]},
            }
            if (ext := sglext(replies[0])) is not None:
                out["sglext"] = ext
            return web.json_response(out)
        return await _stream_completions(
            request, sub, model, created, echoes, logprobs, include_usage
        )
    except (asyncio.CancelledError, ConnectionResetError):
        sub.cancel("the client disconnected")
        raise


async def _stream_completions(
    request: web.Request,
    sub: Submission,
    model: str,
    created: int,
    echoes: list[str] | None,
    logprobs: bool,
    include_usage: bool,
) -> web.StreamResponse:
    resp = await _sse(request)
    sent: dict[int, int] = {}  # characters of text sent per choice
    tokens: dict[int, int] = {}  # output tokens whose logprobs were sent
    finals: dict[int, dict[str, Any]] = {}
    last_id = ""
    while sub.pending:
        i, r, done = await sub.next(request)
        meta = r["meta_info"]
        last_id = meta["id"]
        first = i not in sent
        text = _stable(r["text"], done)
        delta = text[sent.get(i, 0) :]
        sent[i] = max(sent.get(i, 0), len(text))
        if first and echoes:
            delta = echoes[i] + delta
        lp = None
        n_out = meta["completion_tokens"]
        if logprobs and (n_out > tokens.get(i, 0) or (first and echoes)):
            lp = completion_logprobs(meta, tokens.get(i, 0), n_out, bool(first and echoes))
            tokens[i] = n_out
        reason, matched = finish_of(r) if done else (None, None)
        chunk = {
            "id": meta["id"],
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": i,
                    "text": delta,
                    "logprobs": lp,
                    "finish_reason": reason,
                    "matched_stop": matched,
                }
            ],
            "usage": None,
        }
        await _send(resp, chunk)
        if done:
            finals[i] = r
    if include_usage:
        replies = [finals[i] for i in sorted(finals)]
        head = {"id": last_id, "object": "text_completion", "created": created, "model": model}
        await _send(resp, {**head, "choices": [], "usage": usage(replies)})
    return await _done(resp)


# ------------------------------------------------------------------------- chat


def _template(app: web.Application, engine: Any) -> tuple[ChatTemplate, dict[str, Any]]:
    """(chat template, generation defaults) of the served model, cached per model path."""
    cache, path = app[_TEMPLATE_KEY], engine.config.model_path
    entry = cache.get("entry")
    if entry is None or entry[0] != path:  # one tuple: threads see a whole entry or none
        entry = (path, ChatTemplate.from_model_dir(path), generation_defaults(path))
        cache["entry"] = entry
    return entry[1], entry[2]


def _chat_body(app: web.Application, engine: Any, body: dict[str, Any], limit: float) -> Any:
    """`chat_body` with the served model's template (in a thread: loading and rendering it)."""
    template, defaults = _template(app, engine)
    return chat_body(body, template, defaults, engine.context_length, limit)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``."""
    engine = ready_engine(request)
    try:
        body = await _object_body(request)
        if engine.tokenizer is None:
            raise BadRequest("chat completions need the tokenizer (not --skip-tokenizer-init)")
        limit = request.app[LIMITS_KEY].chat_template_timeout_s
        # off the event loop, with a deadline: a template from a checkpoint may loop for ever
        gen = await asyncio.to_thread(_chat_body, request.app, engine, body, limit)
        stream, include_usage = bool_field(body, "stream"), stream_usage(body)
        gen["stream"] = stream
        reqs, _, _ = await parse_body_requests(
            gen, engine, request.app[LIMITS_KEY], request.app[BUDGET_KEY], _CHAT_NAMES
        )
    except _Refused as e:
        return e.response
    except BadRequest as e:
        return openai_error(400, str(e))
    model = body.get("model") or "default"
    logprobs = bool(gen["return_logprob"])
    created = int(time.time())
    sub = Submission(engine, reqs, stream)
    try:
        if not stream:
            replies = await sub.collect(request)
            if replies is None:
                return web.Response(status=499, text="client closed request")
            r = replies[0]
            reason, matched = finish_of(r)
            n_out = r["meta_info"]["completion_tokens"]
            out = {
                "id": r["meta_info"]["id"],
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {
                            "role": "assistant",
                            "content": r["text"],
                            "reasoning_content": None,
                            "tool_calls": None,
                        },
                        "logprobs": chat_logprobs(r["meta_info"], 0, n_out) if logprobs else None,
                        "finish_reason": reason,
                        "matched_stop": matched,
                    }
                ],
                "usage": usage(replies),
                "metadata": {"weight_version": r["meta_info"]["weight_version"]},
            }
            if (ext := sglext(r)) is not None:
                out["sglext"] = ext
            return web.json_response(out)
        return await _stream_chat(request, sub, model, created, logprobs, include_usage)
    except (asyncio.CancelledError, ConnectionResetError):
        sub.cancel("the client disconnected")
        raise


async def _stream_chat(
    request: web.Request,
    sub: Submission,
    model: str,
    created: int,
    logprobs: bool,
    include_usage: bool,
) -> web.StreamResponse:
    resp = await _sse(request)
    sent, tokens, final = 0, 0, None
    rid = sub.reqs[0].rid
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}

    def chunk(**choice: Any) -> dict[str, Any]:
        base = {"index": 0, "logprobs": None, "finish_reason": None, "matched_stop": None}
        return {**head, "choices": [{**base, **choice}]}

    await _send(resp, chunk(delta={"role": "assistant", "content": ""}))
    while sub.pending:
        _, r, done = await sub.next(request)
        meta = r["meta_info"]
        text = _stable(r["text"], done)
        delta = text[sent:]
        n_out = meta["completion_tokens"]
        if delta:
            lp = chat_logprobs(meta, tokens, n_out) if logprobs else None
            tokens = n_out if logprobs else tokens
            sent = len(text)
            await _send(resp, chunk(delta={"content": delta}, logprobs=lp))
        if done:
            final = r
    assert final is not None
    reason, matched = finish_of(final)
    n_out = final["meta_info"]["completion_tokens"]
    lp = chat_logprobs(final["meta_info"], tokens, n_out) if logprobs and n_out > tokens else None
    await _send(resp, chunk(delta={}, logprobs=lp, finish_reason=reason, matched_stop=matched))
    ext = sglext(final)
    if ext is not None:
        await _send(resp, {**head, "choices": [], "usage": None, "sglext": ext})
    if include_usage:
        await _send(resp, {**head, "choices": [], "usage": usage([final])})
    return await _done(resp)


# ------------------------------------------------------------------------- plumbing


class _Refused(Exception):
    """A request refused before it reached the engine (carries the response)."""

    def __init__(self, response: web.Response) -> None:
        super().__init__()
        self.response = response


async def _object_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await read_json(request)
    except TooLarge as e:
        limit = request.app[LIMITS_KEY].max_request_bytes
        got = f"{e.args[0]} bytes" if e.args[0] is not None else "the body"
        raise _Refused(openai_error(413, f"{got} exceeds --max-request-bytes ({limit})")) from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def _stable(text: str, done: bool) -> str:
    """Streamed text, holding back an unfinished request's trailing U+FFFD.

    A trailing replacement character is a partial UTF-8 character the next token may complete.
    """
    return text if done else text.rstrip("\ufffd")


async def _sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    return resp


async def _send(resp: web.StreamResponse, chunk: dict[str, Any]) -> None:
    await resp.write(f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode())


async def _done(resp: web.StreamResponse) -> web.StreamResponse:
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def add_routes(app: web.Application) -> None:
    """Registers ``/v1/completions`` and ``/v1/chat/completions`` on ``app``."""
    app[_TEMPLATE_KEY] = {}
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
