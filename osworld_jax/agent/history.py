"""What an owner's rollout records: every model call, exactly, and every declared compaction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True, kw_only=True, eq=False)
class CallRecord:
    """One model call, exactly as the server saw and answered it.

    Attributes:
      prompt_ids: i32[P] the input ids sent (image placeholders expanded: one
        ``<|image_pad|>`` per image token).
      output_ids: i32[O] the generated ids as the context keeps them: a generated media token
        (``<|image_pad|>``, ...) is replaced by the ids of its text, so that no placeholder
        without an image reaches a later prompt.
      output_logprobs: f32[O] the engine's logprob of each generated id (0 from the first
        replaced media token on).
      routed_experts: i32[P + O - 1 - S, L, K]: row j is the route when token ``S + j`` of
        (prompt + output) was the input (the last generated token has none), or None when routes
        were not requested.
      finish_reason: the server's finish reason (``{"type": "stop" | "length", ...}``).
      weight_version: the policy version that generated the reply (its final part).
      rid: the request id.
      text: the decoded reply the env received.
      routed_experts_start: S, the first position with a route row (the agent asks only for the
        positions its segment has no route for yet).
      images: the PNG screenshots of the prompt's images, in placeholder order (sent as
        SGLang's ``image_data``).
      trainable: the leading output ids that are exactly what the model generated in this
        context (the rest follow a replaced media token: their context changed, so they get
        loss mask 0 and their route rows are -1); None: all of them.
      weight_versions: the weight version of each run of the generated ids kept as-is (the
        first ``trainable`` output ids, or all): one run per part of a stitched reply (a refit
        aborted it and it was resubmitted), ``Generation.weight_versions``.
      part_lengths: the runs' lengths (``Generation.part_lengths`` cut to the kept prefix);
        they sum to the number of ids kept as-is. Default for both: one run of
        ``weight_version``. `output_weight_versions` expands them per token.
    """

    prompt_ids: np.ndarray
    output_ids: np.ndarray
    output_logprobs: np.ndarray
    routed_experts: np.ndarray | None
    finish_reason: dict[str, Any]
    weight_version: str
    rid: str = ""
    text: str = ""
    routed_experts_start: int = 0
    images: tuple[bytes, ...] = ()
    trainable: int | None = None
    weight_versions: tuple[str, ...] = ()
    part_lengths: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "images", tuple(self.images))
        object.__setattr__(self, "prompt_ids", np.asarray(self.prompt_ids, np.int32).reshape(-1))
        object.__setattr__(self, "output_ids", np.asarray(self.output_ids, np.int32).reshape(-1))
        object.__setattr__(
            self, "output_logprobs", np.asarray(self.output_logprobs, np.float32).reshape(-1)
        )
        if self.routed_experts is not None:
            object.__setattr__(self, "routed_experts", np.asarray(self.routed_experts, np.int32))
        n = self.num_generated
        versions = tuple(self.weight_versions) or (self.weight_version,)
        lengths = tuple(self.part_lengths) or ((n,) if len(versions) == 1 else ())
        object.__setattr__(self, "weight_versions", versions)
        object.__setattr__(self, "part_lengths", lengths)
        problem = None
        if len(versions) != len(lengths):
            problem = f"{len(versions)} weight versions but {len(lengths)} part lengths"
        elif not all(isinstance(v, str) for v in versions):
            problem = f"weight versions {versions!r} are not all strings"
        elif any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in lengths):
            problem = f"part lengths {lengths!r} are not all non-negative ints"
        elif sum(lengths) != n:
            problem = f"part lengths {lengths!r} sum to {sum(lengths)}, not {n} generated ids"
        if problem is not None:
            raise ValueError(f"call {self.rid!r}: {problem}")

    @property
    def num_generated(self) -> int:
        """Output ids that are exactly what the model generated (``trainable``, else all)."""
        n = int(self.output_ids.size)
        return n if self.trainable is None else min(int(self.trainable), n)

    def output_weight_versions(self) -> tuple[str, ...]:
        """The weight version of each of the first `num_generated` output ids.

        ``weight_versions[i]`` repeated ``part_lengths[i]`` times, in order: a reply aborted
        by a refit after 3 ids and finished with 2 more gives ``("0", "0", "0", "1", "1")``.
        """
        return tuple(
            v
            for v, k in zip(self.weight_versions, self.part_lengths, strict=True)
            for _ in range(k)
        )

    @property
    def length(self) -> int:
        """Prompt plus output tokens."""
        return int(self.prompt_ids.size + self.output_ids.size)


@dataclass(frozen=True, kw_only=True)
class Compaction:
    """A declared context rewrite: the call ``before_call`` starts a new segment.

    Attributes:
      before_call: index of the first call made with the rewritten context.
      reason: ``every_k_actions``, ``budget``, or ``screenshots`` (the new observation's
        screenshot would pass ``AgentConfig.max_screenshots``: the oldest one shown becomes a
        text placeholder).
      dropped_observations: observations replaced by the compact action history (cumulative over
        the episode: every observation before the first kept one).
      kept_observations: observations kept verbatim (the current one included).
      tokens_before: length of the context the rewrite replaced (what the next prompt would have
        extended).
      tokens_after: length of the rewritten prompt.
      screenshots: screenshots the rewritten prompt shows.
    """

    before_call: int
    reason: str
    dropped_observations: int
    kept_observations: int
    tokens_before: int
    tokens_after: int
    screenshots: int = 0


@dataclass(kw_only=True)
class History:
    """An owner's ordered calls and compactions.

    Attributes:
      owner_id: the logical owner.
      group_id: the owner's prompt group.
      media_token_ids: ids of media placeholder tokens (masked out of the loss when generated).
      image_token_id: the ``<|image_pad|>`` id when prompts carry images (segments check that
        their images fill their placeholder runs), else None.
      events: calls and compactions in the order they happened.
    """

    owner_id: int
    group_id: int
    media_token_ids: frozenset[int] = frozenset()
    image_token_id: int | None = None
    events: list[CallRecord | Compaction] = field(default_factory=list)

    @property
    def calls(self) -> list[CallRecord]:
        """The calls, in order."""
        return [e for e in self.events if isinstance(e, CallRecord)]

    @property
    def compactions(self) -> list[Compaction]:
        """The declared compactions, in order."""
        return [e for e in self.events if isinstance(e, Compaction)]

    @property
    def num_calls(self) -> int:
        """Number of calls recorded."""
        return sum(isinstance(e, CallRecord) for e in self.events)

    def record_call(self, call: CallRecord) -> None:
        """Appends a call."""
        self.events.append(call)

    def declare_compaction(self, compaction: Compaction) -> None:
        """Declares that the next call starts a rewritten context."""
        if compaction.before_call != self.num_calls:
            raise ValueError(
                f"owner {self.owner_id}: compaction before call {compaction.before_call} declared "
                f"after {self.num_calls} calls"
            )
        self.events.append(compaction)
