"""osworld_jax.env room: OSWorld tasks, sandboxes, AgentEnv, actions, evaluators (no jax).

See docs/INTERFACES.md. Public names are imported on first use. Backends register in
``BACKENDS`` when their module is imported: ``memory`` (``osworld_jax.env.testing``), ``local``
(``osworld_jax.env.local``), ``remote`` (``osworld_jax.env.remote``) and ``osworld``
(``osworld_jax.env.osworld_adapter``); ``load_backends()`` / ``make_backend(name)`` import them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from osworld_jax.env.backend import BACKENDS

if TYPE_CHECKING:
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
    from osworld_jax.env.osworld_adapter import OSWorldBackend, OSWorldBackendConfig
    from osworld_jax.env.protocol import VMProtocol
    from osworld_jax.env.remote import RemoteBackend, RemoteBackendConfig
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
        runnable_tasks,
    )
    from osworld_jax.env.testing import (
        FaultInjectingBackend,
        MemoryBackend,
        word_task,
        write_word_tasks,
    )

# Public names, imported on first use (keeps ``python -m osworld_jax.env.tasks`` clean).
_EXPORTS = {
    "Action": "osworld_jax.env.actions",
    "ActionKind": "osworld_jax.env.actions",
    "AgentEnv": "osworld_jax.env.agent_env",
    "AgentEnvConfig": "osworld_jax.env.agent_env",
    "BACKENDS": "osworld_jax.env.backend",
    "EnvMetrics": "osworld_jax.env.agent_env",
    "EvaluatorSpec": "osworld_jax.env.tasks",
    "FaultInjectingBackend": "osworld_jax.env.testing",
    "GETTERS": "osworld_jax.env.evaluators",
    "GetterSpec": "osworld_jax.env.tasks",
    "METRICS": "osworld_jax.env.evaluators",
    "MemoryBackend": "osworld_jax.env.testing",
    "NotRunnable": "osworld_jax.env.tasks",
    "Observation": "osworld_jax.env.backend",
    "OwnerResult": "osworld_jax.env.agent_env",
    "PreflightError": "osworld_jax.env.backend",
    "Reason": "osworld_jax.env.tasks",
    "Runnable": "osworld_jax.env.tasks",
    "SETUP_STEPS": "osworld_jax.env.setup",
    "Sandbox": "osworld_jax.env.backend",
    "SandboxBackend": "osworld_jax.env.backend",
    "SandboxCreateError": "osworld_jax.env.backend",
    "SandboxError": "osworld_jax.env.backend",
    "SandboxEvalError": "osworld_jax.env.backend",
    "SandboxStepError": "osworld_jax.env.backend",
    "SandboxTimeout": "osworld_jax.env.backend",
    "SetupStep": "osworld_jax.env.tasks",
    "Task": "osworld_jax.env.tasks",
    "TaskFormatError": "osworld_jax.env.tasks",
    "VMProtocol": "osworld_jax.env.protocol",
    "bundled_task_dir": "osworld_jax.env.bundled",
    "bundled_tasks_dir": "osworld_jax.env.bundled",
    "capabilities": "osworld_jax.env.tasks",
    "evaluate_task": "osworld_jax.env.evaluators",
    "load_task": "osworld_jax.env.tasks",
    "load_tasks": "osworld_jax.env.tasks",
    "parse_action": "osworld_jax.env.actions",
    "run_setup": "osworld_jax.env.setup",
    "runnable_tasks": "osworld_jax.env.tasks",
    "to_pyautogui": "osworld_jax.env.actions",
    "word_task": "osworld_jax.env.testing",
    "write_word_tasks": "osworld_jax.env.testing",
    "RemoteBackend": "osworld_jax.env.remote",
    "RemoteBackendConfig": "osworld_jax.env.remote",
    "OSWorldBackend": "osworld_jax.env.osworld_adapter",
    "OSWorldBackendConfig": "osworld_jax.env.osworld_adapter",
}

# Backends living in optional sub-packages: name -> module that registers it on import.
_OPTIONAL_BACKENDS = {
    "local": "osworld_jax.env.local",
    "memory": "osworld_jax.env.testing",
    "remote": "osworld_jax.env.remote",
    "osworld": "osworld_jax.env.osworld_adapter",
}


def load_backends(*names: str) -> None:
    """Imports optional backend packages (all, or those of ``names``) so they register."""
    for name, module in _OPTIONAL_BACKENDS.items():
        if name not in BACKENDS and (not names or name in names):
            importlib.import_module(module)


def make_backend(name: str, *args: Any, **kwargs: Any) -> Any:
    """Constructs the backend registered as ``name`` (loading optional backends first)."""
    load_backends(name)
    return BACKENDS.get(name)(*args, **kwargs)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
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
    "runnable_tasks",
    "word_task",
    "write_word_tasks",
    "RemoteBackend",
    "RemoteBackendConfig",
    "OSWorldBackend",
    "OSWorldBackendConfig",
]
