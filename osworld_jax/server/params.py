"""Sampling parameters and numeric request fields, checked once at the edge (no aiohttp).

Every value a request sends is checked against its type's range, the engine's int32 / float32
arrays and the model's vocabulary before a `GenRequest` exists: a bad one is a `BadRequest`
(HTTP 400) whose one-line message names the field and the bound it violates, so no request value
can fail inside the engine thread (where one step serves every client). The rules are SGLang's
``SamplingParams.__post_init__`` / ``verify`` (0.5.x, ``srt/sampling/sampling_params.py``) with
its documented clamps: ``top_k`` of -1 or at least the vocabulary size keeps every token,
``max_new_tokens`` beyond the context is cut to what fits (`build_request`). Keys the engine does
not implement are accepted only at their neutral value (None and empty containers / strings are
neutral too, as in SGLang).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from osworld_jax.server.sampling import MAX_BANNED

if TYPE_CHECKING:
    from osworld_jax.server.engine import Engine


class StopLimits(Protocol):
    """The stop-string limits of `osworld_jax.server.protocol.ServerLimits`."""

    @property
    def max_stop_strings(self) -> int:
        """Most stop strings of a request."""

    @property
    def max_stop_length(self) -> int:
        """Longest stop string, in characters."""


#: Largest float32 (temperatures live in float32 arrays on the device).
FLOAT32_MAX = float(np.finfo(np.float32).max)
INT32_MAX = 2**31 - 1
#: The range of every integer field unless a field has a narrower one (SGLang's are int64).
INT64 = (-(2**63), 2**63 - 1)


class BadRequest(ValueError):
    """A malformed request body (HTTP 400)."""


SAMPLING_KEYS = {
    "max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
    "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "custom_params", "stream_interval",
    "logit_bias", "sampling_seed", "stop_regex", "beam_width", "watermark",
}  # fmt: skip
# Keys the embedded engine does not implement: accepted only at their neutral value.
NEUTRAL: dict[str, Any] = {
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "n": 1,
    "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None, "logit_bias": None,
    "stop_regex": None, "beam_width": None, "watermark": None,
}  # fmt: skip
BOOL_KEYS = ("ignore_eos", "skip_special_tokens", "no_stop_trim", "spaces_between_special_tokens")


def is_neutral(value: Any, neutral: Any) -> bool:
    """None, an empty list / object / string, or ``neutral`` itself (bools only equal bools)."""
    if value is None or (isinstance(value, list | dict | str) and not value):
        return True
    if isinstance(value, bool) != isinstance(neutral, bool):
        return False
    return bool(value == neutral)


def is_int(v: Any) -> bool:
    """A JSON integer (bools are not; orjson reads integers beyond 64 bits as floats)."""
    return isinstance(v, int) and not isinstance(v, bool)


def int_in(v: Any, name: str, lo: int = INT64[0], hi: int = INT64[1]) -> int:
    """``v`` when it is an int in ``[lo, hi]`` (default: int64); else `BadRequest`.

    The message names the bound ``v`` violates; an integer beyond 64 bits (which orjson reads
    as a float) violates ``hi`` or ``lo`` too.
    """
    integral = isinstance(v, float) and math.isfinite(v) and v.is_integer()
    if not is_int(v) and not integral:
        raise BadRequest(f"{name} must be an integer, got {v!r}")
    if v < lo:
        raise BadRequest(f"{name} must be at least {lo}, got {v}")
    if v > hi:
        raise BadRequest(f"{name} must be at most {hi}, got {v}")
    if integral:
        raise BadRequest(f"{name} must be an integer, got {v!r}")
    return int(v)


def number_in(
    v: Any, name: str, lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False
) -> float:
    """``v`` as a float in ``[lo, hi]`` (``(lo`` / ``hi)`` when open); else `BadRequest`."""
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
        raise BadRequest(f"{name} must be a finite number, got {v!r}")
    if v < lo or (lo_open and v == lo):
        raise BadRequest(
            f"{name} must be {'greater than' if lo_open else 'at least'} {lo}, got {v}"
        )
    if v > hi or (hi_open and v == hi):
        raise BadRequest(f"{name} must be {'less than' if hi_open else 'at most'} {hi}, got {v}")
    return float(v)


def _or(v: Any, default: Any) -> Any:
    return default if v is None else v


def _check_stop(sp: dict[str, Any], name: str, engine: Engine, limits: StopLimits) -> list[str]:
    stop = _or(sp.get("stop"), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest(f"{name} must be a string or a list of strings")
    if len(stop) > limits.max_stop_strings:
        raise BadRequest(
            f"{name} has {len(stop)} strings, at most {limits.max_stop_strings} are allowed"
        )
    for s in stop:
        if not s:
            raise BadRequest(f"{name} strings must be non-empty")
        if len(s) > limits.max_stop_length:
            raise BadRequest(
                f"{name} string of {len(s)} characters exceeds the limit of "
                f"{limits.max_stop_length}"
            )
    if stop and engine.tokenizer is None:
        raise BadRequest(
            f"{name}={stop[:3]!r} is unavailable with --skip-tokenizer-init (it needs the "
            "tokenizer to decode the output)"
        )
    return stop


def _check_stop_ids(v: Any, name: str, vocab: int) -> list[int]:
    ids = v or []
    if not isinstance(ids, list) or not all(is_int(t) for t in ids):
        raise BadRequest(f"{name} must be a list of integers")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise BadRequest(f"{name} holds ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    return ids


def check_sampling(
    sp: Any,
    engine: Engine,
    limits: StopLimits,
    prefix: str = "sampling_params.",
    names: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """SGLang's ``SamplingParams`` normalisation and ``verify`` plus the engine's limits.

    Args:
      sp: the ``sampling_params`` object of one request.
      engine: the served engine (vocabulary, tokenizer, EOS ids).
      limits: the server's `ServerLimits` (its stop-string limits).
      prefix: what messages put before a key's name (``sampling_params[3].`` in a batch; the
        OpenAI routes' keys are top-level: "").
      names: wire names of renamed keys (the OpenAI routes' ``max_tokens``, ``seed``, ...).

    Returns:
      the normalised values `build_request` takes (``top_k`` >= the vocabulary becomes -1).
    """

    def name(key: str) -> str:
        return prefix + (names.get(key, key) if names is not None else key)

    sp = _or(sp, {})
    if not isinstance(sp, dict):
        raise BadRequest(f"{prefix.rstrip('.')} must be an object, got {type(sp).__name__}")
    unknown = sorted(set(sp) - SAMPLING_KEYS)
    if unknown:
        raise BadRequest(f"unknown sampling_params keys {unknown}")
    for key, neutral in NEUTRAL.items():
        if key in sp and not is_neutral(sp[key], neutral):
            raise BadRequest(f"{name(key)}={sp[key]!r} is not supported by this server")
    t = number_in(_or(sp.get("temperature"), 1.0), name("temperature"), 0.0, FLOAT32_MAX)
    top_p = number_in(_or(sp.get("top_p"), 1.0), name("top_p"), 0.0, 1.0, lo_open=True)
    min_p = number_in(_or(sp.get("min_p"), 0.0), name("min_p"), 0.0, 1.0)
    top_k = int_in(_or(sp.get("top_k"), -1), name("top_k"), -1)
    if top_k == 0:
        raise BadRequest(f"{name('top_k')} must be -1 (disable) or at least 1, got 0")
    if top_k >= engine.vocab_size:  # SGLang: every token (its TOP_K_ALL); no int32 overflow
        top_k = -1
    max_new = int_in(_or(sp.get("max_new_tokens"), 128), name("max_new_tokens"), 0)
    min_new = int_in(sp.get("min_new_tokens") or 0, name("min_new_tokens"), 0)
    if min_new > max_new:
        raise BadRequest(
            f"{name('min_new_tokens')} must be at most {name('max_new_tokens')} ({max_new}), "
            f"got {min_new}"
        )
    if min_new and engine.tokenizer is None:
        raise BadRequest(
            f"{name('min_new_tokens')} is unavailable with --skip-tokenizer-init (as in SGLang)"
        )
    stop = _check_stop(sp, name("stop"), engine, limits)
    stop_ids = _check_stop_ids(sp.get("stop_token_ids"), name("stop_token_ids"), engine.vocab_size)
    if min_new and len(set(stop_ids) | set(engine.eos_ids)) > MAX_BANNED:
        raise BadRequest(f"{name('min_new_tokens')} supports at most {MAX_BANNED} stop + EOS ids")
    seed = sp.get("sampling_seed")
    if seed is not None:
        int_in(seed, name("sampling_seed"))
    if sp.get("stream_interval") is not None:  # accepted; every step is streamed
        int_in(sp["stream_interval"], name("stream_interval"), 1, INT32_MAX)
    if not isinstance(_or(sp.get("custom_params"), {}), dict):
        raise BadRequest(f"{name('custom_params')} must be an object")
    for key in BOOL_KEYS:
        if sp.get(key) is not None and not isinstance(sp[key], bool):
            raise BadRequest(f"{name(key)} must be a bool, got {sp[key]!r}")
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
