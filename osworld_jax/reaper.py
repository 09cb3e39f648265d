"""What a run leaves behind when its trainer dies: found by an inherited marker, and removed.

A run (`osworld_jax.rl.lease.RunLease`) puts ``OSWORLD_JAX_RUN=<run_dir>#<pid>.<start>`` into
its environment before it starts anything, so every process it starts (the embedded or SGLang
servers and their workers) inherits the marker, and it records the host directories it creates
(the sandboxes' root) in ``<run_dir>/.lease.json``. The jails need no marker: bubblewrap's
``--die-with-parent`` ends each jail with the trainer.

Two things use the marker:

- this module as a process (``python -m osworld_jax.reaper LEASE MARKER``), started by the run
  with the read end of a pipe on its stdin: when the trainer dies, even by ``kill -9``, the
  pipe closes, and the reaper ends every process carrying the marker (with its process group:
  SIGTERM, then SIGKILL after a grace period), removes the recorded directories and the lease,
  and exits. A run that ends normally writes ``exit`` first and the reaper leaves quietly;
- the next start in the same run directory (`cleanup_crashed_run`), for whatever a crash left
  when the reaper could not act (it was killed too, or the machine rebooted mid-cleanup).

Standard library only (it starts in a fraction of a second and imports no jax).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterable
from pathlib import Path

MARKER = "OSWORLD_JAX_RUN"
LEASE_FILE = ".lease.json"
GRACE_S = 3.0  # SIGTERM -> SIGKILL


def process_start(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot (None if it is gone or a zombie).

    ``(pid, start)`` names one process: a pid reused later has another start time.
    """
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def marker_value(run_dir: Path, pid: int, start: int) -> str:
    """The marker of the run instance ``(pid, start)`` in ``run_dir``."""
    return f"{run_dir.resolve()}#{pid}.{start}"


def _marker_of(pid: int) -> str | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    prefix = MARKER.encode() + b"="
    for item in environ.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix) :].decode(errors="replace")
    return None


def marked_processes(run_dir: Path, *, instance: str | None = None) -> list[int]:
    """Live processes carrying a marker of ``run_dir`` (of exactly ``instance`` if given).

    This process is never listed. Processes whose environment cannot be read (another user's,
    when not root) are not listed either.
    """
    prefix = f"{run_dir.resolve()}#"
    out: list[int] = []
    if not Path("/proc/self/environ").exists():  # no procfs (not Linux): nothing can be found
        return out
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        value = _marker_of(int(entry.name))
        if value is None or not value.startswith(prefix):
            continue
        if (instance is None or value == instance) and process_start(int(entry.name)):
            out.append(int(entry.name))
    return out


def instance_alive(value: str) -> bool:
    """Whether the trainer that owns the marker ``value`` still runs (same pid, same start)."""
    try:
        pid, start = value.rsplit("#", 1)[1].split(".")
        return process_start(int(pid)) == int(start)
    except (ValueError, IndexError):
        return False


def kill_processes(pids: Iterable[int], grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM each process and its process group, SIGKILL what is left after ``grace_s``.

    The caller's own process group is never signalled as a group. Returns the pids that were
    alive when called.
    """
    targets = {p: process_start(p) for p in pids}
    targets = {p: s for p, s in targets.items() if s is not None}
    own_group = os.getpgrp()
    groups = set()
    for pid in targets:
        try:
            pgid = os.getpgid(pid)
        except OSError:
            continue
        if pgid != own_group and pgid == pid:  # a group leader (servers start their own)
            groups.add(pgid)

    def signal_all(sig: int) -> None:
        for pgid in groups:
            try:
                os.killpg(pgid, sig)
            except OSError:
                pass
        for pid, start in targets.items():
            if process_start(pid) == start:
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass

    signal_all(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if all(process_start(p) != s for p, s in targets.items()):
            break
        time.sleep(0.05)
    else:
        signal_all(signal.SIGKILL)
    return list(targets)


def remove_dirs(paths: Iterable[str]) -> list[str]:
    """Removes the directory trees ``paths`` (built by untrusted code: see ``remove_tree``)."""
    from osworld_jax.env.local.limits import remove_tree

    removed = []
    for p in paths:
        if os.path.lexists(p):
            remove_tree(Path(p))
            removed.append(p)
    return removed


def read_lease(run_dir: Path) -> dict | None:
    """The lease of ``run_dir`` (None if there is none or it is unreadable)."""
    try:
        lease = json.loads((run_dir / LEASE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return lease if isinstance(lease, dict) else None


def cleanup(run_dir: Path, lease: dict) -> tuple[list[int], list[str]]:
    """Ends the processes of the lease's run instance and removes its directories.

    Processes of other dead instances of ``run_dir`` go too (a lease overwritten after a
    crash); processes of a live trainer's instance never do.
    """
    instance = str(lease.get("marker", ""))
    stale = [
        p
        for p in marked_processes(run_dir)
        if (m := _marker_of(p)) is not None and (m == instance or not instance_alive(m))
    ]
    killed = kill_processes(stale)
    removed = remove_dirs(str(d) for d in lease.get("dirs", []))
    return killed, removed


def main(argv: list[str]) -> int:
    """``python -m osworld_jax.reaper RUN_DIR MARKER``: waits on stdin, then cleans up."""
    run_dir, marker = Path(argv[0]), argv[1]
    message = sys.stdin.buffer.read()  # returns at EOF: the trainer closed it or died
    if message.strip() == b"exit":
        return 0
    lease = read_lease(run_dir) or {}
    if lease.get("marker") != marker:
        lease = {"marker": marker, "dirs": []}  # another instance took over: only our marker
    killed, removed = cleanup(run_dir, lease)
    current = read_lease(run_dir)
    if current is not None and current.get("marker") == marker:
        (run_dir / LEASE_FILE).unlink(missing_ok=True)
    with open(run_dir / "reaper.log", "a") as log:
        log.write(
            f"{time.strftime('%Y-%m-%d %H:%M:%S')} trainer {marker.rsplit('#', 1)[1]} died: "
            f"ended processes {killed}, removed {removed}\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
