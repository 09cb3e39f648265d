"""OpenAI-compatible endpoints of the embedded server, as SGLang 0.5.x serves them.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (``GET /v1/models`` is in
`osworld_jax.rollout.info`). Like SGLang (``srt/entrypoints/openai/serving_completions.py``,
``serving_chat.py``, ``protocol.py``, ``sse_utils.py``, ``usage_processor.py``), a request is
turned into a native ``/generate`` body (validated by `osworld_jax.rollout.protocol`, images
read in threads) and the engine's replies into OpenAI's shapes:

- completions: ``prompt`` a string, strings, token ids or lists of ids (one choice each);
  ``max_tokens`` (default 16), ``echo``, ``logprobs`` (top-k count), ``stop``, ``seed``, the
  SGLang extras (``top_k``, ``min_p``, ``min_tokens``, ``stop_token_ids``, ``ignore_eos``, ...);
- chat: ``messages`` rendered with the checkpoint's own chat template (jinja2 sandbox, HF's
  environment: `osworld_jax.agent.template.ChatTemplate`); ``image_url`` content parts
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
(SGLang drops them).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any

import jinja2
import jinja2.nodes
from aiohttp import web

from osworld_jax.rollout.protocol import BadRequest
from osworld_jax.rollout.runner import MAX_TOP_LOGPROBS
from osworld_jax.rollout.server import (
    LIMITS_KEY,
    Submission,
    TooLarge,
    parse_body_requests,
    read_json,
    ready_engine,
)

#: Sampling keys of a chat request that default to the checkpoint's generation_config.json.
MODEL_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0}
#: Request keys passed to ``sampling_params`` as they are (SGLang's extras).
PASSTHROUGH = (
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "no_stop_trim",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "logit_bias",
    "regex",
    "ebnf",
    "json_schema",
    "n",
)
_TEMPLATE_KEY: web.AppKey[dict[str, Any]] = web.AppKey("openai_templates", dict)


def openai_error(status: int, message: str, kind: str = "BadRequest") -> web.Response:
    """SGLang's ``ErrorResponse``."""
    return web.json_response(
        {"object": "error", "message": message, "type": kind, "param": None, "code": status},
        status=status,
    )


def _int(body: dict[str, Any], key: str, default: Any, lo: int, hi: int | None = None) -> Any:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
        bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise BadRequest(f"{key} must be an int {bound}, got {v!r}")
    return v


def _bool(body: dict[str, Any], key: str) -> bool:
    v = body.get(key)
    if v is not None and not isinstance(v, bool):
        raise BadRequest(f"{key} must be a bool, got {v!r}")
    return bool(v)


def _common(body: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """``sampling_params`` of the keys completions and chat share."""
    if body.get("response_format") not in (None, {"type": "text"}):
        raise BadRequest("response_format is not supported by this server (only text)")
    sp: dict[str, Any] = {}
    for key, fallback in MODEL_DEFAULTS.items():
        value = body.get(key)
        sp[key] = defaults.get(key, fallback) if value is None else value
    if sp["top_k"] == 0:  # generation_config's "no top-k" (HF); SGLang spells it -1
        sp["top_k"] = -1
    sp["min_new_tokens"] = _int(body, "min_tokens", 0, 0)
    sp["stop"] = body.get("stop")
    sp["sampling_seed"] = body.get("seed")
    for key in PASSTHROUGH:
        if body.get(key) is not None:
            sp[key] = body[key]
    return sp


def _stream_usage(body: dict[str, Any]) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise BadRequest("stream_options must be an object")
    return bool(opts.get("include_usage"))


def usage(replies: list[dict[str, Any]]) -> dict[str, Any]:
    """SGLang's ``UsageInfo`` (no cache report; image tokens in ``prompt_tokens_details``)."""
    prompt = sum(r["meta_info"]["prompt_tokens"] for r in replies)
    completion = sum(r["meta_info"]["completion_tokens"] for r in replies)
    images = sum(r["meta_info"].get("image_tokens", 0) for r in replies)
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": 0, "image_tokens": images} if images else None,
        "reasoning_tokens": 0,
    }


def _top_dict(entries: list[Any] | None) -> dict[str, float] | None:
    """``{token text: logprob}`` of SGLang's top entries, the best first kept per text."""
    if entries is None:
        return None
    out: dict[str, float] = {}
    for lp, _, text in entries:
        out.setdefault(text, lp)
    return out


def completion_logprobs(meta: dict[str, Any], lo: int, hi: int, echo: bool) -> dict[str, Any]:
    """SGLang's completion ``LogProbs`` of output tokens ``[lo, hi)`` (prompt first if echo)."""
    entries = list(meta.get("input_token_logprobs", [])) if echo else []
    entries += meta["output_token_logprobs"][lo:hi]
    tops = list(meta.get("input_top_logprobs", [])) if echo else []
    tops += meta.get("output_top_logprobs", [])[lo:hi]
    return {
        "text_offset": [-1] * len(entries),
        "token_logprobs": [e[0] for e in entries],
        "tokens": [e[2] for e in entries],
        "top_logprobs": [_top_dict(t) for t in tops],
    }


def chat_logprobs(meta: dict[str, Any], lo: int, hi: int) -> dict[str, Any]:
    """SGLang's chat ``ChoiceLogprobs`` of output tokens ``[lo, hi)``."""
    tops = meta.get("output_top_logprobs", [])[lo:hi]
    content = []
    for k, (lp, _, text) in enumerate(meta["output_token_logprobs"][lo:hi]):
        top = _top_dict(tops[k]) if k < len(tops) else None
        content.append(
            {
                "token": text,
                "bytes": list(text.encode("utf-8")),
                "logprob": lp,
                "top_logprobs": [
                    {"token": t, "bytes": list(t.encode("utf-8")), "logprob": v}
                    for t, v in (top or {}).items()
                ],
            }
        )
    return {"content": content}


def _finish(reply: dict[str, Any]) -> tuple[str | None, Any]:
    finish = reply["meta_info"]["finish_reason"]
    return (finish["type"], finish.get("matched")) if finish else (None, None)


# ------------------------------------------------------------------------- completions


def completion_body(body: dict[str, Any]) -> tuple[dict[str, Any], bool, bool]:
    """The ``/generate`` body of a completion request; (body, echo, wants logprobs)."""
    prompt = body.get("prompt")
    if (
        not prompt
        or not isinstance(prompt, str | list)
        or (isinstance(prompt, list) and all(not p for p in prompt))
    ):
        raise BadRequest("Prompt cannot be empty")
    if body.get("suffix") is not None:
        raise BadRequest("suffix is not supported by this server")
    if _int(body, "best_of", 1, 1) != 1:
        raise BadRequest("best_of > 1 is not supported by this server")
    logprobs = _int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    echo = _bool(body, "echo")
    sp = _common(body, {})
    sp["max_new_tokens"] = _int(body, "max_tokens", 16, 1)
    text = isinstance(prompt, str) or isinstance(prompt[0], str)
    gen: dict[str, Any] = {
        "text" if text else "input_ids": prompt,
        "sampling_params": sp,
        "return_logprob": logprobs is not None,
        "top_logprobs_num": logprobs or 0,
        "logprob_start_len": 0 if echo and logprobs is not None else -1,
        "return_text_in_logprobs": True,
        "rid": body.get("rid") or f"cmpl-{uuid.uuid4().hex}",
    }
    if isinstance(gen["rid"], str) and isinstance(prompt, list) and not isinstance(prompt[0], int):
        gen["rid"] = [f"{gen['rid']}_{i}" for i in range(len(prompt))]
    _routes(body, gen)
    return gen, echo, logprobs is not None


def _routes(body: dict[str, Any], gen: dict[str, Any]) -> None:
    if _bool(body, "return_routed_experts"):
        gen["return_routed_experts"] = True
        gen["routed_experts_start_len"] = _int(body, "routed_experts_start_len", 0, 0)


def _sglext(reply: dict[str, Any]) -> dict[str, Any] | None:
    routes = reply["meta_info"].get("routed_experts")
    return None if routes is None else {"routed_experts": routes}


def _echo_texts(engine: Any, prompt: Any) -> list[str]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt[0], str):
        return list(prompt)
    lists = [prompt] if isinstance(prompt[0], int) else prompt
    return [engine.tokenizer.decode(p, skip_special_tokens=True) for p in lists]


async def completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions``."""
    engine = ready_engine(request)
    try:
        body = await _object_body(request)
        gen, echo, logprobs = completion_body(body)
        stream, include_usage = _bool(body, "stream"), _stream_usage(body)
        gen["stream"] = stream
        reqs, _, _ = await parse_body_requests(gen, engine, request.app[LIMITS_KEY])
        echoes = _echo_texts(engine, body["prompt"]) if echo else None
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
                reason, matched = _finish(r)
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
            if (ext := _sglext(replies[0])) is not None:
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
        i, r, done = await sub.next()
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
        reason, matched = _finish(r) if done else (None, None)
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


def content_format(source: str) -> str:
    """SGLang's template content format: "openai" or "string".

    "openai" when the template loops over a message's ``content`` (content parts then reach
    it as a list), else "string" (text parts joined by spaces, images dropped).
    """
    try:
        tree = jinja2.Environment().parse(source)
    except jinja2.TemplateSyntaxError:
        return "string"
    for loop in tree.find_all(jinja2.nodes.For):
        node = loop.iter
        while isinstance(node, jinja2.nodes.Filter) and node.node is not None:
            node = node.node
        key: Any = None
        if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const):
            key = node.arg.value
        elif isinstance(node, jinja2.nodes.Getattr):
            key = node.attr
        base = getattr(node, "node", None)
        if key == "content" and isinstance(base, jinja2.nodes.Name):
            if base.name in ("message", "msg", "m"):
                return "openai"
    return "string"


ROLES = ("system", "user", "assistant", "tool", "function", "developer")


def chat_messages(body: dict[str, Any], fmt: str) -> tuple[list[dict[str, Any]], list[str], str]:
    """(template messages, image strings in order, assistant prefix) of a chat request."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("Messages cannot be empty.")
    out: list[dict[str, Any]] = []
    images: list[str] = []
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{k}] must be an object with a string 'role'")
        role = m["role"].lower()
        if role not in ROLES:
            raise BadRequest(f"messages[{k}].role must be one of {ROLES}, got {m['role']!r}")
        msg = {key: v for key, v in m.items() if v is not None}
        msg["role"] = role
        content = m.get("content")
        if content is None:
            msg["content"] = ""
        elif isinstance(content, list):
            msg["content"] = _parts(content, k, fmt, images)
            if role == "tool" and isinstance(msg["content"], list):
                if all(p.get("type") == "text" for p in msg["content"]):
                    msg["content"] = " ".join(p["text"] for p in msg["content"])
        elif not isinstance(content, str):
            raise BadRequest(f"messages[{k}].content must be a string or a list of parts")
        out.append(msg)
    prefix = ""
    last = out[-1]
    if last["role"] == "assistant" and isinstance(last["content"], str):
        if _bool(body, "continue_final_message"):
            prefix = last["content"]
            out = out[:-1]
        else:  # SGLang: the last message is always the user's
            out[-1] = {"role": "user", "content": last["content"]}
    return out, images, prefix


def _parts(parts: list[Any], k: int, fmt: str, images: list[str]) -> Any:
    kept: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        where = f"messages[{k}].content[{j}]"
        if not isinstance(part, dict):
            raise BadRequest(f"{where} must be an object")
        kind = part.get("type")
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise BadRequest(f"{where}.text must be a string")
            kept.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else None
            if not isinstance(url, str):
                raise BadRequest(f"{where}.image_url.url must be a string")
            if fmt == "openai":
                images.append(url)
                kept.append({"type": "image"})
        else:
            raise BadRequest(f"{where}: content parts of type {kind!r} are not supported")
    if fmt == "openai":
        return kept
    return " ".join(p["text"] for p in kept if p["type"] == "text")


def _generation_defaults(path: str) -> dict[str, Any]:
    file = Path(path) / "generation_config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    return {k: config[k] for k in MODEL_DEFAULTS if config.get(k) is not None}


def _template(app: web.Application, engine: Any) -> tuple[Any, str, dict[str, Any]]:
    """(chat template, content format, generation defaults) of the served model, cached."""
    from osworld_jax.agent.template import ChatTemplate

    cache = app[_TEMPLATE_KEY]
    if cache.get("path") != engine.config.model_path:
        template = ChatTemplate.from_model_dir(engine.config.model_path)
        cache.update(
            path=engine.config.model_path,
            template=template,
            format=content_format(template.source),
            defaults=_generation_defaults(engine.config.model_path),
        )
    return cache["template"], cache["format"], cache["defaults"]


def chat_body(body: dict[str, Any], app: web.Application, engine: Any) -> dict[str, Any]:
    """The ``/generate`` body of a chat request (prompt rendered with the chat template)."""
    from osworld_jax.agent.errors import ChatTemplateError

    if engine.tokenizer is None:
        raise BadRequest("chat completions need the tokenizer (not --skip-tokenizer-init)")
    template, fmt, defaults = _template(app, engine)
    messages, images, prefix = chat_messages(body, fmt)
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise BadRequest(f"tool_choice {choice!r} is not supported by this server (auto | none)")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise BadRequest("chat_template_kwargs must be an object")
    tools = body.get("tools") if choice != "none" else None
    try:
        prompt = template.render(messages, add_generation_prompt=True, tools=tools, **kwargs)
    except ChatTemplateError as e:
        raise BadRequest(str(e)) from None
    top = _int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    sp = _common(body, defaults)
    max_new = body.get("max_completion_tokens") or body.get("max_tokens")
    sp["max_new_tokens"] = _int({"max_tokens": max_new}, "max_tokens", engine.context_length, 1)
    gen: dict[str, Any] = {
        "text": prompt + prefix,
        "sampling_params": sp,
        "return_logprob": _bool(body, "logprobs"),
        "top_logprobs_num": top,
        "logprob_start_len": -1,
        "return_text_in_logprobs": True,
        "rid": body.get("rid") or f"chatcmpl-{uuid.uuid4().hex}",
    }
    if images:
        gen["image_data"] = images
    _routes(body, gen)
    return gen


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``."""
    engine = ready_engine(request)
    try:
        body = await _object_body(request)
        gen = chat_body(body, request.app, engine)
        stream, include_usage = _bool(body, "stream"), _stream_usage(body)
        gen["stream"] = stream
        reqs, _, _ = await parse_body_requests(gen, engine, request.app[LIMITS_KEY])
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
            reason, matched = _finish(r)
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
            if (ext := _sglext(r)) is not None:
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
        _, r, done = await sub.next()
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
    reason, matched = _finish(final)
    n_out = final["meta_info"]["completion_tokens"]
    lp = chat_logprobs(final["meta_info"], tokens, n_out) if logprobs and n_out > tokens else None
    await _send(resp, chunk(delta={}, logprobs=lp, finish_reason=reason, matched_stop=matched))
    ext = _sglext(final)
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


__all__ = [
    "add_routes",
    "chat_body",
    "chat_logprobs",
    "completion_body",
    "completion_logprobs",
    "content_format",
    "openai_error",
    "usage",
]
