"""osworld_jax.rl: the RL loop that wires the rooms together (see docs/INTERFACES.md)."""

from osworld_jax.rl.config import (
    ExperimentConfig,
    MeshConfig,
    ModelSourceConfig,
    RLConfig,
    ServerConfig,
)
from osworld_jax.rl.loop import TrainResult, train
from osworld_jax.rl.preflight import run_preflight

__all__ = [
    "ExperimentConfig",
    "MeshConfig",
    "ModelSourceConfig",
    "RLConfig",
    "ServerConfig",
    "TrainResult",
    "run_preflight",
    "train",
]
