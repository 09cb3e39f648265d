"""One jailed desktop: bubblewrap + Xvfb + window manager + dbus + the project's in-VM server.

``LocalDesktop`` starts a jail (what it is started with, and what it guarantees: ``jail.py``;
threat model in ``docs/SECURITY.md``), waits for its in-VM server, reaches its files and kills it:

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
import os
import resource
import shlex
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from osworld_jax.env.backend import SandboxCreateError, SandboxStepError, SandboxTimeout
from osworld_jax.env.local import procfs
from osworld_jax.env.local.jail import JailSpec, jail_file_mode
from osworld_jax.env.local.limits import JailCgroup, remove_tree
from osworld_jax.env.local.sysroot import HOST, SystemRoot
from osworld_jax.env.vm_client import VMClient

__all__ = ["LocalDesktop", "gate_argv"]

_BWRAP = "/usr/bin/bwrap"
_LOG_MAX_BYTES = 4 << 20
_PRLIMIT_NAMES = {resource.RLIMIT_NPROC: "nproc", resource.RLIMIT_AS: "as"}


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, 0)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def gate_argv(system: SystemRoot, args_fd: int, rlimits: dict[int, int] | None) -> list[str]:
    """The command a jail starts as (its arguments follow: ``sh``, then the jail's command).

    A gate: the process waits on stdin until the host has put it into its cgroup, then becomes
    bwrap (same pid; through prlimit, which lowers its own rlimits: that needs no privilege)
    with no environment and no host path on its command line. With a system root, ``sh``,
    ``prlimit`` and ``bwrap`` are the root's, run by its loader in the root (``SystemRoot.argv``;
    raises ``FileNotFoundError`` when the root lacks one).
    """
    limit_args = "".join(
        f" --{_PRLIMIT_NAMES[res]}={value}:{value}" for res, value in (rlimits or {}).items()
    )
    prefix = f"{shlex.join(system.argv('/usr/bin/prlimit'))}{limit_args} -- " if limit_args else ""
    bwrap = shlex.join(system.argv(_BWRAP))
    return [
        *system.argv("/bin/sh"),
        "-c",
        f'read _ && exec {prefix}{bwrap} --args {args_fd} -- "$@"',
    ]


class LocalDesktop:
    """A running jailed desktop and its in-VM server client.

    Attributes:
      id: the sandbox id (also the name of its host directory).
      dir: the sandbox's host directory (``ctl/`` with the server socket, ``work/`` for setup
        outputs, ``jail.log``); the jail's own files are in its tmpfs (``host_path``).
      client: the ``VMClient`` of its in-VM server (``unix://<dir>/ctl/vm.sock``).
      pid_ns: the jail's pid namespace (``pid:[inode]``), for leak checks.
      cgroup: the jail's cgroup, when one limits it.
      system: where the jail's system and the host-side programs that start it and copy its
        files come from (``sysroot.py``; the ``JailSpec``'s, set by ``start``).
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
        self.system: SystemRoot = HOST
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
            self.system = spec.system
            try:
                gate = gate_argv(spec.system, args_fd, rlimits)
            except FileNotFoundError as e:
                raise SandboxCreateError(f"sandbox {self.id}: {e}") from e
            kwargs: dict = {}
            if host_uid is not None:
                kwargs.update(user=host_uid, group=host_uid, extra_groups=[])
            try:
                self._proc = await asyncio.create_subprocess_exec(
                    *gate,
                    "sh",
                    *command,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.STDOUT,
                    pass_fds=(*fds, listener.fileno(), ready_w),
                    env={},
                    cwd=spec.system.cwd or "/",
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
        mine = procfs.pid_namespace(self._proc.pid)
        stack = procfs.children(self._proc.pid)
        while stack:
            pid = stack.pop()
            ns = procfs.pid_namespace(pid)
            if ns is not None and ns != mine:
                return ns, pid
            stack.extend(procfs.children(pid))
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
            for child in procfs.children(stack.pop()):
                if not procfs.is_zombie(child):
                    pids.append(child)
                stack.append(child)
        if self.pid_ns is not None:
            pids += [p for p in procfs.pid_namespace_members(self.pid_ns) if p not in pids]
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
        known = {pid: procfs.start_time(pid) for pid in self.host_pids()}
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
            p
            for p, t in known.items()
            if procfs.start_time(p) == t and t and not procfs.is_zombie(p)
        ]:
            if time.monotonic() > end:
                raise SandboxTimeout(f"sandbox {self.id}: processes {left} survived SIGKILL")
            await asyncio.sleep(0.01)
        if self.pid_ns is not None:
            while left := procfs.pid_namespace_members(self.pid_ns):
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
