"""The apps table, the programs a task runs, and what the jail gets for the apps (no desktop)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from osworld_jax.env.capabilities import _programs
from osworld_jax.env.local import apps, jail
from osworld_jax.env.local.snapshot import drop_app_locks

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    ("command", "shell", "programs"),
    [
        (["python", "-c", "import pyautogui"], False, ["python"]),
        ("./setup.sh", True, []),  # a file the task downloaded, not a program to install
        ("bash ./setup.sh", True, ["bash"]),
        ("VLC_VERBOSE=-1 vlc --no-audio", True, ["vlc"]),
        (
            "export DBUS_SESSION_BUS_ADDRESS='unix:path=/run/user/1000/bus'\n"
            "gnome-terminal --maximize",
            True,
            ["gnome-terminal"],
        ),
        (
            "pulseaudio --start\npactl list sinks | grep Volume",
            True,
            ["pulseaudio", "pactl", "grep"],
        ),
        ('d="/home/user/x"\nmkdir -p "$d"/a', True, ["mkdir"]),
        ("for f in a b; do rm $f; done", True, ["rm"]),
        ("if [ -f x ]; then rm x; fi; { cat y; } | wc -l", True, ["rm", "cat", "wc"]),
        ("echo {CLIENT_PASSWORD} | sudo -S apt install jq", True, ["sudo"]),
        (["/bin/bash", "-c", "killall gnome-terminal-server"], False, ["/bin/bash"]),
        ("gimp /home/user/x.png", False, ["gimp"]),
    ],
)
def test_the_programs_a_step_runs(command, shell, programs):
    assert _programs(command, shell) == programs


def test_has_app_looks_where_the_jail_looks(monkeypatch, tmp_path):
    chromium = tmp_path / "chromium"
    monkeypatch.setitem(apps._WRAPPERS, "google-chrome", ("#!/bin/sh\n", str(chromium)))
    assert not apps.has_app("google-chrome")  # the wrapper is there, its program is not
    chromium.write_text("")
    assert apps.has_app("google-chrome")
    assert apps.has_app("python")  # the jail's python -> python3 link
    assert apps.has_app("/usr/bin/python3") and apps.has_app("sh")
    assert not apps.has_app("/root/secret-tool")  # not a directory the jail mounts
    assert not apps.has_app("code")  # VS Code is not in Debian


def test_jail_files_wrappers_skel_and_bus_services():
    files = apps.jail_files()
    for name in ("google-chrome", "vlc", "pkill", "gnome-terminal"):
        path = f"{apps.BIN_DIR}/{name}"
        assert files[path][1] == 0o755 and jail.jail_file_mode(path) == "0755"
        assert files[path][0].startswith(b"#!/bin/sh\n")
    chrome = files[f"{apps.BIN_DIR}/google-chrome"][0].decode()
    assert '"--user-data-dir=$HOME/.config/google-chrome"' in chrome and "--no-sandbox" in chrome
    xcu = files[f"{apps.SKEL_DIR}/.config/libreoffice/4/user/registrymodifications.xcu"][0]
    assert b'"WarnAlienFormat" oor:op="fuse"><value>false' in xcu  # Ctrl+S keeps the format
    assert b'"ShowTipOfTheDay" oor:op="fuse"><value>false' in xcu
    vlc = files[f"{apps.BIN_DIR}/vlc"][0].decode()
    assert "--http-port=8080" in vlc and "--http-password=password" in vlc
    services = {p.rsplit("/", 1)[1] for p in files if p.startswith(apps.DBUS_SERVICE_DIR)}
    assert services <= set(apps.DBUS_SERVICES)  # never GNOME Terminal's server, or the host's
    conf = jail.jail_files()["/opt/osworld/dbus-session.conf"].decode()
    assert f"<servicedir>{apps.DBUS_SERVICE_DIR}</servicedir>" in conf
    assert "/usr/share/dbus-1" not in conf


def test_pkill_wrapper_maps_chrome_to_chromium(tmp_path):
    script = dict(apps.jail_files())[f"{apps.BIN_DIR}/pkill"][0].decode()
    fake = tmp_path / "pkill"
    fake.write_text(script.replace("exec /usr/bin/pkill", 'printf "%s\\n"'))
    out = subprocess.run(
        ["sh", str(fake), "-f", "chrome", "vlc"], capture_output=True, text=True, check=True
    )
    assert out.stdout.splitlines() == ["-f", "chrom(e|ium)", "vlc"]


def test_snapshots_leave_out_the_apps_lock_files(tmp_path):
    home = tmp_path / "home"
    keep = [home / "Desktop/lock", home / "Desktop/report.xlsx", home / "notes.txt"]
    drop = [
        home / "Desktop/.~lock.report.xlsx#",
        home / ".config/libreoffice/4/user/.lock",
        home / ".thunderbird/p.default/.parentlock",
    ]
    for p in keep + drop:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("x")
    links = [home / ".config/google-chrome/SingletonLock", home / ".thunderbird/p.default/lock"]
    for link in links:
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to("sandbox-12")
    drop_app_locks(home)
    assert all(p.exists() for p in keep)  # a regular file named "lock" is the user's
    assert not any(p.exists() or p.is_symlink() for p in drop + links)


def test_setup_installs_every_apps_packages():
    text = (ROOT / "scripts" / "setup.sh").read_text()
    block = re.search(r'if \[ "\$APPS" -eq 1 \]; then\n  APT_PACKAGES\+=\((.*?)\)', text, re.S)
    assert block is not None
    listed = set(block.group(1).split())
    for app in apps.APPS:
        assert set(app.packages) <= listed, app.name
    assert "--apps" in (ROOT / "scripts" / "test.sh").read_text()


def _task(*commands: str):
    from osworld_jax.env.tasks import load_task

    steps = [{"type": "launch", "parameters": {"command": c, "shell": True}} for c in commands]
    return load_task(
        {
            "id": "t",
            "instruction": "x",
            "config": steps,
            "evaluator": {"func": "infeasible"},
        }
    )


def test_preflight_names_the_programs_the_tasks_need_and_lack():
    from osworld_jax.env.backend import PreflightError
    from osworld_jax.env.local import LocalBackend

    backend = LocalBackend()
    tasks = [_task("code /home/user/x.py"), _task("code .", "no-such-app-xyz --flag")]
    with pytest.raises(PreflightError) as e:
        backend.preflight(tasks)
    assert "code (2 tasks)" in str(e.value) and "no-such-app-xyz (1 tasks)" in str(e.value)
