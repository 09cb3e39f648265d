"""Upstream OSWorld's own ``PythonController`` (desktop-env 1.0.2) driving a local sandbox.

The controller's module is loaded from the desktop-env wheel that ``scripts/setup.sh --dev`` keeps
in ``.venv/share/osworld-upstream`` (not installed: ``desktop_env`` stays unimportable elsewhere)
and talks HTTP to ``http://127.0.0.1:PORT``; a forwarder on this test's loopback port carries each
connection to the sandbox server's UNIX socket unchanged. Every call below is the controller's own
code path, including its computer_13 ``execute_action`` (``MOVE_TO`` with a random pyautogui
ease function).
"""

from __future__ import annotations

import socket
import socketserver
import sys
import threading
import time
import types
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from osworld_jax.env.local import LocalBackend, LocalDesktop

REPO = Path(__file__).resolve().parents[3]
WHEEL_DIR = REPO / ".venv" / "share" / "osworld-upstream"


def _load_python_controller() -> type:
    wheels = sorted(WHEEL_DIR.glob("desktop_env-1.0.2-*.whl"))
    assert wheels, f"no desktop-env wheel in {WHEEL_DIR}: run scripts/setup.sh --dev"
    import requests  # noqa: F401 - the controller's HTTP client (a dev dependency)

    saved = {k: sys.modules.get(k) for k in ("desktop_env", "desktop_env.actions")}
    with zipfile.ZipFile(wheels[0]) as zf:
        sources = {
            name: zf.read(f"desktop_env/{name}.py").decode()
            for name in ("actions", "controllers/python")
        }
    pkg = types.ModuleType("desktop_env")
    pkg.__path__ = []
    actions = types.ModuleType("desktop_env.actions")
    exec(compile(sources["actions"], "desktop_env/actions.py", "exec"), actions.__dict__)
    sys.modules["desktop_env"], sys.modules["desktop_env.actions"] = pkg, actions
    try:
        mod = types.ModuleType("upstream_python_controller")
        exec(
            compile(sources["controllers/python"], "desktop_env/controllers/python.py", "exec"),
            mod.__dict__,
        )
    finally:
        for k, v in saved.items():  # leave desktop_env unimportable, as it was
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return mod.PythonController


class _Forward(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, unix_path: str) -> None:
        self.unix_path = unix_path
        super().__init__(("127.0.0.1", 0), _Pipe)


class _Pipe(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        upstream.connect(self.server.unix_path)  # type: ignore[attr-defined]

        def pump(src: socket.socket, dst: socket.socket) -> None:
            try:
                while data := src.recv(65536):
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        back = threading.Thread(target=pump, args=(upstream, self.request), daemon=True)
        back.start()
        pump(self.request, upstream)
        back.join(timeout=30)
        upstream.close()


@pytest.fixture(scope="module")
def controller(runner, backend: LocalBackend) -> Iterator[tuple]:
    cls = _load_python_controller()
    d: LocalDesktop = runner.run(backend.start_desktop())
    fwd = _Forward(str(d.dir / "ctl" / "vm.sock"))
    t = threading.Thread(target=fwd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    t.start()
    try:
        c = cls(vm_ip="127.0.0.1", server_port=fwd.server_address[1])
        c.retry_interval = 0.2  # upstream waits 5 s between tries
        yield c, d
    finally:
        fwd.shutdown()
        fwd.server_close()
        runner.run(d.close())


def test_observation_and_file_calls(runner, controller):
    c, d = controller
    shot = c.get_screenshot()
    assert shot is not None and shot.startswith(b"\x89PNG")
    assert c.get_vm_screen_size() == {"width": 1920, "height": 1080}
    assert "<desktop-frame" in c.get_accessibility_tree()
    assert c.get_terminal_output() is None  # no terminal is focused
    runner.run(d.client.upload("/home/user/Desktop/a.txt", b"hello\n"))
    assert c.get_file("/home/user/Desktop/a.txt") == b"hello\n"
    assert c.get_vm_desktop_path() == "/home/user/Desktop"
    tree = c.get_vm_directory_tree("/home/user/Desktop")
    assert tree == {
        "type": "directory",
        "name": "Desktop",
        "children": [{"type": "file", "name": "a.txt"}],
    }


def test_scripts_run_through_run_python_and_run_bash_script(controller):
    c, _ = controller
    r = c.run_python_script("import platform\nprint(platform.system())")
    assert (r["status"], r["output"], r["return_code"]) == ("success", "Linux\n", 0)
    r = c.run_bash_script("echo $HOME; ls ~/Desktop", timeout=30)
    assert r == {
        "status": "success",
        "output": "/home/user\na.txt\n",
        "error": "",
        "returncode": 0,
    }
    assert c.get_vm_platform() == "Linux"  # execute_python_command over /execute


def test_computer_13_actions_and_window_size(runner, controller):
    c, d = controller
    # MOVE_TO: pyautogui.moveTo(x, y, duration, pyautogui.<random ease>), duration 0.5-1 s.
    for x, y in ((200, 150), (640, 360), (1000, 700)):
        c.execute_action({"action_type": "MOVE_TO", "parameters": {"x": x, "y": y}})
        pos = runner.run(d.client.execute(["xdotool", "getmouselocation"]))["output"]
        assert pos.startswith(f"x:{x} y:{y} "), pos
    c.execute_action({"action_type": "CLICK", "parameters": {"button": "left", "x": 5, "y": 5}})
    c.execute_action({"action_type": "TYPING", "parameters": {"text": "abc"}})
    c.execute_action({"action_type": "HOTKEY", "parameters": {"keys": ["ctrl", "a"]}})
    runner.run(d.client.launch(["mousepad"]))
    deadline = time.monotonic() + 20
    size = None
    while size is None and time.monotonic() < deadline:
        size = c.get_vm_window_size("mousepad")
    assert size is not None and set(size) == {"width", "height"}
