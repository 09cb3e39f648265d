"""The ``remote`` sandbox backend: OSWorld desktops in an OpenSandbox-style sandbox service.

A sandbox's life: ``POST /sandboxes`` (a bounded creation rate), ``GET /sandboxes/{id}`` polled
until ``Running`` (``boot_timeout_s``, then ``SandboxTimeout``), ``GET /sandboxes/{id}/endpoints/
5000`` for its in-VM server, then the OSWorld in-VM protocol through ``VMClient`` at that
endpoint, over HTTPS with the same pinned CA and the endpoint's own headers; ``DELETE`` at the end.

Fork, in order of preference:

- **by fork** (``use_fork="auto"`` and the service offers ``POST /sandboxes/{id}/fork``): the
  service copies the running sandbox n times (AgentENV-style; processes included), nothing is
  re-run. A 404/405/501 for the route on a live sandbox means "not offered": remembered, and the
  backend falls back for good.
- **by snapshot**: ``POST /sandboxes/{id}/snapshots``, ``GET /snapshots/{sid}`` polled until
  ``Ready``, n ``POST /sandboxes {snapshotId}``, then only the task's program-starting setup steps
  (``fork_rerun_step_types``) re-run in each (a snapshot keeps the disk, not running programs);
  the snapshot is deleted afterwards.

``metrics`` counts forks by fork and by snapshot. Failures are typed ``SandboxError``s (AgentEnv
masks the owner): ``RemoteCreateError`` (create, boot, fork, snapshot), ``SandboxTimeout`` (boot
or snapshot too slow), ``RemoteStepError`` with status 404 (the sandbox vanished mid-episode),
``RemoteStepError``. Every sandbox created is tracked from the moment its id is known and deleted
on close, on failure and on cancellation; ``aclose()`` deletes what is left, including sandboxes a
lost create reply never named (found by this backend's metadata tag).

Beside it: ``sandbox.py`` (``RemoteSandbox``), ``metrics.py`` (``RemoteMetrics``), ``api.py`` (the
service's HTTP API), ``config.py`` (``RemoteBackendConfig``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from osworld_jax.env.backend import (
    PreflightError,
    Sandbox,
    SandboxBackend,
    SandboxCreateError,
    SandboxError,
    SandboxTimeout,
)
from osworld_jax.env.remote.api import (
    RateLimiter,
    RemoteCreateError,
    RemoteServiceError,
    RemoteStepError,
    SandboxServiceClient,
    Secret,
    state_of,
)
from osworld_jax.env.remote.config import RemoteBackendConfig
from osworld_jax.env.remote.metrics import RemoteMetrics
from osworld_jax.env.remote.sandbox import RemoteSandbox
from osworld_jax.env.setup import SetupContext, run_setup
from osworld_jax.env.tls import CABundleError, check_ca_bundle, pinned_ssl_context
from osworld_jax.env.vm_client import VMClient
from osworld_jax.env.vm_sandbox import setup_context

if TYPE_CHECKING:
    from osworld_jax.env.tasks import Task

__all__ = ["RemoteBackend", "RemoteMetrics", "RemoteSandbox"]

_log = logging.getLogger("osworld_jax.env.remote")

CLIENT_TAG = "osworld_jax.client"
RUNNING = "Running"
DEAD_STATES = frozenset({"Failed", "Terminated", "Stopping", "Error"})
SNAPSHOT_READY = frozenset({"Ready", "Available", "Succeeded"})


class RemoteBackend(SandboxBackend[RemoteSandbox]):
    """Creates, forks and tracks sandboxes in a remote sandbox service (module docstring).

    Attributes:
      config: the configuration.
      metrics: counters (forks by fork vs by snapshot, retries, leftovers...).
      client_tag: this backend's metadata tag on every sandbox it creates.
    """

    name = "remote"
    sandbox_type = RemoteSandbox
    config_class = RemoteBackendConfig

    def __init__(self, config: RemoteBackendConfig) -> None:
        self.config = config
        self.metrics = RemoteMetrics()
        self.client_tag = uuid.uuid4().hex
        self._ssl: Any = None
        self._connector: aiohttp.TCPConnector | None = None
        self._api: SandboxServiceClient | None = None
        self._limiter: RateLimiter | None = None
        self._live: set[str] = set()
        self._snapshots: set[str] = set()
        self._fork_supported: bool | None = None if config.use_fork == "auto" else False
        self._work_root: Path | None = None

    def __repr__(self) -> str:
        return f"RemoteBackend(base_url={self.config.base_url!r}, live={len(self._live)})"

    # -- plumbing -----------------------------------------------------------------------------

    def _token(self) -> Secret:
        value = os.environ.get(self.config.token_env, "")
        if not value:
            raise RemoteCreateError(
                f"remote backend: environment variable {self.config.token_env} (the API token) "
                "is not set"
            )
        return Secret(value)

    def _client(self) -> SandboxServiceClient:
        if self._api is None:
            try:
                self._ssl = pinned_ssl_context(self.config.ca_bundle)
            except CABundleError as e:
                raise RemoteCreateError(f"remote backend: {e}") from None
            token = self._token()
            self._connector = aiohttp.TCPConnector(
                limit=self.config.max_connections, limit_per_host=0, ssl=self._ssl
            )
            self._api = SandboxServiceClient(
                self.config,
                token,
                ssl_context=self._ssl,
                connector=self._connector,
                retries=self.metrics.retries,
            )
            self._limiter = RateLimiter(self.config.max_creations_per_s, self.config.creation_burst)
        return self._api

    def _metadata(self) -> dict[str, str]:
        return {**dict(self.config.metadata), CLIENT_TAG: self.client_tag}

    def _work_dir(self, sandbox_id: str) -> Path:
        if self._work_root is None:
            self._work_root = Path(tempfile.mkdtemp(prefix="osworld_jax-remote-"))
        d = self._work_root / sandbox_id.replace("/", "_")
        d.mkdir(parents=True, exist_ok=True)
        return d

    async def _acquire_creations(self, n: int) -> None:
        assert self._limiter is not None
        self.metrics.creation_wait_s += await self._limiter.acquire(n)

    async def _new_sandbox(
        self, snapshot_id: str | None = None, created: list[str] | None = None
    ) -> str:
        """``POST /sandboxes``; the id is tracked (and appended to ``created``) at once."""
        api = self._client()
        await self._acquire_creations(1)
        reply = await api.create(metadata=self._metadata(), snapshot_id=snapshot_id)
        self._live.add(reply["id"])
        if created is not None:
            created.append(reply["id"])
        if snapshot_id is None:
            self.metrics.creates += 1
        return reply["id"]

    async def _wait_running(self, sandbox_id: str, deadline: float) -> None:
        api = self._client()
        loop = asyncio.get_running_loop()
        state = "?"
        while True:
            reply = await api.get(sandbox_id, error=RemoteCreateError)
            if reply is None:
                raise RemoteCreateError(f"sandbox {sandbox_id} vanished while booting", status=404)
            state, why = state_of(reply)
            if state == RUNNING:
                return
            if state in DEAD_STATES:
                raise RemoteCreateError(f"sandbox {sandbox_id} failed to boot: {state} {why}")
            if loop.time() >= deadline:
                self.metrics.boot_timeouts += 1
                raise SandboxTimeout(
                    f"sandbox {sandbox_id} not running within boot_timeout_s="
                    f"{self.config.boot_timeout_s:g} s (state {state or '?'})"
                )
            await asyncio.sleep(min(self.config.poll_interval_s, max(0.0, deadline - loop.time())))

    async def _connect(self, sandbox_id: str, task: Task, deadline: float) -> RemoteSandbox:
        """Waits for Running, resolves the endpoint, waits for the in-VM server."""
        cfg = self.config
        await self._wait_running(sandbox_id, deadline)
        url, headers = await self._client().endpoint(sandbox_id, cfg.vm_port)
        assert self._connector is not None
        session = aiohttp.ClientSession(
            connector=self._connector, connector_owner=False, headers=headers
        )
        vm = VMClient(
            url,
            timeout=cfg.rpc_timeout_s,
            session=session,
            ssl=self._ssl,
            mask=self._client().secret.mask,  # a service echoing the token leaks none of it
        )
        work_dir = self._work_dir(sandbox_id)
        sandbox = RemoteSandbox(
            sandbox_id,
            task,
            vm,
            work_dir,
            config=cfg,
            check_alive=functools.partial(self._check_alive, sandbox_id),
            release=functools.partial(self._release, sandbox_id, session, work_dir),
        )
        try:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                self.metrics.boot_timeouts += 1
                raise SandboxTimeout(f"sandbox {sandbox_id}: no time left to reach its server")
            try:
                await vm.wait_ready(deadline=remaining, interval=cfg.poll_interval_s)
            except SandboxTimeout:
                self.metrics.boot_timeouts += 1
                raise
        except BaseException:
            await sandbox.close()
            raise
        return sandbox

    def _setup_ctx(self, task: Task, sandbox: RemoteSandbox) -> SetupContext:
        return setup_context(task, cache_dir=self.config.cache_dir, work_dir=sandbox.work_dir)

    async def _release(
        self, sandbox_id: str, session: aiohttp.ClientSession | None, work_dir: Path | None
    ) -> None:
        """Deletes a sandbox (404 = gone) and forgets it; on failure it stays in inventory."""
        if session is not None:
            with contextlib.suppress(Exception):
                await session.close()
        if work_dir is not None:
            await asyncio.to_thread(shutil.rmtree, work_dir, True)
        if sandbox_id not in self._live or self._api is None:
            return
        await self._api.delete(sandbox_id)
        self._live.discard(sandbox_id)
        self.metrics.deletes += 1

    async def _discard(self, *sandbox_ids: str) -> None:
        """Best-effort delete of sandboxes that were not handed out (also when cancelled)."""

        async def one(sid: str) -> None:
            with contextlib.suppress(Exception):
                await self._release(sid, None, None)

        if sandbox_ids:
            await asyncio.shield(asyncio.gather(*(one(s) for s in sandbox_ids)))

    async def _check_alive(self, sandbox_id: str, context: str) -> None:
        """Raises ``RemoteStepError`` (404) when the service says the sandbox is gone or dead."""
        try:
            reply = await self._client().get(sandbox_id, error=RemoteStepError)
        except RemoteServiceError:
            return  # the service itself is unwell: the original error stands
        state = "gone (404)" if reply is None else state_of(reply)[0]
        if reply is None or state in DEAD_STATES:
            self.metrics.lost += 1
            if reply is None:
                self._live.discard(sandbox_id)
            raise RemoteStepError(f"sandbox {sandbox_id} was lost: {state} ({context})", status=404)

    # -- SandboxBackend -----------------------------------------------------------------------

    async def create(self, task: Task) -> RemoteSandbox:
        """Creates a sandbox from the image, waits for it to boot, runs the task's setup."""
        deadline = asyncio.get_running_loop().time() + self.config.boot_timeout_s
        sid = await self._new_sandbox()
        sandbox: RemoteSandbox | None = None
        try:
            sandbox = await self._connect(sid, task, deadline)
            await run_setup(task.config, sandbox.vm, ctx=self._setup_ctx(task, sandbox))
        except BaseException as e:
            if sandbox is not None:
                await sandbox.close()
            await self._discard(sid)
            if isinstance(e, SandboxError) or not isinstance(e, Exception):
                raise
            raise SandboxCreateError(f"task {task.id}: setup failed: {e}") from e
        return sandbox

    async def _fork(self, sandbox: RemoteSandbox, n: int) -> list[Sandbox]:
        """Returns n copies of ``sandbox`` (by the service's fork, else by snapshot)."""
        if self._fork_supported is not False:
            forks = await self._fork_by_fork(sandbox, n)
            if forks is not None:
                return forks
        return await self._fork_by_snapshot(sandbox, n)

    async def _fork_by_fork(self, source: RemoteSandbox, n: int) -> list[Sandbox] | None:
        api = self._client()
        deadline = asyncio.get_running_loop().time() + self.config.boot_timeout_s
        await self._acquire_creations(n)
        status, ids = await api.fork(source.id, n)
        if not ids:
            if status == 404:  # no such route, or no such sandbox?
                await self._check_alive(source.id, "fork")
            _log.info("remote: %s offers no /fork (HTTP %s): forking by snapshot", api, status)
            self._fork_supported = False
            return None
        self._fork_supported = True
        self._live.update(ids)
        if len(ids) != n:
            await self._discard(*ids)
            raise RemoteCreateError(f"fork of {source.id}: asked for {n}, service made {len(ids)}")
        forks = await self._connect_all(ids, source, deadline, rerun=False)
        self.metrics.forks_by_fork += n
        return forks

    async def _fork_by_snapshot(self, source: RemoteSandbox, n: int) -> list[Sandbox]:
        api = self._client()
        loop = asyncio.get_running_loop()
        snap = await api.snapshot(source.id)
        self._snapshots.add(snap)
        self.metrics.snapshots += 1
        try:
            deadline = loop.time() + self.config.snapshot_timeout_s
            while True:
                state, why = state_of(await api.get_snapshot(snap))
                if state in SNAPSHOT_READY:
                    break
                if state in DEAD_STATES:
                    raise RemoteCreateError(f"snapshot {snap} of {source.id} failed: {why}")
                if loop.time() >= deadline:
                    raise SandboxTimeout(
                        f"snapshot {snap} of {source.id} not ready within "
                        f"{self.config.snapshot_timeout_s:g} s (state {state or '?'})"
                    )
                await asyncio.sleep(self.config.poll_interval_s)
            ids: list[str] = []
            boot_deadline = loop.time() + self.config.boot_timeout_s
            try:
                results = await asyncio.gather(
                    *(self._new_sandbox(snapshot_id=snap, created=ids) for _ in range(n)),
                    return_exceptions=True,
                )
                bad = [r for r in results if isinstance(r, BaseException)]
                if bad:
                    raise bad[0]
            except BaseException:
                await self._discard(*ids)
                raise
            forks = await self._connect_all(ids, source, boot_deadline, rerun=True)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.shield(api.delete_snapshot(snap))
                self._snapshots.discard(snap)
        self.metrics.forks_by_snapshot += n
        return forks

    async def _connect_all(
        self, ids: list[str], source: RemoteSandbox, deadline: float, *, rerun: bool
    ) -> list[Sandbox]:
        """Boots and connects every id (re-running launch steps when ``rerun``); all or none.

        Each copy also gets the source's host-side setup outputs (``execute`` steps' saved
        stdout/stderr, read back by ``cache_file`` getters).
        """
        task = source.task

        async def one(sid: str) -> RemoteSandbox:
            sb = await self._connect(sid, task, deadline)
            try:
                await asyncio.to_thread(
                    shutil.copytree, source.work_dir, sb.work_dir, dirs_exist_ok=True
                )
                if rerun:
                    await run_setup(
                        task.config,
                        sb.vm,
                        only_types=self.config.fork_rerun_step_types,
                        ctx=self._setup_ctx(task, sb),
                    )
            except BaseException as e:
                await sb.close()
                if isinstance(e, SandboxError) or not isinstance(e, Exception):
                    raise
                raise SandboxCreateError(f"fork {sid}: setup re-run failed: {e}") from e
            return sb

        try:
            results = await asyncio.gather(*(one(s) for s in ids), return_exceptions=True)
        except BaseException:  # cancelled: none of these is handed out
            await self._discard(*ids)
            raise
        good = [r for r in results if isinstance(r, RemoteSandbox)]
        bad = [r for r in results if isinstance(r, BaseException)]
        if bad:
            for sb in good:
                await sb.close()
            await self._discard(*ids)
            err = bad[0]
            if isinstance(err, SandboxError | asyncio.CancelledError) or not isinstance(
                err, Exception
            ):
                raise err
            raise RemoteCreateError(f"fork: {err!r}") from err
        return list(good)

    def inventory(self) -> list[str]:
        """Ids of the sandboxes this backend created and has not deleted."""
        return sorted(self._live)

    async def aclose(self) -> None:
        """Deletes every sandbox and snapshot left (also untracked ones of this backend's tag)."""
        if self._api is not None:
            api = self._api
            leftovers = set(self._live)
            with contextlib.suppress(RemoteServiceError):
                leftovers |= set(await api.list_ids({CLIENT_TAG: self.client_tag}))
            results = await asyncio.gather(
                *(api.delete(sid) for sid in leftovers), return_exceptions=True
            )
            for sid, res in zip(leftovers, results, strict=True):
                if isinstance(res, BaseException):
                    _log.warning("remote: could not delete sandbox %s: %s", sid, res)
                else:
                    self._live.discard(sid)
                    self.metrics.leftovers_deleted += 1
                    self.metrics.deletes += 1
            for snap in list(self._snapshots):
                with contextlib.suppress(RemoteServiceError):
                    await api.delete_snapshot(snap)
                    self._snapshots.discard(snap)
            await api.aclose()
            self._api = None
        if self._connector is not None:
            await self._connector.close()
            self._connector = None
        if self._work_root is not None:
            await asyncio.to_thread(shutil.rmtree, self._work_root, True)
            self._work_root = None

    # -- preflight ----------------------------------------------------------------------------

    def preflight(self, tasks: Sequence[Task] | None = None) -> None:
        """Checks the CA bundle, the token, the service and a test sandbox's create + delete.

        Raises:
          PreflightError: one message naming every problem found.
        """
        problems: list[str] = []
        try:
            check_ca_bundle(self.config.ca_bundle)
        except CABundleError as e:
            problems.append(str(e))
        if not os.environ.get(self.config.token_env):
            problems.append(f"the API token variable {self.config.token_env} is not set or empty")
        if not problems:
            problem = _run_sync(self._preflight_service())
            if problem:
                problems.append(problem)
        if problems:
            raise PreflightError(
                f"remote sandbox backend ({self.config.base_url}): " + "; ".join(problems)
            )

    async def _preflight_service(self) -> str | None:
        """The service answers, accepts the token and creates + deletes a test sandbox."""
        probe = RemoteBackend(self.config)
        try:
            api = probe._client()
            try:
                await api.list_ids({CLIENT_TAG: probe.client_tag}, max_pages=1)
            except RemoteServiceError as e:
                if e.tls:
                    return str(e)  # says "TLS ..." and what failed
                if e.status in (401, 403):
                    return f"the service rejects the token from {self.config.token_env} ({e})"
                return f"the service does not answer: {e}"
            t0 = time.monotonic()
            try:
                sid = await probe._new_sandbox()
                await probe._wait_running(
                    sid, asyncio.get_running_loop().time() + self.config.boot_timeout_s
                )
            except SandboxError as e:
                return f"a test sandbox could not be created: {e}"
            try:
                await probe._release(sid, None, None)
            except SandboxError as e:
                return f"the test sandbox {sid} could not be deleted: {e}"
            _log.info(
                "remote preflight: test sandbox booted and deleted in %.1f s", time.monotonic() - t0
            )
            return None
        finally:
            await probe.aclose()


def _run_sync(coro: Any) -> Any:
    """Runs a coroutine to completion from sync code, also when this thread runs a loop."""
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = asyncio.run(coro)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            out["error"] = e

    thread = threading.Thread(target=target, name="remote-preflight")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out.get("value")
