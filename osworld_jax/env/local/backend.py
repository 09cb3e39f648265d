"""The ``local`` sandbox backend: jailed Xvfb desktops on this machine, no VM.

A sandbox is one ``LocalDesktop`` (``desktop.py``: the running jail; ``jail.py``: what it is
started with) initialised for one task: its setup steps run once through the in-VM server protocol
(``run_setup``); it is then a ``LocalSandbox`` (``sandbox.py``: actions run in the jail, limit
checks). The rest of the backend lives beside it: ``config.py`` (``LocalBackendConfig``, the
limits), ``preflight.py`` (what must be on this machine), ``snapshot.py`` (what a fork copies and
what it restarts).

Fork (``fork(sandbox, n)``) copies the initialised sandbox's FILESYSTEM (home, /tmp, the host-side
work dir) into n fresh desktops and re-runs only the task's program-starting setup steps
(``fork_rerun_step_types``); no process state is copied (the full list: ``snapshot.py``).

Warm pool (``LocalBackendConfig.warm_pool``, default 0): idle desktops started ahead of need.
``create`` and ``fork`` take one when available (a fork's snapshot is then copied into the live
home and /tmp directories, which are bind mounts, before its launch/open steps run), so their cost
is the task's own setup; the pool refills in the background. Idle pool desktops are not sandboxes
(``inventory`` does not list them); ``aclose`` stops them.

Cost per desktop and the create/fork/step times are measured by ``benchmarks/sandbox.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import resource
import tempfile
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from osworld_jax.env.backend import (
    PreflightError,
    SandboxBackend,
    SandboxCreateError,
    SandboxError,
    SandboxTimeout,
)
from osworld_jax.env.local import apps, limits, preflight, snapshot, sysmount
from osworld_jax.env.local.config import DEFAULT_OPENERS, LocalBackendConfig
from osworld_jax.env.local.desktop import LocalDesktop
from osworld_jax.env.local.jail import JailSpec
from osworld_jax.env.local.sandbox import LocalSandbox
from osworld_jax.env.local.sysroot import SystemRoot
from osworld_jax.env.setup import SetupContext, run_setup
from osworld_jax.env.vm_sandbox import setup_context

if TYPE_CHECKING:
    from osworld_jax.env.tasks import Task

__all__ = ["LocalBackend", "LocalBackendConfig", "LocalSandbox"]

_log = logging.getLogger(__name__)


class LocalBackend(SandboxBackend[LocalSandbox]):
    """Creates, forks and tracks jailed local desktops (see the module docstring)."""

    name = "local"
    sandbox_type = LocalSandbox
    config_class = LocalBackendConfig
    runs_on_host = True

    def __init__(self, config: LocalBackendConfig | None = None) -> None:
        self.config = config if config is not None else LocalBackendConfig()
        self.system = _system(self.config)
        self._root: Path | None = Path(self.config.root) if self.config.root else None
        self._own_root = self.config.root is None
        self._cgroups: limits.CgroupSupport | None = None
        self._live: dict[str, LocalSandbox] = {}
        self._desktops: dict[str, LocalDesktop] = {}
        self._pool: list[LocalDesktop] = []
        self._pool_tasks: set[asyncio.Task[None]] = set()
        self._sysmount = sysmount.RootMount(self.system)
        self._sysmount_lock = threading.Lock()
        self._system_dir: Path | None = None  # where the jails' system binds come from
        self._sysmount_warned = False

    # -- capabilities and preflight ---------------------------------------------------------

    @staticmethod
    def has_app(name: str, config: LocalBackendConfig | None = None) -> bool:
        """Whether program ``name`` runs inside the jail (``apps.has_app``: the wrappers in
        ``/opt/osworld/bin``, then the jail's PATH, or an absolute path the jail mounts), in
        the jail's system (``config.system_root``; None: the host's).
        """  # noqa: D205
        return apps.has_app(name, _system(config))

    @classmethod
    def capability_reasons(cls, task: Task, config: LocalBackendConfig | None = None) -> list[str]:
        """Local-only limits: files that ``open`` steps open but no configured app opens."""
        system = _system(config)
        reasons = []
        for step in task.config:
            if step.type != "open":
                continue
            path = str(step.parameters.get("path", ""))
            suffixes = [s for s, _ in DEFAULT_OPENERS if path.lower().endswith(s)]
            if not suffixes and system.which("xdg-open") is None and system.which(path) is None:
                reasons.append(f"no local application opens {path!r}")
        return reasons

    @property
    def _root_user(self) -> bool:
        return os.geteuid() == 0

    @property
    def _host_uid(self) -> int | None:
        return self.config.host_uid if self._root_user else None

    def _limit_support(self) -> limits.CgroupSupport:
        if self._cgroups is None:
            self._cgroups = limits.detect(self.config.cgroup)
            if self._cgroups.version is not None:
                limits.sweep_stale(self._cgroups)
        return self._cgroups

    def limit_mechanisms(self) -> dict[str, str]:
        """How each configured limit is enforced here (``preflight.limit_mechanisms``).

        Raises ``PreflightError`` when a limit the config asks for cannot be enforced (never
        silently runs without it).
        """
        return preflight.limit_mechanisms(
            self.config, self._limit_support(), root_user=self._root_user
        )

    def preflight(self, tasks: Sequence[Task] | None = None) -> None:
        """Checks the binaries, that bubblewrap can create its namespaces here, the limits, and
        the desktop applications.

        Applications (``apps.APPS``): with ``tasks``, every program those tasks start must run in
        the jail (a missing one is a ``PreflightError`` naming it, the tasks that need it and the
        packages), and each application they need is started once in a jailed desktop with the
        configured limits (``App.probe``), so an install the jail cannot run fails here; without
        ``tasks``, a missing application is only logged (its tasks are not runnable here).
        """  # noqa: D205
        problems = preflight.host_problems(self.config.window_manager, self._host_uid, self.system)
        if problems:
            fix = "run scripts/setup.sh as root"
            if self.system.path is not None:
                fix = "LocalBackendConfig.system_root: see scripts/offline_install.sh"
            raise PreflightError(
                "local sandbox backend cannot run here: " + "; ".join(problems) + f" ({fix})"
            )
        mechanisms = self.limit_mechanisms()
        self._warn_system_mount()
        self._check_apps(tasks)
        fallbacks = {k: v for k, v in mechanisms.items() if "RLIMIT" in v}
        if fallbacks:
            _log.warning(
                "local backend: no cgroup for %s (%s); using %s",
                ", ".join(fallbacks),
                self._limit_support().reason,
                fallbacks,
            )

    def _system_mount_unavailable(self) -> str | None:
        """Why the jails' system cannot come from a filesystem of its own (``sysmount``), in
        one line, or None (no system root, the root is one already, or a tmpfs copy can be
        mounted here)."""  # noqa: D205, D209
        root = self.system.path
        if root is None or sysmount.filesystem_root(root):
            return None
        why = sysmount.unavailable()
        if why is None:
            return None
        return (
            f"local backend: system root {root}: {why}; the jails run, but their "
            f"/proc/self/mountinfo shows its host path (run as root to hide it, docs/SECURITY.md)"
        )

    def _warn_system_mount(self) -> bool:
        """Logs ``_system_mount_unavailable`` once per backend; whether there was a reason."""
        why = self._system_mount_unavailable()
        if why and not self._sysmount_warned:
            _log.warning("%s", why)
            self._sysmount_warned = True
        return why is not None

    async def _system_source(self) -> Path | None:
        """The directory the jails' system binds come from: a tmpfs copy of the system root,
        made at the first desktop (``sysmount.RootMount``); None: the host's own system."""  # noqa: D205, D209
        if self._system_dir is not None or self.system.path is None:
            return self._system_dir
        return await asyncio.to_thread(self._system_source_once)

    def _system_source_once(self) -> Path:
        """``_system_source`` under a thread lock (desktops start concurrently; no loop bound)."""
        assert self.system.path is not None
        with self._sysmount_lock:
            if self._system_dir is not None:
                return self._system_dir
            if sysmount.filesystem_root(self.system.path) or self._warn_system_mount():
                self._system_dir = self.system.path  # bound as it is
                return self._system_dir
            try:
                self._system_dir = self._sysmount.open()
            except OSError as e:
                raise SandboxCreateError(
                    f"system root {self.system.path}: cannot copy it to a private tmpfs: {e}"
                ) from e
            assert self._system_dir is not None
            return self._system_dir

    def _check_apps(self, tasks: Sequence[Task] | None) -> None:
        needed = preflight.check_installed(tasks, lambda a: self.has_app(a, self.config))
        if tasks is None:
            absent = [a.name for a in apps.APPS if not apps.installed(a, self.system)]
            if absent:
                where = "bash scripts/setup.sh --apps"
                if self.system.path is not None:
                    where = f"system root {self.system.path} has none of them"
                _log.warning(
                    "local backend: not installed: %s; the tasks that start them are not "
                    "runnable here (%s)",
                    ", ".join(absent),
                    where,
                )
            return
        names = {x for a in needed for x in a.split("|")}
        probe = [a for a in apps.APPS if apps.installed(a, self.system) and names & set(a.commands)]
        if probe:
            failed = preflight.run_in_thread(self._probe_apps(probe))
            if failed:
                raise PreflightError(
                    "local sandbox backend: applications that do not run in the jail: "
                    + "; ".join(failed)
                )

    async def _probe_apps(self, probe: Sequence[apps.App]) -> list[str]:
        """Runs each app's probe command in one jailed desktop; the failures, one line each."""
        desktop = await self._start_desktop()
        try:
            failed = []
            for app in probe:
                res = await desktop.client.execute(list(app.probe))
                if res.get("returncode") != 0:
                    err = str(res.get("error") or res.get("output") or "").strip()[-200:]
                    failed.append(f"{' '.join(app.probe)} -> {res.get('returncode')}: {err}")
            return failed
        finally:
            await self._discard(desktop)

    # -- sandboxes --------------------------------------------------------------------------

    def _ensure_root(self) -> Path:
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="osworld_jax-local-"))
        self._root.mkdir(parents=True, exist_ok=True)
        self._root.chmod(0o700)  # the jails never mount anything of it
        return self._root

    def _spec(self, system_dir: Path | None = None) -> JailSpec:
        cfg = self.config
        return JailSpec(
            width=cfg.screen_width,
            height=cfg.screen_height,
            openers=cfg.openers,
            window_manager=cfg.window_manager,
            open_timeout_s=cfg.open_timeout_s,
            start_timeout_s=cfg.start_timeout_s,
            exec_timeout_s=cfg.step_timeout_s,
            home_bytes=cfg.home_bytes,
            tmp_bytes=cfg.tmp_bytes,
            shm_bytes=cfg.shm_bytes,
            max_output_bytes=cfg.max_output_bytes,
            max_file_bytes=cfg.max_file_bytes,
            extra_ro_binds=cfg.extra_ro_binds,
            system_root=cfg.system_root,
            system_dir=None if system_dir is None else str(system_dir),
        )

    async def _start_desktop(
        self, populate: Path | None = None, *, pooled: bool = False
    ) -> LocalDesktop:
        """A desktop for a sandbox: from the warm pool when one is idle, else started now.

        ``populate``: a snapshot directory (home/, tmp/, work/) whose files the desktop gets,
        copied into the running jail's home and /tmp (its tmpfs) and its host work dir.
        ``pooled``: start one for the pool (not listed by ``inventory``).
        """
        if not pooled and self._pool:
            desktop = self._pool.pop()
            self._top_up_pool()
            self._desktops[desktop.id] = desktop
        else:
            if not pooled:
                self._top_up_pool()
            desktop = await self._launch(pooled)
        if populate is not None:
            try:
                await snapshot.populate(desktop, populate)
            except BaseException:
                await self._discard(desktop)
                raise
        return desktop

    async def _launch(self, pooled: bool) -> LocalDesktop:
        cfg = self.config
        mechanisms = self.limit_mechanisms()
        system_dir = await self._system_source()
        root = self._ensure_root()
        sid = f"local-{uuid.uuid4().hex[:12]}"
        sdir = root / sid
        LocalDesktop.make_dirs(sdir)
        desktop = LocalDesktop(sid, sdir, on_close=self._forget, max_body_bytes=cfg.max_body_bytes)
        if not pooled:
            self._desktops[sid] = desktop
        host_uid = self._host_uid
        rlimits: dict[int, int] = {}
        if mechanisms.get("processes", "").startswith("RLIMIT") and cfg.max_processes:
            host_uid = random.randrange(*cfg.host_uid_range)
            rlimits[resource.RLIMIT_NPROC] = cfg.max_processes
        if mechanisms.get("memory", "").startswith("RLIMIT") and cfg.memory_bytes:
            rlimits[resource.RLIMIT_AS] = cfg.memory_bytes
        try:
            cgroup = None
            sup = self._limit_support()
            if sup.version is not None:
                cgroup = limits.JailCgroup(
                    sup,
                    sid,
                    max_processes=cfg.max_processes,
                    memory_bytes=cfg.memory_bytes,
                )
            await desktop.start(
                self._spec(system_dir),
                host_uid=host_uid,
                start_timeout_s=cfg.start_timeout_s,
                rpc_timeout_s=cfg.rpc_timeout_s,
                cgroup=cgroup,
                rlimits=rlimits,
            )
        except BaseException as e:
            await self._discard(desktop)
            if isinstance(e, OSError):
                raise SandboxCreateError(f"sandbox {sid}: cannot set up its limits: {e}") from e
            raise
        desktop.host_uid = host_uid
        return desktop

    async def _discard(self, desktop: LocalDesktop) -> None:
        await asyncio.shield(desktop.close())

    # -- warm pool --------------------------------------------------------------------------

    def _top_up_pool(self) -> None:
        """Starts background desktop launches until the pool (idle + starting) is full."""
        while len(self._pool) + len(self._pool_tasks) < self.config.warm_pool:
            task = asyncio.get_running_loop().create_task(self._fill_one())
            self._pool_tasks.add(task)
            task.add_done_callback(self._pool_tasks.discard)

    async def _fill_one(self) -> None:
        try:
            desktop = await self._start_desktop(pooled=True)
        except Exception as e:  # noqa: BLE001 - a failed warm start only means a cold start later
            _log.warning("local backend: warm pool desktop failed to start: %s", e)
            return
        self._pool.append(desktop)

    async def warm_up(self) -> None:
        """Fills the warm pool (``LocalBackendConfig.warm_pool`` desktops) and waits for it."""
        self._top_up_pool()
        await self.wait_pool_full()

    async def wait_pool_full(self) -> None:
        """Waits until every pool launch in flight has finished."""
        while self._pool_tasks:
            await asyncio.gather(*list(self._pool_tasks), return_exceptions=True)

    async def start_desktop(self) -> LocalDesktop:
        """A bare jailed desktop with no task (tests, benchmarks); close it with ``close()``.

        It is listed by ``inventory`` until closed.
        """
        return await self._start_desktop()

    def _setup_ctx(self, task: Task, desktop: LocalDesktop) -> SetupContext:
        return setup_context(task, cache_dir=self.config.cache_dir, work_dir=desktop.dir / "work")

    async def create(self, task: Task) -> LocalSandbox:
        """Starts a desktop and runs the task's setup steps in it."""
        desktop = await self._start_desktop()
        try:
            await run_setup(task.config, desktop.client, ctx=self._setup_ctx(task, desktop))
        except BaseException as e:
            await self._discard(desktop)
            if isinstance(e, SandboxCreateError | SandboxTimeout) or not isinstance(e, Exception):
                raise
            raise SandboxCreateError(f"task {task.id}: setup failed: {e}") from e
        return self._adopt(desktop, task)

    def _adopt(self, desktop: LocalDesktop, task: Task) -> LocalSandbox:
        sandbox = LocalSandbox(self.config, desktop, task)
        self._live[desktop.id] = sandbox
        return sandbox

    def _forget(self, sandbox_id: str) -> None:
        self._live.pop(sandbox_id, None)
        self._desktops.pop(sandbox_id, None)

    async def snapshot(self, sandbox: LocalSandbox) -> Path:
        """Copies the sandbox's filesystem state (home, tmp, work) into a new directory."""
        return await snapshot.snapshot(sandbox.desktop, self._ensure_root())

    async def _fork(self, sandbox: LocalSandbox, n: int) -> list[LocalSandbox]:
        """Returns n sandboxes started from a copy of ``sandbox``'s files (``snapshot.py``)."""
        snap = await self.snapshot(sandbox)
        task = sandbox.task

        async def one() -> LocalSandbox:
            desktop = await self._start_desktop(populate=snap)
            try:
                await run_setup(
                    task.config,
                    desktop.client,
                    only_types=self.config.fork_rerun_step_types,
                    ctx=self._setup_ctx(task, desktop),
                )
            except BaseException as e:
                await self._discard(desktop)
                if isinstance(e, SandboxCreateError | SandboxTimeout) or not isinstance(
                    e, Exception
                ):
                    raise
                raise SandboxCreateError(f"fork of {sandbox.id}: setup failed: {e}") from e
            return self._adopt(desktop, task)

        try:
            results = await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)
        finally:
            await asyncio.to_thread(limits.remove_tree, snap)
        good = [r for r in results if isinstance(r, LocalSandbox)]
        bad = [r for r in results if isinstance(r, BaseException)]
        if bad:
            for s in good:
                await asyncio.shield(s.close())
            err = bad[0]
            if isinstance(err, SandboxError | asyncio.CancelledError):
                raise err
            raise SandboxCreateError(f"fork of {sandbox.id}: {err!r}") from err
        return list(good)

    def inventory(self) -> list[str]:
        """Ids of the sandboxes (and bare desktops) started here and not yet closed."""
        return sorted(self._desktops)

    async def aclose(self) -> None:
        """Closes every live sandbox and pool desktop and removes the temporary root."""
        for task in list(self._pool_tasks):
            task.cancel()
        await asyncio.gather(*list(self._pool_tasks), return_exceptions=True)
        for desktop in [*self._desktops.values(), *self._pool]:
            with contextlib.suppress(Exception):
                await desktop.close()
        self._pool.clear()
        if self._own_root and self._root is not None:
            await asyncio.to_thread(limits.remove_tree, self._root)
            self._root = None
        self._sysmount.close()
        self._system_dir = None


def _system(config: LocalBackendConfig | None) -> SystemRoot:
    """Where ``config``'s jails take their system from (None: the defaults, the host's)."""
    return SystemRoot(config.system_root if config is not None else None)
