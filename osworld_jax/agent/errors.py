"""Typed errors of the agent room."""

from __future__ import annotations

from osworld_jax.errors import InfraError, OsworldJaxError
from osworld_jax.model.errors import ChatTemplateError

__all__ = [
    "AgentCallError",
    "ChatTemplateError",
    "ContextOverflowError",
    "GroupPolicyError",
    "PackingError",
    "SegmentIntegrityError",
    "WeightVersionError",
]


class ContextOverflowError(OsworldJaxError):
    """Even a fully compacted context (one observation, no a11y tree) exceeds the prompt budget.

    The system prompt plus the instruction are longer than
    ``max_context_tokens - reserved_generation_tokens``: a configuration problem, not data.
    """


class AgentCallError(InfraError):
    """A model call failed in transport or returned an unusable reply: the owner is failed."""


class SegmentIntegrityError(OsworldJaxError):
    """An owner's calls do not extend each other token-exactly and no compaction was declared.

    Fatal: the rows would not be the tokens the server saw.

    Attributes:
      owner_id: the logical owner.
      call_index: index of the call whose prompt breaks the prefix.
      position: first differing token position (in the segment's token coordinates).
    """

    def __init__(self, owner_id: int, call_index: int, position: int, detail: str) -> None:
        super().__init__(
            f"owner {owner_id}: call {call_index} breaks the token prefix of its segment at "
            f"position {position} without a declared compaction ({detail})"
        )
        self.owner_id = owner_id
        self.call_index = call_index
        self.position = position


class WeightVersionError(OsworldJaxError, ValueError):
    """A weight version is not a step number (the message names the owner and the version)."""


class PackingError(OsworldJaxError):
    """Rows cannot be packed (a row longer than the largest bucket, inconsistent shapes)."""


class GroupPolicyError(OsworldJaxError):
    """Too few prompt groups survive the group policy for a step (or a drop under ``fail``)."""
