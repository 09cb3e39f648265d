"""The ``osworld`` sandbox backend: an adapter over upstream OSWorld's ``desktop_env`` package.

For users who already run OSWorld VMs (docker, vmware, virtualbox, aws, ... providers): each
sandbox is one upstream ``desktop_env.desktop_env.DesktopEnv`` (the optional extra
``osworld_jax[osworld]`` installs ``desktop-env``). Upstream is synchronous, so every call runs
in this backend's thread pool: ``DesktopEnv(provider_name=..., path_to_vm=..., action_space=
"pyautogui", ...)``, ``reset(task_config=<the task's JSON>)`` (upstream runs the task's setup),
``step(action, pause)``, ``evaluate()`` and ``close()``.

Actions: pyautogui code is passed as is, computer_13 actions are lowered to pyautogui code
(``to_pyautogui``, as the ``local`` backend does), WAIT/DONE/FAIL as upstream's special strings.
AgentEnv never steps a terminal action, but upstream's ``evaluate`` reads the last action from
its own history (FAIL scores 0, or 1 for ``infeasible``), so ``evaluate`` first steps a final
DONE/FAIL with no pause.

Fork: upstream providers revert ONE VM to a named snapshot in place; none clones a running
desktop. So ``fork(sandbox, n)`` starts n fresh ``DesktopEnv``s and resets each to the same task
(the full setup runs n times): ``metrics.forks_by_reset`` counts them (``forks_by_snapshot`` stays
0). Setups that fetch live web content may therefore differ between forks.

Errors: constructor/reset failures raise ``SandboxCreateError``, step failures
``SandboxStepError``, evaluate failures ``SandboxEvalError`` (each masks the owner in AgentEnv).
A cancelled create cannot stop upstream's blocking call; the worker closes the VM as soon as the
call returns, and ``aclose()`` closes whatever is still open.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import importlib
import itertools
import json
import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from osworld_jax.env.actions import Action, ActionKind, to_pyautogui
from osworld_jax.env.backend import (
    Observation,
    PreflightError,
    Sandbox,
    SandboxBackend,
    SandboxCreateError,
    SandboxEvalError,
    SandboxStepError,
)
from osworld_jax.errors import ConfigError

if TYPE_CHECKING:
    from osworld_jax.env.tasks import Task

__all__ = [
    "OSWorldBackend",
    "OSWorldBackendConfig",
    "OSWorldMetrics",
    "OSWorldSandbox",
    "task_config_dict",
]

_log = logging.getLogger(__name__)
T = TypeVar("T")

UPSTREAM_MODULE = "desktop_env.desktop_env"
VM_PATH_PROVIDERS = frozenset({"vmware", "virtualbox"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class OSWorldBackendConfig:
    """How the ``osworld`` backend builds upstream ``DesktopEnv``s.

    Attributes:
      provider_name: upstream's VM provider (``docker``, ``vmware``, ``virtualbox``, ``aws``...).
      path_to_vm: the VM image/file (vmware ``.vmx``, ...); None lets the provider pick/download.
      region: the cloud region for cloud providers; None = upstream's default.
      snapshot_name: the VM snapshot upstream reverts to before a task.
      os_type: the guest OS (upstream: ``Ubuntu``).
      screen_width: the VM's screen width in pixels.
      screen_height: the VM's screen height in pixels.
      headless: run the VM without a window.
      require_a11y_tree: fetch the accessibility tree with each observation.
      require_terminal: fetch the terminal's text with each observation.
      cache_dir: upstream's task file cache directory.
      step_pause_s: upstream's pause after each action before observing (``step(pause=...)``).
      max_workers: threads for upstream's blocking calls (bounds concurrent VM operations).
      extra_kwargs: further (name, value) keyword arguments of ``DesktopEnv`` (e.g.
        ``("enable_proxy", True)``), passed as is.
    """

    provider_name: str = "docker"
    path_to_vm: str | None = None
    region: str | None = None
    snapshot_name: str = "init_state"
    os_type: str = "Ubuntu"
    screen_width: int = 1920
    screen_height: int = 1080
    headless: bool = True
    require_a11y_tree: bool = True
    require_terminal: bool = False
    cache_dir: str = "cache"
    step_pause_s: float = 2.0
    max_workers: int = 32
    extra_kwargs: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if not self.provider_name:
            raise ConfigError("OSWorldBackendConfig.provider_name is required")
        if self.max_workers < 1:
            raise ConfigError(
                f"OSWorldBackendConfig.max_workers must be >= 1, got {self.max_workers}"
            )
        if self.step_pause_s < 0:
            raise ConfigError("OSWorldBackendConfig.step_pause_s must be >= 0")

    def env_kwargs(self) -> dict[str, Any]:
        """The ``DesktopEnv(...)`` keyword arguments."""
        kw: dict[str, Any] = {
            "provider_name": self.provider_name,
            "path_to_vm": self.path_to_vm,
            "snapshot_name": self.snapshot_name,
            "action_space": "pyautogui",
            "cache_dir": self.cache_dir,
            "screen_size": (self.screen_width, self.screen_height),
            "headless": self.headless,
            "require_a11y_tree": self.require_a11y_tree,
            "require_terminal": self.require_terminal,
            "os_type": self.os_type,
        }
        if self.region is not None:
            kw["region"] = self.region
        kw.update(dict(self.extra_kwargs))
        return kw


@dataclasses.dataclass
class OSWorldMetrics:
    """Counters of the ``osworld`` backend.

    Attributes:
      creates: DesktopEnvs created and reset for a task.
      forks_by_reset: forks made as fresh DesktopEnvs reset to the task (upstream cannot clone).
      forks_by_snapshot: always 0 (kept so run metrics compare with the remote backend).
      closes: DesktopEnvs closed.
    """

    creates: int = 0
    forks_by_reset: int = 0
    forks_by_snapshot: int = 0
    closes: int = 0

    def as_dict(self) -> dict[str, int]:
        """The counters keyed ``sandbox/<name>``."""
        return {f"sandbox/{k}": v for k, v in dataclasses.asdict(self).items()}


def task_config_dict(task: Task) -> dict[str, Any]:
    """The task as upstream's ``task_config`` JSON object (the file itself when there is one)."""
    if task.path is not None and Path(task.path).is_file():
        return dict(json.loads(Path(task.path).read_text(encoding="utf-8")))
    ev = task.evaluator

    def getter(g: Any) -> dict[str, Any] | None:
        return None if g is None else {"type": g.type, **dict(g.params)}

    def one_or_list(values: list[Any]) -> Any:
        return values[0] if len(values) == 1 else values

    evaluator: dict[str, Any] = {"func": one_or_list(list(ev.func))}
    results = [getter(g) for g in ev.result]
    if any(r is not None for r in results):
        evaluator["result"] = one_or_list(results)
    expected = [getter(g) for g in ev.expected]
    if any(e is not None for e in expected):
        evaluator["expected"] = one_or_list(expected)
    if any(ev.options):
        evaluator["options"] = one_or_list([dict(o) for o in ev.options])
    if len(ev.func) > 1:
        evaluator["conj"] = ev.conj
    if ev.postconfig:
        evaluator["postconfig"] = [
            {"type": s.type, "parameters": dict(s.parameters)} for s in ev.postconfig
        ]
    return {
        "id": task.id,
        "snapshot": task.snapshot,
        "instruction": task.instruction,
        "source": task.source,
        "config": [{"type": s.type, "parameters": dict(s.parameters)} for s in task.config],
        "evaluator": evaluator,
        "related_apps": list(task.related_apps),
        "proxy": task.proxy,
        "fixed_ip": task.fixed_ip,
        "possibility_of_env_change": task.possibility_of_env_change,
    }


def _upstream_action(action: Action) -> str:
    if action.kind == ActionKind.PYAUTOGUI:
        return action.code
    if action.kind == ActionKind.COMPUTER_13:
        return to_pyautogui(action)
    return str(action.kind.value)  # WAIT / DONE / FAIL


class OSWorldSandbox(Sandbox):
    """One upstream ``DesktopEnv`` reset to one task.

    Attributes:
      id: this backend's id of the env.
      task: the task.
      env: the upstream ``DesktopEnv``.
    """

    def __init__(self, backend: OSWorldBackend, sid: str, task: Task, env: Any, obs: Any) -> None:
        self.id = sid
        self.task = task
        self.env = env
        self._backend = backend
        self._obs = obs
        self._terminal_stepped = False
        self._closing: asyncio.Future[None] | None = None

    def _observation(self, obs: Any) -> Observation:
        if not isinstance(obs, dict):
            raise SandboxStepError(
                f"sandbox {self.id}: upstream observation is not a dict: {obs!r:.100}"
            )
        shot = obs.get("screenshot")
        return Observation(
            screenshot=bytes(shot) if shot is not None else None,
            a11y_tree=obs.get("accessibility_tree") or "",
            terminal=obs.get("terminal") or "",
            instruction=obs.get("instruction") or self.task.instruction,
        )

    async def observe(self) -> Observation:
        """The latest observation (from reset or the last step; fetched when there is none)."""
        if self._obs is None:
            try:
                self._obs = await self._backend._run(self.env._get_obs)
            except Exception as e:  # noqa: BLE001 - upstream raises anything
                raise SandboxStepError(f"sandbox {self.id}: observe failed: {e!r}") from e
        return self._observation(self._obs)

    async def step(self, action: Action) -> Observation:
        """``env.step(action, pause)`` in a worker thread."""
        cmd = _upstream_action(action)
        try:
            obs, _, _, _ = await self._backend._run(
                self.env.step, cmd, self._backend.config.step_pause_s
            )
        except Exception as e:  # noqa: BLE001
            raise SandboxStepError(f"sandbox {self.id}: step failed: {e!r}") from e
        self._terminal_stepped = action.is_terminal
        self._obs = obs
        return self._observation(obs)

    async def evaluate(self, last_action: Action | None) -> float:
        """Steps a terminal DONE/FAIL (no pause) so upstream sees it, then ``env.evaluate()``."""
        try:
            if last_action is not None and last_action.is_terminal and not self._terminal_stepped:
                await self._backend._run(self.env.step, _upstream_action(last_action), 0)
                self._terminal_stepped = True
            reward = await self._backend._run(self.env.evaluate)
        except Exception as e:  # noqa: BLE001
            raise SandboxEvalError(f"sandbox {self.id}: evaluation failed: {e!r}") from e
        try:
            return float(reward)
        except (TypeError, ValueError) as e:
            raise SandboxEvalError(f"sandbox {self.id}: reward {reward!r} is not a number") from e

    async def close(self) -> None:
        """``env.close()`` (stops the VM); idempotent, a second call waits for the first."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._backend._close_env(self.id))
        await asyncio.shield(self._closing)


class OSWorldBackend(SandboxBackend[OSWorldSandbox]):
    """Sandboxes on upstream OSWorld ``DesktopEnv``s (see the module docstring).

    Attributes:
      config: the configuration.
      metrics: counters (``forks_by_reset``: upstream has no snapshot fork).
    """

    name = "osworld"
    sandbox_type = OSWorldSandbox
    config_class = OSWorldBackendConfig

    def __init__(self, config: OSWorldBackendConfig | None = None) -> None:
        self.config = config if config is not None else OSWorldBackendConfig()
        self.metrics = OSWorldMetrics()
        self._envs: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.config.max_workers, thread_name_prefix="osworld-env"
        )

    @staticmethod
    def _upstream() -> Any:
        """The upstream ``DesktopEnv`` class (ImportError when ``desktop_env`` is missing)."""
        return importlib.import_module(UPSTREAM_MODULE).DesktopEnv

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args))

    def preflight(self, tasks: Sequence[Task] | None = None) -> None:
        """Checks that ``desktop_env`` is importable and the VM path exists when one is given."""
        try:
            cls = self._upstream()
        except ImportError as e:
            raise PreflightError(
                "osworld sandbox backend: the upstream OSWorld package desktop_env is not "
                f"installed ({e}); install it with pip install 'osworld_jax[osworld]' "
                "(PyPI: desktop-env)"
            ) from None
        missing = [m for m in ("reset", "step", "evaluate", "close") if not hasattr(cls, m)]
        if missing:
            raise PreflightError(
                f"osworld sandbox backend: {UPSTREAM_MODULE}.DesktopEnv lacks {missing}; "
                "this desktop_env version is not supported"
            )
        cfg = self.config
        if cfg.provider_name in VM_PATH_PROVIDERS and cfg.path_to_vm is not None:
            if not Path(cfg.path_to_vm).expanduser().exists():
                raise PreflightError(
                    f"osworld sandbox backend: OSWorldBackendConfig.path_to_vm {cfg.path_to_vm} "
                    f"does not exist (provider {cfg.provider_name})"
                )

    def _start(
        self, task_config: dict[str, Any], abandoned: threading.Event
    ) -> tuple[str, Any, Any]:
        """Worker thread: builds a DesktopEnv and resets it to the task; registers it first."""
        cls = self._upstream()
        env = cls(**self.config.env_kwargs())
        sid = f"osworld-{next(self._ids)}"
        with self._lock:
            self._envs[sid] = env
        try:
            obs = env.reset(task_config=task_config)
        except BaseException:
            self._close_env_sync(sid)
            raise
        if abandoned.is_set():  # the caller was cancelled while we blocked: nobody owns it
            self._close_env_sync(sid)
        return sid, env, obs

    def _close_env_sync(self, sid: str) -> None:
        with self._lock:
            env = self._envs.pop(sid, None)
        if env is None:
            return
        try:
            env.close()
        finally:
            with self._lock:
                self.metrics.closes += 1

    async def _close_env(self, sid: str) -> None:
        await self._run(self._close_env_sync, sid)

    async def _new(self, task: Task) -> OSWorldSandbox:
        abandoned = threading.Event()
        try:
            sid, env, obs = await self._run(self._start, task_config_dict(task), abandoned)
        except asyncio.CancelledError:
            abandoned.set()
            raise
        except ImportError as e:
            raise SandboxCreateError(f"osworld backend: desktop_env is not installed ({e})") from e
        except Exception as e:  # noqa: BLE001 - upstream raises anything
            raise SandboxCreateError(
                f"task {task.id}: DesktopEnv create/reset failed: {e!r}"
            ) from e
        return OSWorldSandbox(self, sid, task, env, obs)

    async def create(self, task: Task) -> OSWorldSandbox:
        """A new ``DesktopEnv`` reset to ``task`` (upstream runs the setup)."""
        sb = await self._new(task)
        self.metrics.creates += 1
        return sb

    async def _fork(self, sandbox: OSWorldSandbox, n: int) -> list[OSWorldSandbox]:
        """Returns n fresh ``DesktopEnv``s reset to the same task (upstream cannot clone a VM)."""
        tasks = [asyncio.ensure_future(self._new(sandbox.task)) for _ in range(n)]
        try:
            results = await asyncio.gather(*tasks, return_exceptions=True)
        except BaseException:
            for t in tasks:
                t.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            await self._close_all([r for r in results if isinstance(r, OSWorldSandbox)])
            raise
        good = [r for r in results if isinstance(r, OSWorldSandbox)]
        bad = [r for r in results if isinstance(r, BaseException)]
        if bad:
            await self._close_all(good)
            err = bad[0]
            if isinstance(err, SandboxCreateError) or not isinstance(err, Exception):
                raise err
            raise SandboxCreateError(f"fork of {sandbox.id}: {err!r}") from err
        self.metrics.forks_by_reset += n
        return list(good)

    async def _close_all(self, sandboxes: list[OSWorldSandbox]) -> None:
        await asyncio.shield(
            asyncio.gather(*(s.close() for s in sandboxes), return_exceptions=True)
        )

    def inventory(self) -> list[str]:
        """Ids of the DesktopEnvs created and not yet closed."""
        with self._lock:
            return sorted(self._envs)

    async def aclose(self) -> None:
        """Closes every DesktopEnv still open and stops the worker threads."""
        for sid in self.inventory():
            try:
                await self._close_env(sid)
            except Exception as e:  # noqa: BLE001 - best effort, reported
                _log.warning("osworld backend: closing %s failed: %r", sid, e)
        self._pool.shutdown(wait=False, cancel_futures=False)
