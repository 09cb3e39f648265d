"""String enums and registries for the algorithm choices (estimators, loss modes, gates).

Each choice with implementations has one source of truth: a ``StrEnum`` naming the allowed
values and a :class:`~osworld_jax.registry.Registry` holding the implementation registered under
each value; the gate level is a plain choice (a ``Literal``).
The implementing modules fill the registries at import time (``osworld_jax.algorithms`` imports
them all), a duplicate registration raises ``ValueError`` and an unknown name raises
``ConfigError`` listing the choices. Config validation calls e.g.
``ESTIMATORS.validate(name, "RLConfig.estimator")``.
"""

from __future__ import annotations

import enum
import typing
from collections.abc import Callable
from typing import Any, Literal

from osworld_jax.registry import Registry, check_choice


class Estimator(enum.StrEnum):
    """Advantage estimators (``compute_advantages`` names)."""

    GRPO = "grpo"
    DR_GRPO = "dr_grpo"
    RLOO = "rloo"
    REINFORCE_BASELINE = "reinforce_baseline"
    BATCH_MEAN = "batch_mean"


class LossAggMode(enum.StrEnum):
    """Loss aggregation modes (``aggregate_loss(mode=...)``)."""

    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"
    PROMPT_MEAN_TOKEN_MEAN = "prompt-mean-token-mean"


class Gate(enum.StrEnum):
    """Off-policy gates of ``policy_loss`` (``gate=...``)."""

    BINARY_KL = "binary_kl"
    NONE = "none"
    RATIO = "ratio"


#: Where a gate decides: one decision per row, per logical owner (all its rows), or per token
#: (a plain choice: no registry).
GateLevel = Literal["sequence", "owner", "token"]


ESTIMATORS: Registry[Callable[..., Any]] = Registry("advantage estimator")
LOSS_AGG_MODES: Registry[Callable[..., Any]] = Registry("loss aggregation mode")
GATES: Registry[Callable[..., Any]] = Registry("policy-loss gate")


def check_gate_level(level: str) -> GateLevel:
    """Returns ``level`` as a `GateLevel`; an unknown level raises ``ConfigError``."""
    check_choice(level, GateLevel, "gate_level", "gate level")
    return typing.cast(GateLevel, level)
