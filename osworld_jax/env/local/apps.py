"""The desktop applications of the local sandbox, as OSWorld's tasks expect them (no jax).

What the jail gets so that the tasks find their programs where upstream's Ubuntu VM has them.

Installed from Debian packages by ``bash scripts/setup.sh --apps`` (``APPS`` lists them). Inside
the jail the programs are the host's (``/usr`` is mounted read-only); this module adds only what
makes them behave as the tasks expect, each through a file the host hands to the jail
(``jail_files``), never through the host's own configuration:

- **Google Chrome is Debian's Chromium.** ``google-chrome`` (also ``google-chrome-stable``,
  ``chromium``, ``chromium-browser``) in ``/opt/osworld/bin`` (first on the jail's ``PATH``)
  starts Chromium with the profile at ``~/.config/google-chrome`` (Google Chrome's Linux
  profile, where the tasks' steps and getters read and write). Chromium names its processes
  ``chromium``; ``pkill`` in ``/opt/osworld/bin`` turns the pattern ``chrome`` (the Chrome tasks'
  postconfig runs ``pkill chrome`` so that Chrome writes its profile files) into
  ``chrom(e|ium)``, and passes everything else to ``/usr/bin/pkill`` unchanged.
  Chromium's own sandbox is off (``--no-sandbox``): it needs a user namespace, and the jail
  forbids nested ones (``--disable-userns``); the jail is the sandbox. ``--test-type`` hides the
  warning bar that flag would show. The tasks start it with ``--remote-debugging-port=1337`` and
  forward 9222 to it with ``socat``, as upstream.
- **VLC** starts with its HTTP interface on 127.0.0.1:8080, password ``password`` (upstream's
  ``vlc_port`` and password; the ``vlc_playing_info`` getter reads ``/requests/status.xml``).
- **First-start state of a used desktop** (``skel()``, copied into each new home before anything
  starts, as ``/etc/skel``): LibreOffice without the "Tip of the Day" dialog and without the
  "Keep current format?" question on saving a Microsoft format (the tasks' postconfig saves with
  Ctrl+S and expects the file in its format); VLC without its first-run privacy dialog.

GIMP is 2.10 in Debian 12 (``~/.config/GIMP/2.10``, where the GIMP getters read), Thunderbird
and LibreOffice run unchanged. VS Code is not in Debian: tasks that launch ``code`` stay "app not
installed".
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil
import subprocess

from osworld_jax.env.local.sysroot import HOST, SystemRoot

__all__ = [
    "APPS",
    "App",
    "BIN_DIR",
    "DBUS_SERVICES",
    "DBUS_SERVICE_DIR",
    "SKEL_DIR",
    "app_for",
    "has_app",
    "installed",
    "jail_files",
    "jail_symlinks",
    "libreoffice_version",
    "lock_file_expression",
    "skel",
]

#: Directory of the wrappers inside the jail (first on ``jail.JAIL_ENV["PATH"]``).
BIN_DIR = "/opt/osworld/bin"
#: Where the first-start home files are inside the jail (copied into ``/home/user``).
SKEL_DIR = "/opt/osworld/skel"
#: The jail's PATH after ``BIN_DIR`` (``/usr/local`` is part of the mounted ``/usr``).
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
_CHROMIUM = "/usr/lib/chromium/chromium"
#: Chromium's flags in the jail (see the module docstring); a caller's own flags come after and
#: win (Chromium keeps the last value of a repeated switch).
CHROME_FLAGS = (
    "--no-sandbox",
    "--test-type",
    "--user-data-dir=$HOME/.config/google-chrome",
    "--no-first-run",
    "--no-default-browser-check",
    "--password-store=basic",
    "--disable-gpu",
    "--hide-crash-restore-bubble",
)
#: The session bus's service directory in the jail (``jail.py``'s bus config): copies of the
#: host's service files of ``DBUS_SERVICES`` only.
DBUS_SERVICE_DIR = "/opt/osworld/dbus-1/services"
#: The D-Bus services the session bus may start (the accessibility bus, the settings store).
DBUS_SERVICES = ("org.a11y.Bus.service", "ca.desrt.dconf.service")
_SYSTEM_DBUS_SERVICES = "/usr/share/dbus-1/services"
VLC_HTTP_PORT = 8080
VLC_HTTP_PASSWORD = "password"

_CHROME_WRAPPER = f"""#!/bin/sh
# Google Chrome in the osworld_jax desktop is Debian's Chromium (osworld_jax/env/local/apps.py)
exec {_CHROMIUM} {" ".join(f'"{f}"' for f in CHROME_FLAGS)} "$@"
"""
_PKILL_WRAPPER = """#!/bin/sh
# pkill in the osworld_jax local desktop (osworld_jax/env/local/apps.py): Chromium, standing in
# for Google Chrome, names its processes "chromium"; the pattern "chrome" matches them too.
for a do
  shift
  case $a in chrome | google-chrome) a='chrom(e|ium)' ;; esac
  set -- "$@" "$a"
done
exec /usr/bin/pkill "$@"
"""
_VLC_WRAPPER = f"""#!/bin/sh
# VLC with its HTTP interface on 127.0.0.1:{VLC_HTTP_PORT} as in OSWorld's VM (osworld_jax apps.py)
exec /usr/bin/vlc --extraintf=http --http-host=127.0.0.1 --http-port={VLC_HTTP_PORT} \\
  --http-password={VLC_HTTP_PASSWORD} "$@"
"""


_TERMINAL_WRAPPER = """#!/bin/sh
# GNOME Terminal in the osworld_jax local desktop (osworld_jax/env/local/apps.py): its server is
# started here, in the desktop's namespace, when none owns its bus name (the session bus may not
# start it: the agent's shell would run outside the desktop's namespace).
owned() {
  dbus-send --session --print-reply --dest=org.freedesktop.DBus /org/freedesktop/DBus \\
    org.freedesktop.DBus.NameHasOwner string:org.gnome.Terminal 2>/dev/null | grep -q true
}
if ! owned; then
  /usr/libexec/gnome-terminal-server >/dev/null 2>&1 &
  i=0
  while [ $i -lt 100 ] && ! owned; do sleep 0.05; i=$((i + 1)); done
fi
exec /usr/bin/gnome-terminal "$@"
"""


def _xcu(items: list[tuple[str, str, str]]) -> bytes:
    """A LibreOffice ``registrymodifications.xcu`` setting ``(path, name, value)`` items."""
    body = "".join(
        f'<item oor:path="{path}"><prop oor:name="{name}" oor:op="fuse">'
        f"<value>{value}</value></prop></item>\n"
        for path, name, value in items
    )
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        '<oor:items xmlns:oor="http://openoffice.org/2001/registry" '
        'xmlns:xs="http://www.w3.org/2001/XMLSchema" '
        'xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance">\n' + body + "</oor:items>\n"
    ).encode()


@functools.cache
def libreoffice_version(system: SystemRoot = HOST) -> str | None:
    """The installed LibreOffice's ``major.minor`` (``soffice --version``), or None.

    None too for a separate system root (``sysroot.py``): its ``soffice`` is a shell script that
    runs only in the jail.
    """
    if system.path is not None or shutil.which("soffice") is None:
        return None
    try:
        out = subprocess.run(
            ["soffice", "--version"], capture_output=True, text=True, timeout=60, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"LibreOffice (\d+)\.(\d+)", out)
    return f"{m.group(1)}.{m.group(2)}" if m else None


def skel(system: SystemRoot = HOST) -> dict[str, bytes]:
    """Home-relative path -> content of the files every new desktop's home starts with."""
    lo = [
        ("/org.openoffice.Office.Common/Misc", "ShowTipOfTheDay", "false"),
        ("/org.openoffice.Office.Common/Save/Document", "WarnAlienFormat", "false"),
        ("/org.openoffice.Setup/Office", "ooSetupInstCompleted", "true"),
    ]
    if (version := libreoffice_version(system)) is not None:  # no "running 7.4 for the first time"
        lo.append(("/org.openoffice.Setup/Product", "ooSetupLastVersion", version))
    return {
        ".config/libreoffice/4/user/registrymodifications.xcu": _xcu(lo),
        ".config/vlc/vlcrc": b"[qt] # Qt interface\nqt-privacy-ask=0\n",
    }


@dataclasses.dataclass(frozen=True)
class App:
    """One desktop application of the tasks.

    Attributes:
      name: short name (``chrome``, ``libreoffice``, ...).
      commands: the program names tasks call it by (looked up on the jail's PATH).
      binary: the installed file that must exist for it to run (host path, under ``/usr``).
      packages: the Debian packages ``setup.sh --apps`` installs for it.
      probe: a command that must exit 0 inside the jail when it works (``preflight``).
    """

    name: str
    commands: tuple[str, ...]
    binary: str
    packages: tuple[str, ...]
    probe: tuple[str, ...]


APPS: tuple[App, ...] = (
    App(
        name="libreoffice",
        commands=("libreoffice", "soffice"),
        binary="/usr/lib/libreoffice/program/soffice.bin",
        packages=(
            "libreoffice-calc",
            "libreoffice-writer",
            "libreoffice-impress",
            "libreoffice-gtk3",
            "python3-uno",
        ),
        probe=("soffice", "--version"),
    ),
    App(
        name="chrome",
        commands=("google-chrome", "google-chrome-stable", "chromium", "chromium-browser"),
        binary=_CHROMIUM,
        packages=("chromium",),
        probe=("google-chrome", "--version"),
    ),
    App(
        name="gimp",
        commands=("gimp", "gimp-2.10"),
        binary="/usr/bin/gimp-2.10",
        packages=("gimp", "gtk2-engines-pixbuf"),
        probe=("gimp", "--version"),
    ),
    App(
        name="vlc",
        commands=("vlc", "cvlc"),
        binary="/usr/bin/vlc",
        packages=("vlc",),
        probe=("vlc", "--version"),
    ),
    App(
        name="thunderbird",
        commands=("thunderbird", "/usr/bin/thunderbird"),
        binary="/usr/lib/thunderbird/thunderbird",
        packages=("thunderbird",),
        probe=("thunderbird", "--version"),
    ),
    App(
        name="socat",
        commands=("socat",),
        binary="/usr/bin/socat",
        packages=("socat",),
        probe=("socat", "-V"),
    ),
    App(
        name="gnome-terminal",
        commands=("gnome-terminal",),
        binary="/usr/bin/gnome-terminal",
        packages=("gnome-terminal",),
        probe=("gnome-terminal", "--version"),
    ),
    App(
        name="desktop-utils",
        commands=("xdg-open", "xdg-mime", "update-desktop-database"),
        binary="/usr/bin/xdg-mime",
        packages=("xdg-utils", "desktop-file-utils"),
        probe=("xdg-mime", "--version"),
    ),
    App(
        name="pulseaudio",
        commands=("pulseaudio", "pactl"),
        binary="/usr/bin/pactl",
        packages=("pulseaudio", "pulseaudio-utils"),
        probe=("pactl", "--version"),
    ),
)

#: Wrapper name -> (script, the binary it needs).
_WRAPPERS: dict[str, tuple[str, str]] = {
    **{
        name: (_CHROME_WRAPPER, _CHROMIUM)
        for name in ("google-chrome", "google-chrome-stable", "chromium", "chromium-browser")
    },
    "vlc": (_VLC_WRAPPER, "/usr/bin/vlc"),
    "gnome-terminal": (_TERMINAL_WRAPPER, "/usr/libexec/gnome-terminal-server"),
    "pkill": (_PKILL_WRAPPER, "/usr/bin/pkill"),
}


#: Links in the jail: ``python`` (upstream's VM has one; the tasks run ``python -c ...``).
_LINKS = {f"{BIN_DIR}/python": "/usr/bin/python3"}


def app_for(command: str) -> App | None:
    """The ``APPS`` entry a program name (or absolute path) belongs to, if any."""
    for app in APPS:
        if command in app.commands or os.path.basename(command) in app.commands:
            return app
    return None


def installed(app: App, system: SystemRoot = HOST) -> bool:
    """Whether ``app``'s binary is installed in the jail's system (and so visible in the jail)."""
    return system.resolve(app.binary).exists()


def has_app(command: str, system: SystemRoot = HOST) -> bool:
    """Whether ``command`` runs inside the jail: a wrapper whose program is installed, or a file
    on the jail's PATH (``/opt/osworld/bin``, then ``SYSTEM_PATH``), or an absolute path under a
    directory the jail mounts; looked up in the jail's system (``system``).
    """  # noqa: D205
    in_bin = f"{BIN_DIR}/{command}" if "/" not in command else command
    if in_bin in _LINKS:
        return system.resolve(_LINKS[in_bin]).exists()
    if command in _WRAPPERS or command.startswith(BIN_DIR + "/"):
        name = os.path.basename(command)
        return name in _WRAPPERS and system.resolve(_WRAPPERS[name][1]).exists()
    if os.path.isabs(command):
        top = command.split("/")[1] if command.count("/") > 1 else ""
        return top in ("usr", "bin", "sbin", "lib", "lib64") and os.access(
            system.resolve(command), os.X_OK
        )
    return system.which(command, path=SYSTEM_PATH) is not None


def jail_files(system: SystemRoot = HOST) -> dict[str, tuple[bytes, int]]:
    """Jail path -> (content, mode) of the wrappers and the first-start home files."""
    out: dict[str, tuple[bytes, int]] = {}
    for name, (script, _) in _WRAPPERS.items():
        out[f"{BIN_DIR}/{name}"] = (script.encode(), 0o755)
    for rel, data in skel(system).items():
        out[f"{SKEL_DIR}/{rel}"] = (data, 0o644)
    for name in DBUS_SERVICES:
        host = system.resolve(f"{_SYSTEM_DBUS_SERVICES}/{name}")
        if host.is_file():
            out[f"{DBUS_SERVICE_DIR}/{name}"] = (host.read_bytes(), 0o644)
    return out


def jail_symlinks() -> dict[str, str]:
    """Jail path -> link target (``_LINKS``)."""
    return dict(_LINKS)


def lock_file_expression() -> list[str]:
    """A ``find`` expression matching the running apps' lock files in a home.

    A fork copies the home of a running desktop; these files name processes of that desktop
    (LibreOffice's document locks ``.~lock.NAME#`` and profile lock, Chromium's profile
    ``Singleton*`` links, Thunderbird's profile ``lock`` link and ``.parentlock``), so the fork's
    freshly started apps would take its documents or profile for in use by another instance.
    Snapshots leave them out.
    """
    names = [".~lock.*#", "SingletonLock", "SingletonSocket", "SingletonCookie", ".parentlock"]
    expr = ["("]
    for n in names:
        expr += ["-name", n, "-o"]
    expr += ["(", "-type", "l", "-name", "lock", ")", "-o"]
    expr += ["-path", "*/libreoffice/4/user/.lock", ")"]
    return expr
