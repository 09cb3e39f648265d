"""What the host runs over a system root or the sandboxes' files: a clean, explicit environment
(sysroot.SystemRoot.env), and a root whose programs another user could change is refused."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from osworld_jax.env.local import limits, snapshot
from osworld_jax.env.local.sysroot import HOST

PRELOAD = r"""
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
__attribute__((constructor)) static void mark(void) {
    char path[4096];
    const char *dir = getenv("PRELOAD_MARK_DIR");
    snprintf(path, sizeof path, "%s/load", dir ? dir : "/tmp");
    close(open(path, O_WRONLY | O_CREAT | O_APPEND, 0644));
}
"""


@pytest.fixture
def preload(tmp_path, monkeypatch) -> Path:
    """A trainer environment with an LD_PRELOAD library that marks every process it enters."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the LD_PRELOAD library")
    (tmp_path / "mark.c").write_text(PRELOAD)
    lib = tmp_path / "mark.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", lib, tmp_path / "mark.c"], check=True)
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv("LD_PRELOAD", str(lib))
    monkeypatch.setenv("PRELOAD_MARK_DIR", str(marks))
    return marks


def test_host_programs_get_none_of_the_trainers_loader_variables(tmp_path, preload):
    subprocess.run(["true"], check=True)  # the control: an inheriting child loads it
    assert (preload / "load").exists()
    (preload / "load").unlink()
    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "home" / ".cache").mkdir(parents=True)
    (src / "home" / ".lock").write_text("")
    asyncio.run(snapshot.copy_tree(src, dst=dst))  # cp
    snapshot.drop_app_locks(dst / "home")  # find
    snapshot.drop_session_files(dst / "home")  # find, rm
    limits.remove_tree(dst)  # chmod, rm
    assert not dst.exists() and not (preload / "load").exists()
    assert set(HOST.env) == {"PATH", "LC_ALL"}


def test_a_root_another_user_could_change_is_refused_before_it_runs(tmp_path, monkeypatch):
    """The host runs the root's bwrap, sh, tar... (as uid 0 here): a program, a library, the
    root or a directory above it that another uid owns or anyone may write is refused at
    preflight, in one line naming the path, before any of the root's programs runs."""
    from osworld_jax.env.backend import PreflightError
    from osworld_jax.env.local import LocalBackend, LocalBackendConfig
    from osworld_jax.env.local.sysroot import SystemRoot
    from tests.env.local.test_system_root import fake_root

    root = fake_root(tmp_path, programs=("sh", "prlimit", "bwrap", "tar", "cp", "find"))
    system = SystemRoot(root)
    programs = ("/bin/sh", "/usr/bin/prlimit", "/usr/bin/bwrap", "tar", "cp", "find")
    lib = root / "usr/lib/x86_64-linux-gnu"
    (lib / "libz.so.1.2.13").write_bytes(b"")
    (lib / "libz.so.1").symlink_to("libz.so.1.2.13")  # a link's own mode is 0777: not a write bit
    assert system.untrusted_paths(programs) == []  # all ours, none group/other-writable
    ran: list[object] = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **kw: ran.append(a))
    other = os.geteuid() + 4242
    cases = [
        (root / "usr/bin/tar", lambda p: os.chown(p, other, -1)),  # another owner
        (root / "usr/lib/x86_64-linux-gnu/libc.so.6", lambda p: p.chmod(0o666)),  # o+w library
        (root / "usr", lambda p: p.chmod(0o775)),  # g+w directory on the way
        (root, lambda p: os.chown(p, other, -1)),  # the root itself
        (tmp_path, lambda p: p.chmod(0o1777)),  # sticky above the root: fine
    ]
    for path, spoil in cases:
        if not path.exists():
            path.write_bytes(b"")
            path.chmod(0o644)
        before = path.stat()
        spoil(path)
        found = system.untrusted_paths(programs)
        if path == tmp_path:
            assert found == []
        else:
            assert [f.split(" (")[0] for f in found] == [str(path)], found
            with pytest.raises(PreflightError) as refused:
                LocalBackend(LocalBackendConfig(system_root=str(root))).preflight()
            line = str(refused.value)
            assert "\n" not in line and f"another user could change {path} (owner uid" in line
        os.chown(path, before.st_uid, before.st_gid)
        path.chmod(before.st_mode & 0o7777)
    assert ran == []  # refused before any program of the root ran
