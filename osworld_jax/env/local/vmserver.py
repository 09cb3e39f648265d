"""The local sandbox's own implementation of the OSWorld in-VM server protocol.

This file runs INSIDE the bubblewrap jail with the system ``python3``: it uses only the standard
library plus Debian's ``python3-xlib`` and (lazily) ``python3-pyatspi``. It must not import
``osworld_jax``. Start-up: it starts ``Xvfb`` on ``--display`` (readiness through ``-displayfd``)
and the window manager, waits until the window manager owns the screen, then serves the protocol
on the UNIX socket ``--socket`` (the socket file appearing means "ready"). It is run under
``dbus-run-session`` so that the session bus (and, activated on demand, the at-spi bus) exist.

Routes (request and reply shapes as upstream OSWorld's ``desktop_env/server/main.py``):
``GET /screenshot`` PNG; ``POST /execute`` and ``/setup/execute`` JSON ``{command, shell}`` ->
``{status, output, error, returncode}``; ``GET /accessibility`` ``{"AT": xml}``; ``POST /file``
(form ``file_path``); ``POST /setup/upload`` (multipart ``file_path`` + ``file_data``);
``POST /setup/launch``; ``POST /setup/open_file``; ``POST /setup/activate_window``;
``POST /setup/close_window``; ``POST /screen_size``; ``GET /terminal``; ``GET /cursor_position``;
``GET /platform``.

Differences from upstream, on purpose: a command that cannot be started (missing binary, no
permission) or that runs past ``--exec-timeout`` is a deterministic result (HTTP 200,
``returncode`` 127/126/-9), not a 500, so that 5xx keeps meaning "transient, retry"; the a11y tree
of a huge spreadsheet table is limited to its first 200 x 60 cells that are showing.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import shlex
import shutil
import signal
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import time
import traceback
import urllib.parse
import xml.etree.ElementTree as ET
import zlib

EXEC_TIMEOUT_S = 120.0
_STATE: dict = {}
_X_LOCK = threading.Lock()
_A11Y_LOCK = threading.Lock()

NS = {
    "st": "https://accessibility.ubuntu.example.org/ns/state",
    "attr": "https://accessibility.ubuntu.example.org/ns/attributes",
    "cp": "https://accessibility.ubuntu.example.org/ns/component",
    "doc": "https://accessibility.ubuntu.example.org/ns/document",
    "docattr": "https://accessibility.ubuntu.example.org/ns/document/attributes",
    "txt": "https://accessibility.ubuntu.example.org/ns/text",
    "val": "https://accessibility.ubuntu.example.org/ns/value",
    "act": "https://accessibility.ubuntu.example.org/ns/action",
}
for _prefix, _uri in NS.items():
    ET.register_namespace(_prefix, _uri)


def _q(ns: str, name: str) -> str:
    """An ElementTree qualified name in one of the OSWorld a11y namespaces."""
    return "{" + NS[ns] + "}" + name


MAX_DEPTH = 50
MAX_WIDTH = 1024
MAX_NODES = 5000
TABLE_ROWS = 200
TABLE_COLS = 60


# --------------------------------------------------------------------------------------------
# Screenshots: X11 GetImage -> RGB -> PNG (stdlib zlib).


def png_encode(width: int, height: int, rgb: bytes) -> bytes:
    """Encodes 8-bit RGB pixels (row-major, no padding) as a PNG."""
    stride = width * 3
    raw = b"".join(b"\x00" + rgb[y * stride : (y + 1) * stride] for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 1))
        + chunk(b"IEND", b"")
    )


def bgrx_to_rgb(data: bytes, npixels: int) -> bytearray:
    """Converts 32-bit little-endian BGRX pixels to packed RGB."""
    rgb = bytearray(npixels * 3)
    rgb[0::3] = data[2::4]
    rgb[1::3] = data[1::4]
    rgb[2::3] = data[0::4]
    return rgb


def _x_display():
    from Xlib import display as xdisplay  # python3-xlib

    d = _STATE.get("xdisplay")
    if d is None:
        d = xdisplay.Display(_STATE["display"])
        _STATE["xdisplay"] = d
    return d


def paint_cursor(rgb: bytearray, width: int, height: int, cursor) -> None:
    """Alpha-blends an XFixes cursor image (premultiplied ARGB32 words) onto packed RGB pixels.

    ``cursor`` has ``x``, ``y`` (pointer position), ``xhot``, ``yhot``, ``width``, ``height``
    and ``cursor_image`` (row-major ARGB words), as XFixes GetCursorImage replies.
    """
    x0, y0 = cursor.x - cursor.xhot, cursor.y - cursor.yhot
    pixels = cursor.cursor_image
    for cy in range(cursor.height):
        y = y0 + cy
        if not 0 <= y < height:
            continue
        for cx in range(cursor.width):
            x = x0 + cx
            if not 0 <= x < width:
                continue
            argb = pixels[cy * cursor.width + cx]
            a = (argb >> 24) & 0xFF
            if a == 0:
                continue
            i = (y * width + x) * 3
            inv = 255 - a
            rgb[i] = min(255, ((argb >> 16) & 0xFF) + rgb[i] * inv // 255)
            rgb[i + 1] = min(255, ((argb >> 8) & 0xFF) + rgb[i + 1] * inv // 255)
            rgb[i + 2] = min(255, (argb & 0xFF) + rgb[i + 2] * inv // 255)


def _cursor_image(d):
    """The current cursor image (XFixes), or None when the extension is missing."""
    if not _STATE.get("xfixes_ready"):
        if not d.has_extension("XFIXES"):
            return None
        d.xfixes_query_version()
        _STATE["xfixes_ready"] = True
    return d.xfixes_get_cursor_image(d.screen().root)


def screenshot_png() -> bytes:
    """Grabs the whole root window, with the mouse cursor painted in (as upstream), as PNG."""
    from Xlib import X

    with _X_LOCK:
        try:
            d = _x_display()
            root = d.screen().root
            geom = root.get_geometry()
            w, h = geom.width, geom.height
            img = root.get_image(0, 0, w, h, X.ZPixmap, 0xFFFFFFFF)
            cursor = _cursor_image(d)
        except Exception:
            _STATE.pop("xdisplay", None)
            _STATE.pop("xfixes_ready", None)
            raise
    data = img.data if isinstance(img.data, bytes) else bytes(img.data)
    if len(data) != w * h * 4:
        raise RuntimeError(f"unexpected X image size {len(data)} for {w}x{h} (depth {img.depth})")
    rgb = bgrx_to_rgb(data, w * h)
    if cursor is not None:
        paint_cursor(rgb, w, h, cursor)
    return png_encode(w, h, bytes(rgb))


def screen_size() -> tuple[int, int]:
    """The root window's size."""
    with _X_LOCK:
        try:
            s = _x_display().screen()
            return s.width_in_pixels, s.height_in_pixels
        except Exception:
            _STATE.pop("xdisplay", None)
            raise


def wm_running() -> bool:
    """True once a EWMH window manager has set ``_NET_SUPPORTING_WM_CHECK`` on the root."""
    from Xlib import X

    with _X_LOCK:
        d = _x_display()
        atom = d.intern_atom("_NET_SUPPORTING_WM_CHECK")
        prop = d.screen().root.get_full_property(atom, X.AnyPropertyType)
        return prop is not None and len(prop.value) > 0


# --------------------------------------------------------------------------------------------
# Commands and windows.


def _expand(command):
    if isinstance(command, str):
        return command
    return [
        os.path.expanduser(a) if isinstance(a, str) and a.startswith("~/") else a for a in command
    ]


def run_command(command, shell: bool, timeout: float | None = None) -> dict:
    """Runs a command to completion; a failure to start is a result, not an exception."""
    if isinstance(command, str) and not shell:
        command = shlex.split(command)
    command = _expand(command)
    if timeout is None:
        timeout = _STATE.get("exec_timeout", EXEC_TIMEOUT_S)
    try:
        result = subprocess.run(
            command,
            shell=shell,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
        )
    except FileNotFoundError as e:
        return {"status": "error", "output": "", "error": str(e), "returncode": 127}
    except PermissionError as e:
        return {"status": "error", "output": "", "error": str(e), "returncode": 126}
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode("utf-8", "replace") if isinstance(e.stdout, bytes) else e.stdout
        return {
            "status": "error",
            "output": out or "",
            "error": f"command timed out after {timeout:g} s",
            "returncode": -9,
        }
    return {
        "status": "success",
        "output": result.stdout,
        "error": result.stderr,
        "returncode": result.returncode,
    }


def spawn(command, shell: bool = False) -> subprocess.Popen:
    """Starts a detached program (its output goes to the sandbox's log directory)."""
    if isinstance(command, str) and not shell:
        command = shlex.split(command)
    command = _expand(command)
    log = open(os.path.join(_STATE["logdir"], "apps.log"), "ab")  # noqa: SIM115
    try:
        return subprocess.Popen(
            command,
            shell=shell,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    finally:
        log.close()


def list_windows() -> list[tuple[str, str, str]]:
    """(id, wm_class, title) of the managed top-level windows, via wmctrl."""
    res = run_command(["wmctrl", "-lx"], shell=False, timeout=10)
    out = []
    for line in res["output"].splitlines():
        parts = line.split(None, 4)
        if len(parts) >= 3:
            out.append((parts[0], parts[2], parts[4] if len(parts) == 5 else ""))
    return out


def find_window(name: str, strict: bool = False, by_class: bool = False) -> str | None:
    """The id of the first window whose title (or class) matches, wmctrl-style."""
    for wid, wm_class, title in list_windows():
        hay = wm_class if by_class else title
        if strict:
            if hay == name or (by_class and name in hay.split(".")):
                return wid
        elif name.lower() in hay.lower():
            return wid
    return None


def open_path(path: str, timeout: float) -> tuple[int, str]:
    """Opens a file with its configured application, or starts a program; waits for a window."""
    full = os.path.expandvars(os.path.expanduser(path))
    if os.path.exists(full):
        opener = None
        lower = full.lower()
        for suffix, cmd in _STATE["openers"]:
            if lower.endswith(suffix):
                opener = cmd
                break
        if opener is None:
            if shutil.which("xdg-open") is None:
                return 404, f"no application configured to open {path}"
            opener = "xdg-open"
        spawn(shlex.split(opener) + [full])
        base = os.path.basename(full)
        candidates = [base, os.path.splitext(base)[0]]
    elif shutil.which(path):
        spawn([path])
        candidates = [path]
    else:
        return 404, f"Application/file not found: {path}"
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for wid, _cls, title in list_windows():
            if any(c and c in title for c in candidates):
                run_command(["wmctrl", "-i", "-a", wid], shell=False, timeout=10)
                return 200, "File opened and window activated successfully"
        time.sleep(0.05)
    return 500, f"Failed to find window for {candidates} within {timeout:g} seconds."


# --------------------------------------------------------------------------------------------
# Accessibility (pyatspi), OSWorld-style XML.


def _pyatspi():
    import pyatspi  # python3-pyatspi; imported lazily (slow) and only when asked for

    if not _STATE.get("atspi_timeout_set"):
        try:
            pyatspi.setTimeout(3000, 10000)
        except Exception:
            pass
        _STATE["atspi_timeout_set"] = True
    return pyatspi


def _node_xml(node, pyatspi, depth: int, budget: list) -> ET.Element:
    budget[0] -= 1
    attrs = {"name": node.name or ""}
    states = node.getState().getStates()
    for st in states:
        sname = pyatspi.StateType._enum_lookup.get(int(st), "")
        sname = sname.split("_", 1)[1].lower() if "_" in sname else ""
        if sname:
            attrs[_q("st", sname)] = "true"
    try:
        for key, value in (node.get_attributes() or {}).items():
            if key:
                attrs[_q("attr", key)] = str(value)
    except Exception:
        pass
    if attrs.get(_q("st", "visible")) == "true" and attrs.get(_q("st", "showing")) == "true":
        try:
            comp = node.queryComponent()
            x, y, w, h = comp.getExtents(pyatspi.XY_SCREEN)
            attrs[_q("cp", "screencoord")] = str((x, y))
            attrs[_q("cp", "size")] = str((w, h))
        except Exception:
            pass
    text = ""
    try:
        t = node.queryText()
        text = t.getText(0, t.characterCount).replace("\ufffc", "").replace("\ufffd", "")
    except Exception:
        pass
    for probe, key in (("queryImage", "image"), ("querySelection", "selection")):
        try:
            getattr(node, probe)()
            attrs[key] = "true"
        except Exception:
            pass
    try:
        v = node.queryValue()
        for key, getter in (
            ("value", lambda: v.currentValue),
            ("min", lambda: v.minimumValue),
            ("max", lambda: v.maximumValue),
            ("step", lambda: v.minimumIncrement),
        ):
            try:
                attrs[_q("val", key)] = str(getter())
            except Exception:
                pass
    except Exception:
        pass
    try:
        a = node.queryAction()
        for i in range(a.nActions):
            aname = a.getName(i).replace(" ", "-")
            attrs[_q("act", aname + "_desc")] = a.getDescription(i)
            attrs[_q("act", aname + "_kb")] = a.getKeyBinding(i)
    except Exception:
        pass
    role = (node.getRoleName().strip() or "unknown").replace(" ", "-")
    el = ET.Element(role, attrs)
    if text:
        el.text = text
    if depth >= MAX_DEPTH or budget[0] <= 0:
        return el
    try:
        count = node.childCount
    except Exception:
        return el
    if role == "table" and count > MAX_WIDTH:
        _table_children(node, el, pyatspi, depth, budget)
        return el
    for i in range(min(count, MAX_WIDTH)):
        if budget[0] <= 0:
            break
        try:
            child = node.getChildAtIndex(i)
            if child is not None:
                el.append(_node_xml(child, pyatspi, depth + 1, budget))
        except Exception:
            continue
    return el


def _table_children(node, el, pyatspi, depth, budget) -> None:
    """Showing cells of a huge table (a spreadsheet): the first TABLE_ROWS x TABLE_COLS."""
    try:
        table = node.queryTable()
    except Exception:
        return
    for r in range(min(table.nRows, TABLE_ROWS)):
        row_seen = False
        for c in range(min(table.nColumns, TABLE_COLS)):
            if budget[0] <= 0:
                return
            cell = table.getAccessibleAt(r, c)
            if cell is None or not cell.getState().contains(pyatspi.STATE_SHOWING):
                if row_seen:
                    break
                continue
            row_seen = True
            el.append(_node_xml(cell, pyatspi, depth + 1, budget))


def accessibility_xml() -> str:
    """The desktop's a11y tree; an empty tree with a ``note`` when at-spi is unavailable."""
    root = ET.Element("desktop-frame")
    try:
        with _A11Y_LOCK:
            pyatspi = _pyatspi()
            desktop = pyatspi.Registry.getDesktop(0)
            budget = [MAX_NODES]
            for i in range(desktop.childCount):
                app = desktop.getChildAtIndex(i)
                if app is not None:
                    root.append(_node_xml(app, pyatspi, 1, budget))
    except Exception as e:  # at-spi down or broken: an explicit, empty tree
        root = ET.Element("desktop-frame", {"note": f"accessibility unavailable: {e!r}"[:500]})
    return ET.tostring(root, encoding="unicode")


def terminal_text() -> str | None:
    """Text of the focused terminal widget in the active frame, or None."""
    try:
        with _A11Y_LOCK:
            pyatspi = _pyatspi()
            desktop = pyatspi.Registry.getDesktop(0)
            for i in range(desktop.childCount):
                app = desktop.getChildAtIndex(i)
                if app is None:
                    continue
                for j in range(app.childCount):
                    frame = app.getChildAtIndex(j)
                    if frame is None or not frame.getState().contains(pyatspi.STATE_ACTIVE):
                        continue
                    hit = pyatspi.findDescendant(
                        frame,
                        lambda n: (
                            n.getRoleName() == "terminal"
                            and n.getState().contains(pyatspi.STATE_FOCUSED)
                        ),
                    )
                    if hit is not None:
                        t = hit.queryText()
                        return t.getText(0, t.characterCount).rstrip()
    except Exception:
        return None
    return None


# --------------------------------------------------------------------------------------------
# HTTP over a UNIX socket.


def parse_multipart(body: bytes, content_type: str) -> dict[str, bytes]:
    """Fields of a ``multipart/form-data`` body (name -> raw bytes)."""
    boundary = None
    for part in content_type.split(";")[1:]:
        k, _, v = part.strip().partition("=")
        if k.lower() == "boundary":
            boundary = v.strip('"')
    if not boundary:
        raise ValueError("multipart body without boundary")
    fields: dict[str, bytes] = {}
    delim = b"--" + boundary.encode("latin-1")
    for chunk in body.split(delim)[1:]:
        if chunk.startswith(b"--"):
            break
        chunk = chunk[2:] if chunk.startswith(b"\r\n") else chunk
        head, sep, data = chunk.partition(b"\r\n\r\n")
        if not sep:
            continue
        if data.endswith(b"\r\n"):
            data = data[:-2]
        name = None
        for line in head.decode("utf-8", "replace").split("\r\n"):
            if line.lower().startswith("content-disposition:"):
                for item in line.split(";")[1:]:
                    k, _, v = item.strip().partition("=")
                    if k == "name":
                        name = v.strip('"')
        if name is not None:
            fields[name] = data
    return fields


class Handler(http.server.BaseHTTPRequestHandler):
    """One protocol request."""

    protocol_version = "HTTP/1.1"
    server_version = "osworld-jax-local/1"

    def log_message(self, format, *args):  # noqa: A002 - stdlib signature
        """Logs to stderr (the sandbox's jail.log)."""
        sys.stderr.write("vmserver: " + (format % args) + "\n")

    def address_string(self):
        """UNIX-socket peers have no address."""
        return "unix"

    def _send(self, status: int, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json")

    def _text(self, status: int, text: str) -> None:
        self._send(status, text.encode(), "text/plain; charset=utf-8")

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _json_body(self) -> dict:
        body = self._body()
        data = json.loads(body) if body else {}
        if not isinstance(data, dict):
            raise ValueError("request body must be a JSON object")
        return data

    def do_GET(self):  # noqa: N802 - stdlib name
        """Dispatches a GET."""
        self._dispatch("GET")

    def do_POST(self):  # noqa: N802 - stdlib name
        """Dispatches a POST."""
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        route = urllib.parse.urlsplit(self.path).path
        fn = ROUTES.get((method, route))
        if fn is None:
            self._text(404, f"no route {method} {route}")
            return
        try:
            fn(self)
        except (ValueError, KeyError) as e:
            self._json(400, {"status": "error", "message": f"bad request: {e!r}"})
        except Exception as e:
            traceback.print_exc()
            self._json(500, {"status": "error", "message": f"{type(e).__name__}: {e}"})

    # Routes ---------------------------------------------------------------------------------

    def _r_screenshot(self):
        self._send(200, screenshot_png(), "image/png")

    def _r_execute(self):
        data = self._json_body()
        shell = bool(data.get("shell", False))
        command = data.get("command", "" if shell else [])
        self._json(200, run_command(command, shell))

    def _r_launch(self):
        data = self._json_body()
        shell = bool(data.get("shell", False))
        command = data.get("command", "" if shell else [])
        try:
            spawn(command, shell)
        except OSError as e:
            self._json(404, {"status": "error", "message": str(e)})
            return
        shown = command if isinstance(command, str) else " ".join(command)
        self._text(200, f"{shown} launched successfully")

    def _r_accessibility(self):
        self._json(200, {"AT": accessibility_xml()})

    def _r_terminal(self):
        self._json(200, {"output": terminal_text(), "status": "success"})

    def _r_screen_size(self):
        w, h = screen_size()
        self._json(200, {"width": w, "height": h})

    def _r_cursor(self):
        res = run_command(["xdotool", "getmouselocation", "--shell"], shell=False, timeout=10)
        pos = dict(line.split("=", 1) for line in res["output"].split() if "=" in line)
        self._json(200, [int(pos["X"]), int(pos["Y"])])

    def _r_platform(self):
        self._text(200, "Linux")

    def _r_file(self):
        form = urllib.parse.parse_qs(self._body().decode("utf-8"))
        if "file_path" not in form:
            self._json(400, {"error": "file_path is required"})
            return
        path = os.path.expandvars(os.path.expanduser(form["file_path"][0]))
        if not os.path.isfile(path):
            self._json(404, {"error": "File not found"})
            return
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            self._json(403, {"error": f"cannot read file: {e}"})
            return
        self._send(200, data, "application/octet-stream")

    def _r_upload(self):
        fields = parse_multipart(self._body(), self.headers.get("Content-Type", ""))
        if "file_path" not in fields or "file_data" not in fields:
            self._json(400, {"error": "file_path and file_data are required"})
            return
        path = os.path.expandvars(os.path.expanduser(fields["file_path"].decode("utf-8")))
        try:
            parent = os.path.dirname(path)
            if parent:
                os.makedirs(parent, exist_ok=True)
            with open(path, "wb") as f:
                f.write(fields["file_data"])
        except OSError as e:
            self._json(403, {"error": f"Failed to upload file: {e}"})
            return
        self._text(200, f"File Uploaded: {len(fields['file_data'])} bytes")

    def _r_open_file(self):
        data = self._json_body()
        path = data.get("path")
        if not path:
            self._text(400, "Path not supplied!")
            return
        timeout = float(data.get("timeout_seconds", _STATE["open_timeout"]))
        status, msg = open_path(path, timeout)
        self._text(status, msg)

    def _window_args(self):
        data = self._json_body()
        name = data.get("window_name")
        if not name:
            raise ValueError("window_name required")
        return name, bool(data.get("strict", False)), bool(data.get("by_class", False))

    def _r_activate_window(self):
        name, strict, by_class = self._window_args()
        wid = find_window(name, strict, by_class)
        if wid is None:
            self._text(404, f"Window {name} not found")
            return
        run_command(["wmctrl", "-i", "-a", wid], shell=False, timeout=10)
        self._text(200, "Window activated successfully")

    def _r_close_window(self):
        name, strict, by_class = self._window_args()
        wid = find_window(name, strict, by_class)
        if wid is None:
            self._text(404, f"Window {name} not found")
            return
        run_command(["wmctrl", "-i", "-c", wid], shell=False, timeout=10)
        self._text(200, "Window closed successfully")


ROUTES = {
    ("GET", "/screenshot"): Handler._r_screenshot,
    ("POST", "/execute"): Handler._r_execute,
    ("POST", "/setup/execute"): Handler._r_execute,
    ("POST", "/setup/launch"): Handler._r_launch,
    ("GET", "/accessibility"): Handler._r_accessibility,
    ("GET", "/terminal"): Handler._r_terminal,
    ("POST", "/screen_size"): Handler._r_screen_size,
    ("GET", "/cursor_position"): Handler._r_cursor,
    ("GET", "/platform"): Handler._r_platform,
    ("POST", "/file"): Handler._r_file,
    ("POST", "/setup/upload"): Handler._r_upload,
    ("POST", "/setup/open_file"): Handler._r_open_file,
    ("POST", "/setup/activate_window"): Handler._r_activate_window,
    ("POST", "/setup/close_window"): Handler._r_close_window,
}


class UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """Threaded HTTP server on a UNIX socket."""

    daemon_threads = True

    def get_request(self):
        """Accepts a connection (UNIX sockets have no peer address)."""
        conn, _ = self.socket.accept()
        return conn, ("unix", 0)


# --------------------------------------------------------------------------------------------
# Start-up.


def start_xvfb(display: str, width: int, height: int, timeout: float) -> subprocess.Popen:
    """Starts Xvfb and waits until it accepts connections (``-displayfd``)."""
    rfd, wfd = os.pipe()
    proc = subprocess.Popen(
        [
            "Xvfb",
            display,
            "-screen",
            "0",
            f"{width}x{height}x24",
            "-nolisten",
            "tcp",
            "-dpi",
            "96",
            "-displayfd",
            str(wfd),
        ],
        pass_fds=(wfd,),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=open(os.path.join(_STATE["logdir"], "xvfb.log"), "ab"),  # noqa: SIM115
    )
    os.close(wfd)
    end = time.monotonic() + timeout
    buf = b""
    os.set_blocking(rfd, False)
    while time.monotonic() < end:
        try:
            chunk = os.read(rfd, 64)
        except BlockingIOError:
            chunk = None
        if chunk:
            buf += chunk
            if buf.endswith(b"\n"):
                break
        elif chunk == b"" or proc.poll() is not None:
            raise RuntimeError(f"Xvfb exited during start-up (code {proc.poll()})")
        time.sleep(0.005)
    else:
        raise RuntimeError(f"Xvfb not ready within {timeout:g} s")
    os.close(rfd)
    return proc


def main(argv=None) -> int:
    """Starts the desktop and serves the protocol until killed."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--socket", required=True)
    p.add_argument("--display", default=":0")
    p.add_argument("--width", type=int, default=1920)
    p.add_argument("--height", type=int, default=1080)
    p.add_argument("--wm", default="openbox --sm-disable")
    p.add_argument("--openers", default="[]", help="JSON list of [suffix, command]")
    p.add_argument("--open-timeout", type=float, default=30.0)
    p.add_argument("--start-timeout", type=float, default=20.0)
    p.add_argument("--exec-timeout", type=float, default=EXEC_TIMEOUT_S)
    p.add_argument("--logdir", default="/tmp")
    args = p.parse_args(argv)

    _STATE.update(
        display=args.display,
        logdir=args.logdir,
        openers=[(s.lower(), c) for s, c in json.loads(args.openers)],
        open_timeout=args.open_timeout,
        exec_timeout=args.exec_timeout,
    )
    os.makedirs(args.logdir, exist_ok=True)
    os.environ["DISPLAY"] = args.display
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

    t0 = time.monotonic()
    start_xvfb(args.display, args.width, args.height, args.start_timeout)
    t_x = time.monotonic() - t0
    spawn(args.wm)
    end = time.monotonic() + args.start_timeout
    while not wm_running():
        if time.monotonic() > end:
            raise RuntimeError(f"window manager {args.wm!r} not up within {args.start_timeout} s")
        time.sleep(0.01)

    if os.path.exists(args.socket):
        os.unlink(args.socket)
    tmp = args.socket + ".tmp"
    if os.path.exists(tmp):
        os.unlink(tmp)
    server = UnixHTTPServer(tmp, Handler)
    os.rename(tmp, args.socket)  # the socket appearing under its name means "ready"
    sys.stderr.write(
        f"vmserver: ready in {time.monotonic() - t0:.2f} s (Xvfb {t_x:.2f} s) on {args.socket}\n"
    )
    sys.stderr.flush()
    try:
        server.serve_forever(poll_interval=0.5)
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    socket.setdefaulttimeout(None)
    sys.exit(main())
