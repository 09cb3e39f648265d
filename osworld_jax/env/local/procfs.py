"""The host's view of a jail's processes, read from ``/proc``: pid namespaces, children, zombies."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["children", "is_zombie", "pid_namespace", "pid_namespace_members", "start_time"]


def pid_namespace(pid: int) -> str | None:
    """The pid namespace (``pid:[inode]``) of process ``pid``; None when it is gone."""
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def is_zombie(pid: int) -> bool:
    """Whether ``pid`` is dead (a zombie, or gone) though perhaps not yet reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2 :].startswith(("Z", "X"))


def start_time(pid: int) -> str | None:
    """The process's start time (``/proc/PID/stat`` field 22): tells a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()[19]


def pid_namespace_members(ns: str) -> list[int]:
    """Pids (host view) of the running processes whose pid namespace is ``ns`` (``pid:[inode]``).

    Zombies (already dead, waiting to be reaped by the host's init) are not counted.
    """
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and pid_namespace(int(entry)) == ns and not is_zombie(int(entry)):
            out.append(int(entry))
    return out


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (its main thread's); empty when it is gone."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in text.split()]
