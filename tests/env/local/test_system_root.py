"""LocalBackendConfig.system_root: the jail's system from a separate Debian root (sysroot.py).

None keeps the host's system exactly (the jail's arguments, the gate); a root replaces every
system path the jail binds and every program the host runs for it, run by the root's own loader;
preflight names the root and what it lacks on one line. The slow test builds a real root with
scripts/offline_bundle.sh + scripts/offline_install.sh and starts a desktop from it.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from osworld_jax.env.backend import PreflightError
from osworld_jax.env.capabilities import APP, capabilities
from osworld_jax.env.local import LocalBackend, LocalBackendConfig, sysmount
from osworld_jax.env.local.desktop import gate_argv
from osworld_jax.env.local.jail import JailSpec, jail_files
from osworld_jax.env.local.sysroot import HOST, SystemRoot
from osworld_jax.env.tasks import load_task

REPO = Path(__file__).resolve().parents[3]
SIZES = dict(
    width=1920,
    height=1080,
    openers=(),
    window_manager="openbox",
    open_timeout_s=1.0,
    start_timeout_s=1.0,
    exec_timeout_s=1.0,
    home_bytes=1 << 20,
    tmp_bytes=1 << 20,
    shm_bytes=1 << 20,
    max_output_bytes=1 << 20,
    max_file_bytes=1 << 20,
)
LOADER = "usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"


def fake_root(tmp_path: Path, programs: tuple[str, ...] = ()) -> Path:
    """A usrmerged root: usr/, etc/, the links, a loader reached through an ABSOLUTE link (as
    libc6 ships it) and empty executables for ``programs`` (names in usr/bin)."""  # noqa: D205, D209
    root = tmp_path / "root"
    for d in ("usr/bin", "usr/sbin", "usr/lib/x86_64-linux-gnu", "usr/lib64", "etc"):
        (root / d).mkdir(parents=True)
    for top in ("bin", "sbin", "lib", "lib64"):
        (root / top).symlink_to(f"usr/{top}")
    (root / LOADER).write_bytes(b"")
    (root / LOADER).chmod(0o755)
    (root / "usr/lib64/ld-linux-x86-64.so.2").symlink_to(f"/{LOADER.replace('usr/', '', 1)}")
    for name in programs:
        (root / "usr/bin" / name).write_bytes(b"")
        (root / "usr/bin" / name).chmod(0o755)
    for name in ("passwd", "group", "hostname", "hosts"):
        (root / "etc" / name).write_bytes(b"")
    return root


def test_without_a_root_the_jail_binds_the_hosts_system_as_before():
    args = JailSpec(**SIZES).args
    expected = ["--unshare-all", "--die-with-parent", "--new-session"]
    expected += ["--uid", "1000", "--gid", "1000", "--hostname", "sandbox"]
    expected += ["--ro-bind", "/usr", "/usr"]
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = Path("/") / top
        if host.is_symlink():
            expected += ["--symlink", os.readlink(host), f"/{top}"]
        elif host.is_dir():
            expected += ["--ro-bind", str(host), f"/{top}"]
    expected += ["--ro-bind", "/etc", "/etc"]
    expected += ["--ro-bind-try", "/var/cache/fontconfig", "/var/cache/fontconfig"]
    expected += ["--ro-bind-try", "/var/lib/dbus", "/var/lib/dbus", "--proc", "/proc"]
    assert args[: len(expected)] == expected
    assert JailSpec(**SIZES, system_root=None).args == args
    assert JailSpec(**SIZES).files == jail_files() == jail_files(HOST)


def test_a_root_replaces_every_system_path_the_jail_binds(tmp_path):
    root = fake_root(tmp_path)
    (root / "lib32").mkdir()  # a real directory is bound, a link is recreated
    host = JailSpec(**SIZES, extra_ro_binds=("/opt/app",))
    spec = JailSpec(**SIZES, extra_ro_binds=("/opt/app",), system_root=str(root))
    cut = spec.args.index("--proc")
    assert spec.args[:cut] == [
        *host.args[:9],
        *("--ro-bind", f"{root}/usr", "/usr"),
        *("--symlink", "usr/bin", "/bin", "--symlink", "usr/sbin", "/sbin"),
        *("--symlink", "usr/lib", "/lib", "--ro-bind", f"{root}/lib32", "/lib32"),
        *("--symlink", "usr/lib64", "/lib64"),
        *("--ro-bind", f"{root}/etc", "/etc"),
        *("--ro-bind-try", f"{root}/var/cache/fontconfig", "/var/cache/fontconfig"),
        *("--ro-bind-try", f"{root}/var/lib/dbus", "/var/lib/dbus"),
        *("--ro-bind-try", "/opt/app", "/opt/app"),  # extra binds are host paths either way
    ]
    # Everything after the system (tmpfs, env, files) is the same as without a root.
    assert spec.args[cut:] == host.args[host.args.index("--proc") :]


def test_the_gate_runs_the_roots_programs_through_its_loader(tmp_path):
    import resource

    limits = {resource.RLIMIT_NPROC: 5}
    # None: exactly the host's programs, as before system_root existed.
    assert gate_argv(HOST, 7, None) == [
        "/bin/sh",
        "-c",
        'read _ && exec /usr/bin/bwrap --args 7 -- "$@"',
    ]
    assert gate_argv(HOST, 7, limits)[2] == (
        'read _ && exec /usr/bin/prlimit --nproc=5:5 -- /usr/bin/bwrap --args 7 -- "$@"'
    )
    root = fake_root(tmp_path, programs=("dash", "bwrap", "prlimit"))
    (root / "usr/bin/sh").symlink_to("dash")
    system = SystemRoot(root)
    run = [LOADER, "--inhibit-cache", "--library-path", "usr/lib/x86_64-linux-gnu"]
    gate = gate_argv(system, 7, limits)
    assert gate[:6] == [*run, "usr/bin/dash", "-c"]
    assert gate[6] == (
        f"read _ && exec {' '.join(run)} usr/bin/prlimit --nproc=5:5 -- "
        f'{" ".join(run)} usr/bin/bwrap --args 7 -- "$@"'
    )
    assert system.cwd == str(root)  # relative paths: no host path on the jail's command line
    assert not any(str(tmp_path) in a for a in gate)
    # The loader's absolute link resolves inside the root, never to the host's /lib.
    assert system.resolve("/lib64/ld-linux-x86-64.so.2") == root / LOADER
    (root / "usr/bin/loop").symlink_to("/bin/loop")
    with pytest.raises(OSError, match="symlink loop"):
        system.resolve("/usr/bin/loop")


def test_preflight_names_the_root_and_what_it_lacks_on_one_line(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(PreflightError, match=f"system root {missing} is not a directory"):
        LocalBackend(LocalBackendConfig(system_root=str(missing))).preflight()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(PreflightError, match=f"system root {empty} has no dynamic loader"):
        LocalBackend(LocalBackendConfig(system_root=str(empty))).preflight()
    have = ("Xvfb", "xdotool", "wmctrl", "dbus-run-session", "cp", "tar", "prlimit", "sh")
    root = fake_root(tmp_path, programs=(*have, "python3", "openbox"))
    (root / "etc/hosts").unlink()
    with pytest.raises(PreflightError) as err:
        LocalBackend(LocalBackendConfig(system_root=str(root))).preflight()
    msg = str(err.value)
    assert "\n" not in msg
    assert f"system root {root} lacks bwrap (deb bubblewrap), /etc/hosts" in msg
    assert "scripts/offline_install.sh" in msg and "setup.sh" not in msg
    with pytest.raises(ValueError, match="absolute path"):
        LocalBackendConfig(system_root="relative/root")


def test_apps_and_runnable_tasks_are_looked_up_in_the_root(tmp_path):
    root = fake_root(tmp_path)
    config = LocalBackendConfig(system_root=str(root))
    task = load_task(
        {
            "id": "t",
            "snapshot": "s",
            "instruction": "edit the note",
            "source": "tests",
            "config": [{"type": "launch", "parameters": {"command": ["mousepad", "a.txt"]}}],
            "evaluator": {"func": "infeasible"},
        }
    )
    assert not LocalBackend.has_app("mousepad", config)
    verdict = capabilities(task, "local", backend_config=config)
    assert not verdict and [(r.kind, r.detail) for r in verdict.reasons] == [(APP, "mousepad")]
    (root / "usr/bin/mousepad").write_bytes(b"")
    (root / "usr/bin/mousepad").chmod(0o755)
    assert LocalBackend.has_app("mousepad", config)
    assert capabilities(task, "local", backend_config=config)


def built_root() -> Path:
    """A real root from the offline scripts (debs only), cached in /tmp by the scripts' hash.

    /tmp, not pytest's 0700 directories: the jails' unprivileged uid must reach the root.
    """
    scripts = [REPO / "scripts/offline_bundle.sh", REPO / "scripts/offline_install.sh"]
    key = hashlib.sha256(b"".join(p.read_bytes() for p in scripts)).hexdigest()[:12]
    bundle = Path(tempfile.gettempdir()) / f"osworld_jax-sysroot-{key}"
    for stale in bundle.parent.glob("osworld_jax-sysroot-*"):  # built by older scripts
        if stale != bundle:
            shutil.rmtree(stale, ignore_errors=True)
    if not (bundle / "root/usr/bin/bwrap").exists():
        bundle.mkdir(mode=0o755, exist_ok=True)
        for script, *args in ((scripts[0], "--debs-only"), (scripts[1],)):
            res = subprocess.run(
                ["bash", str(script), *args, str(bundle)], capture_output=True, text=True
            )
            if res.returncode != 0:
                tail = (res.stdout + res.stderr).strip()[-600:]
                if script == scripts[0] and (
                    "Could not resolve" in tail or "Failed to fetch" in tail
                ):
                    pytest.skip(f"no Debian mirror to build a root from: {tail[-200:]}")
                raise AssertionError(f"{script.name} failed: {tail}")
    return bundle / "root"


@pytest.mark.slow
def test_a_desktop_runs_from_a_built_root_and_loads_nothing_of_the_host():
    """~12 s with a fresh build (apt resolves and fetches 35 MB), ~0.5 s from the cached root."""
    root = built_root()
    backend = LocalBackend(LocalBackendConfig(system_root=str(root), window_manager="blackbox"))
    backend.preflight()

    async def main() -> None:
        d = await backend.start_desktop()
        try:
            from PIL import Image

            png = await d.client.screenshot()
            assert Image.open(io.BytesIO(png)).size == (1920, 1080)
            code = "import pyautogui\npyautogui.moveTo(400, 300)\npyautogui.click(410, 320)\n"
            code += "print(tuple(pyautogui.position()))"
            res = await d.client.execute(["python", "-c", code])
            assert res["returncode"] == 0 and res["output"].strip() == "(410, 320)", res
            # The jail's /usr is the root's, bound from its tmpfs copy (sysmount) when this
            # process can mount one: same inode as the copy's bwrap, not the host's.
            source = backend._system_dir
            assert source is not None and (source != root) == (sysmount.unavailable() is None)
            res = await d.client.execute(["stat", "-L", "-c", "%i", "/usr/bin/bwrap"])
            assert int(res["output"]) == (source / "usr/bin/bwrap").stat().st_ino
            if Path("/usr/bin/bwrap").exists():
                assert int(res["output"]) != Path("/usr/bin/bwrap").stat().st_ino
            assert (source / "usr/bin/bwrap").read_bytes() == (root / "usr/bin/bwrap").read_bytes()
            # The agent's mountinfo names no host path of the root (issue 43 item 11).
            res = await d.client.execute(["cat", "/proc/self/mountinfo"])
            usr = [ln.split() for ln in res["output"].splitlines() if ln.split()[4:5] == ["/usr"]]
            if source != root:
                assert usr and all(u[3] == "/usr" for u in usr), res
                assert str(root) not in res["output"] and str(source) not in res["output"]
            # The outer bwrap (and its namespace's first process) run the root's loader and map
            # only files of the root; its command line names no host path.
            for pid in d.host_pids()[:2]:  # the outer bwrap, then its namespace's pid 1
                assert os.readlink(f"/proc/{pid}/exe") == str(root / LOADER)
                maps = [
                    m.split(maxsplit=5) for m in Path(f"/proc/{pid}/maps").read_text().splitlines()
                ]
                files = {m[5] for m in maps if len(m) == 6 and m[5].startswith("/")}
                files = {f for f in files if not f.startswith("/memfd:")}
                assert files and all(f.startswith(f"{root}/") for f in files), files
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                assert str(root).encode() not in cmdline and b"usr/bin/bwrap" in cmdline
            res = await d.client.execute(["wmctrl", "-m"])
            assert "Name: Blackbox" in res["output"], res
        finally:
            await d.close()
            await backend.aclose()

    asyncio.run(main())
