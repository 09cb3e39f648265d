"""Rollout history -> token-exact training segments (one owner's chain).

Consecutive calls whose prompt extends the previous prompt + output token-exactly form one segment:
its tokens are the last call's prompt + output, and every call's generated span sits at its own
positions. A declared compaction seals the segment; an undeclared prefix break is fatal. A
segment carries the screenshots of its last call's prompt (each call's images extend the
previous call's, as its tokens do), one per run of ``<|image_pad|>`` tokens, in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from osworld_jax.agent.errors import SegmentIntegrityError
from osworld_jax.agent.history import CallRecord, Compaction, History


@dataclass(frozen=True, kw_only=True, eq=False)
class Segment:
    """One training row of one owner.

    Attributes:
      owner_id: the logical owner.
      group_id: the owner's prompt group.
      tokens: i32[n] the last call's prompt + output.
      loss_mask: f32[n] 1 on generated non-media tokens (up to a reply's first generated media
        token), else 0.
      behavior_logprobs: f32[n] the engine's logprob of ``tokens[t]`` where generated, else 0.
      routed_experts: i32[n, L, K] the route when ``tokens[t]`` was the input, -1 where none
        was recorded (always the last token); None when no call of the segment returned routes.
      call_indices: the owner's call indices in this segment.
      weight_versions: the policy version of each of those calls (its final part's).
      images: the PNG screenshots of the segment, in the order of its image-token runs.
      token_version_ids: i32[n] the weight version that generated ``tokens[t]``, as an index
        into ``version_table``; -1 where no model generated the token as-is (prompt tokens, a
        reply's tokens from its first generated media token on). Every token with loss mask 1
        has an index >= 0. None (hand-built segments only): unknown per token, see
        `trainable_tokens_by_version`.
      version_table: the distinct weight versions of the segment's generated tokens, in order
        of first position.
    """

    owner_id: int
    group_id: int
    tokens: np.ndarray
    loss_mask: np.ndarray
    behavior_logprobs: np.ndarray
    routed_experts: np.ndarray | None
    call_indices: tuple[int, ...]
    weight_versions: tuple[str, ...]
    images: tuple[bytes, ...] = ()
    token_version_ids: np.ndarray | None = None
    version_table: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        ids = self.token_version_ids
        if ids is None:
            return
        ids = np.asarray(ids, np.int32).reshape(-1)
        object.__setattr__(self, "token_version_ids", ids)
        object.__setattr__(self, "version_table", tuple(self.version_table))
        n_versions = len(self.version_table)
        if ids.size != np.asarray(self.tokens).size or (
            ids.size and not (-1 <= ids.min() and ids.max() < n_versions)
        ):
            raise ValueError(
                f"owner {self.owner_id}: token_version_ids must be {np.asarray(self.tokens).size} "
                f"indices in [-1, {n_versions}) of version_table, got {ids.size} in "
                f"[{ids.min() if ids.size else '-'}, {ids.max() if ids.size else '-'}]"
            )
        if np.any((np.asarray(self.loss_mask) > 0) & (ids < 0)):
            t = int(np.flatnonzero((np.asarray(self.loss_mask) > 0) & (ids < 0))[0])
            raise ValueError(
                f"owner {self.owner_id}: token {t} has loss mask 1 but no weight version"
            )

    def trainable_tokens_by_version(self) -> dict[str, int]:
        """How many tokens with loss mask 1 each weight version generated (first position order).

        A segment without ``token_version_ids`` (built by hand) is answered only when its calls
        share one version (then every trainable token has it).

        Raises:
          ValueError: no per-token versions and the calls' versions differ.
        """
        trainable = np.asarray(self.loss_mask) > 0
        n = int(np.count_nonzero(trainable))
        if self.token_version_ids is None:
            versions = set(self.weight_versions)
            if n and len(versions) != 1:
                raise ValueError(
                    f"owner {self.owner_id}: segment of calls {self.call_indices} has no "
                    f"per-token versions and its calls ran on {sorted(versions)}"
                )
            return {self.weight_versions[0]: n} if n else {}
        ids = self.token_version_ids[trainable]
        counts = np.bincount(ids, minlength=len(self.version_table))
        return {v: int(counts[i]) for i, v in enumerate(self.version_table) if counts[i]}

    @property
    def length(self) -> int:
        """Number of tokens."""
        return int(self.tokens.size)

    @property
    def num_trainable(self) -> int:
        """Number of tokens with loss mask 1."""
        return int(self.loss_mask.sum())


def _first_difference(a: np.ndarray, b: np.ndarray) -> int:
    """First index where ``a`` and ``b`` differ (``min(len)`` when one is a prefix of the other)."""
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def _check_routes(call: CallRecord, owner_id: int, call_index: int) -> None:
    re_ = call.routed_experts
    if re_ is None:
        return
    start = call.routed_experts_start
    rows = call.length - 1 - start
    if re_.ndim != 3 or re_.shape[0] != rows or start < 0:
        raise SegmentIntegrityError(
            owner_id,
            call_index,
            start,
            f"routed_experts has shape {tuple(re_.shape)}, expected [prompt + output - 1 - start "
            f"= {rows}, L, K] (start {start})",
        )


def _build_one(calls: Sequence[tuple[int, CallRecord]], history: History, owner_id: int) -> Segment:
    """One segment from calls already checked to extend each other."""
    last = calls[-1][1]
    tokens = np.concatenate([last.prompt_ids, last.output_ids]).astype(np.int32)
    n = tokens.size
    loss_mask = np.zeros((n,), np.float32)
    logprobs = np.zeros((n,), np.float32)
    media = np.fromiter(history.media_token_ids, np.int32, len(history.media_token_ids))
    shapes = {c.routed_experts.shape[1:] for _, c in calls if c.routed_experts is not None}
    if len(shapes) > 1:
        raise SegmentIntegrityError(
            owner_id, calls[0][0], 0, f"routed_experts [L, K] differ across calls: {shapes}"
        )
    routes = np.full((n, *shapes.pop()), -1, np.int32) if shapes else None
    version_ids = np.full((n,), -1, np.int32)
    table: dict[str, int] = {}
    for _, call in calls:
        start = call.prompt_ids.size
        stop = start + call.output_ids.size
        mask = np.where(np.isin(call.output_ids, media), 0.0, 1.0)
        if call.trainable is not None:
            mask[call.trainable :] = 0.0
        loss_mask[start:stop] = mask
        logprobs[start:stop] = call.output_logprobs
        pos = start
        for version, k in zip(call.weight_versions, call.part_lengths, strict=True):
            if k:  # the call's first num_generated output ids, part by part
                version_ids[pos : pos + k] = table.setdefault(version, len(table))
            pos += k
        if routes is not None and call.routed_experts is not None:
            # Row j is the route when token start + j was the input. A later call that re-routed
            # positions an earlier call covered overwrites them (the last call's prefill is one
            # consistent forward over the whole prefix).
            routes[call.routed_experts_start : stop - 1] = call.routed_experts
    return Segment(
        owner_id=owner_id,
        group_id=history.group_id,
        tokens=tokens,
        loss_mask=loss_mask,
        behavior_logprobs=logprobs,
        routed_experts=routes,
        call_indices=tuple(i for i, _ in calls),
        weight_versions=tuple(c.weight_version for _, c in calls),
        images=last.images,
        token_version_ids=version_ids,
        version_table=tuple(table),
    )


def image_runs(tokens: np.ndarray, image_token_id: int) -> int:
    """Number of maximal runs of ``image_token_id`` in ``tokens`` (one per image)."""
    hit = np.asarray(tokens) == image_token_id
    return int(np.count_nonzero(hit[1:] & ~hit[:-1]) + (hit.size > 0 and hit[0]))


def _check_images(call: CallRecord, history: History, owner_id: int, call_index: int) -> None:
    if history.image_token_id is None:
        return
    runs = image_runs(call.prompt_ids, history.image_token_id)
    if runs != len(call.images):
        raise SegmentIntegrityError(
            owner_id,
            call_index,
            0,
            f"the prompt has {runs} image-token runs but the call carries {len(call.images)} "
            "screenshots",
        )


def build_segments(history: History, *, owner_id: int | None = None) -> list[Segment]:
    """Splits an owner's calls into token-exact segments.

    Call ``c`` joins the current segment when ``prompt_c[: len(prompt_{c-1}) + len(output_{c-1})]
    == prompt_{c-1} + output_{c-1}`` and no compaction was declared before it; a declared
    compaction starts a new segment. Every call's ``routed_experts`` must have
    ``len(prompt) + len(output) - 1 - routed_experts_start`` rows; they land at positions
    ``[routed_experts_start, len(prompt) + len(output) - 1)`` of the segment.

    Args:
      history: the owner's recorded calls and compactions.
      owner_id: the logical owner index written into the segments (default ``history.owner_id``).

    Returns:
      The owner's segments in order (empty when no call was made).

    Raises:
      SegmentIntegrityError: a call breaks the prefix without a declared compaction (naming the
        owner, the call and the first differing position), or a routed-experts shape is wrong.
    """
    owner = history.owner_id if owner_id is None else owner_id
    segments: list[Segment] = []
    current: list[tuple[int, CallRecord]] = []
    sealed = False
    call_index = 0
    for event in history.events:
        if isinstance(event, Compaction):
            sealed = True
            continue
        call = event
        _check_routes(call, owner, call_index)
        _check_images(call, history, owner, call_index)
        if current and sealed:
            segments.append(_build_one(current, history, owner))
            current = []
        if current:
            prev = current[-1][1]
            context = np.concatenate([prev.prompt_ids, prev.output_ids])
            pos = _first_difference(context, call.prompt_ids)
            if pos < context.size:
                got = int(call.prompt_ids[pos]) if pos < call.prompt_ids.size else "end of prompt"
                raise SegmentIntegrityError(
                    owner,
                    call_index,
                    pos,
                    f"expected token {int(context[pos])}, got {got}; previous prompt+output has "
                    f"{context.size} tokens, this prompt {call.prompt_ids.size}",
                )
            if call.images[: len(prev.images)] != prev.images:
                raise SegmentIntegrityError(
                    owner,
                    call_index,
                    0,
                    f"the prompt's {len(call.images)} screenshots do not start with the previous "
                    f"call's {len(prev.images)} (only a declared compaction may change them)",
                )
        current.append((call_index, call))
        sealed = False
        call_index += 1
    if current:
        segments.append(_build_one(current, history, owner))
    return segments
