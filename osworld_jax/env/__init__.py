"""osworld_jax.env room: OSWorld tasks, sandboxes, AgentEnv, actions, evaluators (no jax).

See docs/INTERFACES.md. The sandbox backends live in their own modules (``env.local``,
``env.remote``, ``env.osworld_adapter``; the ``memory`` test backend in ``osworld_jax.testing``)
and are found through ``BACKENDS`` (``env.backends``): ``make_backend(config_or_name)`` builds one.
"""

from osworld_jax.env.actions import Action, ActionKind, parse_action, to_pyautogui
from osworld_jax.env.agent_env import AgentEnv, AgentEnvConfig, EnvMetrics, OwnerResult
from osworld_jax.env.backend import (
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
from osworld_jax.env.backends import BACKENDS, make_backend
from osworld_jax.env.bundled import bundled_task_dir, bundled_tasks_dir
from osworld_jax.env.capabilities import (
    NotRunnable,
    Reason,
    Runnable,
    capabilities,
    runnable_tasks,
    unknown_types,
)
from osworld_jax.env.evaluators import GETTERS, METRICS, evaluate_task
from osworld_jax.env.protocol import VMProtocol
from osworld_jax.env.setup import SETUP_STEPS, run_setup
from osworld_jax.env.tasks import (
    EvaluatorSpec,
    GetterSpec,
    SetupStep,
    Task,
    TaskFormatError,
    load_task,
    load_tasks,
)
from osworld_jax.env.vm_sandbox import VMSandbox

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
    "GetterSpec",
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
    "VMSandbox",
    "bundled_task_dir",
    "bundled_tasks_dir",
    "capabilities",
    "evaluate_task",
    "load_task",
    "load_tasks",
    "make_backend",
    "parse_action",
    "run_setup",
    "runnable_tasks",
    "to_pyautogui",
    "unknown_types",
]
