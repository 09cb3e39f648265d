"""The system a jail runs: the host's own, or a separate Debian root (``system_root``).

``LocalBackendConfig.system_root = None``: the jail binds the host's ``/usr``, ``/etc`` and
top-level links (``/bin``, ``/lib``, ...), and the host runs its own ``sh``, ``prlimit`` and
``bwrap`` to start a jail and its own ``tar``, ``cp`` and ``find`` to copy a sandbox's files.

A directory (a Debian userland: ``usr/``, ``etc/`` and the usrmerge links ``bin -> usr/bin``...;
``scripts/offline_install.sh`` builds one from the debs of ``scripts/offline_bundle.sh``): the
jail binds those of the root instead, and each of those host-side programs is the root's, run
through the root's own dynamic loader with the root's library directories and no library cache
(``ld-linux-x86-64.so.2 --inhibit-cache --library-path usr/lib/x86_64-linux-gnu:...
usr/bin/bwrap``), so it never loads a host library: the host needs only a kernel with user
namespaces (its glibc, distribution and packages do not matter). The host's own ``rm`` and
``chmod`` still remove directories (``limits.remove_tree``; also used where no backend is).

Root programs run with the root as their working directory and paths relative to it: the jail's
first process keeps bwrap's command line (``/proc/1/cmdline``), which so names no host path.
Paths are looked up inside the root: its symlinks are followed as the jail sees them (an absolute
link target is inside the root), never into the host's filesystem.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
from pathlib import Path

__all__ = ["HOST", "SystemRoot"]

#: The dynamic loader and library directories of an x86-64 Debian root (jail paths).
LOADER = "/lib64/ld-linux-x86-64.so.2"
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu")
#: Where a program name is looked up in a root (the jail's system PATH, then sbin).
SEARCH_DIRS = ("/usr/local/bin", "/usr/bin", "/bin", "/usr/sbin", "/sbin")
#: The top-level directories (or usrmerge links) a jail takes from its system.
TOP_LEVEL = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")


class SystemRoot:
    """Where a jail's userland and the host-side programs that start or enter it come from.

    Attributes:
      path: the root directory (absolute), or None for the host's own system.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = None if path is None else Path(os.path.abspath(path))

    def __repr__(self) -> str:
        return f"SystemRoot({str(self.path) if self.path else None!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SystemRoot) and other.path == self.path

    def __hash__(self) -> int:
        return hash(self.path)

    @property
    def dir(self) -> Path:
        """The directory the jail's ``/usr``, ``/etc`` and top-level links come from."""
        return self.path if self.path is not None else Path("/")

    @property
    def env(self) -> dict[str, str]:
        """The whole environment of a program the host runs for a jail (``tar``, ``cp``,
        ``find``, ``rm``...): explicit, nothing inherited from the trainer, so no
        ``LD_PRELOAD``, ``LD_LIBRARY_PATH``, ``LD_AUDIT``, ``GCONV_PATH``, ``TAR_OPTIONS``...
        reaches a program that runs over the sandboxes' files (as root, often). ``PATH`` finds
        the host's programs (the host's own ``PATH``); a root's run by their path."""  # noqa: D205, D209
        search = os.environ.get("PATH", os.defpath) if self.path is None else "/usr/bin:/bin"
        return {"PATH": search, "LC_ALL": "C"}

    @property
    def cwd(self) -> str | None:
        """The working directory ``argv`` commands need (the root; None: any)."""
        return None if self.path is None else str(self.path)

    def system_binds(self, tops: tuple[str, ...] = TOP_LEVEL, src: Path | None = None) -> list[str]:
        """Bwrap options mounting this system's ``/usr`` and top-level dirs ``tops`` read-only
        (a usrmerge link becomes the same link; a missing one is left out); ``src``: a copy of
        the root to bind them from instead (``sysmount.RootMount``)."""  # noqa: D205, D209
        src = self.dir if src is None else src
        args = ["--ro-bind", str(src / "usr"), "/usr"]
        for top in tops:
            host = src / top
            if host.is_symlink():
                args += ["--symlink", os.readlink(host), f"/{top}"]
            elif host.is_dir():
                args += ["--ro-bind", str(host), f"/{top}"]
        return args

    def resolve(self, jail_path: str) -> Path:
        """The host path of ``jail_path``, its symlinks followed inside the root.

        Raises ``OSError`` (ELOOP) on a symlink loop. Missing components are kept as they are.
        """
        if self.path is None:
            return Path(jail_path)
        todo = [p for p in jail_path.split("/") if p not in ("", ".")]
        done: list[str] = []
        hops = 0
        while todo:
            part = todo.pop(0)
            if part == "..":
                if done:
                    done.pop()
                continue
            here = self.path.joinpath(*done, part)
            if not here.is_symlink():
                done.append(part)
                continue
            hops += 1
            if hops > 40:
                raise OSError(errno.ELOOP, f"symlink loop in {self.path} at {jail_path}")
            target = os.readlink(here)
            if target.startswith("/"):
                done = []
            todo = [p for p in target.split("/") if p not in ("", ".")] + todo
        return self.path.joinpath(*done)

    def which(self, program: str, path: str | None = None) -> str | None:
        """The path of ``program`` (a name, or an absolute jail path) if it is an executable.

        On the host: ``shutil.which(program, path=path)``. In a root: the jail path
        (``/usr/bin/bwrap``) of a name looked up in ``path`` (``:``-separated; default
        ``SEARCH_DIRS``) inside the root.
        """
        if self.path is None:
            return shutil.which(program, path=path)
        dirs = path.split(":") if path else SEARCH_DIRS
        candidates = [program] if "/" in program else [f"{d}/{program}" for d in dirs]
        for path in candidates:
            host = self.resolve(path)
            if host.is_file() and os.access(host, os.X_OK):
                return path
        return None

    def _relative(self, jail_path: str) -> str:
        assert self.path is not None
        return os.path.relpath(self.resolve(jail_path), self.path)

    def loader_args(self) -> list[str]:
        """The root's loader with its library directories (root-relative), ready for a program."""
        if self.path is None:
            return []
        libs = dict.fromkeys(self._relative(d) for d in LIBRARY_DIRS)
        return [self._relative(LOADER), "--inhibit-cache", "--library-path", ":".join(libs)]

    def argv(self, program: str) -> list[str]:
        """The command line that runs ``program`` on the host (run it in ``cwd``).

        On the host: ``[program]`` unchanged. In a root: the root's loader running the root's
        program, all paths relative to the root. Raises ``FileNotFoundError`` when the root has
        no such program.
        """
        if self.path is None:
            return [program]
        found = self.which(program)
        if found is None:
            raise FileNotFoundError(f"system root {self.path} has no program {program}")
        return [*self.loader_args(), self._relative(found)]

    def untrusted_paths(self, programs: tuple[str, ...]) -> list[str]:
        """The paths another user could change under the programs the host runs from the root.

        The host runs ``programs`` (and the root's loader, with every library of its library
        directories) as the trainer's user, often root: each must be owned by root or by this
        user and writable by no one else (no group or other write bit), and so must every
        directory on its path, from ``/`` through the root (a sticky directory above the root,
        such as ``/tmp``, is fine: others cannot rename what they do not own). Returns
        ``"<path> (owner uid N, mode 0o...)"`` per offending path, nearest ``/`` first.
        """
        if self.path is None:
            return []
        me = os.geteuid()
        seen: set[Path] = set()
        bad: list[str] = []

        def check(path: Path, *, sticky_ok: bool = False) -> None:
            if path in seen:
                return
            seen.add(path)
            try:
                st = path.lstat()
            except OSError:
                return  # missing: preflight names what the root lacks
            writable = st.st_mode & 0o022 and not (sticky_ok and st.st_mode & stat.S_ISVTX)
            writable = writable and not stat.S_ISLNK(st.st_mode)  # a link's mode is always 0777
            if st.st_uid not in (0, me) or writable:
                bad.append(f"{path} (owner uid {st.st_uid}, mode {oct(st.st_mode & 0o7777)})")

        def check_path(host: Path) -> None:
            for parent in reversed(host.parents):
                check(parent, sticky_ok=not parent.is_relative_to(self.path))  # type: ignore[arg-type]
            check(host)

        check_path(self.path)
        files = [self.resolve(LOADER)]
        files += [self.resolve(found) for p in programs if (found := self.which(p)) is not None]
        for lib_dir in LIBRARY_DIRS:
            d = self.resolve(lib_dir)
            check_path(d)
            if d.is_dir():
                files += [f for f in d.iterdir() if f.is_file()]
        for f in files:
            check_path(f)
        return bad

    def outside_libraries(self, program: str) -> list[str]:
        """The libraries ``program`` would load from outside the root (``ld.so --list``).

        Empty when every library resolves inside the root (or on the host system).
        """
        if self.path is None:
            return []
        res = subprocess.run(
            [*self.loader_args(), "--list", self._relative(self.which(program) or program)],
            cwd=self.path,
            capture_output=True,
            text=True,
            check=False,
            timeout=20,
            env={},
        )
        bad = []
        for line in res.stdout.splitlines():
            if "=>" not in line:
                continue
            name, where = (s.strip() for s in line.split("=>", 1))
            where = where.split(" (")[0].strip()
            real = os.path.realpath(os.path.join(self.path, where))
            if where == "not found" or not real.startswith(f"{self.path}/"):
                bad.append(f"{name} ({where})")
        if res.returncode != 0 and not bad:
            bad.append((res.stderr.strip().splitlines() or ["?"])[-1])
        return bad


#: The host's own system (``system_root = None``).
HOST = SystemRoot(None)
