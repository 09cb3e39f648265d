"""The local sandbox's own implementation of the OSWorld in-VM server protocol (the trusted side).

This file runs INSIDE the bubblewrap jail with the system ``python3``: it uses only the standard
library plus Debian's ``python3-xlib`` and (lazily) ``python3-pyatspi``, and ``jailexec.py``
beside it. It must not import ``osworld_jax``. Start-up: it makes itself non-dumpable (no process
of the jail's uid may ptrace it or read its memory), starts ``Xvfb`` on ``--display`` (readiness
through ``-displayfd``) and the window manager, waits until the window manager owns the screen,
writes ``ready`` to ``--ready-fd`` and serves the protocol on the listening UNIX socket it
inherited as ``--listen-fd``. The host created that socket in a directory the jail never mounts:
nothing in the jail can connect to it, replace it or bind another server in its place. It is run
under ``dbus-run-session`` so that the session bus (and, activated on demand, the at-spi bus)
exist.

Where things run (``jailexec.py``): the agent's actions (``POST /agent/execute``, this project's
route) and the programs ``/setup/launch`` and ``/setup/open_file`` start run in the desktop
namespace; the commands of ``/execute``, ``/setup/execute``, ``/run_python`` and
``/run_bash_script`` (setup, postconfig, getters) each run in a throwaway namespace. Neither can
see or signal this server.

Routes (request and reply shapes as upstream OSWorld's ``desktop_env/server/main.py``):
``GET /screenshot`` PNG; ``POST /execute`` and ``/setup/execute`` JSON ``{command, shell}`` ->
``{status, output, error, returncode}``; ``GET /accessibility`` ``{"AT": xml}``; ``POST /file``
(form ``file_path``); ``POST /setup/upload`` (multipart ``file_path`` + ``file_data``);
``POST /setup/launch``; ``POST /setup/open_file``; ``POST /setup/activate_window``;
``POST /setup/close_window``; ``POST /screen_size``; ``GET /terminal``; ``GET /cursor_position``;
``GET /platform``; ``POST /run_python`` ``{code}``; ``POST /run_bash_script``
``{script, timeout, working_dir}``; ``POST /window_size`` (form ``app_class_name``);
``POST /wallpaper``; ``POST /desktop_path``; ``POST /list_directory`` ``{path}``;
``POST /setup/change_wallpaper`` ``{path}``.

Differences from upstream, on purpose: a command that cannot be started (missing binary, no
permission) or that runs past ``--exec-timeout`` on ``/execute`` is a deterministic result (HTTP
200, ``returncode`` 127/126/-9), not a 500, so that 5xx keeps meaning "transient, retry"; the
a11y tree of a huge spreadsheet table is limited to its first 200 x 60 cells that are showing;
``/file`` refuses (404) a path that resolves into ``/proc``, ``/sys`` or ``/dev``; a command's
background programs end with it (its namespace; ``/setup/launch`` starts lasting programs), and
its output is read until 0.5 s after it exits; inline python (``python -c``) and ``/run_python``
run with ``PYTHONSAFEPATH=1`` and ``PYTHONNOUSERSITE=1`` (no module from the current directory,
no user site-packages or ``.pth`` file of the agent); ``/run_python`` and ``/run_bash_script``
run their code from a memory file (``/dev/fd/N``), not a ``/tmp`` file; and every reply
is bounded: a command's stdout/stderr, a file, a directory tree, the a11y tree or the terminal
text larger than its limit (``--max-output``/``--max-file``) is answered HTTP 413 with
``{"status": "error", "limit": ..., "message": ...}`` instead of being sent.
"""

from __future__ import annotations

import argparse
import ctypes
import http.server
import json
import os
import shlex
import shutil
import signal
import socket
import socketserver
import subprocess
import sys
import time
import traceback
import urllib.parse

if __package__:  # imported on the host as osworld_jax.env.local.vmserver (tests)
    from . import jailexec
    from .a11y import accessibility_xml, terminal_text
    from .screen import (
        bgrx_to_rgb,
        paint_cursor,
        png_encode,
        screen_size,
        screenshot_png,
        window_size,
        wm_running,
    )
else:  # in the jail, run with python3 -I (no script directory on sys.path)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import jailexec  # type: ignore[no-redef]
    from a11y import accessibility_xml, terminal_text  # type: ignore[no-redef]
    from screen import (  # type: ignore[no-redef]
        bgrx_to_rgb,
        paint_cursor,
        png_encode,
        screen_size,
        screenshot_png,
        window_size,
        wm_running,
    )

__all__ = ["bgrx_to_rgb", "main", "paint_cursor", "parse_multipart", "png_encode"]

EXEC_TIMEOUT_S = 120.0
MAX_OUTPUT = 4 << 20
MAX_FILE = 64 << 20
_STATE: dict = {}


# --------------------------------------------------------------------------------------------
# Commands and windows.


class LimitExceeded(Exception):
    """A reply would exceed one of the server's size limits (answered HTTP 413)."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit


def run_command(command, shell: bool, timeout: float | None = None) -> dict:
    """Runs one of the server's own helper programs (wmctrl, xdotool, gsettings) directly."""
    if timeout is None:
        timeout = _STATE.get("exec_timeout", EXEC_TIMEOUT_S)
    max_output = _STATE.get("max_output", MAX_OUTPUT)
    return jailexec.run_capped(
        jailexec.expand(command, shell), shell=shell, timeout=timeout, max_output=max_output
    )


def run_trusted(command, shell: bool, timeout: float | None = None, **kw) -> dict:
    """Runs a setup/evaluation command in a throwaway namespace (``jailexec.run_trusted``)."""
    if timeout is None:
        timeout = _STATE.get("exec_timeout", EXEC_TIMEOUT_S)
    return jailexec.run_trusted(
        command,
        shell=shell,
        timeout=timeout,
        max_output=_STATE.get("max_output", MAX_OUTPUT),
        **kw,
    )


def _desktop() -> jailexec.DesktopNamespace:
    return _STATE["desktop"]


def spawn(command, shell: bool = False) -> None:
    """Starts a program in the desktop namespace without waiting for it (OSError if it can't)."""
    reply = _desktop().request({"op": "spawn", "command": command, "shell": shell}, timeout=30)
    if "error" in reply:
        raise OSError(reply.get("errno") or 0, str(reply["error"]))


def list_windows() -> list[tuple[str, str, str]]:
    """(id, wm_class, title) of the managed top-level windows, via wmctrl."""
    res = run_command(["wmctrl", "-lx"], shell=False, timeout=10)
    out = []
    for line in res["output"].splitlines():
        parts = line.split(None, 4)
        if len(parts) >= 3:
            out.append((parts[0], parts[2], parts[4] if len(parts) == 5 else ""))
    return out


#: Upstream's application names in window titles -> this desktop's stand-ins (Debian's Chromium
#: stands in for Google Chrome: its titles end in "- Chromium").
WINDOW_ALIASES = {"Google Chrome": "Chromium"}


def find_window(name: str, strict: bool = False, by_class: bool = False) -> str | None:
    """The id of the first window whose title (or class) matches, wmctrl-style.

    A name that no window matches is tried again with ``WINDOW_ALIASES`` applied.
    """
    windows = list_windows()
    names = [name]
    for upstream, here in WINDOW_ALIASES.items():
        if upstream in name:
            names.append(name.replace(upstream, here))
    for candidate in names:
        for wid, wm_class, title in windows:
            hay = wm_class if by_class else title
            if strict:
                if hay == candidate or (by_class and candidate in hay.split(".")):
                    return wid
            elif candidate.lower() in hay.lower():
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
# Files and upstream's further endpoints.

#: Where a path may not lead for ``/file`` (kernel interfaces, not the desktop's files).
_PSEUDO_FS = ("/proc/", "/sys/", "/dev/")
GSETTINGS_BG = ["gsettings", "set", "org.gnome.desktop.background"]


def read_file(path: str) -> tuple[int, bytes | str]:
    """(200, bytes) of a regular file, or (404/403/413-like status, message).

    The file is opened first and then checked through the descriptor (so a symlink swapped in
    meanwhile changes nothing): a path that resolves into /proc, /sys or /dev is "not found", and
    a file larger than ``--max-file`` raises ``LimitExceeded``.
    """
    limit = _STATE.get("max_file", MAX_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return 404, "File not found"
    except OSError as e:
        if e.errno in (20, 40) or os.path.realpath(path).startswith(_PSEUDO_FS):
            return 404, "File not found"
        return 403, f"cannot read file: {e}"
    try:
        real = os.readlink(f"/proc/self/fd/{fd}")
        st = os.fstat(fd)
        if real.startswith(_PSEUDO_FS) or not stat_is_regular(st.st_mode):
            return 404, "File not found"
        if st.st_size > limit:
            raise LimitExceeded("file_bytes", f"{path} is {st.st_size} bytes (limit {limit})")
        os.set_blocking(fd, True)
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            total += len(chunk)
            if total > limit:  # grew while being read
                raise LimitExceeded("file_bytes", f"{path} is larger than {limit} bytes")
            chunks.append(chunk)
        return 200, b"".join(chunks)
    finally:
        os.close(fd)


def stat_is_regular(mode: int) -> bool:
    """S_ISREG."""
    import stat

    return stat.S_ISREG(mode)


def _script_fd(text: str, name: str) -> int:
    """A memory file holding ``text`` (inherited by the command, which runs ``/dev/fd/N``).

    Unreachable by the agent's processes: it has no path (it is not in ``/tmp``, where a process
    the agent left running could rewrite it between writing and running), and the command's
    ``/proc/PID/fd`` lies in a pid namespace the agent cannot see.
    """
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        data = text.encode("utf-8", "surrogatepass")  # never fails; bad bytes fail the run
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        os.close(fd)
        raise
    return fd


def run_python(code: str) -> tuple[int, dict]:
    """Upstream's ``/run_python``: the code as a file run by /usr/bin/python3 (30 s).

    Upstream writes ``/tmp/python_exec_*.py``; here the file is a memory file (``_script_fd``)
    and the interpreter is the evaluator's (``ISOLATED_PYTHON_ENV``: no user site, no ``.pth``).
    """
    try:
        fd = _script_fd(code, "python_exec")
    except OSError as e:
        failed = {"status": "error", "message": f"Execution error: {e}", "error": repr(e)}
        return 500, {**failed, "need_more": False, "output": None}
    try:
        res = run_trusted(
            ["/usr/bin/python3", f"/dev/fd/{fd}"],
            False,
            timeout=30,
            isolated=True,
            pass_fds=(fd,),
        )
    finally:
        os.close(fd)
    if res.get("limit") == "output":
        raise LimitExceeded("output_bytes", f"run_python: {res['error']}")
    if res.get("limit") == "time":
        return 500, {
            "status": "error",
            "message": "Execution timeout: Code took too long to execute",
            "error": "TimeoutExpired",
            "need_more": False,
            "output": None,
        }
    out, err, rc = res["output"], res["error"], res["returncode"]
    message = out + (("\n" + err if out else err) if err else "")
    if rc != 0 and not err:
        err = f"Process exited with code {rc}"
        message = message + "\n" + err if message else err
    return 200, {
        "status": "success" if rc == 0 else "error",
        "message": message,
        "need_more": False,
        "output": out,
        "error": err,
        "return_code": rc,
    }


def run_bash_script(script: str, timeout: float, working_dir: str | None) -> tuple[int, dict]:
    """Upstream's ``/run_bash_script``: the script run by /bin/bash as a file, stderr merged.

    Upstream writes ``/tmp/tmp*.sh``; here the file is a memory file (``_script_fd``).
    """
    if "#!/bin/bash" not in script:
        script = "#!/bin/bash\n\n" + script
    fd = _script_fd(script, "bash_script")  # not a /tmp file the agent could rewrite
    try:
        res = run_trusted(
            ["/bin/bash", f"/dev/fd/{fd}"],
            False,
            timeout=timeout,
            cwd=working_dir,
            merge_stderr=True,
            pass_fds=(fd,),
        )
    finally:
        os.close(fd)
    if res.get("limit") == "output":
        raise LimitExceeded("output_bytes", f"run_bash_script: {res['error']}")
    if res.get("limit") == "time":
        msg = f"Script execution timed out after {timeout:g} seconds"
        return 500, {"status": "error", "output": msg, "error": "", "returncode": -1}
    rc = res["returncode"]
    status = "success" if rc == 0 else "error"
    return 200, {"status": status, "output": res["output"], "error": "", "returncode": rc}


def wallpaper_path() -> str | None:
    """The file of ``org.gnome.desktop.background picture-uri`` (None when unset/unavailable)."""
    cmd = ["gsettings", "get", "org.gnome.desktop.background", "picture-uri"]
    res = run_command(cmd, shell=False, timeout=30)
    if res["returncode"] != 0:
        return None
    path = res["output"].strip().replace("file://", "").replace("'", "")
    return path or None


def directory_tree(start: str) -> dict:
    """Upstream's ``/list_directory`` tree, built without recursion and bounded in size.

    ``{"type": "directory", "name": basename, "children": [...]}`` with files as
    ``{"type": "file", "name": ...}``, ``os.listdir`` order, symlinks to directories followed
    (``os.path.isdir``), and ``{"error": str(e)}`` in place of a directory that cannot be listed.
    A tree whose entries' names exceed ``--max-output`` bytes in total (a symlink loop, a huge
    tree) raises ``LimitExceeded``.
    """
    limit = _STATE.get("max_output", MAX_OUTPUT)
    budget = [limit]
    root: dict = {"type": "directory", "name": os.path.basename(start), "children": []}
    stack: list[tuple[str, dict]] = [(start, root)]
    while stack:
        path, node = stack.pop()
        try:
            entries = os.listdir(path)
        except OSError as e:
            node.clear()
            node["error"] = str(e)
            continue
        for entry in entries:
            budget[0] -= len(entry) + 40
            if budget[0] < 0:
                raise LimitExceeded(
                    "output_bytes", f"directory tree of {start} exceeds {limit} bytes"
                )
            full = os.path.join(path, entry)
            child: dict
            if os.path.isdir(full):
                child = {"type": "directory", "name": entry, "children": []}
                stack.append((full, child))
            else:
                child = {"type": "file", "name": entry}
            node["children"].append(child)
    return root


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
        """Logs to stderr (the host's jail log)."""
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
        body = json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass")
        self._send(status, body, "application/json")

    def _text(self, status: int, text: str) -> None:
        self._send(status, text.encode(), "text/plain; charset=utf-8")

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        if n > _STATE.get("max_request", 1 << 30):
            raise ValueError(f"request body of {n} bytes is too large")
        return self.rfile.read(n) if n else b""

    def _json_body(self) -> dict:
        body = self._body()
        data = json.loads(body) if body else {}
        if not isinstance(data, dict):
            raise ValueError("request body must be a JSON object")
        return data

    def _form(self) -> dict[str, str]:
        form = urllib.parse.parse_qs(self._body().decode("utf-8"), keep_blank_values=True)
        return {k: v[0] for k, v in form.items()}

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
        except LimitExceeded as e:
            self._json(413, {"status": "error", "limit": e.limit, "message": str(e)})
        except (ValueError, KeyError) as e:
            self._json(400, {"status": "error", "message": f"bad request: {e!r}"})
        except Exception as e:
            traceback.print_exc()
            self._json(500, {"status": "error", "message": f"{type(e).__name__}: {e}"})

    def _command_reply(self, res: dict, what: str) -> dict:
        """Raises ``LimitExceeded`` for a command stopped by its output limit."""
        if res.get("limit") == "output":
            raise LimitExceeded("output_bytes", f"{what}: {res['error']}")
        return res

    def _bounded_text(self, text: str, what: str) -> str:
        limit = _STATE.get("max_output", MAX_OUTPUT)
        if text is not None and len(text.encode("utf-8", "surrogatepass")) > limit:
            raise LimitExceeded("output_bytes", f"{what} is larger than {limit} bytes")
        return text

    # Routes ---------------------------------------------------------------------------------

    def _r_screenshot(self):
        self._send(200, screenshot_png(), "image/png")

    def _r_execute(self):
        data = self._json_body()
        shell = bool(data.get("shell", False))
        command = data.get("command", "" if shell else [])
        res = run_trusted(command, shell)
        self._json(200, self._command_reply(res, "command"))

    def _r_agent_execute(self):
        """This project's route for the agent's own actions: runs in the desktop namespace."""
        data = self._json_body()
        shell = bool(data.get("shell", False))
        timeout = float(data.get("timeout", _STATE["exec_timeout"]))
        req = {
            "op": "run",
            "command": data.get("command", "" if shell else []),
            "shell": shell,
            "timeout": timeout,
            "max_output": _STATE.get("max_output", MAX_OUTPUT),
        }
        reply = _desktop().request(req, timeout=timeout + 10)
        if "error" in reply and "status" not in reply:
            self._json(502, {"status": "error", "message": str(reply["error"])[:2000]})
            return
        res = {k: reply.get(k) for k in ("status", "output", "error", "returncode")}
        if reply.get("limit") == "output":
            res["limit"] = "output"
        self._json(200, self._command_reply(res, "action"))

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
        self._json(200, {"AT": self._bounded_text(accessibility_xml(), "the accessibility tree")})

    def _r_terminal(self):
        text = self._bounded_text(terminal_text(), "the terminal text")
        self._json(200, {"output": text, "status": "success"})

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
        form = self._form()
        if "file_path" not in form:
            self._json(400, {"error": "file_path is required"})
            return
        status, data = read_file(os.path.expandvars(os.path.expanduser(form["file_path"])))
        if status != 200:
            self._json(status, {"error": data})
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

    # Upstream's further endpoints (OSWorld's PythonController / SetupController) -------------

    def _r_run_python(self):
        data = self._json_body()
        code = data.get("code")
        if not code:
            self._json(400, {"status": "error", "message": "Code not supplied!"})
            return
        self._json(*run_python(str(code)))

    def _r_run_bash_script(self):
        data = self._json_body()
        script = data.get("script")
        timeout = data.get("timeout", 100)
        working_dir = data.get("working_dir")
        if not script:
            err = {
                "status": "error",
                "output": "Script not supplied!",
                "error": "",
                "returncode": -1,
            }
            self._json(400, err)
            return
        if working_dir:
            working_dir = os.path.expanduser(working_dir)
            if not os.path.exists(working_dir):
                msg = f"Working directory does not exist: {working_dir}"
                self._json(400, {"status": "error", "output": msg, "error": "", "returncode": -1})
                return
        self._json(*run_bash_script(str(script), float(timeout), working_dir))

    def _r_window_size(self):
        form = self._form()
        if "app_class_name" not in form:
            self._json(400, {"error": "app_class_name is required"})
            return
        size = window_size(form["app_class_name"])
        if size is None:  # upstream's view returns None here, which Flask answers with a 500
            self._text(500, f"no window of class {form['app_class_name']!r}")
            return
        self._json(200, {"width": size[0], "height": size[1]})

    def _r_desktop_path(self):
        path = os.path.join(os.path.expanduser("~"), "Desktop")
        if os.path.exists(path):
            self._json(200, {"desktop_path": path})
        else:
            msg = "Unsupported operating system or desktop path not found"
            self._json(404, {"error": msg})

    def _r_wallpaper(self):
        path = wallpaper_path()
        if not path:
            self._text(404, "Wallpaper file not found")
            return
        status, data = read_file(path)
        if status != 200:  # upstream: send_file raised, abort(500)
            self._text(500, "Unable to serve the wallpaper file")
            return
        self._send(200, data, "image/png")

    def _r_change_wallpaper(self):
        data = self._json_body()
        path = data.get("path")
        if not path:
            self._text(400, "Path not supplied!")
            return
        full = os.path.expandvars(os.path.expanduser(path))
        if not os.path.exists(full):
            self._text(404, f"File not found: {full}")
            return
        res = run_command(GSETTINGS_BG + ["picture-uri", f"file://{full}"], shell=False, timeout=30)
        if res["returncode"] != 0:
            self._text(500, f"Failed to change wallpaper. Error: {res['error'].strip()}")
            return
        self._text(200, "Wallpaper changed successfully")

    def _r_list_directory(self):
        data = self._json_body()
        if "path" not in data:
            self._json(400, {"error": "Missing 'path' parameter"})
            return
        start = data["path"]
        if not isinstance(start, str) or not os.path.isdir(start):
            self._json(400, {"error": "The provided path is not a directory"})
            return
        self._json(200, {"directory_tree": directory_tree(start)})


ROUTES = {
    ("GET", "/screenshot"): Handler._r_screenshot,
    ("POST", "/execute"): Handler._r_execute,
    ("POST", "/setup/execute"): Handler._r_execute,
    ("POST", "/agent/execute"): Handler._r_agent_execute,
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
    ("POST", "/setup/change_wallpaper"): Handler._r_change_wallpaper,
    ("POST", "/run_python"): Handler._r_run_python,
    ("POST", "/run_bash_script"): Handler._r_run_bash_script,
    ("POST", "/window_size"): Handler._r_window_size,
    ("POST", "/desktop_path"): Handler._r_desktop_path,
    ("POST", "/wallpaper"): Handler._r_wallpaper,
    ("POST", "/list_directory"): Handler._r_list_directory,
}


class UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """Threaded HTTP server on an inherited, already listening UNIX socket."""

    daemon_threads = True

    def __init__(self, listen_fd: int, handler) -> None:
        super().__init__("", handler, bind_and_activate=False)
        self.socket.close()
        self.socket = socket.socket(fileno=listen_fd)

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


def make_undumpable() -> None:
    """PR_SET_DUMPABLE 0: no process of the same uid may ptrace this one.

    Nor read its memory or take its file descriptors (``/proc/PID/mem``, ``pidfd_getfd``).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def main(argv=None) -> int:
    """Starts the desktop and serves the protocol until killed."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--listen-fd", type=int, required=True, help="inherited listening socket")
    p.add_argument("--ready-fd", type=int, required=True, help="'ready' is written here")
    p.add_argument("--display", default=":0")
    p.add_argument("--width", type=int, default=1920)
    p.add_argument("--height", type=int, default=1080)
    p.add_argument("--wm", default="openbox --sm-disable")
    p.add_argument("--openers", default="[]", help="JSON list of [suffix, command]")
    p.add_argument("--open-timeout", type=float, default=30.0)
    p.add_argument("--start-timeout", type=float, default=20.0)
    p.add_argument("--exec-timeout", type=float, default=EXEC_TIMEOUT_S)
    p.add_argument("--max-output", type=int, default=MAX_OUTPUT)
    p.add_argument("--max-file", type=int, default=MAX_FILE)
    args = p.parse_args(argv)

    make_undumpable()
    here = os.path.dirname(os.path.abspath(__file__))
    desktop = jailexec.DesktopNamespace(
        os.path.join(here, "jailexec.py"),
        max_reply=12 * args.max_output + (1 << 20),  # two streams, JSON escapes up to 6x
        on_start=lambda ns: ns.request({"op": "spawn", "command": args.wm}, timeout=30),
    )
    _STATE.update(
        display=args.display,
        openers=[(s.lower(), c) for s, c in json.loads(args.openers)],
        open_timeout=args.open_timeout,
        exec_timeout=args.exec_timeout,
        max_output=args.max_output,
        max_file=args.max_file,
        max_request=max(args.max_file, args.max_output) + (16 << 20),
        desktop=desktop,
    )
    os.environ["DISPLAY"] = args.display
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

    t0 = time.monotonic()
    start_xvfb(args.display, args.width, args.height, args.start_timeout)
    t_x = time.monotonic() - t0
    desktop.start()  # the desktop namespace, with the window manager in it
    end = time.monotonic() + args.start_timeout
    while not wm_running():
        if time.monotonic() > end:
            raise RuntimeError(f"window manager {args.wm!r} not up within {args.start_timeout} s")
        time.sleep(0.01)

    server = UnixHTTPServer(args.listen_fd, Handler)
    os.write(args.ready_fd, b"ready\n")
    os.close(args.ready_fd)
    sys.stderr.write(f"vmserver: ready in {time.monotonic() - t0:.2f} s (Xvfb {t_x:.2f} s)\n")
    sys.stderr.flush()
    try:
        server.serve_forever(poll_interval=0.5)
    finally:
        server.server_close()
        desktop.close()
    return 0


if __name__ == "__main__":
    socket.setdefaulttimeout(None)
    sys.exit(main())
