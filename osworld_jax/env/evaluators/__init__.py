"""OSWorld evaluators: metrics, getters and the scoring of a finished episode (no jax).

Importing this package registers every metric and getter (``METRICS``, ``GETTERS``); the modules
follow upstream's files: ``metrics`` (general, vscode text), ``table``/``sheets`` (Calc),
``docs`` (Writer), ``slides`` (Impress), ``images`` (GIMP), ``media`` (VLC, audio, video),
``browser`` (Chrome), ``files`` (PDF, archives, configs), ``system`` (OS, Thunderbird, a11y).
"""

from osworld_jax.env.evaluators import browser as _browser  # noqa: F401 - registers metrics
from osworld_jax.env.evaluators import docs as _docs  # noqa: F401
from osworld_jax.env.evaluators import files as _files  # noqa: F401
from osworld_jax.env.evaluators import getters as _getters  # noqa: F401 - registers getters
from osworld_jax.env.evaluators import getters_apps as _getters_apps  # noqa: F401
from osworld_jax.env.evaluators import getters_chrome as _getters_chrome  # noqa: F401
from osworld_jax.env.evaluators import images as _images  # noqa: F401
from osworld_jax.env.evaluators import media as _media  # noqa: F401
from osworld_jax.env.evaluators import metrics as _metrics  # noqa: F401
from osworld_jax.env.evaluators import relative_time as _relative_time  # noqa: F401
from osworld_jax.env.evaluators import slides as _slides  # noqa: F401
from osworld_jax.env.evaluators import system as _system  # noqa: F401
from osworld_jax.env.evaluators import table as _table  # noqa: F401
from osworld_jax.env.evaluators.evaluate import RetryingVM, evaluate_task
from osworld_jax.env.evaluators.registry import (
    GETTERS,
    METRICS,
    EvalContext,
    option_checker,
)

__all__ = [
    "GETTERS",
    "METRICS",
    "EvalContext",
    "RetryingVM",
    "evaluate_task",
    "option_checker",
]
