"""A fake OpenSandbox-style sandbox service over HTTPS on loopback, for tests and load tests.

``FakeSandboxService`` is an aiohttp app served with a certificate from a throw-away CA
(``make_test_pki``: ``pki.py``, re-exported here). It implements the lifecycle API the
``remote`` backend uses (``osworld_jax.env.remote.api``: create, get, list by metadata, delete,
endpoints, fork, snapshots) under ``/v1``, and serves each sandbox's in-VM server (the OSWorld
protocol: ``/screenshot``, ``/execute``, ...) under ``/v1/sandboxes/{id}/proxy/5000/`` over an
in-memory desktop (``memory_vm_server.serve_vm_route`` over a ``MemoryDesktop``: ``python3 -c
CODE`` executions apply CODE's pyautogui calls to the desktop, read with ``ast``, never executed).

Semantics that the tests lean on:

- a sandbox is ``Pending`` for ``faults.boot_delay_s`` after creation, then ``Running``;
- ``/fork`` copies the whole desktop (files, open editor, terminal: a VM fork); a snapshot keeps
  only the disk (files and directories), so a sandbox created from it starts with no programs
  running and the client must re-run the launch steps;
- the endpoint reply carries a per-sandbox header (``X-Sandbox-Token``) that the proxy requires;
  the lifecycle routes require the API token in ``OPEN-SANDBOX-API-KEY``.

Faults (``FakeFaults``, mutable while running): no ``/fork`` route, a seeded 5xx rate, 429 bursts
with ``Retry-After``, creates whose reply is lost after the sandbox was made, slow and stuck
boots, sandboxes that vanish when an ``/execute`` carries a marker. Observability: ``live_ids()``
(zero leaks), ``stats`` (requests, peak concurrently open TLS connections, 429s/5xx sent, tokens
seen on proxy routes), also served as JSON at ``GET /v1/_fake/stats``.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import datetime
import itertools
import json
import random
import ssl
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from osworld_jax.env.backend import SandboxError
from osworld_jax.testing.memory_desktop import MemoryDesktop
from osworld_jax.testing.memory_vm_server import json_error, serve_vm_route
from osworld_jax.testing.pki import TestPKI, make_test_pki

__all__ = [
    "FakeFaults",
    "FakeSandboxService",
    "FakeStats",
    "TestPKI",
    "make_test_pki",
]

API_KEY_HEADER = "OPEN-SANDBOX-API-KEY"
SANDBOX_HEADER = "X-Sandbox-Token"


# ------------------------------------------------------------------------------ state


@dataclasses.dataclass
class FakeFaults:
    """Faults the fake injects (mutable while the service runs).

    Attributes:
      fork_supported: serve ``POST /sandboxes/{id}/fork`` (else it answers 404 like an unknown
        route).
      error_rate: probability that a lifecycle request is answered ``error_status``.
      error_status: the status of injected errors (500, 502, 503...).
      error_methods: the HTTP methods that may get injected errors.
      throttle: the next this-many lifecycle requests are answered 429 with ``Retry-After``.
      retry_after_s: the ``Retry-After`` value of throttled replies.
      lost_create_replies: the next this-many creates make their sandbox, then answer 500 (the
        client never learns the id).
      boot_delay_s: how long a new sandbox stays ``Pending``.
      stuck_boots: the next this-many created sandboxes never leave ``Pending``.
      snapshot_delay_s: how long a snapshot stays ``Creating``.
      lose_marker: an ``/execute`` whose command contains this text deletes its sandbox (as if
        its host died) and is answered 404.
      echo_auth_in_errors: injected error bodies echo the API token they received (to test the
        client's redaction).
      echo_pad: characters of filler before the echoed token in an error body (to put it
        across the client's truncation point).
      vm_error_marker: an ``/execute`` whose command contains this text is answered
        ``error_status`` by the sandbox endpoint, echoing the API token when
        ``echo_auth_in_errors`` (a service that leaks it through a sandbox's replies).
      endpoint_scheme: a scheme the endpoint reply starts with ("" like OpenSandbox, or e.g.
        ``http://`` to offer a plain-text endpoint the client must refuse).
      seed: seed of the error-rate RNG.
    """

    fork_supported: bool = True
    error_rate: float = 0.0
    error_status: int = 500
    error_methods: tuple[str, ...] = ("GET", "POST", "DELETE")
    throttle: int = 0
    retry_after_s: float = 0.2
    lost_create_replies: int = 0
    boot_delay_s: float = 0.0
    stuck_boots: int = 0
    snapshot_delay_s: float = 0.0
    lose_marker: str | None = "LOSE-THIS-SANDBOX"
    echo_auth_in_errors: bool = False
    echo_pad: int = 0
    vm_error_marker: str | None = None
    endpoint_scheme: str = ""
    seed: int = 0


@dataclasses.dataclass
class FakeStats:
    """What the fake observed.

    Attributes:
      requests: lifecycle requests received (authenticated or not).
      proxy_requests: in-VM protocol requests received.
      open_connections: TLS connections open now.
      peak_connections: the most TLS connections open at once.
      connections_total: TLS connections accepted.
      throttled: 429 replies sent.
      errors_injected: injected 5xx replies.
      unauthorized: lifecycle requests rejected for a missing/wrong token.
      created: sandboxes created (by create, fork or from a snapshot).
      forked: sandboxes created by ``/fork``.
      from_snapshot: sandboxes created from a snapshot.
      deleted: sandboxes deleted by the client.
      lost: sandboxes that vanished (lose marker).
      api_key_on_proxy: proxy requests that carried the lifecycle API token header.
      executes: the command of every in-VM ``/execute`` request, in order.
    """

    requests: int = 0
    proxy_requests: int = 0
    open_connections: int = 0
    peak_connections: int = 0
    connections_total: int = 0
    throttled: int = 0
    errors_injected: int = 0
    unauthorized: int = 0
    created: int = 0
    forked: int = 0
    from_snapshot: int = 0
    deleted: int = 0
    lost: int = 0
    api_key_on_proxy: int = 0
    executes: list[Any] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _FakeSandbox:
    id: str
    desktop: MemoryDesktop
    metadata: dict[str, str]
    ready_at: float
    stuck: bool
    token: str
    created_at: str

    def state(self) -> str:
        return "Running" if not self.stuck and time.monotonic() >= self.ready_at else "Pending"

    def as_json(self, image: str = "") -> dict[str, Any]:
        state = self.state()
        return {
            "id": self.id,
            "status": {"state": state, "reason": "", "message": f"fake sandbox {state}"},
            "metadata": self.metadata,
            "image": {"uri": image},
            "entrypoint": ["/fake"],
            "createdAt": self.created_at,
            "expiresAt": self.created_at,
        }


@dataclasses.dataclass
class _FakeSnapshot:
    id: str
    files: dict[str, bytes]
    dirs: set[str]
    ready_at: float

    def as_json(self) -> dict[str, Any]:
        state = "Ready" if time.monotonic() >= self.ready_at else "Creating"
        return {"id": self.id, "status": {"state": state}}


class _CountingProtocol:
    """Wraps aiohttp's per-connection protocol to count open connections."""

    def __init__(self, inner: Any, stats: FakeStats) -> None:
        self._inner = inner
        self._stats = stats
        self._counted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        s = self._stats
        s.open_connections += 1
        s.connections_total += 1
        s.peak_connections = max(s.peak_connections, s.open_connections)
        self._counted = True
        self._inner.connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._counted:
            self._stats.open_connections -= 1
            self._counted = False
        self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


# ------------------------------------------------------------------------------ the service


class FakeSandboxService:
    """The fake service (see the module docstring); ``async with`` starts and stops it.

    Attributes:
      token: the API token the lifecycle routes require.
      pki: the CA and server certificate it serves with.
      tls_version: the only TLS version it speaks (None: TLS 1.2 and 1.3, as a current server).
      faults: the faults to inject.
      stats: counters of what it observed.
      sandboxes: live sandboxes by id.
      snapshots: live snapshots by id.
      port: the bound port (after ``start``).
    """

    def __init__(
        self,
        *,
        token: str,
        pki: TestPKI,
        faults: FakeFaults | None = None,
        screenshot_px: int = 8,
        tls_version: ssl.TLSVersion | None = None,
    ) -> None:
        self.token = token
        self.pki = pki
        self.tls_version = tls_version
        self.faults = faults if faults is not None else FakeFaults()
        self.stats = FakeStats()
        self.sandboxes: dict[str, _FakeSandbox] = {}
        self.snapshots: dict[str, _FakeSnapshot] = {}
        self.port = 0
        self._px = screenshot_px
        self._ids = itertools.count()
        self._rng = random.Random(self.faults.seed)
        self._server: asyncio.AbstractServer | None = None
        self._runner: web.AppRunner | None = None

    @property
    def base_url(self) -> str:
        """The lifecycle API root, ``https://127.0.0.1:PORT/v1``."""
        return f"https://127.0.0.1:{self.port}/v1"

    def live_ids(self) -> list[str]:
        """Ids of the sandboxes that exist (zero leaks: empty after a run)."""
        return sorted(self.sandboxes)

    def desktop(self, sandbox_id: str) -> MemoryDesktop:
        """The in-memory desktop of a sandbox (for assertions)."""
        return self.sandboxes[sandbox_id].desktop

    # -- lifecycle of the server ---------------------------------------------------------------

    async def start(self) -> FakeSandboxService:
        """Binds 127.0.0.1 on a free port and serves HTTPS."""
        app = web.Application(middlewares=[self._middleware], client_max_size=64 * 2**20)
        r = app.router
        r.add_get("/v1/_fake/stats", self._h_stats)
        r.add_get("/v1/sandboxes", self._h_list)
        r.add_post("/v1/sandboxes", self._h_create)
        r.add_get("/v1/sandboxes/{sid}", self._h_get)
        r.add_delete("/v1/sandboxes/{sid}", self._h_delete)
        r.add_get("/v1/sandboxes/{sid}/endpoints/{port}", self._h_endpoint)
        r.add_post("/v1/sandboxes/{sid}/fork", self._h_fork)
        r.add_post("/v1/sandboxes/{sid}/snapshots", self._h_snapshot)
        r.add_get("/v1/snapshots/{snap}", self._h_get_snapshot)
        r.add_delete("/v1/snapshots/{snap}", self._h_delete_snapshot)
        r.add_route("*", "/v1/sandboxes/{sid}/proxy/{port}/{route:.*}", self._h_proxy)
        self._runner = web.AppRunner(
            app, access_log=None, handle_signals=False, shutdown_timeout=2.0
        )
        await self._runner.setup()
        handler_factory = self._runner.server
        assert handler_factory is not None
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _CountingProtocol(handler_factory(), self.stats),  # type: ignore[arg-type,return-value]
            "127.0.0.1",
            0,
            ssl=self.pki.server_context(only_version=self.tls_version),
            backlog=1024,
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        """Stops listening and closes every connection."""
        if self._server is not None:
            self._server.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._server is not None:
            # Python >= 3.12 (and late 3.11 patch releases) wait here for every accepted
            # connection to close; a client that was interrupted mid-handshake may never close
            # its side, so bound the wait rather than hang the owner's shutdown.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), timeout=5.0)
            self._server = None

    async def __aenter__(self) -> FakeSandboxService:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- middleware: auth and faults -----------------------------------------------------------

    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if "/proxy/" in request.path:
            self.stats.proxy_requests += 1
            if API_KEY_HEADER in request.headers:
                self.stats.api_key_on_proxy += 1
            return await handler(request)
        self.stats.requests += 1
        got = request.headers.get(API_KEY_HEADER, "")
        if got != self.token:
            self.stats.unauthorized += 1
            return json_error(401, "UNAUTHORIZED", "missing or invalid OPEN-SANDBOX-API-KEY")
        if request.path == "/v1/_fake/stats":
            return await handler(request)
        f = self.faults
        if f.throttle > 0:
            f.throttle -= 1
            self.stats.throttled += 1
            resp = json_error(429, "TOO_MANY_REQUESTS", "slow down")
            resp.headers["Retry-After"] = f"{f.retry_after_s:g}"
            return resp
        if f.error_rate > 0 and request.method in f.error_methods:
            if self._rng.random() < f.error_rate:
                self.stats.errors_injected += 1
                return json_error(f.error_status, "INTERNAL_ERROR", self._failure_text(got))
        return await handler(request)

    def _failure_text(self, token: str) -> str:
        f = self.faults
        echo = f" (token {'.' * f.echo_pad}{token})" if f.echo_auth_in_errors else ""
        return f"injected failure{echo}"

    # -- lifecycle handlers --------------------------------------------------------------------

    def _new(self, desktop: MemoryDesktop, metadata: dict[str, str]) -> _FakeSandbox:
        f = self.faults
        stuck = f.stuck_boots > 0
        if stuck:
            f.stuck_boots -= 1
        sid = f"fake-{next(self._ids)}-{uuid.uuid4().hex[:6]}"
        sb = _FakeSandbox(
            id=sid,
            desktop=desktop,
            metadata=dict(metadata),
            ready_at=time.monotonic() + f.boot_delay_s,
            stuck=stuck,
            token=uuid.uuid4().hex,
            created_at=datetime.datetime.now(datetime.UTC).isoformat(),
        )
        self.sandboxes[sid] = sb
        self.stats.created += 1
        return sb

    def _sandbox(self, request: web.Request) -> _FakeSandbox:
        sb = self.sandboxes.get(request.match_info["sid"])
        if sb is None:
            raise _http_error(404, "NOT_FOUND", f"no sandbox {request.match_info['sid']}")
        return sb

    async def _h_stats(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                **dataclasses.asdict(self.stats),
                "live": self.live_ids(),
                "snapshots": len(self.snapshots),
            }
        )

    async def _h_list(self, request: web.Request) -> web.Response:
        want: dict[str, str] = {}
        for pair in request.query.get("metadata", "").split("&"):
            if "=" in pair:
                k, v = pair.split("=", 1)
                want[k] = v
        page = int(request.query.get("page", "1"))
        size = int(request.query.get("pageSize", "20"))
        items = [
            sb.as_json()
            for sb in self.sandboxes.values()
            if all(sb.metadata.get(k) == v for k, v in want.items())
        ]
        chunk = items[(page - 1) * size : page * size]
        pages = (len(items) + size - 1) // size
        return web.json_response(
            {
                "items": chunk,
                "pagination": {
                    "page": page,
                    "pageSize": size,
                    "totalItems": len(items),
                    "totalPages": pages,
                    "hasNextPage": page < pages,
                },
            }
        )

    async def _h_create(self, request: web.Request) -> web.Response:
        body = await request.json()
        if not isinstance(body, dict) or "image" not in body:
            return json_error(400, "INVALID_REQUEST", "image is required")
        snap_id = body.get("snapshotId")
        if snap_id is not None:
            snap = self.snapshots.get(snap_id)
            if snap is None:
                return json_error(404, "NOT_FOUND", f"no snapshot {snap_id}")
            desktop = MemoryDesktop(shot=self._px)
            desktop.files = dict(snap.files)
            desktop.dirs = set(snap.dirs)
            self.stats.from_snapshot += 1
        else:
            desktop = MemoryDesktop(shot=self._px)
        sb = self._new(desktop, body.get("metadata") or {})
        if self.faults.lost_create_replies > 0:
            self.faults.lost_create_replies -= 1
            return json_error(500, "INTERNAL_ERROR", "reply lost after the sandbox was created")
        return web.json_response(sb.as_json(), status=202)

    async def _h_get(self, request: web.Request) -> web.Response:
        return web.json_response(self._sandbox(request).as_json())

    async def _h_delete(self, request: web.Request) -> web.Response:
        sb = self._sandbox(request)
        del self.sandboxes[sb.id]
        self.stats.deleted += 1
        return web.Response(status=204)

    async def _h_endpoint(self, request: web.Request) -> web.Response:
        sb = self._sandbox(request)
        port = request.match_info["port"]
        return web.json_response(
            {
                "endpoint": f"{self.faults.endpoint_scheme}127.0.0.1:{self.port}"
                f"/v1/sandboxes/{sb.id}/proxy/{port}",
                "headers": {SANDBOX_HEADER: sb.token},
            }
        )

    async def _h_fork(self, request: web.Request) -> web.Response:
        if not self.faults.fork_supported:
            return json_error(404, "NOT_FOUND", "no such route")
        src = self._sandbox(request)
        body = await request.json()
        count = int(body.get("count", 1))
        if count < 1:
            return json_error(400, "INVALID_REQUEST", "count must be >= 1")
        made = [self._new(copy.deepcopy(src.desktop), src.metadata) for _ in range(count)]
        self.stats.forked += count
        return web.json_response({"sandboxes": [sb.as_json() for sb in made]}, status=202)

    async def _h_snapshot(self, request: web.Request) -> web.Response:
        src = self._sandbox(request)
        snap = _FakeSnapshot(
            id=f"snap-{uuid.uuid4().hex[:8]}",
            files=dict(src.desktop.files),
            dirs=set(src.desktop.dirs),
            ready_at=time.monotonic() + self.faults.snapshot_delay_s,
        )
        self.snapshots[snap.id] = snap
        return web.json_response(snap.as_json(), status=202)

    async def _h_get_snapshot(self, request: web.Request) -> web.Response:
        snap = self.snapshots.get(request.match_info["snap"])
        if snap is None:
            return json_error(404, "NOT_FOUND", "no such snapshot")
        return web.json_response(snap.as_json())

    async def _h_delete_snapshot(self, request: web.Request) -> web.Response:
        if self.snapshots.pop(request.match_info["snap"], None) is None:
            return json_error(404, "NOT_FOUND", "no such snapshot")
        return web.Response(status=204)

    # -- the in-VM protocol (per sandbox) ------------------------------------------------------

    async def _h_proxy(self, request: web.Request) -> web.StreamResponse:
        sb = self._sandbox(request)
        if request.headers.get(SANDBOX_HEADER) != sb.token:
            return json_error(401, "UNAUTHORIZED", "missing or invalid sandbox endpoint header")
        d = sb.desktop
        route = "/" + request.match_info["route"]
        try:
            return await self._vm_route(sb, d, request.method, route, request)
        except SandboxError as e:
            return web.Response(status=400, text=str(e))

    async def _vm_route(
        self, sb: _FakeSandbox, d: MemoryDesktop, method: str, route: str, request: web.Request
    ) -> web.StreamResponse:
        """The service's faults on ``/execute`` (lose marker, error marker), then ``d``'s route."""
        if (method, route) in (("POST", "/execute"), ("POST", "/setup/execute")):
            body = await request.json()
            command = body.get("command")
            self.stats.executes.append(command)
            marker = self.faults.lose_marker
            if marker and marker in json.dumps(command):
                self.sandboxes.pop(sb.id, None)
                self.stats.lost += 1
                return json_error(404, "NOT_FOUND", f"no sandbox {sb.id}")
            marker = self.faults.vm_error_marker
            if marker and marker in json.dumps(command):
                self.stats.errors_injected += 1
                text = self._failure_text(self.token)
                return json_error(self.faults.error_status, "INTERNAL_ERROR", text)
        return await serve_vm_route(d, method, route, request)


def _http_error(status: int, code: str, message: str) -> web.HTTPException:
    exc = web.HTTPException(
        text=json.dumps({"code": code, "message": message}), content_type="application/json"
    )
    exc.set_status(status)
    return exc


def main(argv: list[str] | None = None) -> None:
    """Serves the fake on its own: ``python -m osworld_jax.testing.sandbox_service``.

    Writes the CA to ``--pki-dir/ca.pem``, reads the token from ``--token-env``, prints one line
    ``serving https://127.0.0.1:PORT/v1`` and serves until interrupted (stats at
    ``GET /v1/_fake/stats``).
    """
    import argparse
    import os

    p = argparse.ArgumentParser(description="fake OpenSandbox-style service (tests, load tests)")
    p.add_argument("--pki-dir", required=True, help="where the throw-away CA and cert go")
    p.add_argument("--token-env", default="OPEN_SANDBOX_API_KEY", help="variable with the token")
    p.add_argument("--no-fork", action="store_true", help="serve no /fork route")
    p.add_argument("--boot-delay", type=float, default=0.0, help="seconds Pending before Running")
    args = p.parse_args(argv)
    token = os.environ.get(args.token_env, "")
    if not token:
        raise SystemExit(f"fake_service: set {args.token_env} to the API token to require")
    faults = FakeFaults(fork_supported=not args.no_fork, boot_delay_s=args.boot_delay)

    async def serve() -> None:
        pki = make_test_pki(args.pki_dir)
        async with FakeSandboxService(token=token, pki=pki, faults=faults) as svc:
            print(f"serving {svc.base_url}", flush=True)
            await asyncio.Event().wait()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
