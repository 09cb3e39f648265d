"""In-process test backends: a tiny simulated desktop ("memory") and a fault injector (no X).

``MemoryBackend`` (registered as ``"memory"``) implements the sandbox interface over
``MemoryDesktop``, an in-process ``VMProtocol``: a dict filesystem rooted at ``/home/user``, a
small POSIX command interpreter (``echo printf cat mkdir touch rm mv cp ls test wc sort head
true false pwd``, with ``&&``, ``;``, ``>`` and ``>>``), a text editor (``mousepad``/``gedit``,
and ``memory-editor`` which saves on every keystroke) and a command log. Agent code is not
executed: statements are read with ``ast`` and only literal-argument calls of ``pyautogui``
(``typewrite``/``write``/``press``/``hotkey``; pointer actions are logged) and of
``subprocess.run/call/check_call/Popen``/``os.system`` (run by the command interpreter) act. So
AgentEnv, the agent room and the RL loop run fast and deterministically, and tasks are scored
through the normal setup/getter/metric path.

``word_task(word)`` builds the learnable task family: "type WORD"; the reward is 1 iff the text
typed into the (auto-saving) editor equals ``word`` (``vm_command_line`` + ``exact_match``).

``FaultInjectingBackend(inner, fail_rate, seed)`` wraps any backend and fails that fraction of
create/fork/step/evaluate calls with typed errors (evaluate failures are transient, HTTP 503).
"""

from __future__ import annotations

import ast
import asyncio
import copy
import dataclasses
import hashlib
import io
import itertools
import json
import os
import posixpath
import random
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from osworld_jax.env.actions import Action, ActionKind, to_pyautogui
from osworld_jax.env.backend import (
    BACKENDS,
    Observation,
    Sandbox,
    SandboxBackend,
    SandboxCreateError,
    SandboxError,
    SandboxEvalError,
    SandboxStepError,
)
from osworld_jax.env.evaluators import evaluate_task
from osworld_jax.env.setup import SetupContext, run_setup
from osworld_jax.env.tasks import Task, load_task

HOME = "/home/user"
EDITORS = frozenset({"mousepad", "gedit", "memory-editor"})
_UNARY = {"-f", "-d", "-e", "-s"}


async def _no_sleep(seconds: float) -> None:
    await asyncio.sleep(0)


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


# ------------------------------------------------------------------------------- backend


class MemorySandbox(Sandbox):
    """One ``MemoryDesktop`` for one task."""

    def __init__(self, backend: MemoryBackend, sid: str, task: Task, desktop: MemoryDesktop):
        self.id = sid
        self.task = task
        self.desktop = desktop
        self._backend = backend

    async def observe(self) -> Observation:  # noqa: D102
        d = self.desktop
        return Observation(
            screenshot=d.png(),
            a11y_tree=d.a11y(),
            terminal=d.terminal_text,
            instruction=self.task.instruction,
        )

    async def step(self, action: Action) -> Observation:  # noqa: D102
        if self.id not in self._backend._live:
            raise SandboxStepError(f"sandbox {self.id} is closed")
        if action.kind == ActionKind.PYAUTOGUI:
            self.desktop.act(action.code)
        elif action.kind == ActionKind.COMPUTER_13:
            self.desktop.act(to_pyautogui(action))
        return await self.observe()

    async def evaluate(self, last_action: Action | None) -> float:  # noqa: D102
        return await evaluate_task(
            self.task,
            self.desktop,
            last_action,
            cache_dir=self._backend.cache_dir,
            attempts=1,
            sleep=_no_sleep,
        )

    async def close(self) -> None:  # noqa: D102
        self._backend._live.pop(self.id, None)


@BACKENDS.register("memory")
class MemoryBackend(SandboxBackend):
    """Sandboxes on ``MemoryDesktop`` (see the module docstring); fork = a deep copy.

    Attributes:
      cache_dir: the local file cache for ``download`` steps.
      screenshot_px: the side of the (square) screenshot PNG.
    """

    name = "memory"

    def __init__(self, *, cache_dir: str | None = None, screenshot_px: int = 32) -> None:
        self.cache_dir = cache_dir
        self.screenshot_px = screenshot_px
        self._live: dict[str, MemorySandbox] = {}
        self._ids = itertools.count()

    @classmethod
    def capability_reasons(cls, task: Task) -> list[str]:
        """What this tiny desktop cannot express for ``task`` (programs it does not have)."""
        reasons = []
        probe = MemoryDesktop()
        commands: list[Any] = []
        for s in (*task.config, *task.evaluator.postconfig):
            if s.type in ("launch", "execute", "command"):
                commands.append(s.parameters.get("command"))
        for g in (*task.evaluator.result, *task.evaluator.expected):
            if g is not None and g.type in ("vm_command_line", "vm_command_error"):
                commands.append(g.params.get("command"))
        for c in commands:
            text = c if isinstance(c, str) else " ".join(shlex.quote(str(x)) for x in c or [])
            for part in text.replace("&&", ";").split(";"):
                words = shlex.split(part) if part.strip() else []
                if (
                    words
                    and words[0] not in EDITORS
                    and not hasattr(probe, f"_c_{words[0].replace('-', '_')}")
                ):
                    reasons.append(f"memory desktop has no program {words[0]!r}")
        return list(dict.fromkeys(reasons))

    def preflight(self) -> None:  # noqa: D102 - nothing external
        return None

    def _new(self, task: Task, desktop: MemoryDesktop) -> MemorySandbox:
        sid = f"memory-{next(self._ids)}"
        sb = MemorySandbox(self, sid, task, desktop)
        self._live[sid] = sb
        return sb

    async def create(self, task: Task) -> Sandbox:  # noqa: D102
        desktop = MemoryDesktop(shot=self.screenshot_px)
        ctx = SetupContext(
            cache_dir=self.cache_dir,
            task_id=task.id,
            base_dir=task.path.parent if task.path is not None else None,
            sleep=_no_sleep,
        )
        try:
            await run_setup(task.config, desktop, ctx=ctx)
        except SandboxError:
            raise
        except Exception as e:  # noqa: BLE001 - a setup failure is a create failure
            raise SandboxCreateError(f"memory create({task.id}): {type(e).__name__}: {e}") from e
        return self._new(task, desktop)

    async def fork(self, sandbox: Sandbox, n: int) -> list[Sandbox]:  # noqa: D102
        if not isinstance(sandbox, MemorySandbox) or sandbox.id not in self._live:
            raise SandboxCreateError(f"fork: {sandbox.id} is not a live memory sandbox")
        return [self._new(sandbox.task, copy.deepcopy(sandbox.desktop)) for _ in range(n)]

    def inventory(self) -> list[str]:  # noqa: D102
        return sorted(self._live)


# ------------------------------------------------------------------------------- tasks


def word_task_dict(word: str, *, task_id: str | None = None) -> dict[str, Any]:
    """The OSWorld JSON object of ``word_task(word)`` (see there)."""
    path = f"{HOME}/answer.txt"
    return {
        "id": task_id or f"memory-word-{word}",
        "snapshot": "memory",
        "instruction": f"Type the word {word} into the open editor.",
        "source": "osworld_jax.env.testing.word_task",
        "config": [{"type": "launch", "parameters": {"command": ["memory-editor", path]}}],
        "evaluator": {
            "func": "exact_match",
            "result": {"type": "vm_command_line", "command": ["cat", path]},
            "expected": {"type": "rule", "rules": {"expected": word}},
        },
        "related_apps": ["memory-editor"],
        "proxy": False,
        "fixed_ip": False,
        "possibility_of_env_change": "low",
    }


def write_word_tasks(root: str | os.PathLike[str], words: Sequence[str]) -> Path:
    """Writes ``word_task`` JSON files to ``root/memory_word/<id>.json`` (a task directory for
    the data pipeline); returns ``root``.
    """  # noqa: D205
    out = Path(root) / "memory_word"
    out.mkdir(parents=True, exist_ok=True)
    for w in words:
        d = word_task_dict(w)
        (out / f"{d['id']}.json").write_text(json.dumps(d, indent=2) + "\n")
    return Path(root)


def word_task(word: str, *, task_id: str | None = None) -> Task:
    """The learnable family: "type WORD"; reward 1 iff the editor's text equals ``word``.

    Solved in one turn by ``pyautogui.typewrite('WORD')`` — or, on this desktop, the bare
    ``typewrite('WORD')``/``write('WORD')``, or computer_13 ``TYPING`` — and scored by
    ``vm_command_line`` (``cat`` of the auto-saved file) + ``exact_match``.
    """
    return load_task(word_task_dict(word, task_id=task_id))


# ------------------------------------------------------------------------------- faults


class InjectedFault(SandboxError):
    """Raised by ``FaultInjectingBackend``; ``status`` is 503 for injected transient faults."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class InjectedCreateFault(InjectedFault, SandboxCreateError):
    """An injected create/fork failure."""


class InjectedStepFault(InjectedFault, SandboxStepError):
    """An injected step failure."""


class InjectedEvalFault(InjectedFault, SandboxEvalError):
    """An injected (transient, HTTP 503) evaluation failure."""


class _FaultySandbox(Sandbox):
    def __init__(self, inner: Sandbox, owner: FaultInjectingBackend) -> None:
        self.inner = inner
        self.id = inner.id
        self._owner = owner

    async def observe(self) -> Observation:
        return await self.inner.observe()

    async def step(self, action: Action) -> Observation:
        self._owner._maybe("step", InjectedStepFault)
        return await self.inner.step(action)

    async def evaluate(self, last_action: Action | None) -> float:
        self._owner._maybe("evaluate", InjectedEvalFault, status=503)
        return await self.inner.evaluate(last_action)

    async def close(self) -> None:
        await self.inner.close()


class FaultInjectingBackend(SandboxBackend):
    """Wraps a backend; fails ``fail_rate`` of create/fork/step/evaluate calls with typed errors.

    Attributes:
      inner: the wrapped backend (its inventory is this backend's inventory).
      fail_rate: the probability that a call fails.
      injected: how many faults were injected per operation.
    """

    name = "fault-injecting"

    def __init__(
        self,
        inner: SandboxBackend,
        fail_rate: float,
        seed: int = 0,
        *,
        ops: Sequence[str] = ("create", "fork", "step", "evaluate"),
    ) -> None:
        if not 0.0 <= fail_rate <= 1.0:
            raise ValueError(f"fail_rate must be in [0, 1], got {fail_rate}")
        self.inner = inner
        self.fail_rate = fail_rate
        self.ops = frozenset(ops)
        self.injected: dict[str, int] = {op: 0 for op in self.ops}
        self._rng = random.Random(seed)

    def _maybe(self, op: str, exc: type[InjectedFault], status: int | None = None) -> None:
        if op in self.ops and self._rng.random() < self.fail_rate:
            self.injected[op] += 1
            raise exc(f"injected {op} fault", status=status)

    def preflight(self) -> None:  # noqa: D102
        self.inner.preflight()

    async def create(self, task: Task) -> Sandbox:  # noqa: D102
        self._maybe("create", InjectedCreateFault)
        return _FaultySandbox(await self.inner.create(task), self)

    async def fork(self, sandbox: Sandbox, n: int) -> list[Sandbox]:  # noqa: D102
        self._maybe("fork", InjectedCreateFault)
        inner = sandbox.inner if isinstance(sandbox, _FaultySandbox) else sandbox
        return [_FaultySandbox(s, self) for s in await self.inner.fork(inner, n)]

    def inventory(self) -> list[str]:  # noqa: D102
        return self.inner.inventory()

    async def aclose(self) -> None:  # noqa: D102
        await self.inner.aclose()
