"""osworld_jax.model: the Qwen3-MoE / Qwen3-VL-MoE policy in Flax NNX (see docs/INTERFACES.md).

Public face: configs, the policy and its pure `forward`, KV cache, HF checkpoint I/O, the tiny
checkpoint builder, R3 validation, expert backends, sharding rules, the frozen-router label, and
the jax-free image processor / M-RoPE positions.

The jax-free names (configs, errors, `ImageProcessor`, `mrope_positions`) are imported eagerly;
everything that needs jax is imported on first use (PEP 562), so the agent room can import
``osworld_jax.model`` (or ``osworld_jax.model.processor``) without importing jax.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from osworld_jax.model.config import SUPPORTED_ROPE_TYPES, ModelRuntimeConfig, Qwen3MoeConfig
from osworld_jax.model.errors import (
    CheckpointError,
    ImageInputError,
    ModelConfigError,
    RouterReplayError,
)
from osworld_jax.model.mrope import mrope_positions
from osworld_jax.model.processor import ImageProcessor, smart_resize
from osworld_jax.model.vl_config import Qwen3VLMoeConfig, VisionConfig

if TYPE_CHECKING:
    from osworld_jax.model.freeze import (
        is_frozen_name,
        is_router_path,
        is_vision_path,
        param_labels,
        router_param_labels,
    )
    from osworld_jax.model.hf_io import load_hf_checkpoint, save_hf_checkpoint
    from osworld_jax.model.moe import EXPERT_BACKENDS
    from osworld_jax.model.policy import (
        KVCache,
        Policy,
        PolicyOutput,
        forward,
        init_kv_cache,
        unembed_matrix,
    )
    from osworld_jax.model.remat import REMAT_POLICIES
    from osworld_jax.model.replay import validate_replay
    from osworld_jax.model.sharding import (
        ShardingRules,
        make_mesh,
        param_shardings,
        policy_shardings,
    )
    from osworld_jax.model.tiny import make_tiny_checkpoint

# name -> module of the names that import jax (resolved on first attribute access).
_LAZY = {
    "EXPERT_BACKENDS": "moe",
    "REMAT_POLICIES": "remat",
    "KVCache": "policy",
    "Policy": "policy",
    "PolicyOutput": "policy",
    "forward": "policy",
    "init_kv_cache": "policy",
    "unembed_matrix": "policy",
    "is_frozen_name": "freeze",
    "is_router_path": "freeze",
    "is_vision_path": "freeze",
    "param_labels": "freeze",
    "router_param_labels": "freeze",
    "load_hf_checkpoint": "hf_io",
    "save_hf_checkpoint": "hf_io",
    "validate_replay": "replay",
    "ShardingRules": "sharding",
    "make_mesh": "sharding",
    "param_shardings": "sharding",
    "policy_shardings": "sharding",
    "make_tiny_checkpoint": "tiny",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'osworld_jax.model' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"osworld_jax.model.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "EXPERT_BACKENDS",
    "REMAT_POLICIES",
    "SUPPORTED_ROPE_TYPES",
    "CheckpointError",
    "ImageInputError",
    "ImageProcessor",
    "KVCache",
    "ModelConfigError",
    "ModelRuntimeConfig",
    "Policy",
    "PolicyOutput",
    "Qwen3MoeConfig",
    "Qwen3VLMoeConfig",
    "RouterReplayError",
    "ShardingRules",
    "VisionConfig",
    "forward",
    "init_kv_cache",
    "is_frozen_name",
    "is_router_path",
    "is_vision_path",
    "load_hf_checkpoint",
    "make_mesh",
    "make_tiny_checkpoint",
    "mrope_positions",
    "param_labels",
    "param_shardings",
    "policy_shardings",
    "router_param_labels",
    "save_hf_checkpoint",
    "smart_resize",
    "unembed_matrix",
    "validate_replay",
]
