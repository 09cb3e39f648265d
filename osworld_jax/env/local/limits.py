"""Per-sandbox resource limits of the local backend (host side) and robust directory removal.

Processes and memory are limited per sandbox with a cgroup per jail, where the host can create
one (see ``docs/SECURITY.md``):

- cgroup v2: a child of this process's own cgroup, when the unified hierarchy has the ``pids``
  and ``memory`` controllers and they can be enabled there (``pids.max``, ``memory.max``,
  ``memory.swap.max = 0``);
- cgroup v1: a child of this process's cgroup in the ``pids`` and ``memory`` hierarchies
  (``pids.max``, ``memory.limit_in_bytes``, ``memory.memsw.limit_in_bytes`` where swap is
  accounted).

Each jail's cgroup is ``<this process's cgroup>/osworld_jax/<sandbox id>``; breaches are read from
``pids.events`` (``max``: forks refused) and the OOM-kill counter (v2 ``memory.events``, v1
``memory.oom_control``). ``detect`` reports what this host offers; the backend's preflight turns
that into the mechanism per limit or refuses to run (``LocalBackendConfig.cgroup``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import subprocess
import time
from pathlib import Path

from osworld_jax.env.local.sysroot import HOST

__all__ = ["CgroupSupport", "JailCgroup", "detect", "remove_tree"]

_V1_ROOT = Path("/sys/fs/cgroup")
_GROUP = "osworld_jax"


def _own_cgroups() -> dict[str, str]:
    """Controller (or "" for v2) -> this process's cgroup path, from /proc/self/cgroup."""
    out: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if not controllers:
            out[""] = path
        for c in controllers.split(","):
            if c:
                out[c] = path
    return out


def _mounts() -> dict[str, Path]:
    """Filesystem mount points: "cgroup2" -> path, v1 controller -> path."""
    out: dict[str, Path] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        pre, _, post = line.partition(" - ")
        fields, sup = pre.split(), post.split()
        if not sup:
            continue
        mnt = Path(fields[4])
        if sup[0] == "cgroup2":
            out.setdefault("cgroup2", mnt)
        elif sup[0] == "cgroup":
            for opt in sup[-1].split(","):
                if opt in ("pids", "memory"):
                    out.setdefault(opt, mnt)
    return out


@dataclasses.dataclass(frozen=True)
class CgroupSupport:
    """Where this host lets us create per-sandbox cgroups.

    Attributes:
      version: "v2", "v1" or None (no usable cgroup).
      pids_parent: directory under which jail cgroups get the pids controller (None: none).
      memory_parent: the same for the memory controller.
      reason: why no (or only a partial) cgroup is usable, for messages.
    """

    version: str | None
    pids_parent: Path | None
    memory_parent: Path | None
    reason: str = ""


def _probe_dir(parent: Path) -> str | None:
    """None when a child cgroup can be created (and removed) under ``parent``, else why not."""
    probe = parent / f"probe-{os.getpid()}-{time.monotonic_ns()}"
    try:
        parent.mkdir(exist_ok=True)
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        return f"cannot create cgroups under {parent}: {e.strerror}"
    return None


def _detect_v2(own: dict[str, str], mounts: dict[str, Path]) -> CgroupSupport | None:
    if "cgroup2" not in mounts or "" not in own:
        return None
    base = mounts["cgroup2"] / own[""].lstrip("/")
    try:
        available = (base / "cgroup.controllers").read_text().split()
    except OSError:
        return None
    if not {"pids", "memory"} <= set(available):
        return None
    parent = base / _GROUP
    try:
        parent.mkdir(exist_ok=True)
        # Children of `parent` get the controllers; `parent` itself holds no process. `base`
        # holds this process: the kernel lets it enable controllers for its children only when it
        # holds none, so a delegated cgroup must have them enabled already (then no write).
        if not {"pids", "memory"} <= set((base / "cgroup.subtree_control").read_text().split()):
            (base / "cgroup.subtree_control").write_text("+pids +memory")
        (parent / "cgroup.subtree_control").write_text("+pids +memory")
    except OSError as e:
        return CgroupSupport(
            None,
            None,
            None,
            f"cgroup v2 at {base}: cannot enable pids/memory for children ({e.strerror}); run "
            "the trainer in a delegated cgroup (e.g. systemd-run --scope -p Delegate=yes)",
        )
    err = _probe_dir(parent)
    if err:
        return CgroupSupport(None, None, None, err)
    return CgroupSupport("v2", parent, parent)


def _detect_v1(own: dict[str, str], mounts: dict[str, Path]) -> CgroupSupport | None:
    parents: dict[str, Path | None] = {}
    reasons = []
    for ctl in ("pids", "memory"):
        if ctl not in mounts or ctl not in own:
            parents[ctl] = None
            reasons.append(f"no cgroup v1 {ctl} hierarchy")
            continue
        parent = mounts[ctl] / own[ctl].lstrip("/") / _GROUP
        err = _probe_dir(parent)
        parents[ctl] = None if err else parent
        if err:
            reasons.append(err)
    if parents["pids"] is None and parents["memory"] is None:
        return CgroupSupport(None, None, None, "; ".join(reasons))
    return CgroupSupport("v1", parents["pids"], parents["memory"], "; ".join(reasons))


def detect(mode: str = "auto") -> CgroupSupport:
    """What cgroups this host offers: ``mode`` is "auto" (v2, else v1), "v2", "v1" or "none"."""
    if mode == "none":
        return CgroupSupport(None, None, None, "LocalBackendConfig.cgroup = 'none'")
    try:
        own, mounts = _own_cgroups(), _mounts()
    except OSError as e:
        return CgroupSupport(None, None, None, f"cannot read /proc/self/cgroup: {e}")
    reasons = []
    if mode in ("auto", "v2"):
        v2 = _detect_v2(own, mounts)
        if v2 is not None and v2.version:
            return v2
        reasons.append(v2.reason if v2 is not None else "no cgroup v2 with pids+memory")
    if mode in ("auto", "v1"):
        v1 = _detect_v1(own, mounts)
        if v1 is not None and v1.version:
            return v1
        reasons.append(v1.reason if v1 is not None else "no cgroup v1")
    return CgroupSupport(None, None, None, "; ".join(r for r in reasons if r))


#: A jail cgroup younger than this may belong to a jail another run is starting right now.
STALE_AFTER_S = 300.0


def sweep_stale(support: CgroupSupport, *, older_than_s: float = STALE_AFTER_S) -> list[Path]:
    """Removes empty jail cgroups a crashed run left; returns them.

    Only those older than ``older_than_s``: another run may have just created one and not yet
    moved its jail in (rmdir would succeed on it). Live ones are never removed (rmdir fails).
    """
    removed = []
    now = time.time()
    for parent in {support.pids_parent, support.memory_parent} - {None}:
        assert parent is not None
        with contextlib.suppress(OSError):
            for child in parent.iterdir():
                with contextlib.suppress(OSError):
                    if child.is_dir() and now - child.stat().st_mtime > older_than_s:
                        child.rmdir()
                        removed.append(child)
    return removed


class JailCgroup:
    """The cgroup(s) of one jail: created with its limits, removed when the jail is gone."""

    def __init__(
        self,
        support: CgroupSupport,
        name: str,
        *,
        max_processes: int | None,
        memory_bytes: int | None,
    ) -> None:
        """Creates the cgroup directories and writes the limits (OSError when it cannot)."""
        self.version = support.version
        self.dirs: list[Path] = []
        self.pids: Path | None = None
        self.memory: Path | None = None
        try:
            if max_processes is not None and support.pids_parent is not None:
                self.pids = self._make(support.pids_parent / name)
                (self.pids / "pids.max").write_text(str(max_processes))
            if memory_bytes is not None and support.memory_parent is not None:
                self.memory = self._make(support.memory_parent / name)
                self._limit_memory(memory_bytes)
        except BaseException:
            self.remove()
            raise

    def _make(self, path: Path) -> Path:
        if path not in self.dirs:
            path.mkdir()
            self.dirs.append(path)
        return path

    def _limit_memory(self, limit: int) -> None:
        assert self.memory is not None
        if self.version == "v2":
            (self.memory / "memory.max").write_text(str(limit))
            with contextlib.suppress(OSError):  # absent without swap accounting
                (self.memory / "memory.swap.max").write_text("0")
        else:
            (self.memory / "memory.limit_in_bytes").write_text(str(limit))
            with contextlib.suppress(OSError):
                (self.memory / "memory.memsw.limit_in_bytes").write_text(str(limit))

    def attach(self, pid: int) -> None:
        """Moves process ``pid`` (before it forks anything) into the jail's cgroup(s)."""
        for d in self.dirs:
            (d / "cgroup.procs").write_text(str(pid))

    def _counter(self, path: Path | None, file: str, key: str) -> int:
        if path is None:
            return 0
        try:
            for line in (path / file).read_text().splitlines():
                k, _, v = line.partition(" ")
                if k == key:
                    return int(v)
        except (OSError, ValueError):
            pass
        return 0

    def oom_kills(self) -> int:
        """How many processes the kernel killed for exceeding the memory limit."""
        if self.version == "v2":
            return self._counter(self.memory, "memory.events", "oom_kill")
        return self._counter(self.memory, "memory.oom_control", "oom_kill")

    def forks_refused(self) -> int:
        """How many forks failed because the process limit was reached."""
        return self._counter(self.pids, "pids.events", "max")

    def remove(self, timeout_s: float = 10.0) -> None:
        """Removes the directories once their processes are gone (retries while busy)."""
        end = time.monotonic() + timeout_s
        for d in list(self.dirs):
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY or time.monotonic() > end:
                        raise
                    time.sleep(0.02)
            self.dirs.remove(d)


def remove_tree(path: Path) -> None:
    """Removes a directory tree that untrusted code may have built, or raises OSError.

    No recursion in Python (a tree deeper than the recursion limit is fine) and no reliance on
    the tree's permissions: ``chmod -R u+rwx`` first (directories the agent made unwritable or
    unsearchable), then ``rm -rf --one-file-system`` (GNU coreutils walk trees of any depth
    without recursion limits and never follow symlinks). Verifies the path is gone.
    """
    if not os.path.lexists(path):
        return
    if path.is_dir() and not path.is_symlink():
        subprocess.run(
            ["chmod", "-R", "u+rwx", "--", str(path)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=False,
            env=HOST.env,  # nothing of the trainer's environment (LD_PRELOAD...)
        )
    res = subprocess.run(
        ["rm", "-rf", "--one-file-system", "--", str(path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        check=False,
        env=HOST.env,
    )
    if os.path.lexists(path):
        raise OSError(
            f"cannot remove {path}: {res.stderr.strip().splitlines()[-1:] or ['still present']}"
        )
