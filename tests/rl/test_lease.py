"""The run's lease and its reaper (`osworld_jax.rl.lease`, `osworld_jax.reaper`) on real processes.

A lease holder is a separate Python process (the "trainer") that starts a ``sleep`` in its own
process group, as the servers are started, and records a directory; the tests kill it with
SIGKILL. The end-to-end version with the real server and jails is tests/rl/test_orphans.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from osworld_jax import reaper
from osworld_jax.rl.lease import RunDirBusyError, RunLease

HOLDER = """
import subprocess, sys, time
from pathlib import Path
from osworld_jax.rl.lease import RunLease
run_dir, extra = Path(sys.argv[1]), Path(sys.argv[2])
with RunLease(run_dir) as lease:
    extra.mkdir()
    lease.add_dir(extra)
    child = subprocess.Popen(["sleep", "600"], start_new_session=True)
    print(child.pid, flush=True)
    time.sleep(600)
"""


def _alive(pid: int) -> bool:
    return reaper.process_start(pid) is not None


def _wait(cond, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _holder(run_dir: Path, extra: Path) -> tuple[subprocess.Popen, int]:
    run_dir.mkdir(exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir), str(extra)], stdout=subprocess.PIPE, text=True
    )
    child = int(proc.stdout.readline())
    return proc, child


@pytest.mark.slow  # the holder imports the rl package (jax): ~20 s on a loaded machine
def test_the_reaper_ends_what_a_killed_trainer_started(tmp_path):
    run_dir, extra = tmp_path / "run", tmp_path / "sandboxes"
    holder, child = _holder(run_dir, extra)
    lease = json.loads((run_dir / reaper.LEASE_FILE).read_text())
    assert lease["pid"] == holder.pid and lease["dirs"] == [str(extra.resolve())]
    # The marker is inherited. Popen returns once exec has closed its pipe, a moment before the
    # kernel sets the new image's environment up (/proc/<pid>/environ reads empty until then).
    assert _wait(lambda: reaper.marked_processes(run_dir) == [child], within_s=30)
    assert os.getpgid(child) == child  # its own group, as the servers
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert _wait(lambda: not _alive(child), within_s=5)
    assert _wait(lambda: not extra.exists(), within_s=5)
    assert _wait(lambda: not (run_dir / reaper.LEASE_FILE).exists(), within_s=5)
    assert f"ended processes [{child}]" in (run_dir / "reaper.log").read_text()


@pytest.mark.slow
def test_a_second_trainer_in_a_live_run_dir_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    holder, child = _holder(run_dir, tmp_path / "x")
    try:
        with pytest.raises(RunDirBusyError, match=rf"in use by the trainer with pid {holder.pid}"):
            with RunLease(run_dir):
                pass
        assert _alive(child)  # the refused start touched nothing
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert _wait(lambda: not _alive(child), within_s=5)
    with RunLease(run_dir):  # the dead holder's lease is taken over
        pass


def test_the_next_start_cleans_what_a_crash_left(tmp_path):
    """The reaper died too: a dead instance's marked process and directory wait for the next
    start, which ends and removes them before it returns."""
    run_dir, extra = tmp_path / "run", tmp_path / "sandboxes"
    run_dir.mkdir()
    extra.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs: the crashed trainer
    marker = f"{run_dir.resolve()}#{dead.pid}.1"
    leftover = subprocess.Popen(
        ["sleep", "600"], env={**os.environ, reaper.MARKER: marker}, start_new_session=True
    )
    # Until the child has exec'd, /proc/<pid>/environ is the parent's (no marker): a process
    # the crashed run left is long past its exec; so is this one before the lease starts.
    environ = Path(f"/proc/{leftover.pid}/environ")
    assert _wait(lambda: marker.encode() in environ.read_bytes(), 30.0)
    lease = {"marker": marker, "pid": dead.pid, "host": os.uname().nodename, "dirs": [str(extra)]}
    (run_dir / reaper.LEASE_FILE).write_text(json.dumps(lease))
    before = os.environ.get(reaper.MARKER)
    with RunLease(run_dir) as new:
        assert not _alive(leftover.pid) and not extra.exists()
        assert os.environ[reaper.MARKER] == new.marker
        assert json.loads((run_dir / reaper.LEASE_FILE).read_text())["pid"] == os.getpid()
    leftover.wait()
    assert os.environ.get(reaper.MARKER) == before  # restored
    assert not (run_dir / reaper.LEASE_FILE).exists()
    assert (
        not (run_dir / "reaper.log").exists() or "died" not in (run_dir / "reaper.log").read_text()
    )


def test_two_starts_that_interleave_are_refused_by_the_lock(tmp_path, monkeypatch):
    """The second start read the lease before the first wrote it (it saw no live holder): the
    lock on .lease.lock still refuses it, in one line naming the holder; once the holder
    leaves, the next start gets in."""
    from osworld_jax.rl import lease as lease_mod

    with RunLease(tmp_path) as first:
        with monkeypatch.context() as m:
            m.setattr(lease_mod.RunLease, "_take_over", lambda self: None)  # the racy read
            with pytest.raises(RunDirBusyError) as refused:
                with RunLease(tmp_path):
                    pass
        message = str(refused.value)
        assert "\n" not in message and f"in use by the trainer with pid {os.getpid()}" in message
        assert json.loads((tmp_path / reaper.LEASE_FILE).read_text())["marker"] == first.marker
    with RunLease(tmp_path):
        pass
    assert (tmp_path / lease_mod.LOCK_FILE).exists()  # kept: a removed lock file lets two in


def test_a_filesystem_without_locks_is_said_plainly(tmp_path, monkeypatch, caplog):
    import errno

    from osworld_jax.rl import lease as lease_mod

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(lease_mod.fcntl, "flock", no_locks)
    with caplog.at_level("WARNING", logger="osworld_jax.rl.lease"), RunLease(tmp_path):
        pass
    warned = [r.getMessage() for r in caplog.records if "does not support locks" in r.getMessage()]
    assert len(warned) == 1 and str(tmp_path) in warned[0] and "\n" not in warned[0]
