"""One jailed desktop: bubblewrap + Xvfb + window manager + dbus + the project's in-VM server.

The jail (``bwrap --unshare-all --die-with-parent --new-session``):

- namespaces: user, mount, pid, network, ipc, uts, cgroup. The network namespace holds only a
  loopback device, so nothing inside can reach the host's or any other network. The in-VM server
  listens on a UNIX socket in ``<sandbox>/run/vm.sock``, the one door the host uses.
- identity: inside, the user is ``user`` (uid 1000) with home ``/home/user``. When the host runs as
  root, bubblewrap itself is started as an unprivileged host uid (``LocalBackendConfig.host_uid``,
  default 65534 "nobody"), so files that only root may read (``/etc/shadow``, ``/root``) stay
  unreadable even where they are visible, and an escape would land as nobody.
- filesystem: ``/usr`` and ``/etc`` read-only from the host (``/etc/passwd``, ``/etc/group``,
  ``/etc/hosts``, ``/etc/hostname`` replaced by the sandbox's own); a fresh ``/proc`` of the pid
  namespace, a minimal ``/dev`` and a private ``/dev/shm``. Writable, and only these:
  ``/home/user`` <- ``<sandbox>/home``, ``/tmp`` <- ``<sandbox>/tmp``, ``/run/osworld`` <-
  ``<sandbox>/run``, ``/var/log/osworld`` <- ``<sandbox>/log``, and private tmpfs at
  ``XDG_RUNTIME_DIR``, ``/dev/shm`` and ``/var/tmp``; the jail's root itself is read-only.
  Nothing else of the host (``/root``, ``/work``, the repository, other sandboxes) is mounted.
- environment: cleared; ``PATH`` puts ``/opt/osworld/bin`` (a ``python`` -> ``python3`` link)
  first, ``PYTHONPATH`` the project's ``pyautogui`` shim (``/opt/osworld/lib``).
- lifetime: the whole tree dies with the outer ``bwrap`` process (``--die-with-parent`` on the
  namespace's init: when pid 1 of a pid namespace dies the kernel kills every process in it).
  ``close`` SIGKILLs the outer bwrap and waits until no process of the pid namespace is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

from osworld_jax.env.backend import SandboxCreateError, SandboxTimeout
from osworld_jax.env.vm_client import VMClient

__all__ = ["LocalDesktop", "build_jail_argv", "prepare_shared_dir", "pid_namespace_members"]

JAIL_UID = 1000
JAIL_HOME = "/home/user"
SOCKET_NAME = "vm.sock"
_HERE = Path(__file__).resolve().parent
_SANDBOX_SUBDIRS = ("home", "tmp", "run", "log")
# The XDG user directories an Ubuntu desktop (OSWorld's VM) has in every home; tasks assume them.
HOME_DIRS = (
    "Desktop",
    "Documents",
    "Downloads",
    "Music",
    "Pictures",
    "Public",
    "Templates",
    "Videos",
)


def prepare_shared_dir(shared: Path, host_uid: int | None) -> None:
    """Writes the read-only files every jail of one backend mounts: server, shim, /etc overrides.

    Args:
      shared: directory to fill (created).
      host_uid: the unprivileged host uid the jail runs as (files must be readable by it).
    """
    (shared / "lib").mkdir(parents=True, exist_ok=True)
    (shared / "etc").mkdir(exist_ok=True)
    shutil.copyfile(_HERE / "vmserver.py", shared / "vmserver.py")
    for mod in ("pyautogui.py", "pyscreeze.py", "pytweening.py"):
        shutil.copyfile(_HERE / "shim" / mod, shared / "lib" / mod)
    etc = {
        "passwd": (
            f"root:x:0:0:root:/nonexistent:/usr/sbin/nologin\n"
            f"user:x:{JAIL_UID}:{JAIL_UID}:user:{JAIL_HOME}:/bin/bash\n"
            "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
        ),
        "group": f"root:x:0:\nuser:x:{JAIL_UID}:\nnogroup:x:65534:\n",
        "hostname": "sandbox\n",
        "hosts": "127.0.0.1 localhost sandbox\n::1 localhost\n",
    }
    for name, text in etc.items():
        (shared / "etc" / name).write_text(text)
    for p in [shared, *shared.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)


def build_jail_argv(
    *,
    sandbox_dir: Path,
    shared_dir: Path,
    width: int,
    height: int,
    openers: tuple[tuple[str, str], ...],
    window_manager: str,
    open_timeout_s: float,
    start_timeout_s: float,
    exec_timeout_s: float = 120.0,
    extra_ro_binds: tuple[str, ...] = (),
) -> list[str]:
    """The ``bwrap`` command line that starts one desktop (see the module docstring)."""
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session"]
    argv += ["--uid", str(JAIL_UID), "--gid", str(JAIL_UID), "--hostname", "sandbox"]
    argv += ["--ro-bind", "/usr", "/usr"]
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = Path("/") / top
        if host.is_symlink():
            argv += ["--symlink", os.readlink(host), f"/{top}"]
        elif host.is_dir():
            argv += ["--ro-bind", str(host), f"/{top}"]
    argv += ["--ro-bind", "/etc", "/etc"]
    for name in ("passwd", "group", "hostname", "hosts"):
        argv += ["--ro-bind", str(shared_dir / "etc" / name), f"/etc/{name}"]
    for path in ("/var/cache/fontconfig", "/var/lib/dbus", *extra_ro_binds):
        argv += ["--ro-bind-try", path, path]
    argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/dev/shm", "--tmpfs", "/var/tmp"]
    argv += ["--bind", str(sandbox_dir / "home"), JAIL_HOME]
    argv += ["--bind", str(sandbox_dir / "tmp"), "/tmp"]
    argv += ["--bind", str(sandbox_dir / "run"), "/run/osworld"]
    argv += ["--bind", str(sandbox_dir / "log"), "/var/log/osworld"]
    argv += ["--ro-bind", str(shared_dir / "vmserver.py"), "/opt/osworld/vmserver.py"]
    argv += ["--ro-bind", str(shared_dir / "lib"), "/opt/osworld/lib"]
    argv += ["--symlink", "/usr/bin/python3", "/opt/osworld/bin/python"]
    runtime = f"/run/user/{JAIL_UID}"
    argv += ["--perms", "0700", "--tmpfs", runtime]
    argv += ["--remount-ro", "/"]  # the jail's own root tmpfs: nothing but the binds is writable
    env = {
        "HOME": JAIL_HOME,
        "USER": "user",
        "LOGNAME": "user",
        "SHELL": "/bin/bash",
        "PATH": "/opt/osworld/bin:/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "XDG_RUNTIME_DIR": runtime,
        "PYTHONPATH": "/opt/osworld/lib",
        "PYTHONDONTWRITEBYTECODE": "1",
        "DISPLAY": ":0",
        "GTK_A11Y": "atspi",
        "NO_AT_BRIDGE": "0",
        "QT_ACCESSIBILITY": "1",
        "SAL_USE_VCLPLUGIN": "gtk3",
    }
    argv += ["--clearenv"]
    for k, v in env.items():
        argv += ["--setenv", k, v]
    argv += ["--chdir", JAIL_HOME, "--"]
    argv += ["dbus-run-session", "--", "/usr/bin/python3", "/opt/osworld/vmserver.py"]
    argv += ["--socket", f"/run/osworld/{SOCKET_NAME}", "--display", ":0"]
    argv += ["--width", str(width), "--height", str(height), "--wm", window_manager]
    argv += ["--openers", json.dumps([list(o) for o in openers])]
    argv += ["--open-timeout", f"{open_timeout_s:g}", "--start-timeout", f"{start_timeout_s:g}"]
    argv += ["--exec-timeout", f"{exec_timeout_s:g}"]
    argv += ["--logdir", "/var/log/osworld"]
    return argv


def _pid_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2 :].startswith(("Z", "X"))


def pid_namespace_members(ns: str) -> list[int]:
    """Pids (host view) of the running processes whose pid namespace is ``ns`` (``pid:[inode]``).

    Zombies (already dead, waiting to be reaped by the host's init) are not counted.
    """
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _pid_ns(int(entry)) == ns and not _is_zombie(int(entry)):
            out.append(int(entry))
    return out


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in text.split()]


class LocalDesktop:
    """A running jailed desktop and its in-VM server client.

    Attributes:
      id: the sandbox id (also the name of its directory).
      dir: the sandbox directory on the host (home/, tmp/, run/, log/).
      client: the ``VMClient`` of its in-VM server (``unix://<dir>/run/vm.sock``).
      pid_ns: the jail's pid namespace (``pid:[inode]``), for leak checks.
    """

    def __init__(
        self, sandbox_id: str, sandbox_dir: Path, on_close: Callable[[str], None] | None = None
    ) -> None:
        self.id = sandbox_id
        self._on_close = on_close
        self.dir = sandbox_dir
        self.client = VMClient(f"unix://{sandbox_dir / 'run' / SOCKET_NAME}")
        self.pid_ns: str | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._closed = False
        self._close_task: asyncio.Task[None] | None = None

    @staticmethod
    def make_dirs(sandbox_dir: Path, host_uid: int | None) -> None:
        """Creates the sandbox's writable directories, owned by the jail's host uid."""
        sandbox_dir.mkdir(mode=0o711)
        for sub in _SANDBOX_SUBDIRS:
            (sandbox_dir / sub).mkdir(exist_ok=True)
        home = sandbox_dir / "home"
        for name in HOME_DIRS:
            (home / name).mkdir()
        if host_uid is not None:
            for p in (*(sandbox_dir / s for s in _SANDBOX_SUBDIRS), *(home / n for n in HOME_DIRS)):
                os.chown(p, host_uid, host_uid)

    async def start(
        self,
        argv: list[str],
        *,
        host_uid: int | None,
        start_timeout_s: float,
        rpc_timeout_s: float,
        max_processes: int | None = None,
    ) -> None:
        """Starts the jail and waits until its server's socket answers.

        Args:
          argv: the ``bwrap`` command line (``build_jail_argv``).
          host_uid: run bwrap as this unprivileged host uid (None: as the caller).
          start_timeout_s: deadline for the server's socket to appear.
          rpc_timeout_s: the client's default request deadline.
          max_processes: ``RLIMIT_NPROC`` for the jail (only with ``host_uid``: the limit counts
            every process and thread of that host uid, so all jails share it); stops fork bombs.
        """
        self.client.timeout = rpc_timeout_s
        sock = self.dir / "run" / SOCKET_NAME
        log = open(self.dir / "log" / "jail.log", "ab")  # noqa: SIM115 - handed to the child
        kwargs: dict = {}
        if host_uid is not None:
            kwargs.update(user=host_uid, group=host_uid, extra_groups=[])
            if max_processes is not None:
                limit = (max_processes, max_processes)
                kwargs["preexec_fn"] = lambda: resource.setrlimit(resource.RLIMIT_NPROC, limit)
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                **kwargs,
            )
        except OSError as e:
            raise SandboxCreateError(f"sandbox {self.id}: cannot start bwrap: {e}") from e
        finally:
            log.close()
        loop = asyncio.get_running_loop()
        end = loop.time() + start_timeout_s
        while not sock.exists():
            if self._proc.returncode is not None:
                raise SandboxCreateError(
                    f"sandbox {self.id}: jail exited with code {self._proc.returncode} during "
                    f"start-up; log: {self._log_tail()}"
                )
            if loop.time() > end:
                raise SandboxTimeout(
                    f"sandbox {self.id}: desktop not ready within {start_timeout_s:g} s; "
                    f"log: {self._log_tail()}"
                )
            await asyncio.sleep(0.01)
        self.pid_ns = self._find_pid_ns()

    def _find_pid_ns(self) -> str | None:
        assert self._proc is not None
        mine = _pid_ns(self._proc.pid)
        stack = _children(self._proc.pid)
        while stack:
            pid = stack.pop()
            ns = _pid_ns(pid)
            if ns is not None and ns != mine:
                return ns
            stack.extend(_children(pid))
        return None

    def _log_tail(self, limit: int = 600) -> str:
        parts = []
        for name in ("jail.log", "xvfb.log"):
            with contextlib.suppress(OSError):
                text = (self.dir / "log" / name).read_text(errors="replace").strip()
                if text:
                    parts.append(f"[{name}] {text[-limit:]}")
        return " ".join(parts).replace("\n", " | ") or "(empty)"

    @property
    def alive(self) -> bool:
        """True while the jail's outer bwrap process runs."""
        return self._proc is not None and self._proc.returncode is None

    def host_pids(self) -> list[int]:
        """Host pids of the outer bwrap and of every process inside the jail."""
        pids = [self._proc.pid] if self.alive and self._proc is not None else []
        if self.pid_ns is not None:
            pids += pid_namespace_members(self.pid_ns)
        return pids

    async def close(self, *, remove_dir: bool = True, kill_timeout_s: float = 10.0) -> None:
        """Kills the jail's whole process tree, waits for it, and removes the directory.

        Idempotent, and every caller returns only once the desktop is gone: a second call waits
        for the first one's work. Cancelling a caller does not interrupt the close itself.
        """
        if self._close_task is None:
            self._closed = True
            self._close_task = asyncio.get_running_loop().create_task(
                self._close_once(remove_dir, kill_timeout_s)
            )
        await asyncio.shield(self._close_task)

    async def _close_once(self, remove_dir: bool, kill_timeout_s: float) -> None:
        try:
            await self._terminate(remove_dir, kill_timeout_s)
        finally:
            if self._on_close is not None:
                self._on_close(self.id)

    async def _terminate(self, remove_dir: bool, kill_timeout_s: float) -> None:
        with contextlib.suppress(Exception):
            await self.client.aclose()
        if self._proc is not None and self._proc.returncode is None:
            # The outer bwrap leads its own process group (start_new_session). Signal the group
            # only: Process.kill() would poll (and reap) the child behind asyncio's watcher.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            await self._proc.wait()
        if self.pid_ns is not None:
            end = time.monotonic() + kill_timeout_s
            while left := pid_namespace_members(self.pid_ns):
                for pid in left:  # belt and braces: the kernel already kills them with pid 1
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                if time.monotonic() > end:
                    raise SandboxTimeout(f"sandbox {self.id}: processes {left} survived SIGKILL")
                await asyncio.sleep(0.01)
        if remove_dir:
            await asyncio.to_thread(shutil.rmtree, self.dir, True)
