"""The train state pytree and the trainer's typed errors."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from osworld_jax.errors import OsworldJaxError


class TrainerError(OsworldJaxError):
    """A trainer precondition failed (the message names the field or step)."""


class NonFiniteError(TrainerError, FloatingPointError):
    """The loss or the gradient norm of a step is NaN/Inf; the update was not applied.

    Attributes:
      step: the optimizer step whose loss/gradients were not finite.
      metrics: that step's metrics (host floats), for the post-mortem.
      state: the train state returned by the step (the input state was donated): equal to the
        state before the step, so a caller may checkpoint it or continue with other data.
    """

    def __init__(self, step: int, metrics: dict[str, float], *, state: Any = None):
        bad = sorted(k for k in ("loss", "grad_norm") if not _finite(metrics.get(k, 0.0)))
        super().__init__(
            f"train step {step}: non-finite {', '.join(bad) or 'values'} "
            f"(loss={metrics.get('loss')}, grad_norm={metrics.get('grad_norm')}); "
            "the update was skipped and the state is that of step "
            f"{step}"
        )
        self.step = step
        self.metrics = metrics
        self.state = state


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything an optimizer step reads and writes (a pytree; checkpointed whole).

    Attributes:
      params: the trainable parameters as a nested dict ``{group: {name: array}}`` (the
        ``nnx.Param`` state of the policy in pure-dict form), in ``TrainerConfig.master_dtype``.
      opt_state: the optax state of those parameters.
      step: i32[] optimizer steps taken.
      weight_version: i32[] version of the weights (incremented by every applied update), the
        number the RL loop hands to the rollout engine on refit.
    """

    # Leaves are arrays; the same structure also carries shardings / ShapeDtypeStructs.
    params: Any
    opt_state: Any
    step: Any
    weight_version: Any

    def replace(self, **changes: Any) -> TrainState:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)
