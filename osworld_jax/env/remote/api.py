"""HTTPS client of an OpenSandbox-style lifecycle API (pinned CA, secret token, backoff).

Routes (relative to ``RemoteBackendConfig.base_url``; OpenSandbox's lifecycle API plus the
snapshot and fork routes of AgentENV-style services):

| call | route | reply |
|---|---|---|
| create | ``POST /sandboxes`` ``{image, timeout, resourceLimits, metadata}`` | ``{id, status}`` |
| get | ``GET /sandboxes/{id}`` | ``{id, status: {state, reason, message}}`` |
| list | ``GET /sandboxes?metadata=k%3Dv&page=p`` | ``{items, pagination}`` |
| delete | ``DELETE /sandboxes/{id}`` | 204 |
| endpoint | ``GET /sandboxes/{id}/endpoints/{port}`` | ``{endpoint, headers}`` |
| fork | ``POST /sandboxes/{id}/fork`` ``{count}`` | ``{sandboxes: [{id, status}]}`` |
| snapshot | ``POST /sandboxes/{id}/snapshots`` | ``{id, status}`` |
| get snapshot | ``GET /snapshots/{id}`` | ``{id, status: {state}}`` |
| delete snapshot | ``DELETE /snapshots/{id}`` | 204 |

The create body may carry ``entrypoint`` and ``snapshotId``. A reply of 429, 502, 503 or 504,
or a dropped connection, is retried with exponential backoff
(full jitter) that honours ``Retry-After``; a 500 is retried only for idempotent requests (GET,
DELETE), since a create that failed server-side may still have created something (those are
found by their metadata tag and deleted at ``aclose``). A failed TLS handshake is never retried
and its error says what failed (``osworld_jax.env.tls.describe_tls_failure``): expired
certificate, hostname mismatch, unknown CA, protocol version (a dropped handshake is checked for a
server that speaks only TLS 1.0/1.1 before it counts as a connection failure).

The token goes only to the lifecycle API, in ``RemoteBackendConfig.auth_header`` (redirects are
not followed). It is never logged (a filter on this module's logger redacts it from any record),
every string of a parsed reply is scrubbed of it, and error text quoted from a reply is masked
BEFORE it is cut to length, so an echo of the token leaks neither all nor part of it (a run of 8
or more of its characters counts as the token; so do its JSON- and URL-escaped forms).
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import random
import ssl
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp

from osworld_jax.env.backend import SandboxCreateError, SandboxError, SandboxStepError
from osworld_jax.env.remote.config import RemoteBackendConfig
from osworld_jax.env.tls import describe_tls_failure, legacy_tls_version, version_refused
from osworld_jax.env.vm_client import MASK, snippet, unmask

__all__ = [
    "RateLimiter",
    "RemoteCreateError",
    "RemoteServiceError",
    "RemoteStepError",
    "SandboxServiceClient",
    "Secret",
]

_log = logging.getLogger("osworld_jax.env.remote")

RETRY_STATUSES = frozenset({429, 502, 503, 504})
IDEMPOTENT = frozenset({"GET", "DELETE", "HEAD"})


class RemoteServiceError(SandboxError):
    """The sandbox service failed a request.

    The message is scrubbed of every API token a live client holds (defence in depth: the
    client masks reply text before it quotes it).

    Attributes:
      status: the HTTP status, or None when no reply came (connection, TLS).
      tls: True when the TLS handshake failed (never retried; the message says why).
    """

    def __init__(self, message: str, *, status: int | None = None, tls: bool = False) -> None:
        super().__init__(REDACTOR.redact(message))
        self.status = status
        self.tls = tls


class RemoteCreateError(RemoteServiceError, SandboxCreateError):
    """Creating, booting, forking or snapshotting a remote sandbox failed."""


class RemoteStepError(RemoteServiceError, SandboxStepError):
    """A lifecycle request made while running an episode failed."""


#: A run of this many characters of a secret counts as the secret (a partial echo).
FRAGMENT = 8


class Secret:
    """Holds a secret string; its ``repr``/``str`` never show it."""

    __slots__ = ("_forms", "_fragments", "_value")

    def __init__(self, value: str) -> None:
        self._value = value
        # As sent, and as a JSON string or a URL would carry it.
        forms = {value, json.dumps(value)[1:-1], quote(value, safe="")} if value else set()
        self._forms = tuple(sorted(forms, key=len, reverse=True))
        self._fragments = {
            f[i : i + FRAGMENT]
            for f in self._forms
            if len(f) > FRAGMENT
            for i in range(len(f) - FRAGMENT + 1)
        }

    def reveal(self) -> str:
        """The secret itself (only for the request header)."""
        return self._value

    def mask(self, text: str) -> str:
        """``text`` with the secret's characters replaced one for one by ``MASK``.

        Masked: every occurrence of the secret (as sent, JSON-escaped, URL-encoded) and every run
        of ``FRAGMENT`` or more characters of one of those forms. Other characters keep their
        positions, so text cut to length after masking never holds part of the secret.
        """
        if not self._forms or not text:
            return text
        hits = bytearray(len(text))
        for form in self._forms:
            if len(form) <= FRAGMENT:
                start = text.find(form)
                while start >= 0:
                    hits[start : start + len(form)] = b"\x01" * len(form)
                    start = text.find(form, start + 1)
        if self._fragments:
            for i in range(len(text) - FRAGMENT + 1):
                if text[i : i + FRAGMENT] in self._fragments:
                    hits[i : i + FRAGMENT] = b"\x01" * FRAGMENT
        if not any(hits):
            return text
        return "".join(MASK if hit else c for c, hit in zip(text, hits, strict=True))

    def redact(self, text: str) -> str:
        """``text`` with every occurrence (or run of 8+ characters) of the secret as ``***``."""
        return unmask(self.mask(text))

    def snippet(self, text: bytes | str, *, limit: int = 300) -> str:
        """At most ``limit`` characters of ``text`` for an error message, secret masked first."""
        return snippet(text, limit=limit, mask=self.mask)

    def __repr__(self) -> str:
        return "Secret(***)"

    __str__ = __repr__

    def __reduce__(self) -> Any:
        raise TypeError("a Secret cannot be pickled")


class _RedactingFilter(logging.Filter):
    """Replaces the registered secrets in every record of the remote backend's logger."""

    def __init__(self) -> None:
        super().__init__()
        self.secrets: dict[int, Secret] = {}

    def redact(self, text: str) -> str:
        """``text`` with every registered secret redacted."""
        for secret in list(self.secrets.values()):
            text = secret.redact(text)
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        if self.secrets:
            text = record.getMessage()
            clean = self.redact(text)
            if clean != text:
                record.msg, record.args = clean, ()
        return True


REDACTOR = _RedactingFilter()
_log.addFilter(REDACTOR)


class RateLimiter:
    """A token bucket: ``burst`` acquisitions at once, then ``rate`` per second (FIFO).

    Attributes:
      rate: tokens per second.
      burst: bucket size.
      waited_s: total time the bucket made its head-of-line caller sleep.
    """

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = float(rate)
        self.burst = int(burst)
        self.waited_s = 0.0
        self._tokens = float(burst)
        self._stamp = time.monotonic()
        self._lock = asyncio.Lock()

    async def acquire(self, n: int = 1) -> float:
        """Takes ``n`` tokens, waiting for refills as needed; returns the seconds this call waited
        (queueing behind other callers included).
        """  # noqa: D205
        t0 = time.monotonic()
        async with self._lock:
            for _ in range(n):
                while True:
                    now = time.monotonic()
                    self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
                    self._stamp = now
                    if self._tokens >= 1.0:
                        self._tokens -= 1.0
                        break
                    wait = (1.0 - self._tokens) / self.rate
                    self.waited_s += wait
                    await asyncio.sleep(wait)
        return time.monotonic() - t0


def retry_after_s(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or HTTP date), None if absent/bad."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


class SandboxServiceClient:
    """Async lifecycle-API client (see the module docstring).

    Attributes:
      config: the backend config.
      retries: retried requests per cause (``"429"``, ``"503"``, ``"connection"``, ...).
    """

    def __init__(
        self,
        config: RemoteBackendConfig,
        token: Secret,
        *,
        ssl_context: ssl.SSLContext,
        connector: aiohttp.BaseConnector,
        retries: dict[str, int] | None = None,
    ) -> None:
        self.config = config
        self.retries: dict[str, int] = retries if retries is not None else {}
        self._token = token
        self._ssl = ssl_context
        self._base = config.base_url.rstrip("/")
        self._session = aiohttp.ClientSession(connector=connector, connector_owner=False)
        self._rng = random.Random()
        REDACTOR.secrets[id(self)] = token  # defence in depth: never in a log record

    def __repr__(self) -> str:
        return f"SandboxServiceClient(base_url={self._base!r}, token={self._token!r})"

    @property
    def secret(self) -> Secret:
        """The API token (as a ``Secret``: ``mask`` it out of text from this service)."""
        return self._token

    def redact(self, text: str) -> str:
        """``text`` with the token removed."""
        return self._token.redact(text)

    def _headers(self) -> dict[str, str]:
        value = self._token.reveal()
        if self.config.auth_header.lower() == "authorization":
            value = f"Bearer {value}"
        return {self.config.auth_header: value, "Accept": "application/json"}

    def _backoff(self, attempt: int, hint: float | None) -> float:
        cfg = self.config
        if hint is not None:
            return min(hint, cfg.backoff_max_s)
        cap = min(cfg.backoff_max_s, cfg.backoff_initial_s * 2**attempt)
        return cap * (0.5 + 0.5 * self._rng.random())

    async def call(
        self,
        method: str,
        path: str,
        *,
        error: type[RemoteServiceError],
        body: Mapping[str, Any] | None = None,
        ok: tuple[int, ...] = (200, 201, 202, 204),
        retry_500: bool | None = None,
    ) -> tuple[int, Any]:
        """Sends one request with retries; returns (status, parsed JSON or None).

        Args:
          method: HTTP method.
          path: route below ``base_url`` (starting with ``/``).
          error: the error class raised on failure (create vs step context).
          body: JSON body.
          ok: statuses that count as success (their reply is returned, not raised).
          retry_500: retry a 500 too (default: only for idempotent methods).

        Raises:
          error: a non-retryable status, retries exhausted, or a refused certificate. The message
            names the request, never the token.
        """
        cfg = self.config
        where = f"{method} {self._base}{path}"
        retry_500 = method in IDEMPOTENT if retry_500 is None else retry_500
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=cfg.request_timeout_s, sock_read=cfg.request_timeout_s
        )
        attempt = 0
        while True:
            cause: str
            hint: float | None = None
            try:
                async with self._session.request(
                    method,
                    self._base + path,
                    json=body,
                    headers=self._headers(),
                    ssl=self._ssl,
                    allow_redirects=False,  # the token must not follow a redirect elsewhere
                    timeout=timeout,
                ) as resp:
                    raw = await resp.read()
                    status = resp.status
                    if status in ok:
                        return status, _parse(raw, where, error, self._token)
                    detail = self._token.snippet(raw)
                    if status in RETRY_STATUSES or (status >= 500 and retry_500):
                        cause = str(status)
                        hint = retry_after_s(resp.headers.get("Retry-After"))
                        if attempt >= cfg.max_retries:
                            raise error(
                                f"{where}: HTTP {status} after {attempt + 1} attempts: {detail}",
                                status=status,
                            )
                    else:
                        raise error(f"{where}: HTTP {status}: {detail}", status=status)
            except aiohttp.ClientSSLError as e:
                legacy = await self._legacy_tls() if version_refused(e) else None
                raise error(f"{where}: {self._tls_text(e, legacy)}", tls=True) from None
            except (aiohttp.ClientConnectionError, aiohttp.ServerTimeoutError, TimeoutError) as e:
                if _dropped_handshake(e):  # an old server may drop a modern hello
                    legacy = await self._legacy_tls()
                    if legacy is not None:
                        raise error(f"{where}: {self._tls_text(e, legacy)}", tls=True) from None
                cause = "connection"
                if attempt >= cfg.max_retries:
                    raise error(
                        f"{where}: no reply after {attempt + 1} attempts: "
                        f"{type(e).__name__}: {self.redact(str(e))}"
                    ) from None
            self.retries[cause] = self.retries.get(cause, 0) + 1
            delay = self._backoff(attempt, hint)
            _log.info("remote: %s -> %s, retry %d in %.2f s", where, cause, attempt + 1, delay)
            await asyncio.sleep(delay)
            attempt += 1

    def _tls_text(self, exc: BaseException, server_version: str | None) -> str:
        host = urlsplit(self._base).hostname or "?"
        return describe_tls_failure(
            exc, host=host, ca_bundle=self.config.ca_bundle, server_version=server_version
        )

    async def _legacy_tls(self) -> str | None:
        """The old TLS version the service speaks, if that is why the handshake failed."""
        parts = urlsplit(self._base)
        host, port = parts.hostname or "", parts.port or 443
        return await legacy_tls_version(host, port, timeout=self.config.request_timeout_s)

    # -- typed helpers ------------------------------------------------------------------------

    async def create(
        self, *, metadata: Mapping[str, str], snapshot_id: str | None = None
    ) -> dict[str, Any]:
        """``POST /sandboxes``; returns the reply (``id``, ``status``)."""
        cfg = self.config
        body: dict[str, Any] = {
            "image": {"uri": cfg.image},
            "timeout": cfg.sandbox_ttl_s,
            "resourceLimits": dict(cfg.resource_limits),
            "metadata": dict(metadata),
        }
        if cfg.entrypoint:
            body["entrypoint"] = list(cfg.entrypoint)
        if snapshot_id is not None:
            body["snapshotId"] = snapshot_id
        _, reply = await self.call("POST", "/sandboxes", body=body, error=RemoteCreateError)
        return _with_id(reply, "POST /sandboxes")

    async def get(self, sandbox_id: str, *, error: type[RemoteServiceError]) -> dict | None:
        """``GET /sandboxes/{id}``; None when the service answers 404 (the sandbox is gone)."""
        status, reply = await self.call(
            "GET", f"/sandboxes/{quote(sandbox_id)}", error=error, ok=(200, 404)
        )
        return None if status == 404 else _with_id(reply, "GET /sandboxes/{id}")

    async def delete(self, sandbox_id: str) -> None:
        """``DELETE /sandboxes/{id}`` (404 = already gone)."""
        await self.call(
            "DELETE",
            f"/sandboxes/{quote(sandbox_id)}",
            error=RemoteServiceError,
            ok=(200, 202, 204, 404),
        )

    async def list_ids(self, metadata: Mapping[str, str], *, max_pages: int = 1000) -> list[str]:
        """Ids of the sandboxes whose metadata matches (``GET /sandboxes?metadata=...``)."""
        query = quote("&".join(f"{k}={v}" for k, v in metadata.items()), safe="")
        ids: list[str] = []
        for page in range(1, max_pages + 1):
            _, reply = await self.call(
                "GET",
                f"/sandboxes?metadata={query}&page={page}&pageSize=100",
                error=RemoteServiceError,
            )
            items = reply.get("items", []) if isinstance(reply, dict) else []
            ids += [str(it["id"]) for it in items if isinstance(it, dict) and "id" in it]
            pagination = reply.get("pagination", {}) if isinstance(reply, dict) else {}
            if not pagination.get("hasNextPage"):
                break
        return ids

    async def endpoint(self, sandbox_id: str, port: int) -> tuple[str, dict[str, str]]:
        """``GET /sandboxes/{id}/endpoints/{port}`` -> (https URL, headers to send)."""
        _, reply = await self.call(
            "GET", f"/sandboxes/{quote(sandbox_id)}/endpoints/{port}", error=RemoteCreateError
        )
        if not isinstance(reply, dict) or not isinstance(reply.get("endpoint"), str):
            raise RemoteCreateError(f"endpoint of {sandbox_id}: malformed reply {reply!r:.200}")
        url = reply["endpoint"]
        if url.startswith("http://"):
            raise RemoteCreateError(
                f"endpoint of {sandbox_id}: the service offers plain http ({url}); only https "
                "with the pinned CA is allowed"
            )
        if not url.startswith("https://"):
            url = "https://" + url
        headers = reply.get("headers") or {}
        return url.rstrip("/"), {str(k): str(v) for k, v in headers.items()}

    async def fork(self, sandbox_id: str, count: int) -> tuple[int, list[str]]:
        """``POST /sandboxes/{id}/fork {"count": n}`` -> (status, new ids).

        A 404/405/501 reply is returned as (status, []) so the caller can tell "no fork here"
        from a lost source sandbox.
        """
        status, reply = await self.call(
            "POST",
            f"/sandboxes/{quote(sandbox_id)}/fork",
            body={"count": count},
            error=RemoteCreateError,
            ok=(200, 201, 202, 404, 405, 501),
        )
        if status in (404, 405, 501):
            return status, []
        items = reply.get("sandboxes", reply.get("items")) if isinstance(reply, dict) else reply
        if not isinstance(items, list):
            raise RemoteCreateError(f"fork of {sandbox_id}: malformed reply {reply!r:.200}")
        return status, [_with_id(it, "fork")["id"] for it in items]

    async def snapshot(self, sandbox_id: str) -> str:
        """``POST /sandboxes/{id}/snapshots`` -> snapshot id."""
        _, reply = await self.call(
            "POST", f"/sandboxes/{quote(sandbox_id)}/snapshots", body={}, error=RemoteCreateError
        )
        return str(_with_id(reply, "POST /sandboxes/{id}/snapshots")["id"])

    async def get_snapshot(self, snapshot_id: str) -> dict[str, Any]:
        """``GET /snapshots/{id}``."""
        _, reply = await self.call(
            "GET", f"/snapshots/{quote(snapshot_id)}", error=RemoteCreateError
        )
        return _with_id(reply, "GET /snapshots/{id}")

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """``DELETE /snapshots/{id}`` (404 = already gone)."""
        await self.call(
            "DELETE",
            f"/snapshots/{quote(snapshot_id)}",
            error=RemoteServiceError,
            ok=(200, 202, 204, 404),
        )

    async def aclose(self) -> None:
        """Closes the session (the shared connector stays with its owner)."""
        REDACTOR.secrets.pop(id(self), None)
        await self._session.close()


def _parse(raw: bytes, where: str, error: type[RemoteServiceError], token: Secret) -> Any:
    """The reply's JSON with the token scrubbed from every string (keys included)."""
    if not raw.strip():
        return None
    try:
        return _scrub(json.loads(raw), token)
    except ValueError:
        raise error(f"{where}: reply is not JSON: {token.snippet(raw)}") from None


def _scrub(value: Any, token: Secret) -> Any:
    if isinstance(value, str):
        return token.redact(value)
    if isinstance(value, list):
        return [_scrub(v, token) for v in value]
    if isinstance(value, dict):
        return {_scrub(k, token): _scrub(v, token) for k, v in value.items()}
    return value


def _dropped_handshake(exc: BaseException) -> bool:
    """A connection that the server accepted and then dropped before TLS was up."""
    inner = getattr(exc, "os_error", None)
    return isinstance(exc, aiohttp.ClientConnectorError) and isinstance(
        inner, ConnectionResetError | BrokenPipeError | ssl.SSLEOFError
    )


def _with_id(reply: Any, what: str) -> dict[str, Any]:
    if not isinstance(reply, dict) or not isinstance(reply.get("id"), str | int):
        raise RemoteCreateError(f"{what}: reply has no sandbox id: {reply!r:.200}")
    return {**reply, "id": str(reply["id"])}


def state_of(reply: Mapping[str, Any]) -> tuple[str, str]:
    """(state, reason/message) of a sandbox or snapshot reply; state "" when absent."""
    status = reply.get("status")
    if isinstance(status, Mapping):
        state = str(status.get("state", ""))
        why = str(status.get("message") or status.get("reason") or "")
        return state, why
    return (str(status) if status is not None else "", "")
