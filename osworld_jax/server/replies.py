"""The embedded server's ``/generate`` replies, in SGLang 0.5.23's shape (../shared/SGLANG_API.md).

Pure functions of an `Engine` (its tokenizer, model config, weight version) and a `GenRequest`'s
progress; called on the engine thread (`osworld_jax.server.http_base.Submission` after each step
of a streamed request, once at the end otherwise). The engine does not import this module.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from osworld_jax.contract.routes import encode_routed_experts
from osworld_jax.server.requests import GenRequest

if TYPE_CHECKING:
    from osworld_jax.server.engine import Engine


def output_text(engine: Engine, req: GenRequest) -> str:
    """Decoded output text with SGLang's stop trimming (unless ``no_stop_trim``).

    A matched stop token id is dropped from the ids before decoding; a matched stop string cuts
    the text at its first occurrence.
    """
    assert engine.tokenizer is not None, "output_text needs a tokenizer"
    ids = req.output_ids
    matched = (req.finish or {}).get("matched")
    if isinstance(matched, int) and not req.no_stop_trim and ids and ids[-1] == matched:
        ids = ids[:-1]
    text = engine.tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens)
    if isinstance(matched, str) and not req.no_stop_trim:
        pos = text.find(matched)
        if pos >= 0:
            text = text[:pos]
    return str(text)


def token_texts(engine: Engine, req: GenRequest, which: str) -> list[str]:
    """Each token's own text (special tokens kept), as SGLang's ``return_text_in_logprobs``.

    ``which`` is ``"input"`` or ``"output"``. Decoded once per token and cached on the request
    (stream events are cumulative).
    """
    ids = req.input_ids if which == "input" else req.output_ids
    cache = req.token_texts.setdefault(which, [])
    if len(cache) < len(ids):
        assert engine.tokenizer is not None
        new = [[t] for t in ids[len(cache) :]]
        cache.extend(engine.tokenizer.decode_batch(new, skip_special_tokens=False))
    return cache


def _top_entries(engine: Engine, ids: np.ndarray, lps: np.ndarray, texts: bool) -> list[list[Any]]:
    """SGLang's top-logprob entries of one position: ``[[logprob, token_id, text|None], ...]``."""
    names = (
        engine.tokenizer.decode_batch([[int(t)] for t in ids], skip_special_tokens=False)
        if texts and engine.tokenizer is not None
        else [None] * len(ids)
    )
    return [[float(lp), int(t), n] for lp, t, n in zip(lps, ids, names, strict=True)]


def generate_reply(engine: Engine, req: GenRequest, final: bool = True) -> dict[str, Any]:
    """The SGLang ``/generate`` reply object of ``req`` (cumulative so far).

    ``final=False`` (intermediate stream events) leaves out ``routed_experts``, which only the
    last event carries (re-encoding every route row per token would be quadratic).
    ``prompt_tokens`` counts the prompt as served (image placeholders expanded).
    """
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish,
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
        "weight_version": engine.weight_version,
        "e2e_latency": time.monotonic() - req.created,
    }
    if req.images is not None:
        meta["image_tokens"] = sum(req.images.num_tokens)
    if req.return_logprob:
        _add_logprobs(engine, req, meta)
    if req.return_routed_experts and final and req.num_route_rows:  # never prefilled: none
        rows = len(req.input_ids) + len(req.output_ids) - 1
        c = engine.model_config
        empty = np.zeros((0, c.num_hidden_layers, c.num_experts_per_tok), np.int32)
        routes = np.concatenate([empty, *req.routes], axis=0)[: max(rows, 0)]
        meta["routed_experts"] = encode_routed_experts(routes[req.routed_experts_start_len :])
    if engine.tokenizer is None:  # SGLang's token-only reply (--skip-tokenizer-init)
        return {"output_ids": list(req.output_ids), "meta_info": meta}
    return {"text": output_text(engine, req), "output_ids": list(req.output_ids), "meta_info": meta}


def _add_logprobs(engine: Engine, req: GenRequest, meta: dict[str, Any]) -> None:
    """``output_token_logprobs`` / ``input_token_logprobs`` (and their top-k) of ``req``."""
    texts = req.return_text_in_logprobs and engine.tokenizer is not None
    out_texts = token_texts(engine, req, "output") if texts else None
    meta["output_token_logprobs"] = [
        [lp, t, out_texts[i] if out_texts else None]
        for i, (lp, t) in enumerate(zip(req.output_logprobs, req.output_ids, strict=True))
    ]
    meta["output_token_logprobs_length"] = len(req.output_ids)
    meta["input_token_logprobs"] = []
    if req.top_logprobs_num:
        meta["output_top_logprobs"] = [
            _top_entries(engine, ids, lps, texts) for ids, lps in req.output_top
        ]
        meta["input_top_logprobs"] = []
    if req.logprob_start_len >= 0 and req.input_logprobs is not None:
        start = req.logprob_start_len
        in_texts = token_texts(engine, req, "input")[start:] if texts else None
        meta["input_token_logprobs"] = [
            [None if np.isnan(lp) else float(lp), t, in_texts[i] if in_texts else None]
            for i, (lp, t) in enumerate(
                zip(req.input_logprobs[start:], req.input_ids[start:], strict=True)
            )
        ]
        if req.top_logprobs_num and req.input_top is not None:
            ids, lps = req.input_top
            k = req.top_logprobs_num
            meta["input_top_logprobs"] = [
                None if t == 0 else _top_entries(engine, ids[t][:k], lps[t][:k], texts)
                for t in range(start, len(req.input_ids))
            ]
