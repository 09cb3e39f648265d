"""The ``local`` sandbox backend: jailed Xvfb desktops on this machine, no VM.

A sandbox is one ``LocalDesktop`` (see ``desktop.py`` for the jail) initialised for one task: its
setup steps run once through the in-VM server protocol (``run_setup``). Actions run inside the
jail: pyautogui code (and computer_13 actions, translated to pyautogui code) is executed by the
jail's system python3 against the project's xdotool-backed ``pyautogui`` shim.

Fork (``fork(sandbox, n)``) copies the initialised sandbox's FILESYSTEM and restarts programs:

- copied (``cp -a``, byte-exact, ownership and timestamps kept): everything the sandbox wrote
  under ``/home/user`` (files, app configs, caches, recently-used lists) and ``/tmp`` (minus the
  X, ICE and dbus sockets, which belong to the running session), and the host-side work dir of
  setup outputs (``execute`` steps' saved stdout/stderr that ``cache_file`` getters read).
- not copied: any process state: open windows, their positions and focus, the mouse position,
  clipboard, unsaved edits in an app's memory, undo history, running shells, the X server's
  state, the session and at-spi buses. Each fork starts a fresh desktop on the copied filesystem
  and re-runs only the task's program-starting setup steps (``fork_rerun_step_types``: launch,
  open, activate/close window, sleep), so a fork equals the source right after its setup as long
  as setup did its work through files (which OSWorld setups do: download/upload files, then open
  them). A file an app rewrites at the instant of the snapshot may be copied half-written.

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
import dataclasses
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from osworld_jax.env.backend import (
    PreflightError,
    SandboxBackend,
    SandboxCreateError,
    SandboxError,
    SandboxTimeout,
)
from osworld_jax.env.local.desktop import LocalDesktop, build_jail_argv, prepare_shared_dir
from osworld_jax.env.setup import SetupContext, run_setup
from osworld_jax.env.vm_sandbox import VMSandbox, setup_context

if TYPE_CHECKING:
    from osworld_jax.env.tasks import Task

__all__ = ["LocalBackend", "LocalBackendConfig", "LocalSandbox"]

_log = logging.getLogger(__name__)


# Binaries the jail needs, with the Debian package that ships each.
REQUIRED_BINARIES = {
    "bwrap": "bubblewrap",
    "Xvfb": "xvfb",
    "xdotool": "xdotool",
    "wmctrl": "wmctrl",
    "dbus-run-session": "dbus",
    "cp": "coreutils",
}
DEFAULT_OPENERS: tuple[tuple[str, str], ...] = (
    (".txt", "mousepad"),
    (".md", "mousepad"),
    (".py", "mousepad"),
    (".json", "mousepad"),
    (".log", "mousepad"),
    (".sh", "mousepad"),
    (".html", "mousepad"),
    (".xml", "mousepad"),
    (".csv", "libreoffice --calc"),
    (".xlsx", "libreoffice --calc"),
    (".xls", "libreoffice --calc"),
    (".ods", "libreoffice --calc"),
    (".docx", "libreoffice --writer"),
    (".doc", "libreoffice --writer"),
    (".odt", "libreoffice --writer"),
    (".pptx", "libreoffice --impress"),
    (".odp", "libreoffice --impress"),
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalBackendConfig:
    """Configuration of the ``local`` backend.

    Attributes:
      root: directory holding the sandboxes' directories; None = a fresh temporary directory
        (removed by ``aclose``).
      screen_width: Xvfb screen width in pixels.
      screen_height: Xvfb screen height in pixels.
      window_manager: the window manager command run inside each desktop.
      start_timeout_s: deadline for a desktop to start (Xvfb, window manager, server).
      rpc_timeout_s: default deadline of one in-VM server request.
      step_timeout_s: deadline of one command in the desktop (an action's code, an ``execute``
        step): past it the command is killed and reported as a result (returncode -9).
      open_timeout_s: how long ``open`` setup steps wait for the file's window.
      settle_s: pause after an action before observing (lets the screen repaint).
      wait_action_s: how long a WAIT action pauses.
      observe_a11y: include the accessibility tree in observations.
      observe_terminal: include the focused terminal's text in observations.
      openers: (file suffix, command) pairs the in-VM ``open_file`` uses, first match wins.
      cache_dir: the task file cache for ``download`` steps and ``cloud_file`` getters; None =
        ``osworld_jax.env.cache``'s default.
      host_uid: unprivileged host uid the jail runs as when the host process is root (the jail
        then cannot read root-only host files); ignored when not root.
      max_processes: ``RLIMIT_NPROC`` of the jails when they run as ``host_uid``: processes and
        threads of ALL jails together (they share that host uid); a fork bomb hits it, not the
        host.
      extra_ro_binds: further host paths mounted read-only at the same place in each jail
        (e.g. an app installed under ``/opt``).
      warm_pool: how many idle desktops (jail, Xvfb, window manager, server; empty home) to
        keep started ahead of need. ``create`` and ``fork`` take one when available (a fork's
        files are then copied into its home) and the pool refills in the background. Idle pool
        desktops are not sandboxes: ``inventory`` does not list them; ``aclose`` stops them.
      fork_rerun_step_types: the setup step types a fork re-runs on its copied filesystem.
    """

    root: str | None = None
    screen_width: int = 1920
    screen_height: int = 1080
    window_manager: str = "openbox --sm-disable"
    start_timeout_s: float = 30.0
    rpc_timeout_s: float = 120.0
    step_timeout_s: float = 120.0
    open_timeout_s: float = 30.0
    settle_s: float = 0.1
    wait_action_s: float = 1.0
    observe_a11y: bool = True
    observe_terminal: bool = True
    openers: tuple[tuple[str, str], ...] = DEFAULT_OPENERS
    cache_dir: str | None = None
    host_uid: int = 65534
    max_processes: int = 4096
    extra_ro_binds: tuple[str, ...] = ()
    warm_pool: int = 0
    fork_rerun_step_types: tuple[str, ...] = (
        "launch",
        "open",
        "activate_window",
        "close_window",
        "sleep",
    )

    def __post_init__(self) -> None:
        if self.screen_width <= 0 or self.screen_height <= 0:
            raise ValueError(
                f"LocalBackendConfig.screen_width/height must be > 0, got "
                f"{self.screen_width}x{self.screen_height}"
            )
        for name in ("start_timeout_s", "rpc_timeout_s", "step_timeout_s", "open_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"LocalBackendConfig.{name} must be > 0")
        if self.warm_pool < 0:
            raise ValueError(f"LocalBackendConfig.warm_pool must be >= 0, got {self.warm_pool}")


class LocalSandbox(VMSandbox):
    """A jailed local desktop initialised for one task (observe/step/evaluate: ``VMSandbox``).

    Attributes:
      id: the sandbox id.
      task: the task it was set up for.
      desktop: the running desktop (jail, processes, ``VMClient`` as ``desktop.client``).
      vm: the desktop's in-VM protocol client.
      work_dir: host-side directory of setup outputs (``execute`` steps' saved stdout/stderr).
    """

    def __init__(self, backend: LocalBackend, desktop: LocalDesktop, task: Task) -> None:
        cfg = backend.config
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
        self._backend = backend

    async def close(self) -> None:
        """Kills the jail's process tree and removes its directory; idempotent."""
        await self.desktop.close()


class LocalBackend(SandboxBackend[LocalSandbox]):
    """Creates, forks and tracks jailed local desktops (see the module docstring)."""

    name = "local"
    sandbox_type = LocalSandbox
    config_class = LocalBackendConfig
    runs_on_host = True

    def __init__(self, config: LocalBackendConfig | None = None) -> None:
        self.config = config if config is not None else LocalBackendConfig()
        self._root: Path | None = Path(self.config.root) if self.config.root else None
        self._own_root = self.config.root is None
        self._shared: Path | None = None
        self._live: dict[str, LocalSandbox] = {}
        self._desktops: dict[str, LocalDesktop] = {}
        self._pool: list[LocalDesktop] = []
        self._pool_tasks: set[asyncio.Task[None]] = set()

    # -- capabilities and preflight ---------------------------------------------------------

    @classmethod
    def capability_reasons(cls, task: Task) -> list[str]:
        """Local-only limits: files that ``open`` steps open but no configured app opens."""
        reasons = []
        for step in task.config:
            if step.type != "open":
                continue
            path = str(step.parameters.get("path", ""))
            suffixes = [s for s, _ in DEFAULT_OPENERS if path.lower().endswith(s)]
            if not suffixes and shutil.which("xdg-open") is None and shutil.which(path) is None:
                reasons.append(f"no local application opens {path!r}")
        return reasons

    @property
    def _host_uid(self) -> int | None:
        return self.config.host_uid if os.geteuid() == 0 else None

    def preflight(self) -> None:
        """Checks the binaries and that bubblewrap can create its namespaces here."""
        problems = []
        missing = [f"{b} (apt {p})" for b, p in REQUIRED_BINARIES.items() if not shutil.which(b)]
        wm = shlex.split(self.config.window_manager)[0]
        if not shutil.which(wm):
            missing.append(wm)
        if not Path("/usr/bin/python3").exists():
            missing.append("/usr/bin/python3 (apt python3)")
        if missing:
            problems.append("missing " + ", ".join(missing))
        else:
            probe = subprocess.run(
                [
                    "/usr/bin/python3",
                    "-c",
                    "import Xlib.display, pyatspi",
                ],
                capture_output=True,
                text=True,
                check=False,
            )
            if probe.returncode != 0:
                last = probe.stderr.strip().splitlines()[-1:] or ["?"]
                problems.append(f"system python3 lacks python3-xlib/python3-pyatspi ({last[0]})")
            err = self._probe_bwrap()
            if err:
                problems.append(err)
        if self.config.root is not None:
            root = Path(self.config.root)
            probe_at = root if root.exists() else root.parent
            if probe_at.exists():
                blocked = _untraversable_ancestor(probe_at, self._host_uid)
                if blocked is not None:
                    problems.append(
                        f"root {root}: {blocked} is not searchable by the jail's host uid "
                        f"{self._host_uid}"
                    )
        if problems:
            raise PreflightError(
                "local sandbox backend cannot run here: "
                + "; ".join(problems)
                + " (run scripts/setup.sh as root)"
            )

    def _probe_bwrap(self) -> str | None:
        argv = ["bwrap", "--unshare-all", "--die-with-parent", "--uid", "1000", "--gid", "1000"]
        argv += ["--ro-bind", "/usr", "/usr", "--proc", "/proc", "--dev", "/dev"]
        for top in ("bin", "lib", "lib64"):
            host = Path("/") / top
            if host.is_symlink():
                argv += ["--symlink", os.readlink(host), f"/{top}"]
            elif host.is_dir():
                argv += ["--ro-bind", str(host), f"/{top}"]
        argv += ["--", "/usr/bin/true"]
        kwargs: dict[str, Any] = {}
        if self._host_uid is not None:
            kwargs.update(user=self._host_uid, group=self._host_uid, extra_groups=[])
        try:
            res = subprocess.run(
                argv, capture_output=True, text=True, check=False, timeout=20, **kwargs
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"bwrap probe failed: {e}"
        if res.returncode != 0:
            return (
                f"bwrap cannot create namespaces here ({res.stderr.strip()[:200]}); "
                "unprivileged user namespaces must be enabled"
            )
        return None

    # -- sandboxes --------------------------------------------------------------------------

    def _ensure_dirs(self) -> tuple[Path, Path]:
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="osworld_jax-local-"))
        self._root.mkdir(parents=True, exist_ok=True)
        self._root.chmod(0o711)
        blocked = _untraversable_ancestor(self._root, self._host_uid)
        if blocked is not None:
            raise SandboxCreateError(
                f"LocalBackendConfig.root {self._root}: {blocked} is not traversable by the jail's "
                f"host uid {self._host_uid}; choose a root under a world-searchable directory"
            )
        if self._shared is None:
            shared = self._root / "_shared"
            prepare_shared_dir(shared, self._host_uid)
            self._shared = shared
        return self._root, self._shared

    async def _start_desktop(
        self, populate: Path | None = None, *, pooled: bool = False
    ) -> LocalDesktop:
        """A desktop for a sandbox: from the warm pool when one is idle, else started now.

        ``populate``: a snapshot directory (home/, tmp/, work/) whose files the desktop gets.
        ``pooled``: start one for the pool (not listed by ``inventory``).
        """
        if not pooled and self._pool:
            desktop = self._pool.pop()
            self._top_up_pool()
            self._desktops[desktop.id] = desktop
            try:
                if populate is not None:  # merge home/, tmp/, work/ into the live directories
                    await _copy_tree(populate, dst=desktop.dir, contents=True)
            except BaseException:
                await self._discard(desktop)
                raise
            return desktop
        if not pooled:
            self._top_up_pool()
        root, shared = self._ensure_dirs()
        sid = f"local-{uuid.uuid4().hex[:12]}"
        sdir = root / sid
        if populate is None:
            LocalDesktop.make_dirs(sdir, self._host_uid)
        else:
            await _copy_tree(populate, dst=sdir)
            for sub in ("run", "log"):
                (sdir / sub).mkdir(exist_ok=True)
                if self._host_uid is not None:
                    os.chown(sdir / sub, self._host_uid, self._host_uid)
        (sdir / "work").mkdir(exist_ok=True)
        desktop = LocalDesktop(sid, sdir, on_close=self._forget)
        if not pooled:
            self._desktops[sid] = desktop
        cfg = self.config
        argv = build_jail_argv(
            sandbox_dir=sdir,
            shared_dir=shared,
            width=cfg.screen_width,
            height=cfg.screen_height,
            openers=cfg.openers,
            window_manager=cfg.window_manager,
            open_timeout_s=cfg.open_timeout_s,
            start_timeout_s=cfg.start_timeout_s,
            exec_timeout_s=cfg.step_timeout_s,
            extra_ro_binds=cfg.extra_ro_binds,
        )
        try:
            await desktop.start(
                argv,
                host_uid=self._host_uid,
                start_timeout_s=cfg.start_timeout_s,
                rpc_timeout_s=cfg.rpc_timeout_s,
                max_processes=cfg.max_processes,
            )
        except BaseException:
            await self._discard(desktop)
            raise
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
        sandbox = LocalSandbox(self, desktop, task)
        self._live[desktop.id] = sandbox
        return sandbox

    def _forget(self, sandbox_id: str) -> None:
        self._live.pop(sandbox_id, None)
        self._desktops.pop(sandbox_id, None)

    async def snapshot(self, sandbox: LocalSandbox) -> Path:
        """Copies the sandbox's filesystem state (home, tmp, work) into a new directory."""
        root, _ = self._ensure_dirs()
        snap = root / f"_snap-{sandbox.id}-{uuid.uuid4().hex[:6]}"
        snap.mkdir(mode=0o711)
        subs = [sandbox.desktop.dir / s for s in ("home", "tmp", "work")]
        await _copy_tree(*[p for p in subs if p.exists()], dst=snap)
        await asyncio.to_thread(_drop_session_files, snap / "tmp")
        return snap

    async def _fork(self, sandbox: LocalSandbox, n: int) -> list[LocalSandbox]:
        """Returns n sandboxes started from a copy of ``sandbox``'s files (module doc)."""
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
            await asyncio.to_thread(shutil.rmtree, snap, True)
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
        if self._root is not None and self._shared is not None:
            await asyncio.to_thread(shutil.rmtree, self._shared, True)
            self._shared = None
        if self._own_root and self._root is not None:
            await asyncio.to_thread(shutil.rmtree, self._root, True)
            self._root = None


def _untraversable_ancestor(path: Path, uid: int | None) -> Path | None:
    """The first ancestor of ``path`` that ``uid`` (an unprivileged "other") cannot search."""
    if uid is None:
        return None
    for p in [path.resolve(), *path.resolve().parents]:
        st = p.stat()
        if st.st_uid != uid and not st.st_mode & 0o001:
            return p
    return None


async def _copy_tree(*srcs: Path, dst: Path, contents: bool = False) -> None:
    """One ``cp -a`` (ownership, modes, timestamps, symlinks kept; reflinks where possible).

    One source and no existing ``dst``: ``dst`` becomes a copy of it. Several sources: copied into
    the existing directory ``dst``. ``contents``: what the single source holds is merged into the
    existing directory ``dst``.
    """
    if contents:
        args = [f"{srcs[0]}/.", str(dst)]
    elif len(srcs) == 1:
        args = [str(srcs[0]), str(dst)]
    else:
        args = [*map(str, srcs), f"{dst}/"]
    proc = await asyncio.create_subprocess_exec(
        "cp",
        "-a",
        "--reflink=auto",
        *args,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise SandboxCreateError(f"copy {srcs} -> {dst} failed: {err.decode(errors='replace')}")


def _drop_session_files(tmp: Path) -> None:
    """Removes the running session's sockets and locks from a copied /tmp."""
    if not tmp.exists():
        return
    for name in (".X11-unix", ".ICE-unix", ".X0-lock", ".font-unix", ".XIM-unix"):
        p = tmp / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        elif p.exists() or p.is_symlink():
            p.unlink()
    for p in list(tmp.rglob("*")):
        with contextlib.suppress(OSError):
            if p.is_socket() or p.name.startswith("dbus-"):
                p.unlink()
