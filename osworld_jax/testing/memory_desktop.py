"""An in-process desktop speaking ``VMProtocol``: the ``memory`` test backend's machine (no X).

A dict filesystem rooted at ``/home/user``, a small POSIX command interpreter (``echo printf cat
mkdir touch rm mv cp ls test wc sort head true false pwd``, with ``&&``, ``;``, ``>`` and
``>>``), a text editor (``mousepad``/``gedit``, and ``memory-editor`` which saves on every
keystroke) and a command log. Agent code is never executed: statements are read with ``ast`` and
only literal-argument calls of ``pyautogui`` (``typewrite``/``write``/``press``/``hotkey``;
pointer actions are logged) and of ``subprocess.run/call/check_call/Popen``/``os.system`` (run
by the command interpreter) act.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import io
import posixpath
import shlex
from collections.abc import Sequence
from typing import Any

from osworld_jax.env.backend import SandboxStepError

HOME = "/home/user"
EDITORS = frozenset({"mousepad", "gedit", "memory-editor"})
_UNARY = {"-f", "-d", "-e", "-s"}


@dataclasses.dataclass
class _Doc:
    path: str
    buffer: str
    autosave: bool
    selected_all: bool = False


class _CommandError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class MemoryDesktop:
    """An in-process desktop that speaks ``VMProtocol`` (see the module docstring).

    Attributes:
      files: absolute path -> bytes.
      dirs: absolute directory paths.
      log: every command, launch, window action and agent call, in order.
      terminal_text: the accumulated output of commands run through the terminal.
      screen: the (width, height) reported by ``screen_size``.
    """

    def __init__(self, *, screen: tuple[int, int] = (1920, 1080), shot: int = 32) -> None:
        self.files: dict[str, bytes] = {}
        self.dirs: set[str] = {"/", "/home", HOME, f"{HOME}/Desktop", f"{HOME}/Documents"}
        self.log: list[str] = []
        self.terminal_text = ""
        self.screen = screen
        self.windows: list[str] = []
        self.doc: _Doc | None = None
        self._shot = shot

    # ---------------------------------------------------------------- filesystem
    def _abs(self, path: str, cwd: str = HOME) -> str:
        if path == "~" or path.startswith("~/"):
            path = HOME + path[1:]
        return posixpath.normpath(posixpath.join(cwd, path))

    def _ensure_parent(self, path: str) -> None:
        parent = posixpath.dirname(path)
        if parent not in self.dirs:
            raise _CommandError(1, f"{parent}: No such file or directory")

    def write(self, path: str, data: bytes, *, append: bool = False) -> None:
        """Writes a file (its directory must exist)."""
        p = self._abs(path)
        if p in self.dirs:
            raise _CommandError(1, f"{p}: Is a directory")
        self._ensure_parent(p)
        self.files[p] = (self.files.get(p, b"") if append else b"") + data

    def read(self, path: str) -> bytes:
        """Reads a file; ``FileNotFoundError`` when absent."""
        p = self._abs(path)
        if p not in self.files:
            raise FileNotFoundError(p)
        return self.files[p]

    def _mkdirs(self, p: str) -> None:
        while p not in self.dirs:
            self.dirs.add(p)
            p = posixpath.dirname(p)

    # ---------------------------------------------------------------- commands
    def _cmd(self, argv: list[str], stdin: str) -> str:
        name, args = argv[0], argv[1:]
        if name in EDITORS:
            self._open_editor(name, args)
            return ""
        fn = getattr(self, f"_c_{name.replace('-', '_')}", None)
        if fn is None:
            raise _CommandError(127, f"{name}: command not found")
        return str(fn(args))

    def _c_true(self, a: list[str]) -> str:
        return ""

    def _c_false(self, a: list[str]) -> str:
        raise _CommandError(1, "")

    def _c_pwd(self, a: list[str]) -> str:
        return HOME + "\n"

    def _c_echo(self, a: list[str]) -> str:
        if a and a[0] == "-n":
            return " ".join(a[1:])
        return " ".join(a) + "\n"

    def _c_printf(self, a: list[str]) -> str:
        if not a:
            raise _CommandError(2, "printf: usage: printf format [arguments]")
        fmt = a[0].replace("\\n", "\n").replace("\\t", "\t")
        args, n = a[1:], a[0].count("%s")
        if n == 0:
            return fmt
        out, i = [], 0
        while True:
            vals = args[i : i + n]
            i += n
            chunk = fmt
            for v in vals + [""] * (n - len(vals)):
                chunk = chunk.replace("%s", v, 1)
            out.append(chunk)
            if i >= len(args):
                return "".join(out)

    def _c_cat(self, a: list[str]) -> str:
        out = []
        for f in a:
            try:
                out.append(self.read(f).decode(errors="replace"))
            except FileNotFoundError:
                raise _CommandError(1, f"cat: {f}: No such file or directory") from None
        return "".join(out)

    def _c_mkdir(self, a: list[str]) -> str:
        parents = "-p" in a
        for d in (x for x in a if not x.startswith("-")):
            p = self._abs(d)
            if p in self.dirs:
                if parents:
                    continue
                raise _CommandError(1, f"mkdir: cannot create directory '{d}': File exists")
            if not parents:
                self._ensure_parent(p)
            self._mkdirs(p)
        return ""

    def _c_touch(self, a: list[str]) -> str:
        for f in a:
            p = self._abs(f)
            if p not in self.files and p not in self.dirs:
                self.write(p, b"")
        return ""

    def _c_rm(self, a: list[str]) -> str:
        flags = "".join(x[1:] for x in a if x.startswith("-"))
        for f in (x for x in a if not x.startswith("-")):
            p = self._abs(f)
            if p in self.files:
                del self.files[p]
            elif p in self.dirs and "r" in flags:
                self.dirs = {d for d in self.dirs if d != p and not d.startswith(p + "/")}
                self.files = {k: v for k, v in self.files.items() if not k.startswith(p + "/")}
            elif "f" not in flags:
                raise _CommandError(1, f"rm: cannot remove '{f}': No such file or directory")
        return ""

    def _target(self, src: str, dst: str) -> str:
        d = self._abs(dst)
        return posixpath.join(d, posixpath.basename(self._abs(src))) if d in self.dirs else d

    def _c_cp(self, a: list[str]) -> str:
        src, dst = [x for x in a if not x.startswith("-")][-2:]
        self.write(self._target(src, dst), self.read(src))
        return ""

    def _c_mv(self, a: list[str]) -> str:
        src, dst = [x for x in a if not x.startswith("-")][-2:]
        s = self._abs(src)
        if s in self.dirs:
            t = self._target(src, dst)
            self._ensure_parent(t)
            moved = {d for d in self.dirs if d == s or d.startswith(s + "/")}
            self.dirs = (self.dirs - moved) | {t + d[len(s) :] for d in moved}
            self.files = {
                (t + k[len(s) :] if k.startswith(s + "/") else k): v for k, v in self.files.items()
            }
            return ""
        data = self.read(src)
        self.write(self._target(src, dst), data)
        del self.files[s]
        return ""

    def _c_ls(self, a: list[str]) -> str:
        show_all = any(x.startswith("-") and "A" in x or x == "-a" for x in a)
        paths = [x for x in a if not x.startswith("-")] or [HOME]
        out = []
        for path in paths:
            p = self._abs(path)
            if p in self.files:
                out.append(path)
                continue
            if p not in self.dirs:
                raise _CommandError(2, f"ls: cannot access '{path}': No such file or directory")
            names = {
                posixpath.basename(x)
                for x in (*self.files, *self.dirs)
                if posixpath.dirname(x) == p and x != p
            }
            out += sorted(n for n in names if show_all or not n.startswith("."))
        return "".join(n + "\n" for n in out)

    def _c_test(self, a: list[str]) -> str:
        if len(a) != 2 or a[0] not in _UNARY:
            raise _CommandError(2, f"test: unsupported expression {a}")
        p = self._abs(a[1])
        ok = {
            "-f": p in self.files,
            "-d": p in self.dirs,
            "-e": p in self.files or p in self.dirs,
            "-s": bool(self.files.get(p)),
        }[a[0]]
        if not ok:
            raise _CommandError(1, "")
        return ""

    def _c_wc(self, a: list[str]) -> str:
        files = [x for x in a if not x.startswith("-")]
        if "-l" not in a or len(files) != 1:
            raise _CommandError(2, "wc: only 'wc -l FILE' is supported")
        count = self.read(files[0]).count(b"\n")
        return f"{count} {files[0]}\n"

    def _c_sort(self, a: list[str]) -> str:
        files = [x for x in a if not x.startswith("-")]
        lines = "".join(self.read(f).decode() for f in files).splitlines()
        lines.sort(reverse="-r" in a)
        return "".join(ln + "\n" for ln in lines)

    def _c_head(self, a: list[str]) -> str:
        n = int(a[a.index("-n") + 1]) if "-n" in a else 10
        files = [x for x in a if not x.startswith("-") and not x.lstrip("-").isdigit()]
        lines = self.read(files[0]).decode().splitlines(keepends=True)
        return "".join(lines[:n])

    def run(self, command: list[str] | str, shell: bool = False) -> dict[str, Any]:
        """Runs a command; returns ``{status, output, error, returncode}`` like ``/execute``."""
        self.log.append(f"execute {command!r}")
        try:
            if isinstance(command, str) or shell:
                text = command if isinstance(command, str) else " ".join(command)
                out = self._shell(text)
            else:
                out = self._cmd([str(c) for c in command], "")
        except _CommandError as e:
            return {"status": "error", "output": "", "error": str(e), "returncode": e.code}
        except (FileNotFoundError, ValueError, IndexError) as e:
            return {"status": "error", "output": "", "error": str(e), "returncode": 1}
        return {"status": "success", "output": out, "error": "", "returncode": 0}

    def _shell(self, text: str) -> str:
        lex = shlex.shlex(text, posix=True, punctuation_chars=";&|<>")
        lex.whitespace_split = True
        tokens = list(lex)
        out: list[str] = []
        cmd: list[str] = []
        skip = False

        def flush() -> None:
            nonlocal cmd
            if not cmd:
                return
            redirect = None
            for op in (">>", ">"):
                if op in cmd:
                    i = cmd.index(op)
                    redirect = (op, cmd[i + 1])
                    cmd = cmd[:i] + cmd[i + 2 :]
                    break
            res = self._cmd(cmd, "")
            if redirect is None:
                out.append(res)
            else:
                self.write(redirect[1], res.encode(), append=redirect[0] == ">>")
            cmd = []

        for t in tokens:
            if t in (";", "&&"):
                if not skip:
                    flush()
                cmd, skip = [], False
            elif t in ("|", "||", "<", "&"):
                raise _CommandError(2, f"memory shell: {t!r} is not supported")
            else:
                cmd.append(t)
        if not skip:
            flush()
        return "".join(out)

    # ---------------------------------------------------------------- editor and input
    def _open_editor(self, app: str, args: Sequence[str]) -> None:
        autosave = app == "memory-editor" or "--autosave" in args
        paths = [a for a in args if not a.startswith("-")]
        if not paths:
            raise _CommandError(2, f"{app}: needs a file")
        p = self._abs(paths[0])
        self._ensure_parent(p)
        text = self.files.get(p, b"").decode(errors="replace")
        self.doc = _Doc(path=p, buffer=text, autosave=autosave)
        if autosave:
            self.files[p] = text.encode()
        self.windows.append(f"{posixpath.basename(p)} - {app}")

    def _edit(self, text: str) -> None:
        if self.doc is None:
            self.terminal_text += text
            return
        if self.doc.selected_all:
            self.doc.buffer, self.doc.selected_all = text, False
        else:
            self.doc.buffer += text
        if self.doc.autosave:
            self._save()

    def _save(self) -> None:
        if self.doc is not None:
            self.write(self.doc.path, self.doc.buffer.encode())

    def _press(self, key: str) -> None:
        key = key.lower()
        if key in ("enter", "return"):
            self._edit("\n")
        elif key == "tab":
            self._edit("\t")
        elif key == "space":
            self._edit(" ")
        elif key in ("backspace", "delete", "del"):
            if self.doc is not None:
                self.doc.buffer = "" if self.doc.selected_all else self.doc.buffer[:-1]
                self.doc.selected_all = False
                if self.doc.autosave:
                    self._save()
        elif len(key) == 1:
            self._edit(key)

    def _hotkey(self, keys: Sequence[str]) -> None:
        combo = tuple(k.lower() for k in keys)
        if self.doc is None:
            return
        if combo == ("ctrl", "a"):
            self.doc.selected_all = True
        elif combo == ("ctrl", "s"):
            self._save()
        elif combo == ("ctrl", "end"):
            self.doc.selected_all = False

    def act(self, code: str) -> None:
        """Applies the effects of agent code (see the module docstring); never executes it."""
        try:
            tree = ast.parse(code)
        except SyntaxError as e:
            self.log.append(f"code not parsed: {e.msg}")
            return
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                self._call(node)

    def _call(self, node: ast.Call) -> None:
        name = ast.unparse(node.func)
        try:
            args = [ast.literal_eval(a) for a in node.args]
            kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
        except ValueError:
            self.log.append(f"call {name}: non-literal arguments, ignored")
            return
        self.log.append(f"call {name}{tuple(args)}")
        short = name.removeprefix("pyautogui.")
        if short in ("typewrite", "write") and args:
            text = args[0]
            if isinstance(text, list):
                for k in text:
                    self._press(str(k))
            else:
                self._edit(str(text))
        elif short == "press" and args:
            keys = args[0] if isinstance(args[0], list) else [args[0]]
            for _ in range(int(kwargs.get("presses", 1))):
                for k in keys:
                    self._press(str(k))
        elif short == "hotkey":
            self._hotkey([str(a) for a in args])
        elif name in ("subprocess.run", "subprocess.call", "subprocess.check_call", "os.system"):
            cmd = args[0] if args else kwargs.get("args", "")
            shell = name == "os.system" or bool(kwargs.get("shell", False))
            res = self.run(cmd, shell=shell)
            self.terminal_text += res["output"] + res["error"]
        elif name == "subprocess.Popen":
            cmd = args[0] if args else kwargs.get("args", "")
            self.run(cmd, shell=bool(kwargs.get("shell", False)))

    # ---------------------------------------------------------------- VMProtocol
    def png(self) -> bytes:
        """A small PNG whose colour is a hash of the visible state (changes when it changes)."""
        from PIL import Image

        state = repr((self.windows, self.doc.buffer if self.doc else None, self.terminal_text))
        h = hashlib.sha256(state.encode()).digest()
        img = Image.new("RGB", (self._shot, self._shot), (h[0], h[1], h[2]))
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        return buf.getvalue()

    def a11y(self) -> str:
        """The windows and the editor's text as a small XML tree."""
        from xml.sax.saxutils import escape, quoteattr

        parts = ['<desktop-frame name="Desktop">']
        for w in self.windows:
            parts.append(f"<frame name={quoteattr(w)}/>")
        if self.doc is not None:
            parts.append(f'<text name="document">{escape(self.doc.buffer)}</text>')
        parts.append("</desktop-frame>")
        return "".join(parts)

    async def screenshot(self) -> bytes:  # noqa: D102 - VMProtocol
        return self.png()

    async def execute(self, command: list[str] | str, *, shell: bool = False) -> dict[str, Any]:  # noqa: D102
        return self.run(command, shell=shell)

    async def accessibility(self) -> str:  # noqa: D102
        return self.a11y()

    async def file(self, path: str) -> bytes:  # noqa: D102
        return self.read(path)

    async def upload(self, path: str, data: bytes) -> None:  # noqa: D102
        p = self._abs(path)
        self._mkdirs(posixpath.dirname(p))
        self.files[p] = data

    async def launch(self, command: list[str] | str, shell: bool = False) -> None:  # noqa: D102
        argv = shlex.split(command) if isinstance(command, str) else [str(c) for c in command]
        self.log.append(f"launch {argv!r}")
        if argv and argv[0] in EDITORS:
            try:
                self._open_editor(argv[0], argv[1:])
            except _CommandError as e:
                raise SandboxStepError(f"launch {argv!r}: {e}") from e
        elif argv:
            self.windows.append(argv[0])

    async def open_file(self, path: str) -> None:  # noqa: D102
        p = self._abs(path)
        if p not in self.files:
            raise SandboxStepError(f"open_file: {p} does not exist")
        self._open_editor("mousepad", [p])

    async def activate_window(  # noqa: D102
        self, window_name: str, strict: bool = False, by_class: bool = False
    ) -> None:
        self.log.append(f"activate_window {window_name!r}")

    async def close_window(  # noqa: D102
        self, window_name: str, strict: bool = False, by_class: bool = False
    ) -> None:
        self.log.append(f"close_window {window_name!r}")
        self.windows = [w for w in self.windows if window_name not in w]

    async def screen_size(self) -> tuple[int, int]:  # noqa: D102
        return self.screen

    async def terminal(self) -> str:  # noqa: D102
        return self.terminal_text
