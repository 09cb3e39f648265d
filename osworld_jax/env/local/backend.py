"""The ``local`` sandbox backend: jailed Xvfb desktops on this machine, no VM.

A sandbox is one ``LocalDesktop`` (see ``desktop.py`` for the jail) initialised for one task: its
setup steps run once through the in-VM server protocol (``run_setup``). Actions run inside the
jail: pyautogui code (and computer_13 actions, translated to pyautogui code) is executed by the
jail's system python3 against the project's xdotool-backed ``pyautogui`` shim.

Limits (``LocalBackendConfig``; mechanisms and fallbacks in ``docs/SECURITY.md``): each sandbox
has its own process and memory limit (a cgroup per jail; without one, a distinct host uid per
sandbox with ``RLIMIT_NPROC`` and ``RLIMIT_AS``), size-capped tmpfs for its writable areas, a
cap on every reply the host reads and a wall-clock limit per action. A sandbox that exceeds its
memory or process limit, or whose action, file or tree is over the output cap, raises
``SandboxLimitError`` (the owner is masked) naming the limit; a full disk is the agent's own
``ENOSPC``; an action past its wall-clock limit is killed and reported as a result.

Fork (``fork(sandbox, n)``) copies the initialised sandbox's FILESYSTEM and restarts programs:

- copied (``cp -a``, byte-exact, ownership and timestamps kept): everything the sandbox wrote
  under ``/home/user`` (files, app configs, caches, recently-used lists; minus the running apps'
  lock files, ``apps.lock_file_expression``) and ``/tmp`` (minus the X, ICE and dbus sockets,
  which belong to the running session), and the host-side work dir of setup outputs
  (``execute`` steps' saved stdout/stderr that ``cache_file`` getters read).
- not copied: any process state: open windows, their positions and focus, the mouse position,
  clipboard, unsaved edits in an app's memory, undo history, running shells, the X server's
  state, the session and at-spi buses. Each fork starts a fresh desktop on the copied filesystem
  and re-runs only the task's program-starting setup steps (``fork_rerun_step_types``: launch,
  open, activate/close window, sleep, and the Chrome tab steps, which act on the running
  browser), so a fork equals the source right after its setup as long as setup did its work
  through files or these steps (which OSWorld setups do: download/upload files, then open
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
import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import random
import resource
import shlex
import shutil
import subprocess
import tempfile
import typing
import uuid
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from osworld_jax.env.actions import Action
from osworld_jax.env.backend import (
    Observation,
    PreflightError,
    SandboxBackend,
    SandboxCreateError,
    SandboxError,
    SandboxLimitError,
    SandboxTimeout,
)
from osworld_jax.env.capabilities import app_available, apps_needed
from osworld_jax.env.local import apps, limits
from osworld_jax.env.local.desktop import JailSpec, LocalDesktop
from osworld_jax.env.setup import SetupContext, run_setup
from osworld_jax.env.vm_sandbox import PYAUTOGUI_PREFIX, VMSandbox, setup_context

if TYPE_CHECKING:
    from osworld_jax.env.tasks import Task

__all__ = ["LocalBackend", "LocalBackendConfig", "LocalSandbox"]

_log = logging.getLogger(__name__)
T = TypeVar("T")


# Binaries the jail needs, with the Debian package that ships each.
REQUIRED_BINARIES = {
    "bwrap": "bubblewrap",
    "Xvfb": "xvfb",
    "xdotool": "xdotool",
    "wmctrl": "wmctrl",
    "dbus-run-session": "dbus",
    "cp": "coreutils",
    "tar": "tar",
    "prlimit": "util-linux",
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


#: How a jail's processes and memory are limited (see ``LocalBackendConfig.cgroup``).
Cgroup = Literal["auto", "v2", "v1", "none"]


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
      host_uid: unprivileged host uid the jails run as when the host process is root (the jail
        then cannot read root-only host files); ignored when not root. Without a pids cgroup each
        jail instead gets its own uid from ``host_uid_range``.
      host_uid_range: [first, last) host uids drawn at random, one per sandbox, when processes
        are limited by ``RLIMIT_NPROC`` (no pids cgroup; root only): the limit counts per uid,
        so a fork bomb in one jail leaves the others (and other runs' jails) their share.
      cgroup: how processes and memory are limited: "auto" (cgroup v2, else v1, else the
        rlimit fallback), "v2", "v1" (refuse to run without it) or "none" (rlimits only).
      max_processes: processes + threads of one sandbox (``pids.max``; fallback
        ``RLIMIT_NPROC`` of its own uid); None = unlimited. Reaching it raises
        ``SandboxLimitError('processes')`` at the next step (cgroup only).
      memory_bytes: memory of one sandbox, its tmpfs files included (``memory.max`` /
        ``memory.limit_in_bytes``; fallback ``RLIMIT_AS`` of each process); None = unlimited. An
        OOM kill raises ``SandboxLimitError('memory')`` at the next step (cgroup only).
      home_bytes: size of the tmpfs holding ``/home/user``.
      tmp_bytes: size of the tmpfs holding ``/tmp``.
      shm_bytes: size of each of ``/dev/shm``, ``/var/tmp`` and ``XDG_RUNTIME_DIR``.
      max_output_bytes: the most an action's or command's stdout (and, separately, stderr), the
        a11y tree, the terminal text or a directory listing may hold; over it the owner is
        masked (``SandboxLimitError('output_bytes')``).
      max_file_bytes: the largest file the host reads from a sandbox (``/file``: getters); over
        it ``SandboxLimitError('file_bytes')``.
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
    host_uid_range: tuple[int, int] = (1_000_000_000, 1_500_000_000)
    cgroup: Cgroup = "auto"
    max_processes: int | None = 1024
    memory_bytes: int | None = 4 << 30
    home_bytes: int = 2 << 30
    tmp_bytes: int = 1 << 30
    shm_bytes: int = 256 << 20
    max_output_bytes: int = 4 << 20
    max_file_bytes: int = 64 << 20
    extra_ro_binds: tuple[str, ...] = ()
    warm_pool: int = 0
    fork_rerun_step_types: tuple[str, ...] = (
        "launch",
        "open",
        "activate_window",
        "close_window",
        "sleep",
        "chrome_open_tabs",
        "chrome_close_tabs",
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
        if self.cgroup not in typing.get_args(Cgroup):
            raise ValueError(
                f"LocalBackendConfig.cgroup must be 'auto', 'v2', 'v1' or 'none', got "
                f"{self.cgroup!r}"
            )
        for name in ("home_bytes", "tmp_bytes", "shm_bytes", "max_output_bytes", "max_file_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"LocalBackendConfig.{name} must be > 0")
        for name in ("max_processes", "memory_bytes"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"LocalBackendConfig.{name} must be > 0 or None, got {value}")
        lo, hi = self.host_uid_range
        if not 0 < lo < hi < 2**32 - 1:
            raise ValueError(f"LocalBackendConfig.host_uid_range {self.host_uid_range} is invalid")

    @property
    def max_body_bytes(self) -> int:
        """The largest reply body the host reads (JSON escaping can grow text up to 6x)."""
        return self.max_file_bytes + 12 * self.max_output_bytes + (1 << 20)


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
        self._cgroups: limits.CgroupSupport | None = None
        self._live: dict[str, LocalSandbox] = {}
        self._desktops: dict[str, LocalDesktop] = {}
        self._pool: list[LocalDesktop] = []
        self._pool_tasks: set[asyncio.Task[None]] = set()

    # -- capabilities and preflight ---------------------------------------------------------

    @staticmethod
    def has_app(name: str) -> bool:
        """Whether program ``name`` runs inside the jail (``apps.has_app``: the wrappers in
        ``/opt/osworld/bin``, then the jail's PATH, or an absolute path the jail mounts).
        """  # noqa: D205
        return apps.has_app(name)

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
        """How each configured limit is enforced here, e.g. ``{"processes": "cgroup v1 pids"}``.

        Raises ``PreflightError`` when a limit the config asks for cannot be enforced (never
        silently runs without it).
        """
        cfg = self.config
        sup = self._limit_support()
        out: dict[str, str] = {}
        problems = []
        if cfg.max_processes is not None:
            if sup.pids_parent is not None:
                out["processes"] = f"cgroup {sup.version} pids.max"
            elif cfg.cgroup in ("v1", "v2"):
                problems.append(f"no {cfg.cgroup} pids cgroup ({sup.reason})")
            elif self._root_user:
                out["processes"] = "RLIMIT_NPROC of a distinct host uid per sandbox"
            else:
                problems.append(
                    "max_processes needs a pids cgroup or root (a distinct uid per sandbox); "
                    f"{sup.reason}; set LocalBackendConfig.max_processes = None to run without"
                )
        if cfg.memory_bytes is not None:
            if sup.memory_parent is not None:
                out["memory"] = f"cgroup {sup.version} memory"
            elif cfg.cgroup in ("v1", "v2"):
                problems.append(f"no {cfg.cgroup} memory cgroup ({sup.reason})")
            else:
                out["memory"] = "RLIMIT_AS per process"
        out["disk"] = "tmpfs size"
        out["output"] = "in-jail server + host reply cap"
        out["time"] = "in-jail server"
        if problems:
            raise PreflightError("local sandbox backend: " + "; ".join(problems))
        return out

    def preflight(self, tasks: Sequence[Task] | None = None) -> None:
        """Checks the binaries, that bubblewrap can create its namespaces here, the limits, and
        the desktop applications.

        Applications (``apps.APPS``): with ``tasks``, every program those tasks start must run in
        the jail (a missing one is a ``PreflightError`` naming it, the tasks that need it and the
        packages), and each application they need is started once in a jailed desktop with the
        configured limits (``App.probe``), so an install the jail cannot run fails here; without
        ``tasks``, a missing application is only logged (its tasks are not runnable here).
        """  # noqa: D205
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
                ["/usr/bin/python3", "-c", "import Xlib.display, pyatspi"],
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
        if problems:
            raise PreflightError(
                "local sandbox backend cannot run here: "
                + "; ".join(problems)
                + " (run scripts/setup.sh as root)"
            )
        mechanisms = self.limit_mechanisms()
        self._check_apps(tasks)
        fallbacks = {k: v for k, v in mechanisms.items() if "RLIMIT" in v}
        if fallbacks:
            _log.warning(
                "local backend: no cgroup for %s (%s); using %s",
                ", ".join(fallbacks),
                self._limit_support().reason,
                fallbacks,
            )

    def _check_apps(self, tasks: Sequence[Task] | None) -> None:
        needed: collections.Counter[str] = collections.Counter()
        for task in tasks or ():
            needed.update(apps_needed(task))
        missing = {a: n for a, n in needed.items() if not app_available(a, self.has_app)}
        if missing:
            packages = sorted({p for a in missing for p in _packages_for(a)})
            raise PreflightError(
                "local sandbox backend: the tasks start programs that are not installed here: "
                + ", ".join(f"{a} ({n} tasks)" for a, n in sorted(missing.items()))
                + (f" (apt {' '.join(packages)}: bash scripts/setup.sh --apps)" if packages else "")
            )
        if tasks is None:
            absent = [a.name for a in apps.APPS if not apps.installed(a)]
            if absent:
                _log.warning(
                    "local backend: not installed: %s; the tasks that start them are not "
                    "runnable here (bash scripts/setup.sh --apps)",
                    ", ".join(absent),
                )
            return
        names = {x for a in needed for x in a.split("|")}
        probe = [a for a in apps.APPS if apps.installed(a) and names & set(a.commands)]
        if probe:
            failed = _run_in_thread(self._probe_apps(probe))
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

    def _probe_bwrap(self) -> str | None:
        """None when a nested jail (user + pid namespaces, sized tmpfs) can be created here."""
        inner = "/usr/bin/bwrap --unshare-user --unshare-pid --dev-bind / / --proc /proc true"
        argv = ["bwrap", "--unshare-all", "--die-with-parent", "--uid", "1000", "--gid", "1000"]
        argv += ["--ro-bind", "/usr", "/usr", "--proc", "/proc", "--dev", "/dev"]
        argv += ["--size", str(1 << 20), "--tmpfs", "/tmp"]
        for top in ("bin", "lib", "lib64"):
            host = Path("/") / top
            if host.is_symlink():
                argv += ["--symlink", os.readlink(host), f"/{top}"]
            elif host.is_dir():
                argv += ["--ro-bind", str(host), f"/{top}"]
        argv += ["--", "/bin/sh", "-c", inner]
        kwargs: dict[str, Any] = {}
        if self._host_uid is not None:
            kwargs.update(user=self._host_uid, group=self._host_uid, extra_groups=[])
        try:
            res = subprocess.run(
                argv, capture_output=True, text=True, check=False, timeout=20, env={}, **kwargs
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"bwrap probe failed: {e}"
        if res.returncode != 0:
            return (
                f"bwrap cannot create its namespaces here ({res.stderr.strip()[:200]}); "
                "unprivileged user namespaces (nested), and bwrap >= 0.8 (--size) are needed"
            )
        return None

    # -- sandboxes --------------------------------------------------------------------------

    def _ensure_root(self) -> Path:
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="osworld_jax-local-"))
        self._root.mkdir(parents=True, exist_ok=True)
        self._root.chmod(0o700)  # the jails never mount anything of it
        return self._root

    def _spec(self) -> JailSpec:
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
                await self._populate(desktop, populate)
            except BaseException:
                await self._discard(desktop)
                raise
        return desktop

    async def _launch(self, pooled: bool) -> LocalDesktop:
        cfg = self.config
        mechanisms = self.limit_mechanisms()
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
                self._spec(),
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

    async def _populate(self, desktop: LocalDesktop, snap: Path) -> None:
        """Merges a snapshot's home/, tmp/ into the running jail and work/ into its host dir.

        Into the jail through a tar pipe whose writer runs as the jail's host uid: files in the
        jail's tmpfs must belong to a uid mapped in its user namespace (and then belong to the
        jail's user whatever jail the snapshot came from).
        """
        for sub, jail_dir in (("home", "/home/user"), ("tmp", "/tmp")):
            if (snap / sub).exists():
                await _copy_into_jail(snap / sub, desktop, jail_dir)
        if (snap / "work").exists():
            await _copy_tree(snap / "work", dst=desktop.dir / "work", contents=True)

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
        root = self._ensure_root()
        snap = root / f"_snap-{sandbox.id}-{uuid.uuid4().hex[:6]}"
        snap.mkdir(mode=0o700)
        desktop = sandbox.desktop
        try:
            await _copy_tree(desktop.host_path("/home/user"), dst=snap / "home")
            await _copy_tree(desktop.host_path("/tmp"), dst=snap / "tmp")
            await _copy_tree(desktop.dir / "work", dst=snap / "work")
            await asyncio.to_thread(_drop_session_files, snap / "tmp")
            await asyncio.to_thread(_drop_app_locks, snap / "home")
        except BaseException:
            await asyncio.to_thread(limits.remove_tree, snap)
            raise
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


def _packages_for(app: str) -> list[str]:
    """The Debian packages of the ``APPS`` entry one of ``a|b`` belongs to."""
    for name in app.split("|"):
        found = apps.app_for(name)
        if found is not None:
            return list(found.packages)
    return []


def _run_in_thread(coro: Coroutine[Any, Any, T]) -> T:
    """Runs ``coro`` to completion on a fresh event loop in a worker thread (a sync caller may
    itself be inside a running loop)."""  # noqa: D205, D209
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


async def _copy_into_jail(src: Path, desktop: LocalDesktop, jail_dir: str) -> None:
    """``tar`` the contents of ``src`` into ``jail_dir`` of the running jail (see ``_populate``)."""
    target, fd = desktop.inherited_path(jail_dir)
    read_end, write_end = os.pipe()
    kwargs: dict[str, Any] = {}
    if desktop.host_uid is not None:
        kwargs.update(user=desktop.host_uid, group=desktop.host_uid, extra_groups=[])
    try:
        reader = await asyncio.create_subprocess_exec(
            "tar",
            "-C",
            str(src),
            "--sparse",
            "-cf",
            "-",
            ".",
            stdout=write_end,
            stderr=asyncio.subprocess.PIPE,
        )
        writer = await asyncio.create_subprocess_exec(
            "tar",
            "-C",
            target,
            "--no-same-owner",
            "-xpf",
            "-",
            stdin=read_end,
            stderr=asyncio.subprocess.PIPE,
            pass_fds=(fd,),
            **kwargs,
        )
    finally:
        os.close(read_end)
        os.close(write_end)
    (_, rerr), (_, werr) = await asyncio.gather(reader.communicate(), writer.communicate())
    if reader.returncode or writer.returncode:
        err = (rerr + werr).decode(errors="replace").strip()[-400:]
        raise SandboxCreateError(f"sandbox {desktop.id}: copying files into {jail_dir}: {err}")


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


def _drop_app_locks(home: Path) -> None:
    """Removes the running apps' lock files from a copied home (``apps.lock_file_expression``)."""
    if home.exists():
        subprocess.run(
            ["find", str(home), "-xdev", *apps.lock_file_expression(), "-delete"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=False,
        )


def _drop_session_files(tmp: Path) -> None:
    """Removes the running session's sockets and locks from a copied /tmp (any depth)."""
    if not tmp.exists():
        return
    for name in (".X11-unix", ".ICE-unix", ".X0-lock", ".font-unix", ".XIM-unix"):
        limits.remove_tree(tmp / name)
    subprocess.run(
        [
            "find",
            str(tmp),
            "-xdev",
            "(",
            "-type",
            "s",
            "-o",
            "-name",
            "dbus-*",
            "!",
            "-type",
            "d",
            ")",
            "-delete",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=False,
    )
