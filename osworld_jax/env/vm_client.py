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
connection raises ``SandboxTransientError`` (callers such as evaluators retry it), a 413 reply (the
local sandbox's server refusing to send a reply over one of its size limits) or a reply body
larger than ``max_body_bytes`` ``SandboxOutputLimit`` (a ``SandboxLimitError``, never retried),
any other non-2xx reply ``SandboxRequestError`` (all carry the HTTP ``status``), ``file`` of a
missing path ``FileNotFoundError``, and an exceeded deadline ``SandboxTimeout``. Every message
names the route.

Two failures are permanent although they look like transient ones:

- upstream's server answers ``/execute``, ``/setup/execute`` and ``/setup/launch`` with HTTP 500
  and ``{"status": "error", "message": ...}`` when the command cannot run at all (its
  ``subprocess`` call raised: a missing program, no permission, past its 120 s limit); the same
  request fails the same way again, so that is a ``SandboxRequestError`` (status 500), as
  upstream's getters treat every non-200 reply: no retry;
- a failed TLS handshake (refused certificate, protocol version) is a ``SandboxStepError`` naming
  what failed (``osworld_jax.env.tls.describe_tls_failure``).

Error text quoted from a reply is cut to 300 characters; a client given a ``mask`` (the remote
backend's API token) masks the secret first, so a cut can never leave part of it (``snippet``).
"""

from __future__ import annotations

import asyncio
import json
import re
import ssl as ssl_lib
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from osworld_jax.env.backend import SandboxLimitError, SandboxStepError, SandboxTimeout
from osworld_jax.env.tls import describe_tls_failure

__all__ = [
    "MASK",
    "SandboxOutputLimit",
    "SandboxRequestError",
    "SandboxTransientError",
    "VMClient",
    "snippet",
]

_UNIX_PREFIX = "unix://"
#: Routes whose HTTP 500 + ``{"status": "error"}`` means "this command cannot run" (upstream).
_COMMAND_ROUTES = frozenset({"/execute", "/setup/execute", "/setup/launch"})
#: Marks a masked secret character (see ``snippet``); runs of it print as ``***``.
MASK = "\0"
_SLACK = 4096  # longest secret a snippet's mask is guaranteed to see whole


class SandboxTransientError(SandboxStepError):
    """A sandbox request failed in a way that may pass on retry (5xx, dropped connection).

    Attributes:
      status: the HTTP status, or None when the connection itself failed.
    """

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class SandboxRequestError(SandboxStepError):
    """The server refused a request or reported that it cannot be done; never retried.

    A non-5xx error status (400, 404, ...), or upstream's HTTP 500 + ``{"status": "error"}`` of
    a command that cannot run (module docstring).

    Attributes:
      status: the HTTP status.
    """

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.status = status


class SandboxOutputLimit(SandboxLimitError):
    """A reply was over a size limit (HTTP 413 from the server, or ``max_body_bytes`` here).

    Attributes:
      limit: ``"output_bytes"`` or ``"file_bytes"`` (as the server named it).
      status: the HTTP status.
    """

    def __init__(self, message: str, *, limit: str, status: int) -> None:
        super().__init__(message, limit=limit)
        self.status = status


def snippet(
    body: bytes | str, *, limit: int = 300, mask: Callable[[str], str] | None = None
) -> str:
    """At most ``limit`` characters of ``body`` for an error message, on one line.

    ``mask`` (e.g. ``Secret.mask``) replaces every character of a secret by ``MASK`` without
    moving the others, and it runs BEFORE the cut: a secret that straddles the cut is masked
    whole, so no part of it survives. Masked runs print as ``***``.
    """
    if isinstance(body, bytes):
        text = body[: 4 * (limit + _SLACK)].decode("utf-8", "replace")
        longer = len(body) > limit
    else:
        text, longer = body, len(body) > limit
    head = text[: limit + _SLACK].replace(MASK, "\ufffd")
    if mask is not None:
        head = mask(head)
    shown = unmask(head[:limit]).strip().replace("\n", " ")
    return shown + ("..." if longer else "")


def unmask(text: str) -> str:
    """``text`` with each run of ``MASK`` characters printed as ``***``."""
    return re.sub(f"{MASK}+", "***", text)


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
        mask: Callable[[str], str] | None = None,
        max_body_bytes: int | None = None,
    ) -> None:
        """Creates a client; the HTTP session is opened lazily on first use.

        Args:
          base_url: ``http://host:port``, ``https://host:port`` or ``unix:///abs/path.sock``.
          timeout: default per-request deadline in seconds.
          session: an existing session to share (the client then never closes it). Not allowed
            with a ``unix://`` URL, which needs its own connector.
          ssl: TLS setting passed to every request (an ``SSLContext``, False to skip
            verification, None for aiohttp's default).
          mask: masks a secret in text (``Secret.mask``): applied to every error message this
            client raises, before reply text is cut (see ``snippet``).
          max_body_bytes: the largest reply body read into memory; a larger one raises
            ``SandboxOutputLimit`` without being read (None: no limit).
        """
        self.base_url = base_url
        self.max_body_bytes = max_body_bytes
        self._mask = mask
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

    def _clean(self, text: str) -> str:
        """``text`` with the secret (if any) masked out."""
        return unmask(self._mask(text)) if self._mask is not None else text

    def _quote(self, body: bytes | str, limit: int = 300) -> str:
        return snippet(body, limit=limit, mask=self._mask)

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
                body = await self._read_body(resp, where)
                status = resp.status
                if status == 413:
                    raise SandboxOutputLimit(
                        self._clean(f"{where}: HTTP 413: ") + self._quote(body),
                        limit=_limit_name(body),
                        status=413,
                    )
                if status == 500 and route in _COMMAND_ROUTES and _command_failed(body):
                    raise SandboxRequestError(
                        self._clean(f"{where}: HTTP 500: the command cannot run: ")
                        + self._quote(body),
                        status=status,
                    )
                if status >= 500:
                    raise SandboxTransientError(
                        self._clean(f"{where}: HTTP {status}: ") + self._quote(body), status=status
                    )
                if status >= 300:
                    raise SandboxRequestError(
                        self._clean(f"{where}: HTTP {status}: ") + self._quote(body), status=status
                    )
                return body, resp.headers.get("Content-Type", "")
        except TimeoutError as e:
            raise SandboxTimeout(self._clean(f"{where}: no reply within {deadline:g} s")) from e
        except aiohttp.ClientSSLError as e:
            host = urlsplit(self._http_base).hostname or "?"
            why = describe_tls_failure(e, host=host)
            raise SandboxStepError(self._clean(f"{where}: {why}")) from None
        except aiohttp.ClientError as e:
            raise SandboxTransientError(self._clean(f"{where}: connection failed: {e}")) from e

    async def _read_body(self, resp: aiohttp.ClientResponse, where: str) -> bytes:
        cap = self.max_body_bytes
        if cap is None:
            return await resp.read()
        if resp.content_length is not None and resp.content_length > cap:
            raise SandboxOutputLimit(
                self._clean(f"{where}: reply of {resp.content_length} bytes exceeds {cap} bytes"),
                limit="output_bytes",
                status=resp.status,
            )
        buf = bytearray()
        async for chunk in resp.content.iter_chunked(1 << 16):
            buf += chunk
            if len(buf) > cap:
                raise SandboxOutputLimit(
                    self._clean(f"{where}: reply exceeds {cap} bytes"),
                    limit="output_bytes",
                    status=resp.status,
                )
        return bytes(buf)

    async def post_json(self, route: str, body: Any, *, timeout: float | None = None) -> Any:
        """POSTs a JSON body to ``route`` and returns the JSON reply (typed errors as above)."""
        return await self._json("POST", route, json=body, timeout=timeout)

    async def _json(
        self, method: str, route: str, *, timeout: float | None = None, **kwargs: Any
    ) -> Any:
        body, _ = await self._request(method, route, timeout=timeout, **kwargs)
        try:
            return json.loads(body)
        except ValueError as e:
            raise SandboxStepError(
                self._clean(f"{method} {self.base_url}{route}: reply is not JSON: ")
                + self._quote(body)
            ) from e

    def _malformed(self, method: str, route: str, reply: Any) -> str:
        where = self._clean(f"{method} {self.base_url}{route}: malformed reply ")
        return where + self._quote(repr(reply), limit=200)

    async def screenshot(self, *, timeout: float | None = None) -> bytes:
        """The screen as PNG bytes."""
        body, _ = await self._request("GET", "/screenshot", timeout=timeout)
        if not body.startswith(b"\x89PNG\r\n\x1a\n"):
            where = f"GET {self.base_url}/screenshot"
            raise SandboxStepError(self._clean(f"{where}: reply is not a PNG ({len(body)} bytes)"))
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
            raise SandboxStepError(self._malformed("POST", "/execute", reply))
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
            raise SandboxStepError(self._malformed("GET", "/accessibility", reply))
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
            raise SandboxStepError(self._malformed("POST", "/screen_size", reply)) from e

    async def terminal(self, *, timeout: float | None = None) -> str:
        """The focused terminal's text, "" when no terminal is focused."""
        reply = await self._json("GET", "/terminal", timeout=timeout)
        if not isinstance(reply, dict):
            raise SandboxStepError(self._malformed("GET", "/terminal", reply))
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
        raise SandboxTimeout(
            self._clean(f"{self.base_url}: server not ready within {deadline:g} s ({last})")
        )

    async def aclose(self) -> None:
        """Closes the HTTP session if this client opened it; idempotent."""
        if self._session is not None and self._owns_session and not self._session.closed:
            await self._session.close()
        self._session = None

    async def __aenter__(self) -> VMClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _command_failed(body: bytes) -> bool:
    """Whether a 500 body is upstream's "the command could not run" (``{"status": "error"}``)."""
    try:
        reply = json.loads(body)
    except ValueError:
        return False
    return isinstance(reply, dict) and reply.get("status") == "error"


def _limit_name(body: bytes) -> str:
    """The ``limit`` a 413 reply names (``{"limit": ...}``), "output_bytes" by default."""
    try:
        return str(json.loads(body).get("limit") or "output_bytes")
    except (ValueError, AttributeError):
        return "output_bytes"
