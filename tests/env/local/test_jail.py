"""The bubblewrap jail: actions cannot write or read the host, reach a network, or outlive close."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from osworld_jax.env.local import LocalBackend, LocalDesktop
from osworld_jax.env.local.procfs import pid_namespace_members

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def desktop(runner, backend: LocalBackend):
    d = runner.run(backend.start_desktop())
    yield d
    runner.run(d.close())


def sh(runner, d: LocalDesktop, script: str) -> dict:
    return runner.run(d.client.execute(["bash", "-c", script]))


def test_writes_outside_the_sandbox_fail_and_host_is_unchanged(runner, desktop, tmp_path):
    canary = Path("/tmp") / f"osworld-canary-{uuid.uuid4().hex}"
    canary.write_text("original")
    repo_probe = REPO / f"jail-probe-{uuid.uuid4().hex}"
    try:
        targets = [
            str(canary),  # resolves to the sandbox's own /tmp: the host file must not change
            str(repo_probe),
            "/etc/passwd",
            "/usr/bin/jail-probe",
            "/root/jail-probe",
            "/jail-probe",
            str(tmp_path / "jail-probe"),
        ]
        for target in targets:
            res = sh(runner, desktop, f"echo pwned > {target} && echo WROTE")
            if target == str(canary):
                # The write lands in the jail's private /tmp, never in the host's.
                assert res["returncode"] == 0
            else:
                assert res["returncode"] != 0, (target, res)
                assert "WROTE" not in res["output"]
        assert canary.read_text() == "original"
        assert not repo_probe.exists()
        assert not Path("/usr/bin/jail-probe").exists()
        assert not (tmp_path / "jail-probe").exists()
        # The jail's /tmp is its own tmpfs, the host's /tmp is untouched.
        assert (desktop.host_path("/tmp") / canary.name).read_text() == "pwned\n"
        # python code run as an action can't either (the way model actions run).
        res = runner.run(
            desktop.client.execute(["python3", "-c", f"open({str(repo_probe)!r}, 'w').write('x')"])
        )
        assert res["returncode"] != 0 and not repo_probe.exists()
    finally:
        canary.unlink()


def test_reads_outside_the_sandbox_fail(runner, desktop):
    secret_dir = Path("/root")
    assert secret_dir.exists()
    probes = {
        "cat /etc/shadow": "root-only file",
        "ls /root": "root's home",
        f"ls {REPO}": "the repository",
        f"cat {REPO / 'pyproject.toml'}": "a repository file",
        "ls /work": "the work tree",
        f"ls {desktop.dir.parent}": "the other sandboxes",
    }
    for cmd, what in probes.items():
        res = sh(runner, desktop, cmd)
        assert res["returncode"] != 0, (what, res)
        assert res["output"] == "", (what, res)
    # A private pid namespace: the host's processes are invisible.
    res = sh(runner, desktop, "ls /proc | grep -c '^[0-9]'")
    assert 0 < int(res["output"]) < 30
    res = sh(runner, desktop, f"test -e /proc/{os.getpid()}/cmdline && echo VISIBLE || true")
    assert "VISIBLE" not in res["output"]
    # The jail runs as an unprivileged user.
    assert sh(runner, desktop, "id -u")["output"].strip() == "1000"


def test_no_network(runner, desktop):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    port = server.getsockname()[1]
    code = textwrap.dedent(
        f"""
        import socket
        s = socket.socket()
        s.settimeout(2)
        s.connect(("127.0.0.1", {port}))
        print("CONNECTED")
        """
    )
    res = runner.run(desktop.client.execute(["python3", "-c", code]))
    # A connection that reached the host would be waiting in the listen backlog now.
    with pytest.raises(BlockingIOError):
        server.accept()
    server.close()
    assert res["returncode"] != 0 and "CONNECTED" not in res["output"]
    assert "ConnectionRefused" in res["error"]
    # The namespace has no device but loopback, hence no route anywhere.
    devices = sh(runner, desktop, "tail -n +3 /proc/net/dev | cut -d: -f1")["output"].split()
    assert devices == ["lo"]
    assert sh(runner, desktop, "cat /proc/net/route | wc -l")["output"].strip() == "1"


def test_close_kills_the_whole_process_tree(runner, backend: LocalBackend):
    d = runner.run(backend.start_desktop())
    assert d.id in backend.inventory()
    # Start a detached background program from inside, as an action could.
    runner.run(d.run_action(["bash", "-c", "setsid sleep 600 >/dev/null 2>&1 &"], timeout=30))

    def names(pids: list[int]) -> set[str]:
        out = set()
        for p in pids:
            try:
                out.add(Path(f"/proc/{p}/comm").read_text().strip())
            except OSError:
                pass
        return out

    deadline = time.monotonic() + 5
    while "sleep" not in names(d.host_pids()) and time.monotonic() < deadline:
        time.sleep(0.02)
    pids = d.host_pids()
    assert {"bwrap", "Xvfb", "openbox", "sleep"} <= names(pids)
    ns = d.pid_ns
    assert ns is not None
    runner.run(d.close())
    assert pid_namespace_members(ns) == []
    for p in pids:
        stat = Path(f"/proc/{p}/stat")
        assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    assert d.id not in backend.inventory()
    assert not d.dir.exists()
    runner.run(d.close())  # idempotent


def test_jail_dies_with_its_host_process():
    """A crashed trainer leaves no desktop behind (``--die-with-parent``)."""
    script = textwrap.dedent(
        """
        import asyncio, sys, time
        from osworld_jax.env.local import LocalBackend
        async def main():
            b = LocalBackend()
            d = await b.start_desktop()
            print(d.pid_ns, flush=True)
            await asyncio.sleep(600)
        asyncio.run(main())
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert proc.stdout is not None
        ns = proc.stdout.readline().strip()
        assert ns.startswith("pid:["), ns
        assert pid_namespace_members(ns)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 10
    while pid_namespace_members(ns) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pid_namespace_members(ns) == []
    # The crashed process could not remove its directory; that is all it leaves.


def test_sandbox_directories_are_private_to_the_host(runner, desktop):
    """The host side (the server socket, setup outputs) is root-only and never in the jail."""
    if os.geteuid() != 0:
        pytest.skip("ownership checks are about a root host")
    assert desktop.dir.parent.stat().st_mode & 0o777 == 0o700
    assert (desktop.dir / "ctl").stat().st_mode & 0o777 == 0o700
    res = sh(runner, desktop, f"ls -la {desktop.dir} {desktop.dir}/ctl; cat /proc/self/mountinfo")
    assert str(desktop.dir) not in res["output"]


def test_preflight_names_what_is_missing(monkeypatch):
    from osworld_jax.env.backend import PreflightError
    from osworld_jax.env.local import preflight

    monkeypatch.setitem(preflight.REQUIRED_BINARIES, "no-such-binary-xyz", "pkg-xyz")
    with pytest.raises(PreflightError, match="no-such-binary-xyz \\(apt pkg-xyz\\)"):
        LocalBackend().preflight()


def test_screen_is_a_1920x1080_png(runner, desktop):
    import io

    from PIL import Image

    png = runner.run(desktop.client.screenshot())
    assert Image.open(io.BytesIO(png)).size == (1920, 1080)
    assert runner.run(desktop.client.screen_size()) == (1920, 1080)
    assert asyncio.iscoroutinefunction(desktop.close)


def test_pyautogui_shim_drives_the_pointer(runner, desktop):
    code = textwrap.dedent(
        """
        import pyautogui
        pyautogui.moveTo(400, 300)
        pyautogui.moveTo(400, 300)  # already there: must not block
        pyautogui.click(410, 320)
        pyautogui.doubleClick()
        pyautogui.dragTo(500, 510, duration=0.05)
        pyautogui.scroll(-3)
        pyautogui.hotkey('ctrl', 'shift')
        print(tuple(pyautogui.position()), tuple(pyautogui.size()))
        """
    )
    t0 = time.monotonic()
    res = runner.run(desktop.client.execute(["python", "-c", code]))
    assert time.monotonic() - t0 < 5.0
    assert res["returncode"] == 0, res
    assert res["output"].strip() == "(500, 510) (1920, 1080)"


def test_close_waits_for_a_close_in_progress(runner, backend: LocalBackend):
    """A cancelled closer does not stop the close; a second closer returns only when done."""
    d = runner.run(backend.start_desktop())
    ns = d.pid_ns
    assert ns is not None

    async def main() -> None:
        first = asyncio.ensure_future(d.close())
        await asyncio.sleep(0)
        first.cancel()
        await d.close()
        assert pid_namespace_members(ns) == []
        assert d.id not in backend.inventory()
        assert not d.dir.exists()

    runner.run(main())


def test_a_root_too_deep_for_a_socket_path_is_named(runner, tmp_path):
    from osworld_jax.env.backend import SandboxCreateError
    from osworld_jax.env.local import LocalBackendConfig

    deep = Path("/tmp") / ("r" * 60) / ("s" * 60)
    b = LocalBackend(LocalBackendConfig(root=str(deep)))
    try:
        with pytest.raises(SandboxCreateError, match="limited to 107 bytes"):
            runner.run(b.start_desktop())
        assert b.inventory() == []
    finally:
        runner.run(b.aclose())
        import shutil

        shutil.rmtree(deep.parent, ignore_errors=True)
