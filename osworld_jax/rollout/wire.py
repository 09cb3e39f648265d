"""The SGLang ``/generate`` reply: decoding, validation, and stitching of resubmitted parts.

Everything here is pure (no I/O) so that the client's checks are testable on literal replies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from osworld_jax.contract.errors import ReplyValidationError
from osworld_jax.contract.routes import decode_routed_experts

FINISH_TYPES = ("stop", "length", "abort")


@dataclass(frozen=True, kw_only=True, eq=False)
class Generation:
    """One completed turn: the output tokens with their behaviour logprobs and routes.

    Attributes:
      rid: the request id the caller gave (resubmissions use ``rid`` + suffix on the wire).
      output_ids: generated token ids (all parts of a resubmitted request, in order).
      output_logprobs: ``log_softmax(logits / T_lp)`` of each output token over the full
        vocabulary (SGLang semantics; ``T_lp`` from `logprob_temperature`: the sampling
        temperature, 1 for greedy requests or a server returning original logprobs).
      routed_experts: i32 ``[prompt_tokens + completion_tokens - 1 - routed_experts_start_len, L,
        K]``: the experts chosen when each token was the model's *input* (the last sampled
        token is never an input, so it has no row); -1 on dense layers; None when not requested.
      finish_reason: SGLang's finish reason of the final part (``stop`` or ``length``; a final
        ``abort`` never reaches the caller: it raises `AbortBudgetExceeded`).
      prompt_tokens: length of the prompt as served (image placeholders expanded).
      completion_tokens: ``len(output_ids)``.
      weight_version: the server's weight version of the final part.
      weight_versions: the weight version of every part (more than one after an abort), as
        each part's reply reported it. Each part ran wholly on one version: the client's refit
        pauses with ``mode="abort"``, so a refit ends the running part and the next part starts
        on the new weights (a ``retract`` or ``in_place`` pause would let one part span two
        versions under a single stamp). Default: one part, ``(weight_version,)``.
      part_lengths: the number of output tokens of every part (aligned with
        ``weight_versions``; they sum to ``completion_tokens``). Default: one part,
        ``(len(output_ids),)``. `token_weight_versions` expands the two per token.
      text: decoded text of the output (the parts' texts concatenated).
      num_resubmits: how many times an aborted part was resubmitted.
      routed_experts_start_len: first prompt position that has a route row.
      cached_tokens: prompt tokens the server took from its prefix cache instead of
        prefilling them (``meta_info.cached_tokens``, summed over the parts; 0 where a server
        does not say).
      served_tokens: the prompt tokens the parts were sent with (``prompt_tokens`` of each part,
        summed): ``cached_tokens / served_tokens`` is the turn's prefix-cache hit rate.
    """

    rid: str
    output_ids: list[int]
    output_logprobs: list[float]
    routed_experts: np.ndarray | None
    finish_reason: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int
    weight_version: str
    weight_versions: tuple[str, ...] = ()
    part_lengths: tuple[int, ...] = ()
    text: str = ""
    num_resubmits: int = 0
    routed_experts_start_len: int = 0
    cached_tokens: int = 0
    served_tokens: int = 0

    def __post_init__(self) -> None:
        n = len(self.output_ids)
        versions, lengths = tuple(self.weight_versions), tuple(self.part_lengths)
        if not versions:
            versions = (self.weight_version,)
        if not lengths and len(versions) == 1:
            lengths = (n,)
        object.__setattr__(self, "weight_versions", versions)
        object.__setattr__(self, "part_lengths", lengths)
        problem = check_parts(versions, lengths, n)
        if problem is None and versions[-1] != self.weight_version:
            problem = f"the last part's version {versions[-1]!r} is not {self.weight_version!r}"
        if problem is not None:
            raise ValueError(f"Generation {self.rid!r}: {problem}")

    def token_weight_versions(self) -> tuple[str, ...]:
        """The weight version of every output token (length ``completion_tokens``).

        ``weight_versions[i]`` repeated ``part_lengths[i]`` times, in order: a request aborted
        by a refit after 3 tokens and finished with 2 more on the new weights gives
        ``("0", "0", "0", "1", "1")`` for versions ``("0", "1")``, lengths ``(3, 2)``.
        """
        return expand_parts(self.weight_versions, self.part_lengths)


@dataclass(frozen=True, kw_only=True, eq=False)
class Reply:
    """One validated ``/generate`` reply (a single part of a possibly resubmitted turn).

    Attributes:
      output_ids: generated token ids.
      output_logprobs: their logprobs (empty when not requested).
      routed_experts: decoded routes or None.
      finish_reason: SGLang's finish reason dict.
      prompt_tokens: prompt length the server saw.
      completion_tokens: number of output tokens.
      weight_version: the server's weight version.
      text: decoded output text.
      meta_info: the raw ``meta_info`` (extra keys are tolerated and kept).
      text_missing: the reply had no ``text`` (a server started with
        ``--skip-tokenizer-init``); ``text`` is then "".
    """

    output_ids: list[int]
    output_logprobs: list[float]
    routed_experts: np.ndarray | None
    finish_reason: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int
    weight_version: str
    text: str
    meta_info: dict[str, Any] = field(default_factory=dict)
    text_missing: bool = False


def check_parts(versions: tuple[str, ...], lengths: tuple[int, ...], n: int) -> str | None:
    """Why per-part ``versions`` / ``lengths`` cannot describe ``n`` tokens, or None.

    They must be equally many (at least one), the versions strings, the lengths non-negative
    ints summing to ``n``.
    """
    if not versions or len(versions) != len(lengths):
        return f"{len(versions)} part versions but {len(lengths)} part lengths"
    if not all(isinstance(v, str) for v in versions):
        return f"part versions {versions!r} are not all strings"
    if not all(isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in lengths):
        return f"part lengths {lengths!r} are not all non-negative ints"
    if sum(lengths) != n:
        return f"part lengths {lengths!r} sum to {sum(lengths)}, not the {n} output tokens"
    return None


def expand_parts(versions: tuple[str, ...], lengths: tuple[int, ...]) -> tuple[str, ...]:
    """Per-token versions: ``versions[i]`` repeated ``lengths[i]`` times, concatenated."""
    return tuple(v for v, k in zip(versions, lengths, strict=True) for _ in range(k))


def _int(meta: dict[str, Any], key: str, rid: str) -> int:
    v = meta.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ReplyValidationError(rid, f"meta_info.{key} is {v!r}, not a non-negative int")
    return v


def parse_reply(
    body: Any,
    *,
    rid: str,
    prompt_len: int | None,
    return_logprob: bool,
    routed_experts_start_len: int | None,
    num_layers: int | None = None,
    top_k: int | None = None,
) -> Reply:
    """Validates one ``/generate`` reply against the request that produced it.

    Checks: ``completion_tokens == len(output_ids)``, ``prompt_tokens == prompt_len`` (unless
    None: a prompt whose image placeholders the server expands); with
    logprobs, one ``[logprob, token_id, ...]`` entry per output token whose ids equal
    ``output_ids`` and whose logprobs are finite; with routes (``routed_experts_start_len`` not
    None), the row count ``prompt + completion - 1 - start_len`` (not checked on an ``abort``
    with no output: such a part is resubmitted whole); a string ``weight_version``.

    Raises:
      ReplyValidationError: naming ``rid`` and the first broken invariant.
    """
    if not isinstance(body, dict):
        raise ReplyValidationError(rid, f"reply is {type(body).__name__}, not a JSON object")
    if "error" in body and "meta_info" not in body:
        raise ReplyValidationError(rid, f"server error: {body['error']}")
    meta = body.get("meta_info")
    output_ids = body.get("output_ids")
    if not isinstance(meta, dict):
        raise ReplyValidationError(rid, "reply has no meta_info object")
    if not isinstance(output_ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in output_ids
    ):
        raise ReplyValidationError(rid, "reply output_ids is not a list of ints")
    finish = meta.get("finish_reason")
    if not isinstance(finish, dict) or finish.get("type") not in FINISH_TYPES:
        raise ReplyValidationError(rid, f"finish_reason {finish!r} is not one of {FINISH_TYPES}")
    completion = _int(meta, "completion_tokens", rid)
    prompt = _int(meta, "prompt_tokens", rid)
    if completion != len(output_ids):
        raise ReplyValidationError(
            rid, f"completion_tokens={completion} but {len(output_ids)} output_ids"
        )
    if prompt_len is not None and prompt != prompt_len:
        raise ReplyValidationError(rid, f"prompt_tokens={prompt} but the prompt had {prompt_len}")
    version = meta.get("weight_version")
    if not isinstance(version, str):
        raise ReplyValidationError(rid, f"meta_info.weight_version is {version!r}, not a str")

    logprobs: list[float] = []
    if return_logprob:
        entries = meta.get("output_token_logprobs")
        if not isinstance(entries, list) or len(entries) != completion:
            n = len(entries) if isinstance(entries, list) else entries
            raise ReplyValidationError(
                rid, f"output_token_logprobs has {n} entries, completion_tokens={completion}"
            )
        for i, (entry, tok) in enumerate(zip(entries, output_ids, strict=True)):
            if not isinstance(entry, list | tuple) or len(entry) < 2:
                raise ReplyValidationError(rid, f"output_token_logprobs[{i}] is {entry!r}")
            lp, lp_tok = entry[0], entry[1]
            if lp_tok != tok:
                raise ReplyValidationError(
                    rid, f"output_token_logprobs[{i}] is for token {lp_tok}, output_ids has {tok}"
                )
            if not isinstance(lp, int | float) or not math.isfinite(lp) or lp > 1e-3:
                raise ReplyValidationError(rid, f"output_token_logprobs[{i}] logprob is {lp!r}")
            logprobs.append(float(lp))

    routes = None
    # An abort before the first token has nothing to stitch (the request may never have been
    # prefilled, so a server may send no routes): it is resubmitted whole.
    empty_abort = finish["type"] == "abort" and completion == 0
    if routed_experts_start_len is not None and not empty_abort:
        if num_layers is None or top_k is None:
            raise ValueError("parse_reply: routes requested without num_layers / top_k")
        if "routed_experts" not in meta:
            raise ReplyValidationError(rid, "routed_experts requested but missing from the reply")
        rows = max(0, prompt + completion - 1 - routed_experts_start_len)  # as SGLang
        routes = decode_routed_experts(
            meta["routed_experts"], rows=rows, num_layers=num_layers, top_k=top_k, rid=rid
        )
    text = body.get("text", "")
    return Reply(
        output_ids=list(output_ids),
        output_logprobs=logprobs,
        routed_experts=routes,
        finish_reason=dict(finish),
        prompt_tokens=prompt,
        completion_tokens=completion,
        weight_version=version,
        text=text if isinstance(text, str) else "",
        meta_info=meta,
        text_missing="text" not in body,
    )


def stitch(
    parts: list[Reply],
    *,
    rid: str,
    prompt_tokens: int,
    routed_experts_start_len: int,
    num_resubmits: int | None = None,
) -> Generation:
    """Joins the parts of a request that was aborted and resubmitted into one `Generation`.

    Part ``i + 1`` was sent with prompt ``prompt + out_0 + ... + out_i`` and asked only for route
    rows from ``len(that prompt) - 1`` on (the input row of ``out_i``'s last token, which part
    ``i`` could not have). So each route row comes from the part whose output logprobs it
    conditioned first, and the rows concatenate to exactly
    ``prompt_tokens + total_output - 1 - routed_experts_start_len``. Logprobs and ids
    concatenate in order. (When a refit happened between parts, the parts' weight versions
    differ; ``Generation.weight_versions`` records each and ``Generation.part_lengths`` how
    many output tokens each produced.) Aborts with no output are not parts; ``num_resubmits``
    counts every resubmission (default ``len(parts) - 1``).
    """
    output_ids = [t for p in parts for t in p.output_ids]
    logprobs = [lp for p in parts for lp in p.output_logprobs]
    routes = None
    if parts[0].routed_experts is not None:
        routes = np.concatenate([p.routed_experts for p in parts], axis=0)  # type: ignore[misc]
        expected = max(0, prompt_tokens + len(output_ids) - 1 - routed_experts_start_len)
        if routes.shape[0] != expected:
            raise ReplyValidationError(
                rid, f"stitched routed_experts has {routes.shape[0]} rows, expected {expected}"
            )
    last = parts[-1]
    return Generation(
        rid=rid,
        output_ids=output_ids,
        output_logprobs=logprobs,
        routed_experts=routes,
        finish_reason=last.finish_reason,
        prompt_tokens=prompt_tokens,
        completion_tokens=len(output_ids),
        weight_version=last.weight_version,
        weight_versions=tuple(p.weight_version for p in parts),
        part_lengths=tuple(p.completion_tokens for p in parts),
        text="".join(p.text for p in parts),
        num_resubmits=len(parts) - 1 if num_resubmits is None else num_resubmits,
        routed_experts_start_len=routed_experts_start_len,
        cached_tokens=sum(cached_tokens(p) for p in parts),
        served_tokens=sum(p.prompt_tokens for p in parts),
    )


def cached_tokens(reply: Reply) -> int:
    """``meta_info.cached_tokens`` of a reply, clipped to its prompt (0 if absent or not an int).

    SGLang counts the prompt tokens its radix cache held; a server that does not report it
    counts as no hit.
    """
    v = reply.meta_info.get("cached_tokens")
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        return 0
    return min(v, reply.prompt_tokens)
