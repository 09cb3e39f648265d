"""What a fork copies: a sandbox's files, snapshotted and copied into fresh desktops.

``LocalBackend.fork(sandbox, n)`` copies the initialised sandbox's FILESYSTEM and restarts
programs:

- copied (``cp -a``, byte-exact, ownership and timestamps kept): everything the sandbox wrote
  under ``/home/user`` (files, app configs, caches, recently-used lists; minus the running apps'
  lock files, ``apps.lock_file_expression``) and ``/tmp`` (minus the X, ICE and dbus sockets,
  which belong to the running session), and the host-side work dir of setup outputs
  (``execute`` steps' saved stdout/stderr that ``cache_file`` getters read).
- not copied: any process state: open windows, their positions and focus, the mouse position,
  clipboard, unsaved edits in an app's memory, undo history, running shells, the X server's
  state, the session and at-spi buses. Each fork starts a fresh desktop on the copied filesystem
  and re-runs only the task's program-starting setup steps (``fork_rerun_step_types``: launch,
  open, activate/close window, sleep, and the Chrome tab steps, which act on the running
  browser), so a fork equals the source right after its setup as long as setup did its work
  through files or these steps (which OSWorld setups do: download/upload files, then open
  them). A file an app rewrites at the instant of the snapshot may be copied half-written.

``snapshot`` writes the copy (home/, tmp/, work/) to a host directory; ``populate`` merges one
into a running desktop (a warm-pool one included: its home and /tmp are the jail's tmpfs).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

from osworld_jax.env.backend import SandboxCreateError
from osworld_jax.env.local import apps, limits
from osworld_jax.env.local.desktop import LocalDesktop
from osworld_jax.env.local.sysroot import HOST, SystemRoot

__all__ = ["copy_tree", "populate", "snapshot"]


async def snapshot(desktop: LocalDesktop, root: Path) -> Path:
    """Copies the desktop's filesystem state (home, tmp, work) into a new directory of ``root``."""
    snap = root / f"_snap-{desktop.id}-{uuid.uuid4().hex[:6]}"
    snap.mkdir(mode=0o700)
    try:
        system = desktop.system
        await copy_tree(desktop.host_path("/home/user"), dst=snap / "home", system=system)
        await copy_tree(desktop.host_path("/tmp"), dst=snap / "tmp", system=system)
        await copy_tree(desktop.dir / "work", dst=snap / "work", system=system)
        await asyncio.to_thread(drop_session_files, snap / "tmp", system)
        await asyncio.to_thread(drop_app_locks, snap / "home", system)
    except BaseException:
        await asyncio.to_thread(limits.remove_tree, snap)
        raise
    return snap


async def populate(desktop: LocalDesktop, snap: Path) -> None:
    """Merges a snapshot's home/, tmp/ into the running jail and work/ into its host dir.

    Into the jail through a tar pipe whose writer runs as the jail's host uid: files in the
    jail's tmpfs must belong to a uid mapped in its user namespace (and then belong to the
    jail's user whatever jail the snapshot came from).
    """
    for sub, jail_dir in (("home", "/home/user"), ("tmp", "/tmp")):
        if (snap / sub).exists():
            await copy_into_jail(snap / sub, desktop, jail_dir)
    if (snap / "work").exists():
        await copy_tree(
            snap / "work", dst=desktop.dir / "work", contents=True, system=desktop.system
        )


async def copy_into_jail(src: Path, desktop: LocalDesktop, jail_dir: str) -> None:
    """``tar`` the contents of ``src`` into ``jail_dir`` of the running jail (see ``populate``)."""
    target, fd = desktop.inherited_path(jail_dir)
    read_end, write_end = os.pipe()
    kwargs: dict[str, Any] = {}
    if desktop.host_uid is not None:
        kwargs.update(user=desktop.host_uid, group=desktop.host_uid, extra_groups=[])
    tar, cwd = desktop.system.argv("tar"), desktop.system.cwd
    try:
        reader = await asyncio.create_subprocess_exec(
            *tar,
            "-C",
            str(src),
            "--sparse",
            "-cf",
            "-",
            ".",
            stdout=write_end,
            stderr=asyncio.subprocess.PIPE,
            cwd=cwd,
            env=desktop.system.env,
        )
        writer = await asyncio.create_subprocess_exec(
            *tar,
            "-C",
            target,
            "--no-same-owner",
            "-xpf",
            "-",
            stdin=read_end,
            stderr=asyncio.subprocess.PIPE,
            pass_fds=(fd,),
            cwd=cwd,
            env=desktop.system.env,
            **kwargs,
        )
    finally:
        os.close(read_end)
        os.close(write_end)
    (_, rerr), (_, werr) = await asyncio.gather(reader.communicate(), writer.communicate())
    if reader.returncode or writer.returncode:
        err = (rerr + werr).decode(errors="replace").strip()[-400:]
        raise SandboxCreateError(f"sandbox {desktop.id}: copying files into {jail_dir}: {err}")


async def copy_tree(
    *srcs: Path, dst: Path, contents: bool = False, system: SystemRoot = HOST
) -> None:
    """One ``cp -a`` (ownership, modes, timestamps, symlinks kept; reflinks where possible).

    One source and no existing ``dst``: ``dst`` becomes a copy of it. Several sources: copied into
    the existing directory ``dst``. ``contents``: what the single source holds is merged into the
    existing directory ``dst``. ``system``: whose ``cp`` (``sysroot.py``).
    """
    if contents:
        args = [f"{srcs[0]}/.", str(dst)]
    elif len(srcs) == 1:
        args = [str(srcs[0]), str(dst)]
    else:
        args = [*map(str, srcs), f"{dst}/"]
    proc = await asyncio.create_subprocess_exec(
        *system.argv("cp"),
        "-a",
        "--reflink=auto",
        *args,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        cwd=system.cwd,
        env=system.env,
    )
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise SandboxCreateError(f"copy {srcs} -> {dst} failed: {err.decode(errors='replace')}")


def drop_app_locks(home: Path, system: SystemRoot = HOST) -> None:
    """Removes the running apps' lock files from a copied home (``apps.lock_file_expression``)."""
    if home.exists():
        subprocess.run(
            [*system.argv("find"), str(home), "-xdev", *apps.lock_file_expression(), "-delete"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=False,
            cwd=system.cwd,
            env=system.env,
        )


def drop_session_files(tmp: Path, system: SystemRoot = HOST) -> None:
    """Removes the running session's sockets and locks from a copied /tmp (any depth)."""
    if not tmp.exists():
        return
    for name in (".X11-unix", ".ICE-unix", ".X0-lock", ".font-unix", ".XIM-unix"):
        limits.remove_tree(tmp / name)
    subprocess.run(
        [
            *system.argv("find"),
            str(tmp),
            "-xdev",
            "(",
            "-type",
            "s",
            "-o",
            "-name",
            "dbus-*",
            "!",
            "-type",
            "d",
            ")",
            "-delete",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=False,
        cwd=system.cwd,
        env=system.env,
    )
