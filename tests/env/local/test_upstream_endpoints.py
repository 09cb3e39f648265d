"""Issue 14 item 5: OSWorld's own controllers against the local sandbox's in-jail server.

Each request below is what upstream's ``desktop_env/controllers/python.py`` (``PythonController``)
and ``setup.py`` (``SetupController``) send with ``requests`` (method, route, body encoding,
Content-Type), replayed byte for byte over the sandbox's socket; the replies are checked against
upstream's ``desktop_env/server/main.py`` (shapes and status codes). Also: the pyautogui shim as
OSWorld's computer_13 actions and model code use it (tweens, ``locateOnScreen``).
"""

from __future__ import annotations

import http.client
import io
import json
import socket
import textwrap
import time
import urllib.parse
from typing import Any

import pytest
from PIL import Image

from osworld_jax.env.local import LocalBackend, LocalDesktop


@pytest.fixture(scope="module")
def desktop(runner, backend: LocalBackend):
    d = runner.run(backend.start_desktop())
    yield d
    runner.run(d.close())


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def upstream(
    d: LocalDesktop, route: str, *, json_body: Any = None, form: dict | None = None
) -> tuple[int, bytes, str]:
    """One POST as ``requests.post`` builds it in upstream's controllers.

    ``json_body``: ``data=json.dumps(payload), headers={'Content-Type': 'application/json'}``;
    ``form``: ``data={...}`` (url-encoded, ``application/x-www-form-urlencoded``); neither: an
    empty body with ``Content-Length: 0``.
    """
    headers = {"User-Agent": "python-requests/2.32.3", "Accept": "*/*"}
    if json_body is not None:
        body = json.dumps(json_body).encode()
        headers["Content-Type"] = "application/json"
    elif form is not None:
        body = urllib.parse.urlencode(form).encode()
        headers["Content-Type"] = "application/x-www-form-urlencoded"
    else:
        body = b""
    headers["Content-Length"] = str(len(body))
    conn = _UnixConnection(str(d.dir / "ctl" / "vm.sock"), timeout=150)
    try:
        conn.request("POST", route, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read(), resp.getheader("Content-Type") or ""
    finally:
        conn.close()


def jreply(d: LocalDesktop, route: str, **kw) -> tuple[int, Any]:
    status, body, ctype = upstream(d, route, **kw)
    assert ctype.startswith("application/json"), (status, body[:200], ctype)
    return status, json.loads(body)


def test_run_python_as_python_controller_runs_it(desktop):
    # PythonController.run_python_script: payload = json.dumps({"code": script}).
    code = "import sys\nprint(1 + 1)\nprint('warn', file=sys.stderr)\n"
    status, r = jreply(desktop, "/run_python", json_body={"code": code})
    assert status == 200
    assert r == {
        "status": "success",
        "message": "2\n\nwarn\n",
        "need_more": False,
        "output": "2\n",
        "error": "warn\n",
        "return_code": 0,
    }
    status, r = jreply(desktop, "/run_python", json_body={"code": "raise SystemExit(3)"})
    assert status == 200
    assert (r["status"], r["return_code"], r["output"]) == ("error", 3, "")
    assert r["error"] == r["message"] == "Process exited with code 3"
    # The script runs from a file (upstream writes /tmp/python_exec_<hex>.py): here a memory
    # file the agent cannot reach (issue 33 item 2), nothing in /tmp.
    code = "import os; print(__file__, sorted(os.listdir('/tmp')))"
    status, r = jreply(desktop, "/run_python", json_body={"code": code})
    path, tmp = r["output"].split(" ", 1)
    assert path.startswith("/dev/fd/"), r
    assert "python_exec" not in tmp, tmp
    assert jreply(desktop, "/run_python", json_body={}) == (
        400,
        {"status": "error", "message": "Code not supplied!"},
    )


def test_run_bash_script_as_python_controller_runs_it(desktop):
    # PythonController.run_bash_script: {"script", "timeout", "working_dir"} (30 s, None).
    body = {"script": "echo out; echo err >&2; pwd; exit 3", "timeout": 30, "working_dir": None}
    status, r = jreply(desktop, "/run_bash_script", json_body=body)
    assert status == 200
    assert r == {
        "status": "error",
        "output": "out\nerr\n/home/user\n",  # stderr merged into stdout, in order
        "error": "",
        "returncode": 3,
    }
    body = {"script": "#!/bin/bash\npwd", "timeout": 30, "working_dir": "~/Desktop"}
    assert jreply(desktop, "/run_bash_script", json_body=body) == (
        200,
        {"status": "success", "output": "/home/user/Desktop\n", "error": "", "returncode": 0},
    )
    body = {"script": "pwd", "timeout": 30, "working_dir": "/nonexistent"}
    assert jreply(desktop, "/run_bash_script", json_body=body) == (
        400,
        {
            "status": "error",
            "output": "Working directory does not exist: /nonexistent",
            "error": "",
            "returncode": -1,
        },
    )
    status, r = jreply(desktop, "/run_bash_script", json_body={"script": "", "timeout": 30})
    assert (status, r["output"], r["returncode"]) == (400, "Script not supplied!", -1)
    t0 = time.monotonic()
    body = {"script": "sleep 30", "timeout": 1, "working_dir": None}
    assert jreply(desktop, "/run_bash_script", json_body=body) == (
        500,
        {
            "status": "error",
            "output": "Script execution timed out after 1 seconds",
            "error": "",
            "returncode": -1,
        },
    )
    assert time.monotonic() - t0 < 10


def test_window_size_desktop_path_and_directory_tree(runner, desktop):
    # The setup controller's launch: json.dumps({"command": command, "shell": shell}).
    status, body, _ = upstream(
        desktop, "/setup/launch", json_body={"command": ["mousepad"], "shell": False}
    )
    assert (status, body) == (200, b"mousepad launched successfully")
    deadline = time.monotonic() + 20
    while True:  # PythonController.get_vm_window_size: data={"app_class_name": name}
        status, body, _ = upstream(desktop, "/window_size", form={"app_class_name": "Mousepad"})
        if status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    r = json.loads(body)
    assert status == 200 and set(r) == {"width", "height"}, r
    assert 0 < r["width"] <= 1920 and 0 < r["height"] <= 1080
    status, _, _ = upstream(desktop, "/window_size", form={"app_class_name": "no-such-app"})
    assert status == 500  # upstream's view returns None: Flask answers 500
    assert jreply(desktop, "/window_size", form={}) == (
        400,
        {"error": "app_class_name is required"},
    )
    runner.run(desktop.client.close_window("Mousepad", by_class=True))

    assert jreply(desktop, "/desktop_path") == (200, {"desktop_path": "/home/user/Desktop"})

    make = "mkdir -p ~/tree/a/b && touch ~/tree/f1 ~/tree/a/f2 && ln -s a ~/tree/link"
    runner.run(desktop.client.execute(["bash", "-c", make]))
    status, r = jreply(desktop, "/list_directory", json_body={"path": "/home/user/tree"})
    assert status == 200

    def norm(node: dict) -> dict:
        kids = sorted((norm(c) for c in node.get("children", [])), key=lambda c: c["name"])
        return {**node, "children": kids} if "children" in node else node

    b = {"type": "directory", "name": "b", "children": []}
    a = {"type": "directory", "name": "a", "children": [b, {"type": "file", "name": "f2"}]}
    link = {**a, "name": "link"}  # a symlink to a directory is followed, as os.path.isdir
    assert norm(r["directory_tree"]) == {
        "type": "directory",
        "name": "tree",
        "children": [a, {"type": "file", "name": "f1"}, link],
    }
    assert jreply(desktop, "/list_directory", json_body={}) == (
        400,
        {"error": "Missing 'path' parameter"},
    )
    assert jreply(desktop, "/list_directory", json_body={"path": "/home/user/tree/f1"}) == (
        400,
        {"error": "The provided path is not a directory"},
    )


def test_wallpaper_round_trip(runner, desktop):
    buf = io.BytesIO()
    Image.new("RGB", (8, 6), (10, 200, 30)).save(buf, "PNG")
    runner.run(desktop.client.upload("/home/user/Pictures/wall.png", buf.getvalue()))
    # SetupController._change_wallpaper_setup: json.dumps({"path": path}).
    status, body, _ = upstream(
        desktop, "/setup/change_wallpaper", json_body={"path": "~/Pictures/wall.png"}
    )
    assert (status, body) == (200, b"Wallpaper changed successfully")
    status, body, ctype = upstream(desktop, "/wallpaper")  # PythonController.get_vm_wallpaper
    assert (status, ctype) == (200, "image/png")
    assert body == buf.getvalue()
    status, body, _ = upstream(desktop, "/setup/change_wallpaper", json_body={"path": "~/none.png"})
    assert (status, body) == (404, b"File not found: /home/user/none.png")


def _run(runner, d: LocalDesktop, code: str) -> dict:
    res = runner.run(d.run_action(["python3", "-c", textwrap.dedent(code)], timeout=60))
    assert res["returncode"] == 0, res
    return res


def test_computer_13_move_to_with_an_ease_and_tween_keywords(runner, desktop):
    # PythonController.execute_action(MOVE_TO): moveTo(x, y, duration, pyautogui.easeInQuad),
    # sent through /execute with the controller's prefix.
    prefix = "import pyautogui; import time; pyautogui.FAILSAFE = False; "
    cmd = "pyautogui.moveTo(301, 202, 0.6, pyautogui.easeInQuad)"
    t0 = time.monotonic()
    status, r = jreply(
        desktop,
        "/execute",
        json_body={"command": ["python", "-c", prefix + cmd], "shell": False},
    )
    assert time.monotonic() - t0 >= 0.6  # the duration is honoured, in tweened steps
    assert (status, r["returncode"]) == (200, 0), r
    assert runner.run(desktop.client.execute(["xdotool", "getmouselocation"]))["output"].startswith(
        "x:301 y:202"
    )
    code = """
        import pyautogui
        pyautogui.moveTo(500, 400, duration=0.2, tween=pyautogui.easeOutElastic)
        pyautogui.moveRel(10, -5, 0.2, pyautogui.easeInOutBounce)
        pyautogui.dragTo(520, 420, duration=0.1, tween=pyautogui.linear, button="left")
        pyautogui.click(530, 430, tween=pyautogui.easeInOutSine, duration=0.1)
        print(tuple(pyautogui.position()))
    """
    assert _run(runner, desktop, code)["output"].strip() == "(530, 430)"


def test_locate_on_screen_finds_what_is_shown(runner, desktop):
    code = """
        import os, subprocess, sys, time, pyautogui
        # A window with a distinctive pattern, drawn by a small X client left running.
        painter = '''
        import sys, time
        from Xlib import X, display
        d = display.Display()
        s = d.screen()
        w = s.root.create_window(400, 300, 64, 48, 0, s.root_depth,
                                 background_pixel=s.black_pixel,
                                 override_redirect=True, event_mask=X.ExposureMask)
        w.map()
        d.sync()
        cm = s.default_colormap
        for i in range(8):
            for j in range(6):
                px = cm.alloc_color((i * 8000) % 65535, (j * 11000) % 65535, 40000).pixel
                gc = w.create_gc(foreground=px)
                w.fill_rectangle(gc, i * 8, j * 8, 8, 8)
        d.sync()
        print("up", flush=True)
        time.sleep(60)
        '''
        p = subprocess.Popen([sys.executable, "-c", painter], stdout=subprocess.PIPE)
        assert p.stdout.readline().strip() == b"up"
        time.sleep(0.3)
        needle = "/tmp/needle.png"
        pyautogui.screenshot(needle, region=(410, 310, 30, 20))
        box = pyautogui.locateOnScreen(needle)
        print(tuple(box), tuple(pyautogui.locateCenterOnScreen(needle)))
        pyautogui.click(needle)  # an image file in place of (x, y): its center
        print(tuple(pyautogui.position()))
        blank = pyautogui.screenshot(region=(400, 300, 64, 48))
        print(blank.size, blank.getpixel((0, 0)) != (0, 0, 0))
        try:
            pyautogui.locateOnScreen("/tmp/needle.png", region=(0, 0, 200, 200))
        except pyautogui.ImageNotFoundException:
            print("not found")
        try:
            pyautogui.locateOnScreen(needle, confidence=0.9)
        except NotImplementedError as e:
            print("no opencv")
        p.kill()
    """
    lines = _run(runner, desktop, code)["output"].splitlines()
    assert lines == [
        "(410, 310, 30, 20) (425, 320)",
        "(425, 320)",
        "(64, 48) True",
        "not found",
        "no opencv",
    ]
