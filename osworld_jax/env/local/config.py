"""Configuration of the ``local`` sandbox backend (``LocalBackendConfig``).

Limits (mechanisms and fallbacks in ``docs/SECURITY.md``): each sandbox has its own process and
memory limit (a cgroup per jail; without one, a distinct host uid per sandbox with
``RLIMIT_NPROC`` and ``RLIMIT_AS``), size-capped tmpfs for its writable areas, a cap on every
reply the host reads and a wall-clock limit per action. A sandbox that exceeds its memory or
process limit, or whose action, file or tree is over the output cap, raises
``SandboxLimitError`` (the owner is masked) naming the limit; a full disk is the agent's own
``ENOSPC``; an action past its wall-clock limit is killed and reported as a result.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

__all__ = ["DEFAULT_OPENERS", "Cgroup", "LocalBackendConfig"]

#: (file suffix, command) pairs the in-VM ``open_file`` uses by default, first match wins.
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
      system_root: None = the jails run the host's system (its ``/usr``, ``/etc``, ``/bin``...
        and its ``bwrap``, ``prlimit``, ``sh``, ``tar``, ``cp``, ``find``); an absolute path = a
        directory holding a Debian userland (``usr/``, ``etc/``, usrmerge links; built by
        ``scripts/offline_install.sh``) that the jails bind instead, whose own programs, run
        through its own dynamic loader, start and enter them: no host library is loaded, and
        the host needs no package of its own (``sysroot.py``).
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
    system_root: str | None = None
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
        # Paths the jails and the host programs use from other working directories: a relative
        # one would pass preflight and fail at the first sandbox.
        for name in ("root", "system_root"):
            value = getattr(self, name)
            if value is not None and not value.startswith("/"):
                raise ValueError(
                    f"LocalBackendConfig.{name} must be an absolute path, got {value!r}"
                )
        for path in self.extra_ro_binds:
            if not path.startswith("/"):
                raise ValueError(
                    f"LocalBackendConfig.extra_ro_binds must hold absolute paths, got {path!r}"
                )
        lo, hi = self.host_uid_range
        if not 0 < lo < hi < 2**32 - 1:
            raise ValueError(f"LocalBackendConfig.host_uid_range {self.host_uid_range} is invalid")

    @property
    def max_body_bytes(self) -> int:
        """The largest reply body the host reads (JSON escaping can grow text up to 6x)."""
        return self.max_file_bytes + 12 * self.max_output_bytes + (1 << 20)
