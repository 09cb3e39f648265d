"""What a jail is started with: bubblewrap's arguments, its environment, the files it gets.

The jail (``bwrap --unshare-all --die-with-parent --new-session``; threat model and guarantees in
``docs/SECURITY.md``):

- namespaces: user, mount, pid, network, ipc, uts, cgroup. The network namespace holds only a
  loopback device, so nothing inside can reach the host's or any other network.
- the door: the host creates the listening UNIX socket in ``<sandbox>/ctl/`` (a directory the jail
  never mounts) and hands only the descriptor to the in-jail server, which makes itself
  non-dumpable; the agent's code runs in a nested namespace that cannot see the server
  (``jailexec.py``). Nothing in the jail can connect to, replace or impersonate the server.
- identity: inside, the user is ``user`` (uid 1000) with home ``/home/user``. When the host runs as
  root, bubblewrap itself is started as an unprivileged host uid (``LocalBackendConfig.host_uid``,
  or a distinct uid per sandbox when no pids cgroup is available), so files that only root may
  read (``/etc/shadow``, ``/root``) stay unreadable even where they are visible.
- what the jail can read about itself: bubblewrap is started with an EMPTY environment and its
  arguments come from a descriptor (``--args``), its files (``/etc/passwd`` ..., the server, the
  shim) from descriptors (``--ro-bind-data``); so ``/proc/1/environ``, ``/proc/1/cmdline`` and
  ``/proc/self/mountinfo`` hold no host path and no host variable. Programs in the jail get only
  the allow-listed variables of ``JAIL_ENV``.
- filesystem: ``/usr`` and ``/etc`` read-only from the host, or from the Debian root of
  ``LocalBackendConfig.system_root`` (``sysroot.py``; bound from a private tmpfs copy of it,
  ``sysmount.py``, so mountinfo shows none of its host path) (``/etc/passwd``, ``/etc/group``,
  ``/etc/hosts``, ``/etc/hostname`` replaced); a fresh ``/proc`` of the pid namespace, a minimal
  ``/dev``. Writable, and only these, each a size-capped tmpfs (``LocalBackendConfig``):
  ``/home/user``, ``/tmp``, ``/dev/shm``, ``/var/tmp`` and ``XDG_RUNTIME_DIR``; the jail's root
  itself is read-only. Nothing else of the host (``/root``, ``/work``, the repository, other
  sandboxes) is mounted. The host reaches the jail's files through ``/proc/<pid>/root`` of the
  jail's first process (``host_path``), held open as a descriptor.

The jail's limits and its lifetime: ``desktop.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

from osworld_jax.env.local import apps
from osworld_jax.env.local.sysroot import HOST, SystemRoot

__all__ = ["HOME_DIRS", "JAIL_ENV", "JailSpec", "jail_file_mode", "jail_files"]

JAIL_UID = 1000
JAIL_HOME = "/home/user"
RUNTIME_DIR = f"/run/user/{JAIL_UID}"
_HERE = Path(__file__).resolve().parent
# The XDG user directories an Ubuntu desktop (OSWorld's VM) has in every home; tasks assume them.
HOME_DIRS = (
    "Desktop",
    "Documents",
    "Downloads",
    "Music",
    "Pictures",
    "Public",
    "Templates",
    "Videos",
)
#: The jail's whole environment (bubblewrap itself gets none).
JAIL_ENV = {
    "HOME": JAIL_HOME,
    "USER": "user",
    "LOGNAME": "user",
    "SHELL": "/bin/bash",
    "PATH": "/opt/osworld/bin:/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "XDG_RUNTIME_DIR": RUNTIME_DIR,
    "PYTHONPATH": "/opt/osworld/lib",
    "PYTHONDONTWRITEBYTECODE": "1",
    "DISPLAY": ":0",
    "GTK_A11Y": "atspi",
    "NO_AT_BRIDGE": "0",
    "QT_ACCESSIBILITY": "1",
    "SAL_USE_VCLPLUGIN": "gtk3",
}
# The session bus starts services only from an allow-list of the system's service files
# (apps.DBUS_SERVICE_DIR): never from ~/.local/share/dbus-1/services (a file the agent could plant
# there), nor any other service the host has installed, because the bus starts a service outside
# the agent's namespace: GNOME Terminal's server, activated that way, would run the agent's shell
# beside the evaluator's commands (apps.py starts it in the desktop namespace instead).
_DBUS_CONFIG = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>session</type>
  <keep_umask/>
  <listen>unix:tmpdir=/tmp</listen>
  <auth>EXTERNAL</auth>
  <servicedir>{service_dir}</servicedir>
  <policy context="default">
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>
  </policy>
</busconfig>
"""


def jail_files(system: SystemRoot = HOST) -> dict[str, bytes]:
    """Jail path -> content of every file the host puts into a jail (read-only).

    Those under ``apps.BIN_DIR`` are executable (``jail_file_mode``); ``system``: where the
    jail's system comes from (the D-Bus service files are copied from it).
    """
    files = {
        "/etc/passwd": (
            "root:x:0:0:root:/nonexistent:/usr/sbin/nologin\n"
            f"user:x:{JAIL_UID}:{JAIL_UID}:user:{JAIL_HOME}:/bin/bash\n"
            "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
        ).encode(),
        "/etc/group": f"root:x:0:\nuser:x:{JAIL_UID}:\nnogroup:x:65534:\n".encode(),
        "/etc/hostname": b"sandbox\n",
        "/etc/hosts": b"127.0.0.1 localhost sandbox\n::1 localhost\n",
        "/opt/osworld/dbus-session.conf": _DBUS_CONFIG.format(
            service_dir=apps.DBUS_SERVICE_DIR
        ).encode(),
        "/opt/osworld/vmserver.py": (_HERE / "vmserver.py").read_bytes(),
    }
    for name in ("jailexec.py", "screen.py", "a11y.py"):  # the server's own modules
        files[f"/opt/osworld/{name}"] = (_HERE / name).read_bytes()
    for mod in sorted((_HERE / "shim").glob("*.py")):
        if mod.name != "__init__.py":
            files[f"/opt/osworld/lib/{mod.name}"] = mod.read_bytes()
    files.update({path: data for path, (data, _) in apps.jail_files(system).items()})
    return files


def jail_file_mode(path: str) -> str:
    """The permissions (octal string) of a file ``jail_files`` puts at ``path``."""
    return "0755" if path.startswith(apps.BIN_DIR + "/") else "0644"


class JailSpec:
    """What one jail is started with: bwrap arguments, the files it gets, its sizes and limits.

    Attributes:
      args: bubblewrap options (passed through ``--args FD``), ending before ``--``.
      command: the command after ``--`` (no host path in it).
      files: jail path -> content, handed over as ``--ro-bind-data`` descriptors.
      system: where the jail's ``/usr``, ``/etc`` and top-level links come from.

    ``system_dir``: a copy of ``system_root`` on a filesystem of its own (``sysmount``) that the
    jail's system binds come from instead of the root itself, so that the jail's
    ``/proc/self/mountinfo`` shows no host path.
    """

    def __init__(
        self,
        *,
        width: int,
        height: int,
        openers: tuple[tuple[str, str], ...],
        window_manager: str,
        open_timeout_s: float,
        start_timeout_s: float,
        exec_timeout_s: float,
        home_bytes: int,
        tmp_bytes: int,
        shm_bytes: int,
        max_output_bytes: int,
        max_file_bytes: int,
        extra_ro_binds: tuple[str, ...] = (),
        system_root: str | None = None,
        system_dir: str | None = None,
    ) -> None:
        self.system = SystemRoot(system_root)
        root = Path(system_dir) if system_dir else self.system.dir
        a = ["--unshare-all", "--die-with-parent", "--new-session"]
        a += ["--uid", str(JAIL_UID), "--gid", str(JAIL_UID), "--hostname", "sandbox"]
        a += self.system.system_binds(src=root)
        a += ["--ro-bind", str(root / "etc"), "/etc"]
        for path in ("/var/cache/fontconfig", "/var/lib/dbus"):
            a += ["--ro-bind-try", str(root) + path if root != Path("/") else path, path]
        for path in extra_ro_binds:  # host paths, whatever the system
            a += ["--ro-bind-try", path, path]
        a += ["--proc", "/proc", "--dev", "/dev"]
        a += ["--perms", "0755", "--size", str(home_bytes), "--tmpfs", JAIL_HOME]
        for name in HOME_DIRS:
            a += ["--dir", f"{JAIL_HOME}/{name}"]
        a += ["--perms", "1777", "--size", str(tmp_bytes), "--tmpfs", "/tmp"]
        a += ["--perms", "1777", "--size", str(shm_bytes), "--tmpfs", "/dev/shm"]
        a += ["--perms", "1777", "--size", str(shm_bytes), "--tmpfs", "/var/tmp"]
        a += ["--perms", "0700", "--size", str(shm_bytes), "--tmpfs", RUNTIME_DIR]
        for link, target in apps.jail_symlinks().items():
            a += ["--symlink", target, link]
        a += ["--remount-ro", "/"]  # the jail's own root tmpfs: only the tmpfs above are writable
        a += ["--clearenv"]
        for k, v in JAIL_ENV.items():
            a += ["--setenv", k, v]
        a += ["--chdir", JAIL_HOME]
        self.args = a
        self.files = jail_files(self.system)
        # The home starts with the first-start files of the apps (apps.skel()), as from /etc/skel.
        self.command = [
            "/bin/sh",
            "-c",
            f'cp -R {apps.SKEL_DIR}/. "$HOME"/ && exec "$@"',
            "sh",
            "dbus-run-session",
            "--config-file=/opt/osworld/dbus-session.conf",
            "--",
            "/usr/bin/python3",
            "-I",
            "/opt/osworld/vmserver.py",
        ]
        self.command += ["--display", ":0", "--width", str(width), "--height", str(height)]
        self.command += [
            "--wm",
            window_manager,
            "--openers",
            json.dumps([list(o) for o in openers]),
        ]
        self.command += ["--open-timeout", f"{open_timeout_s:g}"]
        self.command += ["--start-timeout", f"{start_timeout_s:g}"]
        self.command += ["--exec-timeout", f"{exec_timeout_s:g}"]
        self.command += ["--max-output", str(max_output_bytes), "--max-file", str(max_file_bytes)]
