"""osworld_jax.trainer: the functional trainer (see docs/INTERFACES.md).

Train state, the train step as a function (`make_train_step`), the `Trainer` that jits it on a
mesh, optax, memory-safe logprobs, orbax checkpoints.
"""

from osworld_jax.trainer.checkpoint import Checkpointer
from osworld_jax.trainer.config import CheckpointConfig, OptimizerConfig, TrainerConfig
from osworld_jax.trainer.logprobs import token_logprobs
from osworld_jax.trainer.optimizer import make_optimizer, make_schedule
from osworld_jax.trainer.state import NonFiniteError, TrainerError, TrainState
from osworld_jax.trainer.step import (
    make_gradients,
    make_logprobs,
    make_train_step,
    token_loss_weights,
)
from osworld_jax.trainer.trainer import Trainer

__all__ = [
    "CheckpointConfig",
    "Checkpointer",
    "NonFiniteError",
    "OptimizerConfig",
    "TrainState",
    "Trainer",
    "TrainerConfig",
    "TrainerError",
    "make_gradients",
    "make_logprobs",
    "make_optimizer",
    "make_schedule",
    "make_train_step",
    "token_logprobs",
    "token_loss_weights",
]
