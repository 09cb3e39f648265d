"""The sandbox backend interface every backend (local, remote, osworld, test doubles) implements.

No jax in this room. A backend creates a task's sandbox once (running its setup), forks it into n
exact copies of the initialised state, and each sandbox is driven through the OSWorld in-VM server
protocol (``/screenshot``, ``/execute``, ``/accessibility``, ...). The backends themselves are
listed in ``osworld_jax.env.backends``.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, Generic, TypeVar, cast

from osworld_jax.errors import InfraError, PreflightError

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


class SandboxLimitError(SandboxStepError):
    """A sandbox exceeded one of its resource limits (memory, processes, output size).

    Attributes:
      limit: which limit: ``"memory"``, ``"processes"``, ``"output_bytes"``, ``"file_bytes"``.
    """

    def __init__(self, message: str, *, limit: str) -> None:
        super().__init__(message)
        self.limit = limit


__all__ = [
    "Observation",
    "PreflightError",
    "Sandbox",
    "SandboxBackend",
    "SandboxCreateError",
    "SandboxError",
    "SandboxEvalError",
    "SandboxLimitError",
    "SandboxStepError",
    "SandboxTimeout",
]


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


SandboxT = TypeVar("SandboxT", bound=Sandbox)


class SandboxBackend(abc.ABC, Generic[SandboxT]):
    """Creates, forks and tracks sandboxes of one kind (``SandboxT``, ``sandbox_type`` at run time).

    Attributes:
      name: the backend's ``BACKENDS`` name.
      sandbox_type: the class of the sandboxes it makes (``fork`` accepts only those).
      config_class: the config dataclass the constructor takes as its one argument (gin binds
        it; ``make_backend(config)`` finds the backend by it), or None.
      runs_on_host: whether its desktops run on this machine (``capabilities`` then checks the
        programs tasks run and refuses ``sudo``).
    """

    name: ClassVar[str]
    sandbox_type: ClassVar[type[Sandbox]]
    config_class: ClassVar[type | None] = None
    runs_on_host: ClassVar[bool] = False

    @abc.abstractmethod
    def preflight(self, tasks: Sequence[Task] | None = None) -> None:
        """Checks binaries, displays, services, certificates; raises ``PreflightError``.

        ``tasks``: the tasks the run must run (when every one of them must run here); a backend
        may check what they need (the local backend: the applications they start).
        """

    @abc.abstractmethod
    async def create(self, task: Task) -> SandboxT:
        """Creates a sandbox and runs the task's setup once."""

    async def fork(self, sandbox: Sandbox, n: int) -> list[Sandbox]:
        """Returns n new sandboxes, exact copies of ``sandbox``'s initialised state.

        Validates once for every backend (``sandbox`` is a live sandbox of this backend, n >= 0;
        n == 0 forks nothing), then calls the backend's ``_fork``.

        Raises:
          SandboxCreateError: ``sandbox`` is not a live sandbox of this backend.
          ValueError: ``n`` is negative.
        """
        if not isinstance(sandbox, self.sandbox_type) or sandbox.id not in self.inventory():
            raise SandboxCreateError(f"fork: {getattr(sandbox, 'id', sandbox)!r} is not live here")
        if n < 0:
            raise ValueError(f"fork: n must be >= 0, got {n}")
        if n == 0:
            return []
        return list(await self._fork(cast(SandboxT, sandbox), n))

    @abc.abstractmethod
    async def _fork(self, sandbox: SandboxT, n: int) -> Sequence[Sandbox]:
        """Makes n >= 1 copies of the live ``sandbox`` (all or none: on failure none is left)."""

    @abc.abstractmethod
    def inventory(self) -> list[str]:
        """Ids of the sandboxes this backend created and has not yet closed."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Releases backend-wide resources (connection pools, ...)."""
