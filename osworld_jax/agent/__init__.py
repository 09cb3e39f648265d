"""osworld_jax.agent room: prompts, context compaction, history -> segments -> batches.

See docs/INTERFACES.md. NumPy only: no jax import.
"""

from osworld_jax.agent.batching import (
    GroupSelection,
    VisionPacking,
    bucket_length,
    pack_batch,
    select_groups,
    split_selection,
)
from osworld_jax.agent.config import (
    AgentConfig,
    BaselinePopulation,
    CompactionConfig,
    GroupPolicyConfig,
    OnDroppedGroup,
)
from osworld_jax.agent.context import ContextManager, Screenshot
from osworld_jax.agent.errors import (
    AgentCallError,
    ChatTemplateError,
    ContextOverflowError,
    GroupPolicyError,
    PackingError,
    SegmentIntegrityError,
    WeightVersionError,
)
from osworld_jax.agent.history import CallRecord, Compaction, History
from osworld_jax.agent.owner import (
    GenerateClient,
    OwnerAgent,
    OwnerRollout,
    weight_version_number,
)
from osworld_jax.agent.prompts import render_observation, system_prompt
from osworld_jax.agent.segments import Segment, build_segments
from osworld_jax.agent.tokenizer import AgentTokenizer
from osworld_jax.model.chat_template import QWEN_CHAT_TEMPLATE, ChatTemplate

__all__ = [
    "QWEN_CHAT_TEMPLATE",
    "AgentCallError",
    "AgentConfig",
    "AgentTokenizer",
    "BaselinePopulation",
    "CallRecord",
    "ChatTemplate",
    "ChatTemplateError",
    "Compaction",
    "CompactionConfig",
    "ContextManager",
    "ContextOverflowError",
    "GenerateClient",
    "GroupPolicyConfig",
    "GroupPolicyError",
    "GroupSelection",
    "OnDroppedGroup",
    "History",
    "OwnerAgent",
    "OwnerRollout",
    "PackingError",
    "Screenshot",
    "Segment",
    "SegmentIntegrityError",
    "VisionPacking",
    "WeightVersionError",
    "bucket_length",
    "build_segments",
    "pack_batch",
    "render_observation",
    "select_groups",
    "split_selection",
    "system_prompt",
    "weight_version_number",
]
