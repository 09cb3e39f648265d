"""``LocalSandbox``: one jailed local desktop initialised for one task.

Actions run inside the jail: pyautogui code (and computer_13 actions, translated to pyautogui
code) is executed by the jail's system python3 against the project's xdotool-backed
``pyautogui`` shim. After every step and around every evaluation the jail's cgroup is checked: an
OOM kill or a refused fork raises ``SandboxLimitError`` naming the limit (the owner is masked).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from osworld_jax.env.actions import Action
from osworld_jax.env.backend import Observation, SandboxError, SandboxLimitError
from osworld_jax.env.vm_sandbox import PYAUTOGUI_PREFIX, VMSandbox

if TYPE_CHECKING:
    from osworld_jax.env.local.config import LocalBackendConfig
    from osworld_jax.env.local.desktop import LocalDesktop
    from osworld_jax.env.tasks import Task

__all__ = ["LocalSandbox"]


class LocalSandbox(VMSandbox):
    """A jailed local desktop initialised for one task (observe/step/evaluate: ``VMSandbox``).

    Attributes:
      id: the sandbox id.
      task: the task it was set up for.
      desktop: the running desktop (jail, processes, ``VMClient`` as ``desktop.client``).
      vm: the desktop's in-VM protocol client.
      work_dir: host-side directory of setup outputs (``execute`` steps' saved stdout/stderr).
    """

    def __init__(self, config: LocalBackendConfig, desktop: LocalDesktop, task: Task) -> None:
        cfg = config
        # The server stops an action's code at step_timeout_s (a result, returncode -9); the
        # request deadline is later so that only an unresponsive sandbox raises SandboxTimeout.
        super().__init__(
            desktop.id,
            task,
            desktop.client,
            work_dir=desktop.dir / "work",
            settings=cfg,
            execute_timeout_s=cfg.step_timeout_s + 15.0,
        )
        self.desktop = desktop
        self._cfg = cfg

    async def run_code(self, code: str) -> dict[str, Any]:
        """Runs pyautogui/python code as the agent, in the jail's desktop namespace.

        Returns ``{status, output, error, returncode}``. The server stops the code at
        ``step_timeout_s`` (a result, returncode -9); the request deadline is later so that only
        an unresponsive sandbox raises ``SandboxTimeout``. Output over ``max_output_bytes`` raises
        ``SandboxLimitError``.
        """
        return await self._call(
            "action",
            self.desktop.run_action(
                ["python3", "-c", PYAUTOGUI_PREFIX + code], timeout=self._cfg.step_timeout_s
            ),
        )

    def check_limits(self) -> None:
        """Raises ``SandboxLimitError`` when the jail's cgroup saw an OOM kill or a refused fork."""
        cg = self.desktop.cgroup
        if cg is None:
            return
        cfg = self._cfg
        if (n := cg.oom_kills()) > 0:
            raise SandboxLimitError(
                f"sandbox {self.id} exceeded its memory limit of {cfg.memory_bytes} bytes "
                f"(LocalBackendConfig.memory_bytes): {n} process(es) killed",
                limit="memory",
            )
        if (n := cg.forks_refused()) > 0:
            raise SandboxLimitError(
                f"sandbox {self.id} reached its process limit of {cfg.max_processes} "
                f"(LocalBackendConfig.max_processes): {n} fork(s) refused",
                limit="processes",
            )

    async def step(self, action: Action) -> Observation:
        """``VMSandbox.step``, then the limit check (a breach masks the owner)."""
        try:
            obs = await super().step(action)
        except SandboxError:
            self.check_limits()  # a breach explains the failure better than its symptom
            raise
        self.check_limits()
        return obs

    async def evaluate(self, last_action: Action | None) -> float:
        """``VMSandbox.evaluate`` between two limit checks."""
        self.check_limits()
        try:
            reward = await super().evaluate(last_action)
        except SandboxError:
            self.check_limits()
            raise
        self.check_limits()
        return reward

    async def close(self) -> None:
        """Kills the jail's process tree and removes its directory; idempotent."""
        await self.desktop.close()
