"""A ``VMProtocol`` test double that runs commands for real, in a temp "home" on this machine.

Getters that run a Python program inside the desktop (``run_python``) need a desktop that
executes commands; this one runs them as subprocesses with ``HOME`` set to ``home`` and maps the
desktop path ``/home/user`` onto ``home`` in paths and command arguments. It is not a jail: tests
only run the evaluator's own programs through it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from osworld_jax.env.vm_client import SandboxRequestError

DESKTOP_HOME = "/home/user"


class HostVM:
    """Runs ``execute`` with subprocess; files live under ``home``."""

    def __init__(self, home: Path, *, screen: tuple[int, int] = (1920, 1080)) -> None:
        self.home = home
        self.home.mkdir(parents=True, exist_ok=True)
        self.screen = screen
        self.log: list[str] = []
        self.missing_windows: set[str] = set()

    def local(self, path: str) -> Path:
        """The host path of a desktop path (``~`` and ``/home/user`` map to ``home``)."""
        if path.startswith("~"):
            path = DESKTOP_HOME + path[1:]
        if path.startswith(DESKTOP_HOME):
            return self.home / path[len(DESKTOP_HOME) :].lstrip("/")
        return Path(path)

    def _arg(self, a: str) -> str:
        return a.replace(DESKTOP_HOME, str(self.home))

    async def execute(self, command: list[str] | str, *, shell: bool = False) -> dict[str, Any]:
        self.log.append(f"execute {command!r}")
        env = {**os.environ, "HOME": str(self.home)}
        if isinstance(command, list):
            argv = [self._arg(str(c)) for c in command]
            if argv and argv[0] in ("python3", "python"):
                argv[0] = sys.executable
            run_arg: Any = " ".join(argv) if shell else argv
        else:
            run_arg = self._arg(command)
            shell = True
        p = subprocess.run(
            run_arg, shell=shell, capture_output=True, text=True, env=env, timeout=60
        )
        return {
            "status": "success" if p.returncode == 0 else "error",
            "output": p.stdout,
            "error": p.stderr,
            "returncode": p.returncode,
        }

    async def file(self, path: str) -> bytes:
        p = self.local(path)
        if not p.is_file():
            raise FileNotFoundError(path)
        return p.read_bytes()

    async def upload(self, path: str, data: bytes) -> None:
        p = self.local(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)

    async def launch(self, command: list[str] | str, shell: bool = False) -> None:
        self.log.append(f"launch {command!r}")

    async def open_file(self, path: str) -> None:
        self.log.append(f"open {path!r}")

    async def activate_window(
        self, window_name: str, strict: bool = False, by_class: bool = False
    ) -> None:
        self.log.append(f"activate_window {window_name!r}")
        if window_name in self.missing_windows:
            raise SandboxRequestError(f"Window {window_name} not found", status=404)

    async def close_window(
        self, window_name: str, strict: bool = False, by_class: bool = False
    ) -> None:
        self.log.append(f"close_window {window_name!r}")
        if window_name in self.missing_windows:
            raise SandboxRequestError(f"Window {window_name} not found", status=404)

    async def screen_size(self) -> tuple[int, int]:
        return self.screen

    async def accessibility(self) -> str:
        return "<desktop-frame/>"

    async def screenshot(self) -> bytes:
        raise NotImplementedError

    async def terminal(self) -> str:
        return ""
