"""The OpenAI-compatible endpoints' requests and replies as pure functions (no aiohttp).

A completion or chat request becomes a native ``/generate`` body (SGLang's ``GenerateReqInput``,
validated afterwards by `osworld_jax.server.protocol`); the engine's ``/generate`` replies
become OpenAI's logprobs and usage objects. Shapes and defaults follow SGLang 0.5.x
``srt/entrypoints/openai/protocol.py`` and ``serving_*.py`` (see `osworld_jax.server.openai_api`).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import jinja2
import jinja2.nodes

from osworld_jax.model.chat_template import ChatTemplate
from osworld_jax.model.errors import ChatTemplateError
from osworld_jax.server.params import INT64, BadRequest, int_in
from osworld_jax.server.runner import MAX_TOP_LOGPROBS

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


#: The wire names of the ``sampling_params`` keys these routes rename (in 400 messages).
NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed"}


def int_field(body: dict[str, Any], key: str, default: Any, lo: int, hi: int | None = None) -> Any:
    """``body[key]``: an int in ``[lo, hi]``, or ``default`` when absent / null."""
    v = body.get(key)
    return default if v is None else int_in(v, key, lo, INT64[1] if hi is None else hi)


def bool_field(body: dict[str, Any], key: str) -> bool:
    """``body[key]``: a bool (absent / null is False)."""
    v = body.get(key)
    if v is not None and not isinstance(v, bool):
        raise BadRequest(f"{key} must be a bool, got {v!r}")
    return bool(v)


def sampling_params(body: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """``sampling_params`` of the keys completions and chat share."""
    if body.get("response_format") not in (None, {"type": "text"}):
        raise BadRequest("response_format is not supported by this server (only text)")
    sp: dict[str, Any] = {}
    for key, fallback in MODEL_DEFAULTS.items():
        value = body.get(key)
        sp[key] = defaults.get(key, fallback) if value is None else value
    if sp["top_k"] == 0:  # generation_config's "no top-k" (HF); SGLang spells it -1
        sp["top_k"] = -1
    sp["min_new_tokens"] = int_field(body, "min_tokens", 0, 0)
    sp["stop"] = body.get("stop")
    sp["sampling_seed"] = body.get("seed")
    for key in PASSTHROUGH:
        if body.get(key) is not None:
            sp[key] = body[key]
    return sp


def stream_usage(body: dict[str, Any]) -> bool:
    """``stream_options.include_usage``."""
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


def finish_of(reply: dict[str, Any]) -> tuple[str | None, Any]:
    """(finish_reason type, matched stop) of a ``/generate`` reply."""
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
    if int_field(body, "best_of", 1, 1) != 1:
        raise BadRequest("best_of > 1 is not supported by this server")
    logprobs = int_field(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    echo = bool_field(body, "echo")
    sp = sampling_params(body, {})
    sp["max_new_tokens"] = int_field(body, "max_tokens", 16, 1)
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
    routes_field(body, gen)
    return gen, echo, logprobs is not None


def routes_field(body: dict[str, Any], gen: dict[str, Any]) -> None:
    """Passes ``return_routed_experts`` / ``routed_experts_start_len`` to ``gen``."""
    if bool_field(body, "return_routed_experts"):
        gen["return_routed_experts"] = True
        gen["routed_experts_start_len"] = int_field(body, "routed_experts_start_len", 0, 0)


def sglext(reply: dict[str, Any]) -> dict[str, Any] | None:
    """SGLang's ``sglext`` of a response (the routes), or None."""
    routes = reply["meta_info"].get("routed_experts")
    return None if routes is None else {"routed_experts": routes}


def echo_texts(engine: Any, prompt: Any) -> list[str]:
    """The text ``echo`` prepends to each choice (token prompts decoded)."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt[0], str):
        return list(prompt)
    lists = [prompt] if isinstance(prompt[0], int) else prompt
    return [engine.tokenizer.decode(p, skip_special_tokens=True) for p in lists]


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


def chat_messages(
    body: dict[str, Any], fmt: str, context_length: int | None = None
) -> tuple[list[dict[str, Any]], list[str], str]:
    """(template messages, image strings in order, assistant prefix) of a chat request.

    More messages than ``context_length`` cannot fit (each one's turn markers take at least a
    token): refused before any is copied or rendered (900,000 empty messages would otherwise
    hold the GIL for seconds in allocations and garbage collection).
    """
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("Messages cannot be empty.")
    if context_length is not None and len(messages) > context_length:
        raise BadRequest(
            f"messages: {len(messages)} messages cannot fit the model's context length "
            f"({context_length} tokens; each message takes at least one)"
        )
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
        if "tool_calls" in msg:
            _check_tool_calls(msg["tool_calls"], k)
        content = m.get("content")
        if content is None:
            msg["content"] = ""
        elif isinstance(content, list):
            if role == "tool" and any(
                not isinstance(p, dict) or p.get("type") != "text" for p in content
            ):
                raise BadRequest(f"messages[{k}]: a tool message may hold only text parts")
            msg["content"] = _parts(content, k, fmt, images)
            if role == "tool" and isinstance(msg["content"], list):
                msg["content"] = " ".join(p["text"] for p in msg["content"])
        elif not isinstance(content, str):
            raise BadRequest(f"messages[{k}].content must be a string or a list of parts")
        out.append(msg)
    prefix = ""
    last = out[-1]
    if last["role"] == "assistant" and isinstance(last["content"], str):
        if bool_field(body, "continue_final_message"):
            prefix = last["content"]
            out = out[:-1]
        else:  # SGLang: the last message is always the user's
            out[-1] = {"role": "user", "content": last["content"]}
    return out, images, prefix


def _check_tool_calls(calls: Any, k: int) -> None:
    """An assistant message's ``tool_calls``: objects whose ``function`` has a string name."""
    if not isinstance(calls, list):
        raise BadRequest(f"messages[{k}].tool_calls must be a list")
    for j, call in enumerate(calls):
        where = f"messages[{k}].tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise BadRequest(f"{where} must be an object with a 'function' object")
        if not isinstance(fn.get("name"), str):
            raise BadRequest(f"{where}.function.name must be a string")
        if not isinstance(fn.get("arguments", ""), str | dict):
            raise BadRequest(f"{where}.function.arguments must be a string or an object")


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


def generation_defaults(path: str) -> dict[str, Any]:
    """``temperature`` / ``top_p`` / ``top_k`` / ``min_p`` of a model's generation_config."""
    file = Path(path) / "generation_config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    return {k: config[k] for k in MODEL_DEFAULTS if config.get(k) is not None}


#: Template variables the server sets itself; ``chat_template_kwargs`` may not override them.
RESERVED_TEMPLATE_KWARGS = ("messages", "add_generation_prompt", "tools")


def chat_body(
    body: dict[str, Any],
    template: ChatTemplate,
    defaults: dict[str, Any],
    context_length: int,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """The ``/generate`` body of a chat request (blocking: the server runs it in a thread).

    Args:
      body: the request.
      template: the model's chat template.
      defaults: sampling defaults of its ``generation_config.json`` (`generation_defaults`).
      context_length: the server's; the default ``max_new_tokens`` (clamped by the engine).
      timeout_s: longest the template may render (`ChatTemplate.render`).
    """
    fmt = content_format(template.source)
    messages, images, prefix = chat_messages(body, fmt, context_length)
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise BadRequest(f"tool_choice {choice!r} is not supported by this server (auto | none)")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise BadRequest("chat_template_kwargs must be an object")
    for key in RESERVED_TEMPLATE_KWARGS:
        if key in kwargs:
            raise BadRequest(f"chat_template_kwargs may not set {key!r} (the server sets it)")
    if "timeout_s" in kwargs:
        raise BadRequest("chat_template_kwargs may not set 'timeout_s'")
    tools = body.get("tools") if choice != "none" else None
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("tools must be a list")
    try:
        prompt = template.render(
            messages, add_generation_prompt=True, timeout_s=timeout_s, tools=tools, **kwargs
        )
    except ChatTemplateError as e:
        raise BadRequest(str(e)) from None
    top = int_field(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    sp = sampling_params(body, defaults)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    sp["max_new_tokens"] = int_field(body, key, context_length, 1)
    gen: dict[str, Any] = {
        "text": prompt + prefix,
        "sampling_params": sp,
        "return_logprob": bool_field(body, "logprobs"),
        "top_logprobs_num": top,
        "logprob_start_len": -1,
        "return_text_in_logprobs": True,
        "rid": body.get("rid") or f"chatcmpl-{uuid.uuid4().hex}",
    }
    if images:
        gen["image_data"] = images
    routes_field(body, gen)
    return gen
