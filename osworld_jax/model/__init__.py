"""osworld_jax.model: the Qwen3-MoE policy in Flax NNX (see docs/INTERFACES.md).

Public face: configs, the policy and its pure `forward`, KV cache, HF checkpoint I/O, the tiny
checkpoint builder, R3 validation, expert backends, sharding rules and the frozen-router label.
"""

from osworld_jax.model.config import SUPPORTED_ROPE_TYPES, ModelRuntimeConfig, Qwen3MoeConfig
from osworld_jax.model.errors import CheckpointError, ModelConfigError, RouterReplayError
from osworld_jax.model.freeze import is_router_path, router_param_labels
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

__all__ = [
    "EXPERT_BACKENDS",
    "REMAT_POLICIES",
    "SUPPORTED_ROPE_TYPES",
    "CheckpointError",
    "KVCache",
    "ModelConfigError",
    "ModelRuntimeConfig",
    "Policy",
    "PolicyOutput",
    "Qwen3MoeConfig",
    "RouterReplayError",
    "ShardingRules",
    "forward",
    "init_kv_cache",
    "is_router_path",
    "load_hf_checkpoint",
    "make_mesh",
    "make_tiny_checkpoint",
    "param_shardings",
    "policy_shardings",
    "router_param_labels",
    "save_hf_checkpoint",
    "unembed_matrix",
    "validate_replay",
]
