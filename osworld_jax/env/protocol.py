"""The OSWorld in-VM server protocol as a Python interface (no jax).

Everything above the sandbox (setup steps, getters, postconfig) talks to a desktop through this
protocol, so the same code drives a real OSWorld VM (port 5000) and the project's own local
sandbox. ``osworld_jax.env.vm_client.VMClient`` satisfies it; test doubles may too.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from osworld_jax.env.backend import SandboxTimeout
from osworld_jax.env.vm_client import SandboxRequestError, SandboxTransientError


@runtime_checkable
class VMProtocol(Protocol):
    """Async client of one desktop's in-VM server (``/screenshot``, ``/execute``, ...).

    Errors: ``file`` raises ``FileNotFoundError`` when the path does not exist in the desktop
    (getters turn that into ``None``, as upstream does). Other failures raise a ``SandboxError``
    subclass; an error caused by an HTTP reply carries the HTTP status in a ``status`` attribute
    (an int), so callers retry transient ones (``status >= 500``, ``SandboxTimeout``,
    ``ConnectionError``) — see ``is_transient``.
    """

    async def screenshot(self) -> bytes:
        """PNG bytes of the screen (``GET /screenshot``)."""
        ...

    async def execute(self, command: list[str] | str, *, shell: bool = False) -> dict[str, Any]:
        """Runs a command (``POST /execute``); returns ``{status, output, error, returncode}``."""
        ...

    async def accessibility(self) -> str:
        """The accessibility tree as XML text (``GET /accessibility``)."""
        ...

    async def file(self, path: str) -> bytes:
        """The bytes of a file inside the desktop (``POST /file``)."""
        ...

    async def upload(self, path: str, data: bytes) -> None:
        """Writes ``data`` to ``path`` inside the desktop (``POST /setup/upload``)."""
        ...

    async def launch(self, command: list[str] | str, shell: bool = False) -> None:
        """Starts a process without waiting for it (``POST /setup/launch``)."""
        ...

    async def open_file(self, path: str) -> None:
        """Opens a file with its default application (``POST /setup/open_file``)."""
        ...

    async def activate_window(
        self, window_name: str, strict: bool = False, by_class: bool = False
    ) -> None:
        """Raises and focuses a window by title or class (``POST /setup/activate_window``)."""
        ...

    async def close_window(
        self, window_name: str, strict: bool = False, by_class: bool = False
    ) -> None:
        """Closes a window by title or class (``POST /setup/close_window``)."""
        ...

    async def screen_size(self) -> tuple[int, int]:
        """The screen's (width, height) (``POST /screen_size``)."""
        ...

    async def terminal(self) -> str:
        """The text of the focused terminal (``GET /terminal``)."""
        ...


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a transient sandbox failure worth retrying (5xx, timeout, connection).

    A ``SandboxRequestError`` never is, whatever its status: the server answered that the request
    cannot be done (a 4xx, or upstream's 500 for a command that cannot run).
    """
    if isinstance(exc, SandboxRequestError):
        return False
    if isinstance(exc, SandboxTransientError):
        return True
    status = getattr(exc, "status", None)
    if isinstance(status, int) and status >= 500:
        return True
    return isinstance(exc, SandboxTimeout | ConnectionError | TimeoutError)
