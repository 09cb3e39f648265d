"""A jail over a system root sees only its own paths in /proc/self/mountinfo (issue 43 item 11).

The root is bound from a read-only tmpfs copy (``sysmount.RootMount``), whose mountinfo lines
show paths inside the tmpfs (``/usr``), never the root's host directory. The jail here is the real
one (``JailSpec``'s arguments, the root's own bwrap run by the root's loader as the unprivileged
host uid) over a small root made of the host's ``bwrap``, ``cat`` and their libraries; only the
command after ``--`` is ``cat /proc/self/mountinfo`` instead of the desktop's server.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from osworld_jax.env.local import LocalBackend, LocalBackendConfig, sysmount
from tests.env.local.test_system_root import SIZES

HOST_LOADER = "/lib64/ld-linux-x86-64.so.2"


def _libraries(program: str) -> list[str]:
    res = subprocess.run([HOST_LOADER, "--list", program], capture_output=True, text=True)
    return [
        ln.split("=>")[1].split(" (")[0].strip() for ln in res.stdout.splitlines() if "=>" in ln
    ]


@pytest.fixture(scope="module")
def small_root() -> Iterator[Path]:
    """A usrmerged root holding the host's bwrap, cat and cp with their libraries (~5 MB).

    Under /tmp, 0755: the jail's unprivileged host uid must reach it (pytest's dirs are 0700).
    """
    programs = [shutil.which(p) for p in ("bwrap", "cat", "cp")]
    if not (all(programs) and Path(HOST_LOADER).exists()):
        pytest.skip("no bwrap/cat/cp/x86-64 loader on this host: it cannot start jails")
    top = Path(tempfile.mkdtemp(prefix="osworld_jax-test-root-"))
    top.chmod(0o755)
    root = top / "root"
    libdir = root / "usr/lib/x86_64-linux-gnu"
    for d in ("usr/bin", "usr/lib64", "etc", "var/lib/dbus"):
        (root / d).mkdir(parents=True)
    libdir.mkdir(parents=True)
    for top_dir in ("bin", "lib", "lib64"):
        (root / top_dir).symlink_to(f"usr/{top_dir}")
    shutil.copy(os.path.realpath(HOST_LOADER), root / "usr/lib64/ld-linux-x86-64.so.2")
    for program in programs:
        assert program is not None
        shutil.copy(program, root / "usr/bin")
        for lib in _libraries(program):
            shutil.copy(lib, libdir)
    for name in ("passwd", "group", "hostname", "hosts"):
        (root / "etc" / name).write_bytes(b"")
    for path in root.rglob("*"):
        if not path.is_symlink():
            path.chmod(0o755)
    yield root
    shutil.rmtree(top)


def _jail_mountinfo(backend: LocalBackend, system_dir: Path | None) -> str:
    """``/proc/self/mountinfo`` as a process of a jail started with the backend's arguments."""
    system = backend.system
    argv = [*system.argv("bwrap"), *backend._spec(system_dir).args]
    argv += ["--", "/usr/bin/cat", "/proc/self/mountinfo"]
    uid = backend.config.host_uid
    kwargs = dict(user=uid, group=uid, extra_groups=[]) if os.geteuid() == 0 else {}
    res = subprocess.run(
        argv, cwd=system.cwd, env={}, capture_output=True, text=True, timeout=30, **kwargs
    )
    if res.returncode != 0 and "namespace" in res.stderr:
        pytest.skip(f"this machine cannot start jails: {res.stderr.strip()[:200]}")
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_a_jail_over_a_system_root_shows_none_of_its_host_path(small_root):
    if sysmount.unavailable():
        pytest.skip(f"the tmpfs copy cannot be made here: {sysmount.unavailable()}")
    backend = LocalBackend(LocalBackendConfig(system_root=str(small_root), **_cfg()))
    # Control: bound from the root itself, the jail's mountinfo names it (the leak of item 11).
    assert f"{small_root}/usr /usr " in _jail_mountinfo(backend, None)
    try:
        copy = asyncio.run(backend._system_source())
        assert copy is not None and copy != small_root
        assert asyncio.run(backend._system_source()) == copy  # once per backend
        inside = _jail_mountinfo(backend, copy)
        for host in {str(small_root), os.path.realpath(small_root), str(copy), "/tmp/"}:
            assert host not in inside, (host, inside)
        lines = [ln.split() for ln in inside.splitlines()]
        usr = [ln for ln in lines if ln[4] == "/usr"]
        assert len(usr) == 1 and usr[0][3] == "/usr", usr
        assert usr[0][usr[0].index("-") + 2] == sysmount.SOURCE  # no path, no host pid
        assert str(os.getpid()) not in inside
        # On the host: one read-only private tmpfs, a faithful copy; aclose removes it.
        mounts = [m for m in sysmount.mountinfo() if m[1] == str(copy)]
        assert [m[0] for m in mounts] == ["/"] and sysmount.filesystem_root(copy)
        with pytest.raises(OSError, match="Read-only"):
            (copy / "x").write_bytes(b"")
        assert (copy / "usr/bin/cat").read_bytes() == (small_root / "usr/bin/cat").read_bytes()
        assert os.readlink(copy / "lib64") == "usr/lib64"
    finally:
        asyncio.run(backend.aclose())
    assert not copy.exists() and not [m for m in sysmount.mountinfo() if m[1] == str(copy)]


def test_without_the_mechanism_the_jail_runs_from_the_root_with_one_warning(
    small_root, monkeypatch, caplog
):
    """Not root (or no CAP_SYS_ADMIN): the jail still runs, bound from the root itself, and the
    backend says so once, in one line naming the root and why."""  # noqa: D205, D209
    monkeypatch.setattr(os, "geteuid", lambda: 4242)
    why = sysmount.unavailable()
    assert why is not None and "not root (uid 4242)" in why
    monkeypatch.undo()
    monkeypatch.setattr(sysmount, "unavailable", lambda: why)
    backend = LocalBackend(LocalBackendConfig(system_root=str(small_root), **_cfg()))
    with caplog.at_level(logging.WARNING, logger="osworld_jax.env.local.backend"):
        assert backend._warn_system_mount()
        assert asyncio.run(backend._system_source()) == small_root
        assert asyncio.run(backend._system_source()) == small_root
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert f"system root {small_root}: not root (uid 4242)" in warnings[0]
    assert "/proc/self/mountinfo shows its host path" in warnings[0]
    assert f"{small_root}/usr /usr " in _jail_mountinfo(backend, small_root)  # still a jail
    # A root that is a filesystem of its own already is bound as it is: no copy, no warning.
    monkeypatch.setattr(sysmount, "filesystem_root", lambda path: True)
    assert (
        LocalBackend(LocalBackendConfig(system_root=str(small_root)))._warn_system_mount() is False
    )
    asyncio.run(backend.aclose())


def test_a_copy_left_by_a_dead_process_is_swept():
    if sysmount.unavailable():
        pytest.skip(f"no tmpfs can be mounted here: {sysmount.unavailable()}")
    dead = _dead_pid()
    mine = Path(tempfile.mkdtemp(prefix=f"{sysmount.PREFIX}-{os.getpid()}-"))
    target = Path(tempfile.mkdtemp(prefix=f"{sysmount.PREFIX}-{dead}-"))
    for path in (mine, target):
        sysmount._mount(sysmount.SOURCE, path, "tmpfs", 0, "size=4k")
    try:
        swept = sysmount.sweep_stale()
        assert target in swept and mine not in swept  # a live process's copy stays
        assert not target.exists() and sysmount.filesystem_root(mine)
    finally:
        sysmount._close(mine)
        sysmount._close(target)
    assert not mine.exists()


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _cfg() -> dict[str, object]:
    return dict(screen_width=SIZES["width"], screen_height=SIZES["height"])
