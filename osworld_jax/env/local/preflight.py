"""What the ``local`` backend checks before it runs: binaries, namespaces, limits, applications.

``LocalBackend.preflight`` calls these; each problem is a ``PreflightError`` naming what is
missing and how to get it (``scripts/setup.sh``; for a system root, ``scripts/offline_bundle.sh``
and ``scripts/offline_install.sh``), never a silent run without a configured limit.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import os
import shlex
import shutil
import subprocess
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from osworld_jax.env.backend import PreflightError
from osworld_jax.env.capabilities import app_available, apps_needed
from osworld_jax.env.local import apps, limits
from osworld_jax.env.local.config import LocalBackendConfig
from osworld_jax.env.local.sysroot import HOST, LOADER, SystemRoot

if TYPE_CHECKING:
    from osworld_jax.env.tasks import Task

__all__ = [
    "HOST_PROGRAMS",
    "REQUIRED_BINARIES",
    "check_installed",
    "host_problems",
    "limit_mechanisms",
]

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
#: The programs the host runs from a system root (``sysroot.py``): they must load only its
#: libraries.
HOST_PROGRAMS = ("/bin/sh", "/usr/bin/prlimit", "/usr/bin/bwrap", "tar", "cp", "find")
#: Files a system root's /etc must have: the jail mounts its own copies over them.
_MOUNT_POINTS = ("/etc/passwd", "/etc/group", "/etc/hostname", "/etc/hosts")


def host_problems(
    window_manager: str, host_uid: int | None, system: SystemRoot = HOST
) -> list[str]:
    """What keeps a jailed desktop from running here: missing binaries, the system python3's
    modules, bubblewrap's namespaces (probed as ``host_uid`` when not None); one line each.

    With a system root (``system.path``) each line names the root, and what is looked for is in
    it: the programs, python3 and its modules (run by the root's loader), and that the programs
    the host runs from it load no library from outside it.
    """  # noqa: D205
    if system.path is not None:
        return root_problems(window_manager, host_uid, system)
    problems = []
    missing = [f"{b} (apt {p})" for b, p in REQUIRED_BINARIES.items() if not shutil.which(b)]
    wm = shlex.split(window_manager)[0]
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
        err = probe_bwrap(host_uid)
        if err:
            problems.append(err)
    return problems


def root_problems(window_manager: str, host_uid: int | None, system: SystemRoot) -> list[str]:
    """``host_problems`` for a system root: one line, naming the root, per problem."""
    root = system.path
    assert root is not None
    where = f"system root {root}"
    if not root.is_dir():
        return [f"{where} is not a directory (build it: scripts/offline_install.sh)"]
    if not system.resolve(LOADER).is_file():
        return [f"{where} has no dynamic loader {LOADER} (build it: scripts/offline_install.sh)"]
    untrusted = system.untrusted_paths(HOST_PROGRAMS)
    if untrusted:  # checked before anything of the root runs
        more = f" (and {len(untrusted) - 1} more)" if len(untrusted) > 1 else ""
        return [
            f"{where}: the host runs its programs as uid {os.geteuid()}, but another user "
            f"could change {untrusted[0]}{more}: it must be owned by root or this user and "
            "writable by no one else"
        ]
    wanted = {b: f"deb {p}" for b, p in REQUIRED_BINARIES.items()}
    wanted.update({shlex.split(window_manager)[0]: "the window manager", "/bin/sh": "deb dash"})
    wanted["/usr/bin/python3"] = "deb python3-minimal"
    missing = [f"{b} ({p})" for b, p in wanted.items() if system.which(b) is None]
    missing += [
        f"{f} (offline_install.sh makes it)"
        for f in _MOUNT_POINTS
        if not system.resolve(f).is_file()
    ]
    if missing:
        return [f"{where} lacks " + ", ".join(missing)]
    problems = []
    for program in HOST_PROGRAMS:
        outside = system.outside_libraries(program)
        if outside:
            problems.append(
                f"{where}: {program} loads libraries from outside it: {', '.join(outside)}"
            )
    probe = subprocess.run(
        [*system.argv("/usr/bin/python3"), "-I", "-c", "import Xlib.display, pyatspi"],
        capture_output=True,
        text=True,
        check=False,
        cwd=system.cwd,
        env={"GI_TYPELIB_PATH": str(system.resolve("/usr/lib/x86_64-linux-gnu/girepository-1.0"))},
    )
    if probe.returncode != 0:
        last = probe.stderr.strip().splitlines()[-1:] or ["?"]
        problems.append(f"{where}: its python3 lacks python3-xlib/python3-pyatspi ({last[0]})")
    err = probe_bwrap(host_uid, system)
    if err:
        problems.append(f"{where}: {err}")
    return problems


def probe_bwrap(host_uid: int | None, system: SystemRoot = HOST) -> str | None:
    """None when a nested jail (user + pid namespaces, sized tmpfs) can be created here."""
    inner = "/usr/bin/bwrap --unshare-user --unshare-pid --dev-bind / / --proc /proc true"
    argv = [*system.argv("bwrap"), "--unshare-all", "--die-with-parent"]
    argv += ["--uid", "1000", "--gid", "1000", *system.system_binds(("bin", "lib", "lib64"))]
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(1 << 20), "--tmpfs", "/tmp"]
    argv += ["--", "/bin/sh", "-c", inner]
    kwargs: dict[str, Any] = {}
    if host_uid is not None:
        kwargs.update(user=host_uid, group=host_uid, extra_groups=[])
    try:
        res = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            check=False,
            timeout=20,
            env={},
            cwd=system.cwd,
            **kwargs,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bwrap probe failed: {e}"
    if res.returncode != 0:
        readable = ""
        if system.path is not None and host_uid is not None:
            readable = f"; the root and its parents must be readable by uid {host_uid}"
        return (
            f"bwrap cannot create its namespaces here ({res.stderr.strip()[:200]}); "
            f"unprivileged user namespaces (nested), and bwrap >= 0.8 (--size) are needed{readable}"
        )
    return None


def limit_mechanisms(
    cfg: LocalBackendConfig, sup: limits.CgroupSupport, *, root_user: bool
) -> dict[str, str]:
    """How each configured limit is enforced here, e.g. ``{"processes": "cgroup v1 pids"}``.

    Raises ``PreflightError`` when a limit the config asks for cannot be enforced (never
    silently runs without it).
    """
    out: dict[str, str] = {}
    problems = []
    if cfg.max_processes is not None:
        if sup.pids_parent is not None:
            out["processes"] = f"cgroup {sup.version} pids.max"
        elif cfg.cgroup in ("v1", "v2"):
            problems.append(f"no {cfg.cgroup} pids cgroup ({sup.reason})")
        elif root_user:
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


def check_installed(
    tasks: Sequence[Task] | None, has_app: Callable[[str], bool]
) -> collections.Counter[str]:
    """The applications ``tasks`` start (``apps_needed``, ``a|b`` = either), with task counts.

    Raises ``PreflightError`` naming each one that does not run in the jail, how many tasks need
    it and the packages that ship it.
    """
    needed: collections.Counter[str] = collections.Counter()
    for task in tasks or ():
        needed.update(apps_needed(task))
    missing = {a: n for a, n in needed.items() if not app_available(a, has_app)}
    if missing:
        packages = sorted({p for a in missing for p in packages_for(a)})
        raise PreflightError(
            "local sandbox backend: the tasks start programs that are not installed here: "
            + ", ".join(f"{a} ({n} tasks)" for a, n in sorted(missing.items()))
            + (f" (apt {' '.join(packages)}: bash scripts/setup.sh --apps)" if packages else "")
        )
    return needed


def packages_for(app: str) -> list[str]:
    """The Debian packages of the ``APPS`` entry one of ``a|b`` belongs to."""
    for name in app.split("|"):
        found = apps.app_for(name)
        if found is not None:
            return list(found.packages)
    return []


def run_in_thread(coro: Coroutine[Any, Any, T]) -> T:
    """Runs ``coro`` to completion on a fresh event loop in a worker thread (a sync caller may
    itself be inside a running loop)."""  # noqa: D205, D209
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()
