"""The run's lease on its directory: one trainer at a time, and nothing left behind when it dies.

Entering `RunLease` (the first thing a run does, the last it undoes):

0. takes an exclusive ``flock`` on ``<run_dir>/.lease.lock``, held (never waited for) for the
   trainer's life: a second trainer is refused in one line naming the holder, however their
   starts interleave, and on a shared filesystem that honours ``flock`` (NFS, Lustre, CephFS
   emulate it as a whole-file POSIX lock) on any host. The kernel drops the lock when the
   trainer dies. Where the filesystem refuses locks (``ENOLCK``, ``EOPNOTSUPP``) a warning says
   so and the lease below is the only guard (it does not exclude two starts that interleave);
1. reads ``<run_dir>/.lease.json``: a live trainer holding it (same host, same pid and start
   time) refuses the start (`RunDirBusyError`); a dead one's leftovers (its marked processes,
   its recorded directories) are removed first and reported in one log line;
2. writes the lease and puts the run's marker into ``os.environ`` (inherited by every process
   the run starts; see `osworld_jax.reaper`);
3. starts the reaper with a pipe: if the trainer dies without releasing the lease (``kill -9``,
   OOM killer, a segfault), the reaper ends the marked processes and removes the recorded
   directories within seconds.

Leaving it (normally, on an error or Ctrl-C, after the servers and sandboxes were closed) tells
the reaper to exit, restores the environment and removes the lease.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from osworld_jax import reaper
from osworld_jax.errors import ConfigError

log = logging.getLogger(__name__)


LOCK_FILE = ".lease.lock"  # never removed: removing a lock file lets two holders in


class RunDirBusyError(ConfigError):
    """Another live trainer holds the run directory."""


def _holder(run_dir: Path) -> str:
    lease = reaper.read_lease(run_dir)
    if lease is None:
        return "another trainer (starting: no lease written yet)"
    who = f"the trainer with pid {lease.get('pid')} on host {lease.get('host')}"
    if lease.get("host") == socket.gethostname() and not reaper.instance_alive(
        str(lease.get("marker", ""))
    ):
        return f"processes {who} left (it died; its reaper ends them within seconds: retry)"
    return who


def lock_run_dir(run_dir: Path) -> int | None:
    """Takes ``run_dir``'s exclusive lock; returns its descriptor (None: locks unsupported).

    Raises:
      RunDirBusyError: another process holds it (the message names the lease's holder).
    """
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise RunDirBusyError(
                f"{run_dir}: in use by {_holder(run_dir)} (its lock {LOCK_FILE} is held; stop "
                "it, or use another --run_dir)"
            ) from None
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            log.warning(
                "%s: the filesystem does not support locks (%s): two trainers starting at once "
                "in this run dir are not excluded (only the lease file guards it)",
                run_dir,
                os.strerror(e.errno),
            )
            return None
        raise
    return fd


class RunLease:
    """A trainer's lease on ``run_dir`` (a context manager; see the module docstring).

    Attributes:
      run_dir: the run directory.
      marker: this run instance's marker value (``OSWORLD_JAX_RUN``).
      dirs: host directories to remove if the trainer dies.
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir.resolve()
        start = reaper.process_start(os.getpid()) or 0  # 0: no procfs (not Linux)
        self.marker = reaper.marker_value(self.run_dir, os.getpid(), start)
        self.dirs: list[str] = []
        self._reaper: subprocess.Popen[bytes] | None = None
        self._pipe: int | None = None
        self._old_env: str | None = None
        self._lock: int | None = None

    @property
    def path(self) -> Path:
        """The lease file."""
        return self.run_dir / reaper.LEASE_FILE

    def _write(self) -> None:
        lease = {
            "marker": self.marker,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.time(),
            "dirs": self.dirs,
        }
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(lease, indent=1))
        tmp.replace(self.path)

    def _take_over(self) -> None:
        old = reaper.read_lease(self.run_dir)
        if old is not None and old.get("host") not in (None, socket.gethostname()):
            log.warning(
                "%s: the previous trainer ran on host %s; its leftovers there are not cleaned",
                self.run_dir,
                old.get("host"),
            )
            return
        if old is not None and reaper.instance_alive(str(old.get("marker", ""))):
            raise RunDirBusyError(
                f"{self.run_dir}: in use by the trainer with pid {old.get('pid')} "
                "(stop it, or use another --run_dir)"
            )
        killed, removed = reaper.cleanup(self.run_dir, old or {})
        if killed or removed:
            log.warning(
                "%s: cleaned up after a crashed run: ended processes %s, removed %s",
                self.run_dir,
                killed,
                removed,
            )

    def __enter__(self) -> Self:
        self._lock = lock_run_dir(self.run_dir)
        try:
            self._take_over()
            self._write()
        except BaseException:
            self._unlock()
            raise
        self._old_env = os.environ.get(reaper.MARKER)
        os.environ[reaper.MARKER] = self.marker
        env = {k: v for k, v in os.environ.items() if k != reaper.MARKER}
        read, self._pipe = os.pipe()  # neither end is inherited by other children
        try:
            with open(self.run_dir / "reaper.log", "ab") as err:
                self._reaper = subprocess.Popen(
                    [sys.executable, "-m", "osworld_jax.reaper", str(self.run_dir), self.marker],
                    stdin=read,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    env=env,
                    start_new_session=True,  # a Ctrl-C of the terminal's group does not reach it
                )
        except BaseException:
            self._release()
            raise
        finally:
            os.close(read)
        return self

    def add_dir(self, path: str | os.PathLike[str]) -> None:
        """Records a host directory the run created (removed if the trainer dies)."""
        self.dirs.append(str(Path(path).resolve()))
        self._write()

    def _release(self) -> None:
        if self._pipe is not None:
            try:
                os.write(self._pipe, b"exit")
            finally:
                os.close(self._pipe)
                self._pipe = None
        if self._reaper is not None:
            try:
                self._reaper.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._reaper.kill()
            self._reaper = None
        if self._old_env is None:
            os.environ.pop(reaper.MARKER, None)
        else:
            os.environ[reaper.MARKER] = self._old_env
        current = reaper.read_lease(self.run_dir)
        if current is not None and current.get("marker") == self.marker:
            self.path.unlink(missing_ok=True)
        self._unlock()

    def _unlock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)  # releases the flock
            self._lock = None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Any:
        self._release()
        return None
