"""Async client of the OSWorld in-VM server protocol.

One client talks to one desktop: a real OSWorld VM (``http://IP:5000``), a remote sandbox service
(``https://...``, pass ``ssl=``), or the project's own local sandbox server listening on a UNIX
socket (``unix:///path/to/vm.sock``). The wire formats follow upstream OSWorld's
``desktop_env/server/main.py``:

| method | route | request | reply |
|---|---|---|---|
| ``screenshot`` | ``GET /screenshot`` | | PNG bytes |
| ``execute`` | ``POST /execute`` | JSON ``{command, shell}`` | ``{status, output, error, ...}`` |
| ``accessibility`` | ``GET /accessibility`` | | JSON ``{"AT": xml}`` |
| ``file`` | ``POST /file`` | form ``file_path`` | the file's bytes (404 when missing) |
| ``upload`` | ``POST /setup/upload`` | multipart ``file_path`` + ``file_data`` | text |
| ``launch`` | ``POST /setup/launch`` | JSON ``{command, shell}`` | text |
| ``open_file`` | ``POST /setup/open_file`` | JSON ``{path}`` | text |
| ``activate_window`` | ``POST /setup/activate_window`` | ``{window_name, strict, ...}`` | text |
| ``close_window`` | ``POST /setup/close_window`` | ``{window_name, strict, ...}`` | text |
| ``screen_size`` | ``POST /screen_size`` | | JSON ``{width, height}`` |
| ``terminal`` | ``GET /terminal`` | | JSON ``{output}`` (``null`` when no terminal) |

Errors are typed (the contract of ``osworld_jax.env.protocol.VMProtocol``): a 5xx reply or a dropped
connection raises ``SandboxTransientError`` (callers such as evaluators retry it), any other non-2xx
reply ``SandboxRequestError`` (both carry the HTTP ``status``), ``file`` of a missing path
``FileNotFoundError``, and an exceeded deadline ``SandboxTimeout``. Every message names the route.
"""

from __future__ import annotations

import asyncio
import json
import ssl as ssl_lib
from typing import Any

import aiohttp

from osworld_jax.env.backend import SandboxStepError, SandboxTimeout

__all__ = ["SandboxRequestError", "SandboxTransientError", "VMClient"]

_UNIX_PREFIX = "unix://"


class SandboxTransientError(SandboxStepError):
    """A sandbox request failed in a way that may pass on retry (5xx, dropped connection).

    Attributes:
      status: the HTTP status, or None when the connection itself failed.
    """

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class SandboxRequestError(SandboxStepError):
    """The server refused a request (a non-5xx error status such as 400 or 404); not retried.

    Attributes:
      status: the HTTP status.
    """

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.status = status


class VMClient:
    """Async client of one desktop's in-VM server.

    Attributes:
      base_url: the server address as given (``http(s)://host:port`` or ``unix:///path``).
      timeout: default per-request deadline in seconds.
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 120.0,
        session: aiohttp.ClientSession | None = None,
        ssl: ssl_lib.SSLContext | bool | None = None,
    ) -> None:
        """Creates a client; the HTTP session is opened lazily on first use.

        Args:
          base_url: ``http://host:port``, ``https://host:port`` or ``unix:///abs/path.sock``.
          timeout: default per-request deadline in seconds.
          session: an existing session to share (the client then never closes it). Not allowed
            with a ``unix://`` URL, which needs its own connector.
          ssl: TLS setting passed to every request (an ``SSLContext``, False to skip
            verification, None for aiohttp's default).
        """
        self.base_url = base_url
        self.timeout = float(timeout)
        self._ssl: ssl_lib.SSLContext | bool | None = ssl
        self._unix_path: str | None = None
        if base_url.startswith(_UNIX_PREFIX):
            self._unix_path = base_url[len(_UNIX_PREFIX) :]
            if not self._unix_path.startswith("/"):
                raise ValueError(f"VMClient: unix URL must hold an absolute path: {base_url!r}")
            if session is not None:
                raise ValueError("VMClient: a shared session cannot be used with a unix:// URL")
            self._http_base = "http://localhost"
        elif base_url.startswith(("http://", "https://")):
            self._http_base = base_url.rstrip("/")
        else:
            raise ValueError(f"VMClient: base_url must be http(s):// or unix://, got {base_url!r}")
        self._session = session
        self._owns_session = session is None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector: aiohttp.BaseConnector | None = None
            if self._unix_path is not None:
                connector = aiohttp.UnixConnector(path=self._unix_path)
            self._session = aiohttp.ClientSession(connector=connector)
            self._owns_session = True
        return self._session

    async def _request(
        self,
        method: str,
        route: str,
        *,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> tuple[bytes, str]:
        """Sends one request; returns (body, content type) of a 2xx reply or raises typed errors."""
        deadline = self.timeout if timeout is None else timeout
        where = f"{method} {self.base_url}{route}"
        session = self._get_session()
        try:
            async with session.request(
                method,
                self._http_base + route,
                timeout=aiohttp.ClientTimeout(total=deadline),
                ssl=self._ssl if self._ssl is not None else True,
                **kwargs,
            ) as resp:
                body = await resp.read()
                if resp.status >= 500:
                    raise SandboxTransientError(
                        f"{where}: HTTP {resp.status}: {_snippet(body)}", status=resp.status
                    )
                if resp.status >= 300:
                    raise SandboxRequestError(
                        f"{where}: HTTP {resp.status}: {_snippet(body)}", status=resp.status
                    )
                return body, resp.headers.get("Content-Type", "")
        except TimeoutError as e:
            raise SandboxTimeout(f"{where}: no reply within {deadline:g} s") from e
        except aiohttp.ClientError as e:
            raise SandboxTransientError(f"{where}: connection failed: {e}") from e

    async def _json(
        self, method: str, route: str, *, timeout: float | None = None, **kwargs: Any
    ) -> Any:
        body, _ = await self._request(method, route, timeout=timeout, **kwargs)
        try:
            return json.loads(body)
        except ValueError as e:
            raise SandboxStepError(
                f"{method} {self.base_url}{route}: reply is not JSON: {_snippet(body)}"
            ) from e

    async def screenshot(self, *, timeout: float | None = None) -> bytes:
        """The screen as PNG bytes."""
        body, _ = await self._request("GET", "/screenshot", timeout=timeout)
        if not body.startswith(b"\x89PNG\r\n\x1a\n"):
            raise SandboxStepError(
                f"GET {self.base_url}/screenshot: reply is not a PNG ({len(body)} bytes)"
            )
        return body

    async def execute(
        self, command: list[str] | str, *, shell: bool = False, timeout: float | None = None
    ) -> dict[str, Any]:
        """Runs a command in the desktop and waits for it.

        Args:
          command: an argv list, or a string (split with shlex by the server unless ``shell``).
          shell: run the string through the shell.
          timeout: request deadline in seconds (default: the client's).

        Returns:
          ``{"status", "output", "error", "returncode"}`` as the server sent it.
        """
        reply = await self._json(
            "POST", "/execute", json={"command": command, "shell": shell}, timeout=timeout
        )
        if not isinstance(reply, dict) or "status" not in reply:
            raise SandboxStepError(f"POST {self.base_url}/execute: malformed reply {reply!r:.200}")
        return {
            "status": reply.get("status"),
            "output": reply.get("output", ""),
            "error": reply.get("error", reply.get("message", "")),
            "returncode": reply.get("returncode", reply.get("return_code")),
        }

    async def accessibility(self, *, timeout: float | None = None) -> str:
        """The accessibility tree as OSWorld-style XML text."""
        reply = await self._json("GET", "/accessibility", timeout=timeout)
        if not isinstance(reply, dict) or not isinstance(reply.get("AT"), str):
            raise SandboxStepError(
                f"GET {self.base_url}/accessibility: malformed reply {reply!r:.200}"
            )
        return reply["AT"]

    async def file(self, path: str, *, timeout: float | None = None) -> bytes:
        """The bytes of a file in the desktop (``~`` expands to the desktop user's home).

        Raises:
          FileNotFoundError: the path does not exist in the desktop (HTTP 404).
        """
        try:
            body, _ = await self._request(
                "POST", "/file", data={"file_path": path}, timeout=timeout
            )
        except SandboxRequestError as e:
            if e.status == 404:
                raise FileNotFoundError(f"{path} (in {self.base_url})") from e
            raise
        return body

    async def upload(self, path: str, data: bytes, *, timeout: float | None = None) -> None:
        """Writes ``data`` to ``path`` in the desktop, creating parent directories."""
        form = aiohttp.FormData()
        form.add_field("file_path", path)
        name = path.rsplit("/", 1)[-1] or "file"
        form.add_field("file_data", data, filename=name, content_type="application/octet-stream")
        await self._request("POST", "/setup/upload", data=form, timeout=timeout)

    async def launch(
        self, command: list[str] | str, shell: bool = False, *, timeout: float | None = None
    ) -> None:
        """Starts a program in the desktop without waiting for it."""
        await self._request(
            "POST", "/setup/launch", json={"command": command, "shell": shell}, timeout=timeout
        )

    async def open_file(self, path: str, *, timeout: float | None = None) -> None:
        """Opens a file with its default application and waits for its window."""
        await self._request("POST", "/setup/open_file", json={"path": path}, timeout=timeout)

    async def activate_window(
        self,
        window_name: str,
        strict: bool = False,
        by_class: bool = False,
        *,
        timeout: float | None = None,
    ) -> None:
        """Raises and focuses the window whose title (or class) matches ``window_name``."""
        await self._window("/setup/activate_window", window_name, strict, by_class, timeout)

    async def close_window(
        self,
        window_name: str,
        strict: bool = False,
        by_class: bool = False,
        *,
        timeout: float | None = None,
    ) -> None:
        """Closes the window whose title (or class) matches ``window_name``."""
        await self._window("/setup/close_window", window_name, strict, by_class, timeout)

    async def _window(
        self, route: str, window_name: str, strict: bool, by_class: bool, timeout: float | None
    ) -> None:
        """POSTs a window-matching request (``activate_window`` / ``close_window``)."""
        body = {"window_name": window_name, "strict": strict, "by_class": by_class}
        await self._request("POST", route, json=body, timeout=timeout)

    async def screen_size(self, *, timeout: float | None = None) -> tuple[int, int]:
        """The screen's (width, height) in pixels."""
        reply = await self._json("POST", "/screen_size", timeout=timeout)
        try:
            return int(reply["width"]), int(reply["height"])
        except (TypeError, KeyError, ValueError) as e:
            raise SandboxStepError(
                f"POST {self.base_url}/screen_size: malformed reply {reply!r:.200}"
            ) from e

    async def terminal(self, *, timeout: float | None = None) -> str:
        """The focused terminal's text, "" when no terminal is focused."""
        reply = await self._json("GET", "/terminal", timeout=timeout)
        if not isinstance(reply, dict):
            raise SandboxStepError(f"GET {self.base_url}/terminal: malformed reply {reply!r:.200}")
        return reply.get("output") or ""

    async def wait_ready(self, *, deadline: float = 30.0, interval: float = 0.02) -> None:
        """Polls ``/screen_size`` until the server answers.

        Raises ``SandboxTimeout`` after ``deadline`` seconds. A convenience over the protocol.
        """
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline
        last: Exception | None = None
        while loop.time() < end:
            try:
                await self.screen_size(timeout=max(0.5, min(5.0, end - loop.time())))
                return
            except (SandboxTransientError, SandboxTimeout) as e:
                last = e
            await asyncio.sleep(interval)
        raise SandboxTimeout(f"{self.base_url}: server not ready within {deadline:g} s ({last})")

    async def aclose(self) -> None:
        """Closes the HTTP session if this client opened it; idempotent."""
        if self._session is not None and self._owns_session and not self._session.closed:
            await self._session.close()
        self._session = None

    async def __aenter__(self) -> VMClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _snippet(body: bytes, limit: int = 300) -> str:
    text = body[:limit].decode("utf-8", "replace").strip().replace("\n", " ")
    return text + ("..." if len(body) > limit else "")
