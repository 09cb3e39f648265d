"""A system root served to the jails from a filesystem of its own (issue 43 item 11).

A bind mount's line in ``/proc/self/mountinfo`` shows, in its 4th field, the bound directory's
path *inside its filesystem*: a jail whose ``/usr`` is bound from ``/data/bundle/root/usr`` on the
host's disk shows ``/data/bundle/root/usr``, whatever staging path the bind went through. A
directory that is the root of a filesystem of its own shows ``/`` there (and its ``usr`` shows
``/usr``): so the jail's system is bound from a copy of the root on a private tmpfs, mounted once
per backend at ``/tmp/osworld_jax-sysmount-<pid>-XXXX`` (its source field ``osworld_jax-sysroot``:
no path, no pid), read-only once copied. The jail then sees only its own paths.

- Cost: once per backend, at its first desktop, a ``cp -a`` of the root into RAM (137 MiB root:
  ~0.3 s, 137 MiB of memory held until ``aclose``; the jails' binds keep it until the last
  closes); nothing per jail.
- Needs: mounting a tmpfs (root with ``CAP_SYS_ADMIN``: CI, a privileged container). Elsewhere
  ``unavailable`` says why in one line; the backend then warns once and binds the root itself
  (the jail works; its mountinfo shows the root's host path). A root that already is a
  filesystem of its own (a mounted image) is bound as it is, with no copy.
- Leftovers: ``aclose`` (or the process's exit) detaches the mount and removes its directory;
  a mount of a process that died without either is removed by the next ``RootMount.open``.

The mounts are made with the ``mount(2)`` syscall (``ctypes``), the copy by the root's own ``cp``
with a clean environment (``sysroot.SystemRoot``): nothing of the host's userland runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import subprocess
import tempfile
import weakref
from pathlib import Path

from osworld_jax.env.local.sysroot import SystemRoot

__all__ = ["RootMount", "filesystem_root", "mountinfo", "unavailable"]

#: The tmpfs's source field, and its directory: ``<tmp>/PREFIX-<pid of the mounting process>-XXXX``.
SOURCE = "osworld_jax-sysroot"
PREFIX = "osworld_jax-sysmount"
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_PRIVATE = 1, 2, 4, 32, 1 << 18
_MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: str | None, target: Path, fstype: str | None, flags: int, data: str) -> None:
    enc = [None if s is None else s.encode() for s in (source, str(target), fstype, data)]
    if _libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _detach(target: Path) -> None:
    if _libc.umount2(str(target).encode(), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):  # not (or no longer) a mount point
            raise OSError(err, f"umount {target}: {os.strerror(err)}")


def _unescape(field: str) -> str:
    """A mountinfo path field (octal escapes such as 040 for space, tab, newline, backslash)."""
    return field.encode().decode("unicode_escape").encode("latin-1").decode(errors="replace")


def mountinfo(pid: str = "self") -> list[tuple[str, str, str]]:
    """``(root within its filesystem, mount point, source)`` per line of /proc/PID/mountinfo."""
    out = []
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        out.append((_unescape(fields[3]), _unescape(fields[4]), fields[sep + 2]))
    return out


def filesystem_root(path: Path) -> bool:
    """Whether ``path`` is the root of a filesystem of its own (a mount point showing ``/``)."""
    real = os.path.realpath(path)
    top = [root for root, point, _ in mountinfo() if point == real]
    return bool(top) and top[-1] == "/"  # the last mount on a point is the visible one


def unavailable() -> str | None:
    """None when this process can mount a private tmpfs; else why not, in a few words.

    Tries it (a tiny tmpfs at a fresh directory, detached at once).
    """
    if os.geteuid() != 0:
        return f"not root (uid {os.geteuid()}): mounting a tmpfs needs CAP_SYS_ADMIN"
    probe = Path(tempfile.mkdtemp(prefix=f"{PREFIX}-probe-"))  # never swept: no pid
    try:
        _mount(SOURCE, probe, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=4k,mode=0755")
        _detach(probe)
    except OSError as e:
        return f"cannot mount a tmpfs ({e.strerror}; a container needs CAP_SYS_ADMIN)"
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()
    return None


def sweep_stale() -> list[Path]:
    """Detaches and removes the tmpfs copies of processes that died without closing them."""
    removed = []
    for _, point, source in mountinfo():
        pid = Path(point).name.removeprefix(f"{PREFIX}-").split("-")[0]
        if source != SOURCE or not pid.isdigit() or Path(f"/proc/{pid}").exists():
            continue
        with contextlib.suppress(OSError):
            _detach(Path(point))
            Path(point).rmdir()
            removed.append(Path(point))
    return removed


def _close(target: Path) -> None:
    _detach(target)
    with contextlib.suppress(OSError):
        target.rmdir()


class RootMount:
    """A read-only copy of a system root on a private tmpfs (see the module docstring).

    ``open()`` makes it and returns its directory (idempotent); ``close()`` detaches it (the
    jails still running keep their binds) and removes the directory. A ``SystemRoot`` of the
    host (``path`` None) needs none: ``open()`` returns None.
    """

    def __init__(self, system: SystemRoot) -> None:
        self.system = system
        self.dir: Path | None = None
        self._finalizer: weakref.finalize | None = None

    def open(self) -> Path | None:
        """The directory the jails' system binds come from; mounts and copies on first use.

        Raises ``OSError`` naming the step that failed (the mount is then removed).
        """
        if self.dir is not None or self.system.path is None:
            return self.dir
        sweep_stale()
        target = Path(tempfile.mkdtemp(prefix=f"{PREFIX}-{os.getpid()}-"))
        try:
            target.chmod(0o755)  # the jails' unprivileged host uid reaches it
            flags = _MS_NOSUID | _MS_NODEV
            _mount(SOURCE, target, "tmpfs", flags, "mode=0755")
            self._finalizer = weakref.finalize(self, _close, target)
            _mount(None, target, None, _MS_PRIVATE, "")  # no copy of it propagates elsewhere
            res = subprocess.run(
                [*self.system.argv("cp"), "-a", "--", ".", str(target)],
                cwd=self.system.cwd,
                env=self.system.env,
                capture_output=True,
                text=True,
                check=False,
            )
            if res.returncode != 0:
                last = (res.stderr.strip().splitlines() or ["?"])[-1]
                raise OSError(errno.EIO, f"copying system root {self.system.path}: {last}")
            _mount(None, target, None, _MS_REMOUNT | _MS_RDONLY | flags, "")
        except BaseException:
            if self._finalizer is not None:
                self._finalizer()
            else:
                with contextlib.suppress(OSError):
                    target.rmdir()
            raise
        self.dir = target
        return target

    def close(self) -> None:
        """Detaches the copy and removes its directory (idempotent)."""
        if self._finalizer is not None:
            self._finalizer()
        self.dir = None
        self._finalizer = None
