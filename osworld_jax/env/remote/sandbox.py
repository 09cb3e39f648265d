"""``RemoteSandbox``: one desktop of the sandbox service, initialised for one task.

Observe, step and evaluate are ``VMSandbox``'s, over the in-VM server's endpoint. A 404 or a
dropped connection is checked against the service: a sandbox that is gone is a
``RemoteStepError`` with status 404 (AgentEnv masks the owner). ``close`` deletes it in the
service.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from osworld_jax.env.backend import SandboxError, SandboxStepError, SandboxTimeout
from osworld_jax.env.remote.config import RemoteBackendConfig
from osworld_jax.env.vm_client import SandboxRequestError, SandboxTransientError, VMClient
from osworld_jax.env.vm_sandbox import VMSandbox

if TYPE_CHECKING:
    from osworld_jax.env.tasks import Task

__all__ = ["RemoteSandbox"]

_T = TypeVar("_T")


class RemoteSandbox(VMSandbox):
    """One remote desktop initialised for one task (observe/step/evaluate: ``VMSandbox``).

    Attributes:
      id: the service's sandbox id.
      task: the task it was set up for.
      vm: the ``VMClient`` of its in-VM server endpoint.
      endpoint: the endpoint URL.
      work_dir: host-side directory of setup outputs (``execute`` steps' saved stdout/stderr).
    """

    def __init__(
        self,
        sandbox_id: str,
        task: Task,
        vm: VMClient,
        work_dir: Path,
        *,
        config: RemoteBackendConfig,
        check_alive: Callable[[str], Awaitable[None]],
        release: Callable[[], Awaitable[None]],
    ) -> None:
        """Wraps a running sandbox's in-VM server.

        Args:
          sandbox_id: the service's sandbox id.
          task: the task it is set up for.
          vm: the client of its in-VM server endpoint.
          work_dir: host-side directory of setup outputs.
          config: the backend's configuration (observation and action settings, timeouts).
          check_alive: raises ``RemoteStepError`` (404) when the service says the sandbox is
            gone, given what failed (the backend's ``_check_alive`` for this sandbox).
          release: deletes the sandbox in the service, closes its endpoint session and removes
            ``work_dir`` (the backend's ``_release`` for this sandbox).
        """
        super().__init__(
            sandbox_id,
            task,
            vm,
            work_dir=work_dir,
            settings=config,
            execute_timeout_s=config.step_timeout_s,
        )
        self.endpoint = vm.base_url
        self._check_alive = check_alive
        self._release = release
        self._closing: asyncio.Future[None] | None = None

    async def _call(
        self, what: str, aw: Awaitable[_T], error: type[SandboxError] = SandboxStepError
    ) -> _T:
        """As ``VMSandbox._call``; a 404 or dropped connection is checked against the service
        (a ``RemoteStepError`` with status 404 when the sandbox is gone).
        """  # noqa: D205
        try:
            return await super()._call(what, aw, error)
        except (SandboxRequestError, SandboxTransientError, SandboxTimeout) as e:
            status = getattr(e, "status", None)
            if status == 404 or isinstance(e, SandboxTransientError):
                await self._check_alive(f"{what}: {e}")
            raise

    async def close(self) -> None:
        """Deletes the sandbox in the service; idempotent (a second call waits for the first)."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._release())
        closing = self._closing
        try:
            await asyncio.shield(closing)
        except Exception:
            if self._closing is closing:  # a failed delete may be retried by a later close
                self._closing = None
            raise
