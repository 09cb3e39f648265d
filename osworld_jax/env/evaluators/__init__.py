"""OSWorld evaluators: metrics, getters and the scoring of a finished episode (no jax)."""

from osworld_jax.env.evaluators import getters as _getters  # noqa: F401 - registers getters
from osworld_jax.env.evaluators import metrics as _metrics  # noqa: F401 - registers metrics
from osworld_jax.env.evaluators import relative_time as _relative_time  # noqa: F401
from osworld_jax.env.evaluators import table as _table  # noqa: F401 - registers compare_table
from osworld_jax.env.evaluators.evaluate import RetryingVM, evaluate_task
from osworld_jax.env.evaluators.registry import (
    GETTERS,
    METRICS,
    EvalContext,
    UnsupportedOption,
    option_checker,
)

__all__ = [
    "GETTERS",
    "METRICS",
    "EvalContext",
    "RetryingVM",
    "UnsupportedOption",
    "evaluate_task",
    "option_checker",
]
