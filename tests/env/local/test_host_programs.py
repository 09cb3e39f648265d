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
