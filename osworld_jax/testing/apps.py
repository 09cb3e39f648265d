"""Files made by the real applications inside a jailed local desktop (tests, asset scripts).

``RealApps`` starts one jailed desktop (``osworld_jax.env.local``) and uses the applications the
OSWorld tasks use as file factories, from synchronous code (its own event loop runs in a thread):

- ``office(data, name, ext)``: LibreOffice loads the document and stores it as ``ext`` (its own
  filters: ``xlsx`` is what Calc writes for "Excel 2007-365", ``pdf`` its PDF export, ...). One
  headless ``soffice`` serves every request over UNO (``python3-uno`` in the jail).
- ``gimp(data, name, ext)``: GIMP 2.10 loads the image and exports it as ``ext`` (one GIMP in
  batch mode serves Script-Fu requests on 127.0.0.1 inside the jail).
- ``execute``/``upload``/``file``/``launch``: the desktop's own in-VM protocol, for tests that
  drive Chromium, VLC or Thunderbird themselves.

Each app starts on first use (LibreOffice about 3 s, GIMP about 5 s on an idle machine).
"""

from __future__ import annotations

import asyncio
import json
import shlex
import signal
import threading
from collections.abc import Coroutine
from pathlib import PurePosixPath
from typing import Any, TypeVar

from osworld_jax.env.local import LocalBackend, LocalBackendConfig, LocalDesktop

__all__ = ["OFFICE_FILTERS", "RealApps", "RealAppError"]

T = TypeVar("T")
WORK = "/tmp/osworld_apps"
_UNO_PIPE = "osworld_jax_apps"
_SCRIPT_FU_PORT = 10008

#: LibreOffice export filter per target extension; PDF depends on the document's kind.
OFFICE_FILTERS = {
    "xlsx": "Calc MS Excel 2007 XML",
    "xls": "MS Excel 97",
    "ods": "calc8",
    "csv": "Text - txt - csv (StarCalc)",
    "docx": "MS Word 2007 XML",
    "doc": "MS Word 97",
    "odt": "writer8",
    "rtf": "Rich Text Format",
    "txt": "Text",
    "pptx": "Impress MS PowerPoint 2007 XML",
    "ppt": "MS PowerPoint 97",
    "odp": "impress8",
}
_PDF_FILTERS = {
    "com.sun.star.sheet.SpreadsheetDocument": "calc_pdf_Export",
    "com.sun.star.presentation.PresentationDocument": "impress_pdf_Export",
    "com.sun.star.drawing.DrawingDocument": "draw_pdf_Export",
}

# Runs in the jail (system python3 with python3-uno): load a document, store it with a filter.
_LO_CONVERT = """
import json, os, signal, sys, time, uno
from com.sun.star.beans import PropertyValue

# SIGALRM's default action ends the process even while it waits inside a UNO call (a Python
# handler would only run once that call returned: a hung load then ran into /execute's 120 s).
signal.signal(signal.SIGALRM, signal.SIG_DFL)
signal.alarm(int(float(sys.argv[6])) + 30)  # before /execute's own 120 s limit

def prop(name, value):
    p = PropertyValue()
    p.Name, p.Value = name, value
    return p

src, dst, filt = sys.argv[1], sys.argv[2], sys.argv[3]
ctx = uno.getComponentContext()
resolver = ctx.ServiceManager.createInstanceWithContext("com.sun.star.bridge.UnoUrlResolver", ctx)
end = time.monotonic() + float(sys.argv[6])
while True:
    try:
        remote = resolver.resolve("uno:pipe,name=PIPE;urp;StarOffice.ComponentContext")
        break
    except Exception:
        if time.monotonic() > end:
            raise
        time.sleep(0.2)
desktop = remote.ServiceManager.createInstanceWithContext("com.sun.star.frame.Desktop", remote)
view = sys.argv[7] == "view"
if view:  # a view-mode load takes ~1 s even on a loaded machine; one that hangs (seen under
    signal.alarm(VIEW_LIMIT_S)  # load) is cut short, and `office` restarts soffice and retries
doc = desktop.loadComponentFromURL(
    uno.systemPathToFileUrl(src), "_blank", 0, (prop("Hidden", not view),)
)
if doc is None:
    sys.exit("LibreOffice could not load " + src)
try:
    if filt == "pdf":
        kinds = json.loads(sys.argv[4])
        filt = next((f for k, f in kinds.items() if doc.supportsService(k)), "writer_pdf_Export")
    args = [prop("FilterName", filt)]
    if len(sys.argv) > 5 and sys.argv[5]:
        args.append(prop("FilterOptions", sys.argv[5]))
    doc.storeToURL(uno.systemPathToFileUrl(dst), tuple(args))
finally:
    if view:  # let the view finish its updates before it goes (closing at once can crash)
        time.sleep(0.5)
    doc.close(True)
sys.stdout.flush()
os._exit(0)  # python-uno may crash tearing down its bridge at interpreter exit
""".replace("PIPE", _UNO_PIPE).replace("VIEW_LIMIT_S", "20")

# Runs in the jail: one Script-Fu request to GIMP's Script-Fu server ('G', length, script).
_SCRIPT_FU = """
import socket, struct, sys, time
script = sys.argv[1].encode()
end = time.monotonic() + 90
while True:
    try:
        s = socket.create_connection(("127.0.0.1", PORT), timeout=120)
        break
    except OSError:
        if time.monotonic() > end:
            raise
        time.sleep(0.2)
s.sendall(b"G" + struct.pack(">H", len(script)) + script)
head = b""
while len(head) < 4:
    chunk = s.recv(4 - len(head))
    if not chunk:
        sys.exit("Script-Fu server closed the connection")
    head += chunk
error, length = head[1], struct.unpack(">H", head[2:4])[0]
body = b""
while len(body) < length:
    chunk = s.recv(length - len(body))
    if not chunk:
        break
    body += chunk
print(body.decode("utf-8", "replace"))
sys.exit(1 if error else 0)
""".replace("PORT", str(_SCRIPT_FU_PORT))


class RealAppError(RuntimeError):
    """A real application failed to make a file (the message quotes its output)."""


def _scheme_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


class RealApps:
    """One jailed desktop whose applications make files on request (see the module docstring).

    Args:
      config: the local backend's config (default: ``LocalBackendConfig()``).
    """

    def __init__(self, config: LocalBackendConfig | None = None) -> None:
        self._config = config or LocalBackendConfig()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._backend: LocalBackend | None = None
        self._desktop: LocalDesktop | None = None
        self._started: set[str] = set()
        self._lock = threading.Lock()
        self._count = 0

    # ------------------------------------------------------------------ plumbing
    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 300.0) -> T:
        """Runs a coroutine on the desktop's event loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    @property
    def desktop(self) -> LocalDesktop:
        """The running desktop (started on first use, with the helper scripts in it)."""
        with self._lock:
            if self._desktop is None:
                self._backend = LocalBackend(self._config)
                self._backend.preflight()
                desktop = self.run(self._backend.start_desktop())
                for name, code in (("lo_convert.py", _LO_CONVERT), ("script_fu.py", _SCRIPT_FU)):
                    self.run(desktop.client.upload(f"{WORK}/{name}", code.encode()))
                self._desktop = desktop
            return self._desktop

    def execute(self, command: list[str] | str, *, shell: bool = False) -> dict[str, Any]:
        """``/execute`` in the desktop (a trusted, throwaway namespace)."""
        return self.run(self.desktop.client.execute(command, shell=shell))

    def launch(self, command: list[str] | str, *, shell: bool = False) -> None:
        """``/setup/launch``: starts a program in the desktop's namespace."""
        self.run(self.desktop.client.launch(command, shell=shell))

    def upload(self, path: str, data: bytes) -> None:
        """Writes ``data`` to ``path`` in the desktop."""
        self.run(self.desktop.client.upload(path, data))

    def file(self, path: str) -> bytes:
        """The bytes of ``path`` in the desktop."""
        return self.run(self.desktop.client.file(path))

    def _check(self, res: dict[str, Any], what: str) -> None:
        if res.get("returncode") != 0:
            out = (str(res.get("output") or "") + str(res.get("error") or "")).strip()
            raise RealAppError(f"{what} failed (returncode {res.get('returncode')}): {out[-800:]}")

    def _paths(self, name: str, ext: str) -> tuple[str, str]:
        self._count += 1
        base = PurePosixPath(name).name
        stem = PurePosixPath(base).stem or "file"
        return (f"{WORK}/{self._count}/in/{base}", f"{WORK}/{self._count}/out/{stem}.{ext}")

    # ------------------------------------------------------------------ LibreOffice
    def _start_office(self) -> None:
        if "office" in self._started:
            return
        self.launch(
            [
                "soffice",
                "--headless",
                "--invisible",
                "--norestore",
                "--nologo",
                "--nodefault",
                f"--accept=pipe,name={_UNO_PIPE};urp;",
            ]
        )
        self._started.add("office")
        # The first document soffice loads must be a hidden one: on a loaded machine a view
        # opened first blocked loadComponentFromURL until the script's alarm (90 s; a view
        # after a hidden load takes ~1 s), so a one-line hidden conversion goes first. Its
        # failure is not the caller's: a stuck or gone soffice is restarted by `office`.
        src, dst = self._paths("warm-up.csv", "ods")
        self.upload(src, b"1\n")
        self.execute(["mkdir", "-p", str(PurePosixPath(dst).parent)])
        argv = ["python3", f"{WORK}/lo_convert.py", src, dst, OFFICE_FILTERS["ods"], "{}", ""]
        self.execute([*argv, "60", "hidden"])

    def _restart_office(self) -> None:
        self.launch(["pkill", "-KILL", "-f", "soffice"])
        self.execute(["sleep", "1"])
        self._started.discard("office")
        self._start_office()

    def office(
        self, data: bytes, name: str, ext: str, *, filter_options: str = "", view: bool = False
    ) -> bytes:
        """The document ``data`` (file name ``name``) as LibreOffice stores it as ``ext``.

        Args:
          data: the input document (any format LibreOffice opens).
          name: its file name (the extension tells LibreOffice the format).
          ext: the target extension (``OFFICE_FILTERS``, or ``pdf``).
          filter_options: LibreOffice filter options (e.g. CSV separators).
          view: load it with a view (not hidden), so that view settings (frozen panes, zoom)
            are read and written as when a user saves; slower.
        """
        self._start_office()
        src, dst = self._paths(name, ext)
        self.upload(src, data)
        self.execute(["mkdir", "-p", str(PurePosixPath(dst).parent)])
        filt = "pdf" if ext == "pdf" else OFFICE_FILTERS[ext]
        argv = ["python3", f"{WORK}/lo_convert.py", src, dst, filt, json.dumps(_PDF_FILTERS)]
        argv.append(filter_options)
        argv += ["60", "view" if view else "hidden"]
        res = self.execute(argv)
        # our alarm (SIGALRM: -14, or 142 as a shell reports it), 124 (timeout(1)'s, the script's
        # own code before SIG_DFL) or /execute's limit (SIGKILL)
        stuck = res.get("returncode") in (-signal.SIGALRM, 128 + signal.SIGALRM, 124, -9)
        if stuck or (res.get("returncode") != 0 and "NoConnectException" in str(res.get("error"))):
            # soffice is gone (it crashed on an earlier document) or stuck (seen once on a
            # loaded machine with a plain view-mode document): start another one and try once
            # more; a document that blocks LibreOffice blocks the second one too and fails.
            log = self.desktop.log_tail(1500)
            self._restart_office()
            res = self.execute(argv)
            if res.get("returncode") != 0:
                res["error"] = f"{res.get('error')} (jail log before the restart: {log})"
        self._check(res, f"LibreOffice {name} -> {ext}")
        return self.file(dst)

    # ------------------------------------------------------------------ GIMP
    def _start_gimp(self) -> None:
        if "gimp" in self._started:
            return
        server = f'(plug-in-script-fu-server 1 "127.0.0.1" {_SCRIPT_FU_PORT} "")'
        self.launch(["gimp", "-i", "-n", "-d", "-f", "-b", server])
        self._started.add("gimp")

    def script_fu(self, script: str) -> str:
        """Runs a Script-Fu expression in GIMP; returns its printed result."""
        self._start_gimp()
        res = self.execute(["python3", f"{WORK}/script_fu.py", script])
        self._check(res, f"Script-Fu {script[:80]!r}")
        return str(res.get("output") or "")

    def gimp(self, data: bytes, name: str, ext: str | None = None, *, edit: str = "") -> bytes:
        """The image ``data`` as GIMP exports it (as ``ext``, default: the same format).

        ``edit``: Script-Fu forms run on ``img`` / ``drw`` (the image and its layer, the visible
        layers merged when there are several) before the export, e.g.
        ``(gimp-image-flip img ORIENTATION-HORIZONTAL)``.
        """
        ext = ext or PurePosixPath(name).suffix.lstrip(".")
        src, dst = self._paths(name, ext)
        self.upload(src, data)
        self.execute(["mkdir", "-p", str(PurePosixPath(dst).parent)])
        s, d = _scheme_string(src), _scheme_string(dst)
        script = (
            f"(let* ((img (car (gimp-file-load RUN-NONINTERACTIVE {s} {s})))"
            f" (drw (if (> (car (gimp-image-get-layers img)) 1)"
            f" (car (gimp-image-merge-visible-layers img CLIP-TO-IMAGE))"
            f" (car (gimp-image-get-active-drawable img)))))"
            f" {edit}"
            f" (set! drw (car (gimp-image-get-active-drawable img)))"
            f" (gimp-file-save RUN-NONINTERACTIVE img drw {d} {d})"
            f" (gimp-image-delete img))"
        )
        self.script_fu(script)
        return self.file(dst)

    # ------------------------------------------------------------------ lifetime
    def shell(self, command: str) -> str:
        """Runs a shell command in the desktop; returns its stdout (raises on failure)."""
        res = self.execute(command, shell=True)
        self._check(res, f"command {shlex.quote(command)[:80]}")
        return str(res.get("output") or "")

    def close(self) -> None:
        """Stops the desktop (and its apps) and the event loop."""
        try:
            if self._backend is not None:
                self.run(self._backend.aclose())
        finally:
            self._backend = self._desktop = None
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()

    def __enter__(self) -> RealApps:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
