"""Validation of the embedded server's request bodies: SGLang's ``/generate`` rules plus limits.

Everything here is pure (no aiohttp): `parse_body` turns raw bytes into JSON within the
`ServerLimits`, and `parse_generate` turns a ``/generate`` body into `GenRequest`s, raising
`BadRequest` (HTTP 400) with a one-line message naming the field. The rules follow SGLang 0.5.23
(``srt/managers/io_struct.py`` ``GenerateReqInput``, ``srt/sampling/sampling_params.py``,
``srt/managers/scheduler.py`` request checks): ``None`` and empty lists / objects / strings are
the neutral value of every optional parameter, ``logprob_start_len`` is ignored without
``return_logprob`` and ``routed_experts_start_len`` without ``return_routed_experts``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from osworld_jax.server.images import (
    ImageLimits,
    ImageRequestError,
    RequestImages,
    expand_image_tokens,
    normalize_image_data,
)
from osworld_jax.server.params import (
    BadRequest,
    check_sampling,
    int_in,
    is_neutral,
)
from osworld_jax.server.runner import MAX_TOP_LOGPROBS

if TYPE_CHECKING:
    from osworld_jax.server.engine import Engine, GenRequest

#: SGLang's ``MAX_STOP_COUNT`` (``sampling_params.py``).
SGLANG_MAX_STOP_COUNT = 32


@dataclass(frozen=True, kw_only=True)
class ServerLimits:
    """Size and shape limits of one request (hostile bodies get 413 / 400, never a stall).

    Attributes:
      max_request_bytes: largest body; a bigger one is answered 413 before it is read (parsing
        JSON holds the GIL, about 16 ms per MB of integers, so this also bounds how long one
        body can hold up the event loop).
      max_json_depth: deepest nesting of arrays / objects in a body (SGLang's deepest body is 4).
      max_json_values: most values (numbers, strings, ...) in one body, bounded before parsing
        by counting its commas (those inside strings too: a bound, not a count). Parsing
        creates one Python object per value while holding the GIL (a 20 MB body of 3M token
        ids: 0.17 s of orjson plus 0.07 s of type checks), so this bounds how long one body
        holds up ``/health``. 2^20 is 64 prompts of 16,384 ids in one batch body; a base64
        image is one value.
      max_stop_strings: most ``stop`` strings per request (SGLang's own limit is 32).
      max_stop_length: longest ``stop`` string, in characters (each is tokenized and searched
        for after every generated token).
      max_image_pixels: most pixels of one image (from its header, before decoding: a
        decompression bomb is refused without being decoded).
      max_images_per_request: most images of one request.
      max_request_image_pixels: most decoded pixels of one body's images (each distinct image
        once; checked from the headers before decoding).
      max_server_image_pixels: most decoded pixels of images held by the whole server (bodies
        being decoded or waiting for their prefill); a body past it gets 400, retry later.
      chat_template_timeout_s: longest a chat template may render (a template from an
        untrusted checkpoint may loop); past it the request gets 400.
      refit_read_timeout_s: longest ``/update_weights_from_disk`` may take to read a
        checkpoint's config and headers (off the engine thread); past it, 400.
    """

    max_request_bytes: int = 32 << 20
    max_json_depth: int = 32
    max_json_values: int = 1 << 20
    max_stop_strings: int = SGLANG_MAX_STOP_COUNT
    max_stop_length: int = 1024
    max_image_pixels: int = 1 << 25
    max_images_per_request: int = 64
    max_request_image_pixels: int = 1 << 26
    max_server_image_pixels: int = 1 << 27
    chat_template_timeout_s: float = 5.0
    refit_read_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float):  # timeouts
                if not (math.isfinite(v) and v > 0):
                    raise ValueError(f"ServerLimits.{f.name} must be finite and above 0, got {v}")
            elif not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(
                    f"ServerLimits.{f.name} must be an integer of at least 1, got {v!r}"
                )

    @property
    def images(self) -> ImageLimits:
        """The `ImageLimits` of one request (an image file may be as large as a body)."""
        return ImageLimits(
            max_image_pixels=self.max_image_pixels,
            max_image_bytes=self.max_request_bytes,
            max_images=self.max_images_per_request,
            max_request_image_pixels=self.max_request_image_pixels,
        )


REQUEST_NEUTRAL: dict[str, Any] = {
    "audio_data": None, "video_data": None, "input_embeds": None,
    "token_ids_logprob": None, "lora_path": None,
    "custom_logit_processor": None, "return_hidden_states": False,
}  # fmt: skip


def json_depth_exceeds(obj: Any, limit: int) -> bool:
    """True when ``obj`` nests arrays / objects deeper than ``limit`` (iterative, no recursion).

    Lists are scanned with ``map(type, ...)`` (C speed), so a long list of numbers costs
    little; only containers are descended into.
    """
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        kinds = set(map(type, children))
        if list in kinds or dict in kinds:
            stack.extend((c, depth + 1) for c in children if isinstance(c, list | dict))
    return False


def parse_body(raw: bytes, limits: ServerLimits, *, optional: bool = False) -> Any:
    """The JSON of a request body within ``limits`` (``{}`` for an empty optional body).

    Raises:
      BadRequest: empty, not UTF-8 JSON, nested deeper than ``limits.max_json_depth`` or
        holding more than ``limits.max_json_values`` values.
    """
    if not raw.strip():
        if optional:
            return {}
        raise BadRequest("empty body")
    if len(raw) > limits.max_json_values and raw.count(b",") >= limits.max_json_values:
        raise BadRequest(
            f"the body holds more than {limits.max_json_values} values (--max-json-values)"
        )
    # orjson, not json: the parse holds the GIL, and a 20 MB body of 3M token ids takes 0.22 s
    # in orjson and 0.36 s in json, during which /health cannot answer. orjson stops at 1024
    # levels (a nesting attack costs nothing) and refuses NaN, lone surrogates and integers
    # beyond 64 bits, none of which a valid request holds.
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        if "depth limit" in str(e) or "recursion" in str(e).lower():
            raise BadRequest(f"the body nests deeper than {limits.max_json_depth} levels") from None
        raise BadRequest(f"invalid JSON: {e}") from None
    if isinstance(body, list | dict) and json_depth_exceeds(body, limits.max_json_depth):
        raise BadRequest(f"the body nests deeper than {limits.max_json_depth} levels")
    return body


def _per_item(body: dict[str, Any], key: str, n: int, batch: bool, default: Any) -> list[Any]:
    v = body.get(key, default)
    v = default if v is None else v
    if batch and isinstance(v, list):
        if len(v) != n:
            raise BadRequest(f"{key} has {len(v)} entries for a batch of {n}")
        return v
    return [v] * n


def prompt_texts(body: Any, engine: Engine) -> list[str] | None:
    """The ``text`` prompts of a ``/generate`` body (None when it sends ``input_ids``).

    Validates the input keys only; tokenizing is left to the caller (off the event loop).
    Texts longer than ``context_length * longest token`` characters cannot fit the context and
    are refused without tokenizing them.
    """
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
    if has_text == has_ids:
        raise BadRequest("exactly one of 'text' or 'input_ids' is required")
    if has_ids:
        return None
    if engine.tokenizer is None:
        raise BadRequest(
            "text prompts are unavailable with --skip-tokenizer-init: send input_ids instead"
        )
    text = body["text"]
    texts = text if isinstance(text, list) else [text]
    if not texts or not all(isinstance(t, str) for t in texts):
        raise BadRequest("text must be a string or a non-empty list of strings")
    longest = engine.context_length * engine.max_token_chars
    for i, t in enumerate(texts):
        if len(t) > longest:
            where = f"text[{i}]" if isinstance(text, list) else "text"
            raise BadRequest(
                f"{where}: the input ({len(t)} characters) is longer than the model's context "
                f"length ({engine.context_length} tokens)"
            )
    return texts


def prompt_count(body: dict[str, Any]) -> tuple[int, bool]:
    """(number of prompts, is a batch) of a body that passed `prompt_texts`."""
    if body.get("text") is not None:
        text = body["text"]
        return (len(text), True) if isinstance(text, list) else (1, False)
    ids = body["input_ids"]
    if not isinstance(ids, list) or not ids:
        raise BadRequest("input_ids must be a non-empty list of ints or of lists")
    return (len(ids), True) if isinstance(ids[0], list) else (1, False)


def image_items(body: dict[str, Any], engine: Engine) -> list[list[str]]:
    """The ``image_data`` strings of each request of a body (SGLang's normalisation).

    Raises:
      BadRequest: a malformed ``image_data``, or images for a model that takes none.
    """
    n, batch = prompt_count(body)
    try:
        items = normalize_image_data(body.get("image_data"), n, batch)
    except ImageRequestError as e:
        raise BadRequest(str(e)) from None
    if any(items) and engine.processor is None:
        raise BadRequest(
            "image_data: the served model is a text model (qwen3_moe); it takes no images"
        )
    return items


def _check_prompt(p: Any, where: str, engine: Engine) -> None:
    if not isinstance(p, list) or not p:
        raise BadRequest(f"{where} must be a non-empty list of ints")
    if len(p) >= engine.context_length:
        raise BadRequest(
            f"{where}: the input ({len(p)} tokens) is longer than the model's context "
            f"length ({engine.context_length} tokens)"
        )
    if set(map(type, p)) != {int}:  # C-speed scan: bools, floats, strings are refused
        raise BadRequest(f"{where} must be a non-empty list of ints")
    if min(p) < 0 or max(p) >= engine.vocab_size:
        bad = [t for t in p if not 0 <= t < engine.vocab_size]
        raise BadRequest(f"{where} holds token ids outside [0, {engine.vocab_size}): {bad[:5]}")


def parse_generate(
    body: Any,
    engine: Engine,
    limits: ServerLimits,
    tokenized: list[list[int]] | None = None,
    images: list[RequestImages | None] | None = None,
    field_names: dict[str, str] | None = None,
) -> tuple[list[GenRequest], bool, bool]:
    """Validates a ``/generate`` body; returns (requests, is_batch, stream).

    Every sampling and logprob value is checked here, once (`check_sampling`): nothing of a
    request can fail in the engine thread. ``field_names``: the wire names of renamed fields in
    messages (the OpenAI routes send ``max_tokens`` as ``max_new_tokens``: their keys).

    ``tokenized`` holds the token ids of the body's ``text`` prompts (see `prompt_texts`);
    ``images`` each request's processed images (`image_items` read in a thread with
    `osworld_jax.server.images.load_request_images`; None: the body must hold none). Each
    image placeholder of a prompt is expanded to its image's token count
    (`expand_image_tokens`).
    """
    texts = prompt_texts(body, engine)
    for key, neutral in REQUEST_NEUTRAL.items():
        if key in body and not is_neutral(body[key], neutral):
            raise BadRequest(f"{key} is not supported by this server")
    if texts is None:
        ids = body["input_ids"]
        if not isinstance(ids, list) or not ids:
            raise BadRequest("input_ids must be a non-empty list of ints or of lists")
        batch = isinstance(ids[0], list)
        prompts = ids if batch else [ids]
    else:
        if tokenized is None or len(tokenized) != len(texts):
            raise ValueError("parse_generate: text prompts need their token ids")
        batch, prompts = isinstance(body["text"], list), tokenized
    n = len(prompts)
    if images is None:
        if any(image_items(body, engine)):
            raise ValueError("parse_generate: image_data needs its processed images")
        images = [None] * n
    prompts = [_expand(p, images[i], engine, i if batch else None) for i, p in enumerate(prompts)]
    for i, p in enumerate(prompts):
        _check_prompt(p, f"input_ids[{i}]" if batch else "input_ids", engine)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a bool")
    text_lp = body.get("return_text_in_logprobs") or False
    if not isinstance(text_lp, bool):
        raise BadRequest("return_text_in_logprobs must be a bool")
    sps = _per_item(body, "sampling_params", n, batch, {})
    rids = _per_item(body, "rid", n, batch, None)
    lps = _per_item(body, "return_logprob", n, batch, False)
    lp_starts = _per_item(body, "logprob_start_len", n, batch, -1)
    routed = _per_item(body, "return_routed_experts", n, batch, False)
    r_starts = _per_item(body, "routed_experts_start_len", n, batch, 0)
    tops = _per_item(body, "top_logprobs_num", n, batch, 0)
    reqs = []

    def indexed(k: str, i: int) -> str:
        return f"{k}[{i}]" if batch else k

    renamed = field_names or {}
    for i, prompt in enumerate(prompts):
        prefix = "" if field_names is not None else f"{indexed('sampling_params', i)}."
        sampling = check_sampling(sps[i], engine, limits, prefix, field_names)
        rid = rids[i]
        if rid is not None and not isinstance(rid, str):
            raise BadRequest(f"rid must be a string, got {rid!r}")
        if not isinstance(lps[i], bool) or not isinstance(routed[i], bool):
            raise BadRequest("return_logprob / return_routed_experts must be bools")
        # As SGLang's scheduler: each start is checked only when its output is requested.
        lp_start = lp_starts[i] if lps[i] else -1
        where = indexed(renamed.get("logprob_start_len", "logprob_start_len"), i)
        int_in(lp_start, f"{where} (the prompt has {len(prompt)} tokens)", -1, len(prompt))
        r_start = r_starts[i] if routed[i] else 0
        where = indexed("routed_experts_start_len", i)
        int_in(r_start, f"{where} (the prompt has {len(prompt)} tokens)", 0, len(prompt))
        if routed[i] and not engine.config.enable_return_routed_experts:
            raise BadRequest("return_routed_experts needs --enable-return-routed-experts")
        top = tops[i] if lps[i] else 0
        int_in(
            top,
            indexed(renamed.get("top_logprobs_num", "top_logprobs_num"), i),
            0,
            MAX_TOP_LOGPROBS,
        )
        reqs.append(
            engine.make_request(
                rid=rid,
                input_ids=prompt,
                sampling=sampling,
                return_logprob=lps[i],
                logprob_start_len=lp_start,
                top_logprobs_num=top,
                return_text_in_logprobs=text_lp,
                return_routed_experts=routed[i],
                routed_experts_start_len=r_start,
                images=images[i],
            )
        )
    return reqs, batch, stream


def _expand(prompt: Any, images: RequestImages | None, engine: Engine, index: int | None) -> Any:
    """``prompt`` with its image placeholders expanded (a VL model), else unchanged."""
    from osworld_jax.model import Qwen3VLMoeConfig

    config = engine.model_config
    if not isinstance(config, Qwen3VLMoeConfig) or not isinstance(prompt, list):
        return prompt
    if not all(type(t) is int for t in prompt):
        return prompt  # _check_prompt names the problem
    where = "request" if index is None else f"request {index}"
    try:
        return expand_image_tokens(
            prompt, () if images is None else images.num_tokens, config, where
        )
    except ImageRequestError as e:
        raise BadRequest(str(e)) from None
