"""The sandbox backend interface every backend (local, remote, osworld, test doubles) implements.

No jax in this room. A backend creates a task's sandbox once (running its setup), forks it into n
exact copies of the initialised state, and each sandbox is driven through the OSWorld in-VM server
protocol (``/screenshot``, ``/execute``, ``/accessibility``, ...).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING

from osworld_jax.errors import InfraError, OsworldJaxError
from osworld_jax.registry import Registry

if TYPE_CHECKING:
    from osworld_jax.env.actions import Action
    from osworld_jax.env.tasks import Task


class SandboxError(InfraError):
    """Base of sandbox infrastructure failures: the owner is masked, its siblings continue."""


class SandboxCreateError(SandboxError):
    """Creating or setting up a sandbox failed."""


class SandboxStepError(SandboxError):
    """Running an action or reading an observation failed."""


class SandboxEvalError(SandboxError):
    """Evaluating the final state failed (after retries of transient errors)."""


class SandboxTimeout(SandboxError):
    """A sandbox operation exceeded its configured timeout."""


class PreflightError(OsworldJaxError):
    """A backend cannot run here; the message says what is missing, in one line."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Observation:
    """What the agent sees after each step.

    Attributes:
      screenshot: PNG bytes of the screen, or None when the backend has no screen.
      a11y_tree: the accessibility tree as text (XML), "" when unavailable.
      terminal: the terminal's text, "" when unavailable.
      instruction: the task instruction.
    """

    screenshot: bytes | None
    a11y_tree: str
    terminal: str
    instruction: str


class Sandbox(abc.ABC):
    """One running desktop, initialised for one task."""

    id: str

    @abc.abstractmethod
    async def observe(self) -> Observation:
        """Returns the current observation without acting."""

    @abc.abstractmethod
    async def step(self, action: Action) -> Observation:
        """Runs one action (pyautogui code, computer_13, WAIT/DONE/FAIL) and observes."""

    @abc.abstractmethod
    async def evaluate(self, last_action: Action | None) -> float:
        """Runs postconfig and the task's evaluator; returns the reward in [0, 1]."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stops the sandbox and everything it started; idempotent."""


class SandboxBackend(abc.ABC):
    """Creates, forks and tracks sandboxes of one kind."""

    name: str

    @abc.abstractmethod
    def preflight(self) -> None:
        """Checks binaries, displays, services, certificates; raises ``PreflightError``."""

    @abc.abstractmethod
    async def create(self, task: Task) -> Sandbox:
        """Creates a sandbox and runs the task's setup once."""

    @abc.abstractmethod
    async def fork(self, sandbox: Sandbox, n: int) -> list[Sandbox]:
        """Returns n new sandboxes, exact copies of ``sandbox``'s initialised state."""

    @abc.abstractmethod
    def inventory(self) -> list[str]:
        """Ids of the sandboxes this backend created and has not yet closed."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Releases backend-wide resources (connection pools, ...)."""


BACKENDS: Registry[type[SandboxBackend]] = Registry("sandbox backend")
