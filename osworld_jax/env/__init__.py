"""osworld_jax.env room: OSWorld tasks, sandboxes, AgentEnv, actions, evaluators (no jax).

See docs/INTERFACES.md. Backends register in ``BACKENDS``: ``memory`` (``testing``) on import;
``local`` when ``osworld_jax.env.local`` is imported (``load_backends`` / ``make_backend`` do it;
``LocalBackend`` is importable from here lazily).
"""

from __future__ import annotations

import importlib
from typing import Any

from osworld_jax.env.actions import Action, ActionKind, parse_action, to_pyautogui
from osworld_jax.env.agent_env import AgentEnv, AgentEnvConfig, EnvMetrics, OwnerResult
from osworld_jax.env.backend import (
    BACKENDS,
    Observation,
    PreflightError,
    Sandbox,
    SandboxBackend,
    SandboxCreateError,
    SandboxError,
    SandboxEvalError,
    SandboxStepError,
    SandboxTimeout,
)
from osworld_jax.env.bundled import bundled_task_dir, bundled_tasks_dir
from osworld_jax.env.evaluators import GETTERS, METRICS, evaluate_task
from osworld_jax.env.protocol import VMProtocol
from osworld_jax.env.setup import SETUP_STEPS, run_setup
from osworld_jax.env.tasks import (
    EvaluatorSpec,
    GetterSpec,
    NotRunnable,
    Reason,
    Runnable,
    SetupStep,
    Task,
    TaskFormatError,
    capabilities,
    load_task,
    load_tasks,
)
from osworld_jax.env.testing import FaultInjectingBackend, MemoryBackend, word_task

# Backends living in optional sub-packages: name -> module that registers it on import.
_OPTIONAL_BACKENDS = {"local": "osworld_jax.env.local"}


def load_backends() -> None:
    """Imports the optional backend packages so that they register in ``BACKENDS``."""
    for name, module in _OPTIONAL_BACKENDS.items():
        if name not in BACKENDS:
            importlib.import_module(module)


def make_backend(name: str, *args: Any, **kwargs: Any) -> SandboxBackend:
    """Constructs the backend registered as ``name`` (loading optional backends first)."""
    if name in _OPTIONAL_BACKENDS:
        load_backends()
    return BACKENDS.get(name)(*args, **kwargs)


def __getattr__(name: str) -> Any:
    if name in ("LocalBackend", "LocalBackendConfig"):
        return getattr(importlib.import_module("osworld_jax.env.local"), name)
    raise AttributeError(f"module 'osworld_jax.env' has no attribute {name!r}")


__all__ = [
    "BACKENDS",
    "GETTERS",
    "METRICS",
    "SETUP_STEPS",
    "Action",
    "ActionKind",
    "AgentEnv",
    "AgentEnvConfig",
    "EnvMetrics",
    "EvaluatorSpec",
    "FaultInjectingBackend",
    "GetterSpec",
    "MemoryBackend",
    "NotRunnable",
    "Observation",
    "OwnerResult",
    "PreflightError",
    "Reason",
    "Runnable",
    "Sandbox",
    "SandboxBackend",
    "SandboxCreateError",
    "SandboxError",
    "SandboxEvalError",
    "SandboxStepError",
    "SandboxTimeout",
    "SetupStep",
    "Task",
    "TaskFormatError",
    "VMProtocol",
    "bundled_task_dir",
    "bundled_tasks_dir",
    "capabilities",
    "evaluate_task",
    "load_backends",
    "load_task",
    "load_tasks",
    "make_backend",
    "parse_action",
    "run_setup",
    "to_pyautogui",
    "word_task",
]
