"""A backend wrapper that injects failures: ``FaultInjectingBackend(inner, fail_rate, seed)``.

It fails that fraction of create/fork/step/evaluate calls of any backend with typed errors
(evaluate failures are transient, HTTP 503), deterministically for a seed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from osworld_jax.env.actions import Action
from osworld_jax.env.backend import (
    Observation,
    Sandbox,
    SandboxBackend,
    SandboxCreateError,
    SandboxError,
    SandboxEvalError,
    SandboxStepError,
)
from osworld_jax.env.tasks import Task


class InjectedFault(SandboxError):
    """Raised by ``FaultInjectingBackend``; ``status`` is 503 for injected transient faults."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class InjectedCreateFault(InjectedFault, SandboxCreateError):
    """An injected create/fork failure."""


class InjectedStepFault(InjectedFault, SandboxStepError):
    """An injected step failure."""


class InjectedEvalFault(InjectedFault, SandboxEvalError):
    """An injected (transient, HTTP 503) evaluation failure."""


class _FaultySandbox(Sandbox):
    def __init__(self, inner: Sandbox, owner: FaultInjectingBackend) -> None:
        self.inner = inner
        self.id = inner.id
        self._owner = owner

    async def observe(self) -> Observation:
        return await self.inner.observe()

    async def step(self, action: Action) -> Observation:
        self._owner._maybe("step", InjectedStepFault)
        return await self.inner.step(action)

    async def evaluate(self, last_action: Action | None) -> float:
        self._owner._maybe("evaluate", InjectedEvalFault, status=503)
        return await self.inner.evaluate(last_action)

    async def close(self) -> None:
        await self.inner.close()


class FaultInjectingBackend(SandboxBackend[_FaultySandbox]):
    """Wraps a backend; fails ``fail_rate`` of create/fork/step/evaluate calls with typed errors.

    Attributes:
      inner: the wrapped backend (its inventory is this backend's inventory).
      fail_rate: the probability that a call fails.
      injected: how many faults were injected per operation.
    """

    name = "fault-injecting"
    sandbox_type = _FaultySandbox

    def __init__(
        self,
        inner: SandboxBackend,
        fail_rate: float,
        seed: int = 0,
        *,
        ops: Sequence[str] = ("create", "fork", "step", "evaluate"),
    ) -> None:
        if not 0.0 <= fail_rate <= 1.0:
            raise ValueError(f"fail_rate must be in [0, 1], got {fail_rate}")
        self.inner = inner
        self.fail_rate = fail_rate
        self.ops = frozenset(ops)
        self.injected: dict[str, int] = {op: 0 for op in self.ops}
        self._rng = random.Random(seed)

    def _maybe(self, op: str, exc: type[InjectedFault], status: int | None = None) -> None:
        if op in self.ops and self._rng.random() < self.fail_rate:
            self.injected[op] += 1
            raise exc(f"injected {op} fault", status=status)

    def preflight(self, tasks: Sequence[Task] | None = None) -> None:  # noqa: D102
        self.inner.preflight(tasks)

    async def create(self, task: Task) -> _FaultySandbox:  # noqa: D102
        self._maybe("create", InjectedCreateFault)
        return _FaultySandbox(await self.inner.create(task), self)

    async def _fork(self, sandbox: _FaultySandbox, n: int) -> list[_FaultySandbox]:  # noqa: D102
        self._maybe("fork", InjectedCreateFault)
        return [_FaultySandbox(s, self) for s in await self.inner.fork(sandbox.inner, n)]

    def inventory(self) -> list[str]:  # noqa: D102
        return self.inner.inventory()

    async def aclose(self) -> None:  # noqa: D102
        await self.inner.aclose()
