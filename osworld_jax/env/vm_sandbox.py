"""What every sandbox driven through the OSWorld in-VM protocol does the same way: `VMSandbox`.

The ``local`` and ``remote`` backends differ in how a desktop is started, reached, failed and
stopped; once a ``VMProtocol`` client reaches it, observing, acting and evaluating are one
procedure, owned by the ``VMSandbox`` base class:

- observation = screenshot + a11y tree + terminal text, fetched concurrently;
- a pyautogui or computer_13 action runs as python code through ``/execute`` (a raising action is
  data, not an infrastructure failure); WAIT sleeps; every non-terminal action is followed by a
  settle pause;
- evaluation = the task's postconfig, getters and metrics (``evaluate_task``) against the
  desktop's evaluation client.

A subclass says how its sandbox closes and, optionally, how a failed request is classified
(``_call``: the remote backend asks its service whether a sandbox that stopped answering is gone).
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from osworld_jax.env.actions import Action, ActionKind, to_pyautogui
from osworld_jax.env.backend import (
    Observation,
    Sandbox,
    SandboxError,
    SandboxEvalError,
    SandboxStepError,
)
from osworld_jax.env.evaluators import evaluate_task
from osworld_jax.env.protocol import VMProtocol
from osworld_jax.env.setup import SetupContext
from osworld_jax.env.vm_client import VMClient

if TYPE_CHECKING:
    from osworld_jax.env.tasks import Task

__all__ = [
    "PYAUTOGUI_PREFIX",
    "VMSandbox",
    "VMSandboxSettings",
    "fetch_observation",
    "perform_action",
    "setup_context",
]

_T = TypeVar("_T")

#: Prepended to model code, as OSWorld's controller does (FAILSAFE off: corners are clickable).
PYAUTOGUI_PREFIX = "import pyautogui; import time; pyautogui.FAILSAFE = False; "


async def _empty() -> str:
    return ""


async def fetch_observation(
    vm: VMProtocol, *, a11y: bool, terminal: bool
) -> tuple[bytes, str, str]:
    """Fetches (screenshot PNG, a11y tree, terminal text) concurrently; "" for those not asked."""
    shot, tree, term = await asyncio.gather(
        vm.screenshot(),
        vm.accessibility() if a11y else _empty(),
        vm.terminal() if terminal else _empty(),
    )
    return shot, tree, term


async def perform_action(
    run_code: Callable[[str], Awaitable[Any]],
    action: Action,
    *,
    wait_action_s: float,
    settle_s: float,
) -> None:
    """Runs one parsed action through ``run_code`` (python in the desktop); DONE/FAIL do nothing.

    Args:
      run_code: runs python code in the desktop (with `PYAUTOGUI_PREFIX`), e.g. over ``/execute``.
      action: the parsed action.
      wait_action_s: how long WAIT sleeps.
      settle_s: pause after every non-terminal action, so the screen shows its effect.
    """
    if action.kind == ActionKind.PYAUTOGUI:
        await run_code(action.code)
    elif action.kind == ActionKind.COMPUTER_13:
        await run_code(to_pyautogui(action))
    elif action.kind == ActionKind.WAIT:
        await asyncio.sleep(wait_action_s)
    if settle_s > 0 and action.kind not in (ActionKind.DONE, ActionKind.FAIL):
        await asyncio.sleep(settle_s)


def setup_context(task: Task, *, cache_dir: str | None, work_dir: Path) -> SetupContext:
    """The ``SetupContext`` of ``task``'s setup in a desktop whose host-side outputs go to
    ``work_dir`` (``execute`` steps' saved stdout/stderr, read back by ``cache_file`` getters).
    """  # noqa: D205
    return SetupContext(
        cache_dir=cache_dir,
        task_id=task.id,
        base_dir=task.path.parent if task.path is not None else None,
        work_dir=work_dir,
    )


class VMSandboxSettings(Protocol):
    """The settings `VMSandbox` reads (the local and remote backends' configs have them).

    Attributes:
      observe_a11y: include the accessibility tree in observations.
      observe_terminal: include the focused terminal's text in observations.
      settle_s: pause after a non-terminal action before observing.
      wait_action_s: how long a WAIT action pauses.
      cache_dir: the task file cache for evaluation (``cloud_file`` getters); None = default.
    """

    @property
    def observe_a11y(self) -> bool: ...  # noqa: D102
    @property
    def observe_terminal(self) -> bool: ...  # noqa: D102
    @property
    def settle_s(self) -> float: ...  # noqa: D102
    @property
    def wait_action_s(self) -> float: ...  # noqa: D102
    @property
    def cache_dir(self) -> str | None: ...  # noqa: D102


class VMSandbox(Sandbox):
    """A sandbox reached through the in-VM protocol; observe/step/evaluate are written once here.

    Attributes:
      id: the sandbox id.
      task: the task it was set up for.
      vm: the in-VM server client that actions and observations go through.
      work_dir: host-side directory of setup outputs (``execute`` steps' saved stdout/stderr
        that ``cache_file`` getters read).
    """

    def __init__(
        self,
        sandbox_id: str,
        task: Task,
        vm: VMClient,
        *,
        work_dir: Path,
        settings: VMSandboxSettings,
        execute_timeout_s: float,
    ) -> None:
        """Binds the sandbox to its desktop.

        Args:
          sandbox_id: the sandbox id.
          task: the task the desktop was set up for.
          vm: the desktop's in-VM server client.
          work_dir: host-side directory of setup outputs.
          settings: what to observe and how long to pause (the backend's config).
          execute_timeout_s: the request deadline of one action's ``/execute``.
        """
        self.id = sandbox_id
        self.task = task
        self.vm = vm
        self.work_dir = work_dir
        self._settings = settings
        self._execute_timeout_s = execute_timeout_s

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r}, task={self.task.id!r})"

    @property
    def eval_vm(self) -> VMProtocol:
        """The client evaluation reads the desktop through (``vm`` unless a backend has another)."""
        return self.vm

    async def _call(
        self, what: str, aw: Awaitable[_T], error: type[SandboxError] = SandboxStepError
    ) -> _T:
        """Awaits a request to the desktop; any failure that is not a ``SandboxError`` becomes
        ``error`` (naming the sandbox and ``what``). Backends override it to classify failures.
        """  # noqa: D205
        try:
            return await aw
        except SandboxError:
            raise
        except Exception as e:  # noqa: BLE001 - any other failure is this sandbox's failure
            raise error(f"sandbox {self.id}: {what} failed: {e!r}") from e

    async def observe(self) -> Observation:
        """Screenshot, a11y tree and terminal text, fetched concurrently."""
        cfg = self._settings
        shot, tree, term = await self._call(
            "observe",
            fetch_observation(self.vm, a11y=cfg.observe_a11y, terminal=cfg.observe_terminal),
        )
        return Observation(
            screenshot=shot, a11y_tree=tree, terminal=term, instruction=self.task.instruction
        )

    async def run_code(self, code: str) -> dict[str, Any]:
        """Runs pyautogui/python code in the desktop; returns the ``/execute`` reply."""
        return await self._call(
            "execute",
            self.vm.execute(
                ["python3", "-c", PYAUTOGUI_PREFIX + code], timeout=self._execute_timeout_s
            ),
        )

    async def step(self, action: Action) -> Observation:
        """Runs one action and observes.

        An action whose code raises (a model error) is not an infrastructure failure: the
        episode goes on and the screen shows what happened; only sandbox failures raise.
        """
        cfg = self._settings
        await perform_action(
            self.run_code, action, wait_action_s=cfg.wait_action_s, settle_s=cfg.settle_s
        )
        return await self.observe()

    async def evaluate(self, last_action: Action | None) -> float:
        """Runs postconfig and the task's evaluator in this sandbox; a reward in [0, 1]."""
        reward = await self._call(
            "evaluation",
            evaluate_task(self.task, self.eval_vm, last_action, cache_dir=self._settings.cache_dir),
            SandboxEvalError,
        )
        return float(reward)

    @abc.abstractmethod
    async def close(self) -> None:
        """Stops the desktop and everything it started; idempotent."""
