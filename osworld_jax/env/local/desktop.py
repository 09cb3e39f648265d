"""One jailed desktop: bubblewrap + Xvfb + window manager + dbus + the project's in-VM server.

The jail (``bwrap --unshare-all --die-with-parent --new-session``; threat model and guarantees in
``docs/SECURITY.md``):

- namespaces: user, mount, pid, network, ipc, uts, cgroup. The network namespace holds only a
  loopback device, so nothing inside can reach the host's or any other network.
- the door: the host creates the listening UNIX socket in ``<sandbox>/ctl/`` (a directory the jail
  never mounts) and hands only the descriptor to the in-jail server, which makes itself
  non-dumpable; the agent's code runs in a nested namespace that cannot see the server
  (``jailexec.py``). Nothing in the jail can connect to, replace or impersonate the server.
- identity: inside, the user is ``user`` (uid 1000) with home ``/home/user``. When the host runs as
  root, bubblewrap itself is started as an unprivileged host uid (``LocalBackendConfig.host_uid``,
  or a distinct uid per sandbox when no pids cgroup is available), so files that only root may
  read (``/etc/shadow``, ``/root``) stay unreadable even where they are visible.
- what the jail can read about itself: bubblewrap is started with an EMPTY environment and its
  arguments come from a descriptor (``--args``), its files (``/etc/passwd`` ..., the server, the
  shim) from descriptors (``--ro-bind-data``); so ``/proc/1/environ``, ``/proc/1/cmdline`` and
  ``/proc/self/mountinfo`` hold no host path and no host variable. Programs in the jail get only
  the allow-listed variables of ``JAIL_ENV``.
- filesystem: ``/usr`` and ``/etc`` read-only from the host (``/etc/passwd``, ``/etc/group``,
  ``/etc/hosts``, ``/etc/hostname`` replaced); a fresh ``/proc`` of the pid namespace, a minimal
  ``/dev``. Writable, and only these, each a size-capped tmpfs (``LocalBackendConfig``):
  ``/home/user``, ``/tmp``, ``/dev/shm``, ``/var/tmp`` and ``XDG_RUNTIME_DIR``; the jail's root
  itself is read-only. Nothing else of the host (``/root``, ``/work``, the repository, other
  sandboxes) is mounted. The host reaches the jail's files through ``/proc/<pid>/root`` of the
  jail's first process (``host_path``), held open as a descriptor.
- limits: the jail runs in its own cgroup (``limits.JailCgroup``: processes, memory) or, without
  one, under rlimits (``RLIMIT_NPROC`` of a distinct uid, ``RLIMIT_AS``).
- lifetime: the whole tree dies with the outer ``bwrap`` process (``--die-with-parent`` on the
  namespace's init: when pid 1 of a pid namespace dies the kernel kills every process in it).
  ``close`` SIGKILLs the outer bwrap and waits until no process of the pid namespace is left;
  the jail's tmpfs files vanish with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from osworld_jax.env.backend import SandboxCreateError, SandboxStepError, SandboxTimeout
from osworld_jax.env.local import apps
from osworld_jax.env.local.limits import JailCgroup, remove_tree
from osworld_jax.env.vm_client import VMClient

__all__ = [
    "JAIL_ENV",
    "JailSpec",
    "LocalDesktop",
    "jail_files",
    "pid_namespace_members",
]

JAIL_UID = 1000
JAIL_HOME = "/home/user"
RUNTIME_DIR = f"/run/user/{JAIL_UID}"
_HERE = Path(__file__).resolve().parent
_BWRAP = "/usr/bin/bwrap"
_LOG_MAX_BYTES = 4 << 20
_PRLIMIT_NAMES = {resource.RLIMIT_NPROC: "nproc", resource.RLIMIT_AS: "as"}
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
#: The jail's whole environment (bubblewrap itself gets none).
JAIL_ENV = {
    "HOME": JAIL_HOME,
    "USER": "user",
    "LOGNAME": "user",
    "SHELL": "/bin/bash",
    "PATH": "/opt/osworld/bin:/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "XDG_RUNTIME_DIR": RUNTIME_DIR,
    "PYTHONPATH": "/opt/osworld/lib",
    "PYTHONDONTWRITEBYTECODE": "1",
    "DISPLAY": ":0",
    "GTK_A11Y": "atspi",
    "NO_AT_BRIDGE": "0",
    "QT_ACCESSIBILITY": "1",
    "SAL_USE_VCLPLUGIN": "gtk3",
}
# The session bus starts services only from an allow-list of the system's service files
# (apps.DBUS_SERVICE_DIR): never from ~/.local/share/dbus-1/services (a file the agent could plant
# there), nor any other service the host has installed, because the bus starts a service outside
# the agent's namespace: GNOME Terminal's server, activated that way, would run the agent's shell
# beside the evaluator's commands (apps.py starts it in the desktop namespace instead).
_DBUS_CONFIG = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>session</type>
  <keep_umask/>
  <listen>unix:tmpdir=/tmp</listen>
  <auth>EXTERNAL</auth>
  <servicedir>{service_dir}</servicedir>
  <policy context="default">
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>
  </policy>
</busconfig>
"""


def jail_files() -> dict[str, bytes]:
    """Jail path -> content of every file the host puts into a jail (read-only).

    Those under ``apps.BIN_DIR`` are executable (``jail_file_mode``).
    """
    files = {
        "/etc/passwd": (
            "root:x:0:0:root:/nonexistent:/usr/sbin/nologin\n"
            f"user:x:{JAIL_UID}:{JAIL_UID}:user:{JAIL_HOME}:/bin/bash\n"
            "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
        ).encode(),
        "/etc/group": f"root:x:0:\nuser:x:{JAIL_UID}:\nnogroup:x:65534:\n".encode(),
        "/etc/hostname": b"sandbox\n",
        "/etc/hosts": b"127.0.0.1 localhost sandbox\n::1 localhost\n",
        "/opt/osworld/dbus-session.conf": _DBUS_CONFIG.format(
            service_dir=apps.DBUS_SERVICE_DIR
        ).encode(),
        "/opt/osworld/vmserver.py": (_HERE / "vmserver.py").read_bytes(),
    }
    for name in ("jailexec.py", "screen.py", "a11y.py"):  # the server's own modules
        files[f"/opt/osworld/{name}"] = (_HERE / name).read_bytes()
    for mod in sorted((_HERE / "shim").glob("*.py")):
        if mod.name != "__init__.py":
            files[f"/opt/osworld/lib/{mod.name}"] = mod.read_bytes()
    files.update({path: data for path, (data, _) in apps.jail_files().items()})
    return files


def jail_file_mode(path: str) -> str:
    """The permissions (octal string) of a file ``jail_files`` puts at ``path``."""
    return "0755" if path.startswith(apps.BIN_DIR + "/") else "0644"


class JailSpec:
    """What one jail is started with: bwrap arguments, the files it gets, its sizes and limits.

    Attributes:
      args: bubblewrap options (passed through ``--args FD``), ending before ``--``.
      command: the command after ``--`` (no host path in it).
      files: jail path -> content, handed over as ``--ro-bind-data`` descriptors.
    """

    def __init__(
        self,
        *,
        width: int,
        height: int,
        openers: tuple[tuple[str, str], ...],
        window_manager: str,
        open_timeout_s: float,
        start_timeout_s: float,
        exec_timeout_s: float,
        home_bytes: int,
        tmp_bytes: int,
        shm_bytes: int,
        max_output_bytes: int,
        max_file_bytes: int,
        extra_ro_binds: tuple[str, ...] = (),
    ) -> None:
        a = ["--unshare-all", "--die-with-parent", "--new-session"]
        a += ["--uid", str(JAIL_UID), "--gid", str(JAIL_UID), "--hostname", "sandbox"]
        a += ["--ro-bind", "/usr", "/usr"]
        for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            host = Path("/") / top
            if host.is_symlink():
                a += ["--symlink", os.readlink(host), f"/{top}"]
            elif host.is_dir():
                a += ["--ro-bind", str(host), f"/{top}"]
        a += ["--ro-bind", "/etc", "/etc"]
        for path in ("/var/cache/fontconfig", "/var/lib/dbus", *extra_ro_binds):
            a += ["--ro-bind-try", path, path]
        a += ["--proc", "/proc", "--dev", "/dev"]
        a += ["--perms", "0755", "--size", str(home_bytes), "--tmpfs", JAIL_HOME]
        for name in HOME_DIRS:
            a += ["--dir", f"{JAIL_HOME}/{name}"]
        a += ["--perms", "1777", "--size", str(tmp_bytes), "--tmpfs", "/tmp"]
        a += ["--perms", "1777", "--size", str(shm_bytes), "--tmpfs", "/dev/shm"]
        a += ["--perms", "1777", "--size", str(shm_bytes), "--tmpfs", "/var/tmp"]
        a += ["--perms", "0700", "--size", str(shm_bytes), "--tmpfs", RUNTIME_DIR]
        for link, target in apps.jail_symlinks().items():
            a += ["--symlink", target, link]
        a += ["--remount-ro", "/"]  # the jail's own root tmpfs: only the tmpfs above are writable
        a += ["--clearenv"]
        for k, v in JAIL_ENV.items():
            a += ["--setenv", k, v]
        a += ["--chdir", JAIL_HOME]
        self.args = a
        self.files = jail_files()
        # The home starts with the first-start files of the apps (apps.skel()), as from /etc/skel.
        self.command = [
            "/bin/sh",
            "-c",
            f'cp -R {apps.SKEL_DIR}/. "$HOME"/ && exec "$@"',
            "sh",
            "dbus-run-session",
            "--config-file=/opt/osworld/dbus-session.conf",
            "--",
            "/usr/bin/python3",
            "-I",
            "/opt/osworld/vmserver.py",
        ]
        self.command += ["--display", ":0", "--width", str(width), "--height", str(height)]
        self.command += [
            "--wm",
            window_manager,
            "--openers",
            json.dumps([list(o) for o in openers]),
        ]
        self.command += ["--open-timeout", f"{open_timeout_s:g}"]
        self.command += ["--start-timeout", f"{start_timeout_s:g}"]
        self.command += ["--exec-timeout", f"{exec_timeout_s:g}"]
        self.command += ["--max-output", str(max_output_bytes), "--max-file", str(max_file_bytes)]


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, 0)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


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


def _start_time(pid: int) -> str | None:
    """The process's start time (``/proc/PID/stat`` field 22): tells a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()[19]


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
      id: the sandbox id (also the name of its host directory).
      dir: the sandbox's host directory (``ctl/`` with the server socket, ``work/`` for setup
        outputs, ``jail.log``); the jail's own files are in its tmpfs (``host_path``).
      client: the ``VMClient`` of its in-VM server (``unix://<dir>/ctl/vm.sock``).
      pid_ns: the jail's pid namespace (``pid:[inode]``), for leak checks.
      cgroup: the jail's cgroup, when one limits it.
    """

    def __init__(
        self,
        sandbox_id: str,
        sandbox_dir: Path,
        on_close: Callable[[str], None] | None = None,
        *,
        max_body_bytes: int | None = None,
    ) -> None:
        self.id = sandbox_id
        self._on_close = on_close
        self.dir = sandbox_dir
        self.client = VMClient(
            f"unix://{sandbox_dir / 'ctl' / 'vm.sock'}", max_body_bytes=max_body_bytes
        )
        self.pid_ns: str | None = None
        self.cgroup: JailCgroup | None = None
        self.host_uid: int | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._root_fd: int | None = None
        self._log_task: asyncio.Task[None] | None = None
        self._log_tail = bytearray()
        self._closed = False
        self._close_task: asyncio.Task[None] | None = None

    @staticmethod
    def make_dirs(sandbox_dir: Path) -> None:
        """Creates the sandbox's host directory (root-only: the jail never mounts it)."""
        sandbox_dir.mkdir(mode=0o700)
        (sandbox_dir / "ctl").mkdir(mode=0o700)
        (sandbox_dir / "work").mkdir(mode=0o700)

    async def start(
        self,
        spec: JailSpec,
        *,
        host_uid: int | None,
        start_timeout_s: float,
        rpc_timeout_s: float,
        cgroup: JailCgroup | None = None,
        rlimits: dict[int, int] | None = None,
    ) -> None:
        """Starts the jail and waits until its server is ready.

        Args:
          spec: the jail's arguments and files (``JailSpec``).
          host_uid: run bwrap as this unprivileged host uid (None: as the caller).
          start_timeout_s: deadline for the server to be ready.
          rpc_timeout_s: the client's default request deadline.
          cgroup: the jail's cgroup; its first process joins it before anything else runs.
          rlimits: ``resource.RLIMIT_*`` -> limit set on that first process (inherited).
        """
        self.client.timeout = rpc_timeout_s
        self.cgroup = cgroup
        fds: list[int] = []
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        ready_r, ready_w = os.pipe()
        try:
            try:
                listener.bind(str(self.dir / "ctl" / "vm.sock"))
            except OSError as e:
                raise SandboxCreateError(
                    f"sandbox {self.id}: cannot create its socket {self.dir / 'ctl' / 'vm.sock'} "
                    f"({e}); a UNIX socket path is limited to 107 bytes: choose a shorter "
                    "LocalBackendConfig.root"
                ) from e
            listener.listen(64)
            file_args: list[str] = []
            for i, (dest, data) in enumerate(spec.files.items()):
                fd = _memfd(f"jail-file-{i}", data)
                fds.append(fd)
                file_args += ["--perms", jail_file_mode(dest), "--ro-bind-data", str(fd), dest]
            cut = spec.args.index("--remount-ro")  # files go in before the root turns read-only
            args = [*spec.args[:cut], *file_args, *spec.args[cut:]]
            args_fd = _memfd("jail-args", b"".join(a.encode() + b"\0" for a in args))
            fds.append(args_fd)
            command = [
                *spec.command,
                "--listen-fd",
                str(listener.fileno()),
                "--ready-fd",
                str(ready_w),
            ]
            # A gate: the process waits on stdin until the host has put it into its cgroup, then
            # becomes bwrap (same pid; through prlimit, which lowers its own rlimits: that needs
            # no privilege) with no environment and no host path on its command line.
            limit_args = "".join(
                f" --{_PRLIMIT_NAMES[res]}={value}:{value}"
                for res, value in (rlimits or {}).items()
            )
            prefix = f"/usr/bin/prlimit{limit_args} -- " if limit_args else ""
            gate = f'read _ && exec {prefix}{_BWRAP} --args {args_fd} -- "$@"'
            kwargs: dict = {}
            if host_uid is not None:
                kwargs.update(user=host_uid, group=host_uid, extra_groups=[])
            try:
                self._proc = await asyncio.create_subprocess_exec(
                    "/bin/sh",
                    "-c",
                    gate,
                    "sh",
                    *command,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.STDOUT,
                    pass_fds=(*fds, listener.fileno(), ready_w),
                    env={},
                    cwd="/",
                    start_new_session=True,
                    **kwargs,
                )
            except OSError as e:
                raise SandboxCreateError(f"sandbox {self.id}: cannot start bwrap: {e}") from e
            self._log_task = asyncio.get_running_loop().create_task(self._pump_log())
            try:
                if cgroup is not None:
                    cgroup.attach(self._proc.pid)
            except OSError as e:
                raise SandboxCreateError(
                    f"sandbox {self.id}: cannot apply its limits to the jail: {e}"
                ) from e
            assert self._proc.stdin is not None
            self._proc.stdin.write(b"go\n")
            await self._proc.stdin.drain()
            self._proc.stdin.close()
        finally:
            listener.close()
            os.close(ready_w)
            for fd in fds:
                os.close(fd)
        try:
            await self._wait_ready(ready_r, start_timeout_s)
        finally:
            os.close(ready_r)
        self.pid_ns, pid1 = self._find_pid_ns()
        if pid1 is not None:
            with contextlib.suppress(OSError):
                self._root_fd = os.open(f"/proc/{pid1}/root", os.O_PATH | os.O_DIRECTORY)

    async def _wait_ready(self, ready_r: int, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        got = bytearray()
        done = asyncio.Event()

        def readable() -> None:
            try:
                chunk = os.read(ready_r, 64)
            except BlockingIOError:
                return
            got.extend(chunk)
            if not chunk or b"\n" in got:
                done.set()

        os.set_blocking(ready_r, False)
        loop.add_reader(ready_r, readable)
        try:
            async with asyncio.timeout(timeout_s):
                await done.wait()
        except TimeoutError:
            raise SandboxTimeout(
                f"sandbox {self.id}: desktop not ready within {timeout_s:g} s; "
                f"log: {self.log_tail()}"
            ) from None
        finally:
            loop.remove_reader(ready_r)
        if not got.startswith(b"ready"):
            await asyncio.sleep(0.05)  # let the log pump read the jail's last words
            raise SandboxCreateError(
                f"sandbox {self.id}: jail exited during start-up; log: {self.log_tail()}"
            )

    async def _pump_log(self) -> None:
        """Copies the jail's output to ``jail.log`` (its first 4 MiB) and keeps its tail."""
        assert self._proc is not None and self._proc.stdout is not None
        written = 0
        with open(self.dir / "jail.log", "ab") as f:
            while chunk := await self._proc.stdout.read(65536):
                self._log_tail += chunk
                del self._log_tail[:-4096]
                if written < _LOG_MAX_BYTES:
                    part = chunk[: _LOG_MAX_BYTES - written]
                    f.write(part)
                    f.flush()
                    written += len(part)

    def log_tail(self, limit: int = 600) -> str:
        """The end of the jail's log, on one line."""
        text = self._log_tail.decode("utf-8", "replace").strip()[-limit:]
        return text.replace("\n", " | ") or "(empty)"

    def _find_pid_ns(self) -> tuple[str | None, int | None]:
        assert self._proc is not None
        mine = _pid_ns(self._proc.pid)
        stack = _children(self._proc.pid)
        while stack:
            pid = stack.pop()
            ns = _pid_ns(pid)
            if ns is not None and ns != mine:
                return ns, pid
            stack.extend(_children(pid))
        return None, None

    async def run_action(self, command: list[str] | str, *, timeout: float) -> dict[str, Any]:
        """Runs an agent command in the jail's desktop namespace (``POST /agent/execute``).

        The server kills it after ``timeout`` seconds (returncode -9, a result); the request's own
        deadline is 15 s later.
        """
        reply = await self.client.post_json(
            "/agent/execute", {"command": command, "timeout": timeout}, timeout=timeout + 15.0
        )
        if not isinstance(reply, dict) or "status" not in reply:
            raise SandboxStepError(f"sandbox {self.id}: malformed action reply {reply!r:.200}")
        return reply

    def host_path(self, jail_path: str) -> Path:
        """A host path that reaches ``jail_path`` inside the running jail (its mount namespace).

        Symlinks inside the jail resolve within the jail's root, so copy tools that do not follow
        symlinks (``cp -a``) are safe on it.
        """
        if self._root_fd is None:
            raise SandboxCreateError(f"sandbox {self.id}: the jail's files are not reachable")
        # Through this process's pid, not /proc/self: helper programs (cp) resolve it too.
        return Path(f"/proc/{os.getpid()}/fd/{self._root_fd}") / jail_path.lstrip("/")

    def inherited_path(self, jail_path: str) -> tuple[str, int]:
        """(path, fd) for a child process that inherits ``fd``: ``/proc/self/fd/<fd>/<path>``.

        Lets a helper running as the jail's own host uid (which may not look into this process's
        descriptors) write into the jail's tmpfs, whose files must belong to the jail's uid.
        """
        if self._root_fd is None:
            raise SandboxCreateError(f"sandbox {self.id}: the jail's files are not reachable")
        return f"/proc/self/fd/{self._root_fd}/{jail_path.lstrip('/')}", self._root_fd

    @property
    def alive(self) -> bool:
        """True while the jail's outer bwrap process runs."""
        return self._proc is not None and self._proc.returncode is None

    def host_pids(self) -> list[int]:
        """Host pids of the outer bwrap and of every process inside the jail.

        Those of its nested namespaces included (the desktop's, the commands'): every process
        of the jail descends from the outer bwrap, orphans being reaped by a namespace's pid 1.
        """
        pids = [self._proc.pid] if self.alive and self._proc is not None else []
        stack = list(pids)
        while stack:
            for child in _children(stack.pop()):
                if not _is_zombie(child):
                    pids.append(child)
                stack.append(child)
        if self.pid_ns is not None:
            pids += [p for p in pid_namespace_members(self.pid_ns) if p not in pids]
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
        known = {pid: _start_time(pid) for pid in self.host_pids()}
        with contextlib.suppress(Exception):
            await self.client.aclose()
        if self._root_fd is not None:  # releases the jail's tmpfs
            os.close(self._root_fd)
            self._root_fd = None
        if self._proc is not None and self._proc.returncode is None:
            # The outer bwrap leads its own process group (start_new_session). Signal the group
            # only: Process.kill() would poll (and reap) the child behind asyncio's watcher.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            await self._proc.wait()
        end = time.monotonic() + kill_timeout_s
        while left := [
            p for p, t in known.items() if _start_time(p) == t and t and not _is_zombie(p)
        ]:
            if time.monotonic() > end:
                raise SandboxTimeout(f"sandbox {self.id}: processes {left} survived SIGKILL")
            await asyncio.sleep(0.01)
        if self.pid_ns is not None:
            while left := pid_namespace_members(self.pid_ns):
                for pid in left:  # belt and braces: the kernel already kills them with pid 1
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                if time.monotonic() > end:
                    raise SandboxTimeout(f"sandbox {self.id}: processes {left} survived SIGKILL")
                await asyncio.sleep(0.01)
        if self._log_task is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self._log_task, 5)
        if self.cgroup is not None:
            await asyncio.to_thread(self.cgroup.remove)
        if remove_dir:
            await asyncio.to_thread(remove_tree, self.dir)
