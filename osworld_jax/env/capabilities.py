"""What a sandbox backend can run here, and why not (no jax).

``capabilities(task, backend_name)`` answers ``Runnable()`` or ``NotRunnable(reasons)`` with every
reason found: live web or accounts, network commands, step / getter / metric types this package
does not implement (``unknown_types``), files missing from the local cache, programs missing on a
host backend, and the backend's own limits. ``report`` tabulates it per domain.

Run ``python -m osworld_jax.env report DIR [--backend local]`` for a per-domain table of how many
tasks a backend can run here and why the others cannot (``runnable DIR`` lists them).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import re
import shlex
import shutil
import sys
import urllib.parse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from osworld_jax import cliargs
from osworld_jax.env import cache
from osworld_jax.env.backends import BACKENDS
from osworld_jax.env.evaluators.registry import GETTERS, METRICS, option_checker
from osworld_jax.env.setup import SETUP_STEPS
from osworld_jax.env.tasks import Task, TaskFormatError, iter_task_files, load_task, load_tasks


@dataclasses.dataclass(frozen=True)
class Reason:
    """Why a task cannot run here.

    Attributes:
      kind: the category (``REMOTE_FILE``, ``METRIC``, ...; the report groups by it).
      detail: the specific file, metric, app or step.
    """

    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


REMOTE_FILE = "needs remote file not in local cache"
METRIC = "metric unsupported"
GETTER = "getter unsupported"
SETUP = "setup step unsupported"
LIVE_WEB = "needs proxy/live web"
GDRIVE = "needs Google Drive"
LOGIN = "needs an online login"
APP = "app not installed"
ROOT = "needs root (sudo)"
BACKEND = "backend cannot express it"


@dataclasses.dataclass(frozen=True)
class Runnable:
    """The task can run on the backend here (``reasons`` is always empty)."""

    reasons: tuple[Reason, ...] = ()

    def __bool__(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True)
class NotRunnable:
    """The task cannot run on the backend here.

    Attributes:
      reasons: every reason found (not only the first).
    """

    reasons: tuple[Reason, ...]

    def __bool__(self) -> bool:
        return False


# Step types that need the network or an account (known OSWorld types we cannot run offline).
_NETWORK_STEPS = {"googledrive": GDRIVE, "login": LOGIN}
# Getters that load a live web page (upstream navigates Chrome to a URL the task names).
_NETWORK_GETTERS = {
    "googledrive_file": GDRIVE,
    "info_from_website": LIVE_WEB,
    "page_info": LIVE_WEB,
    "pdf_from_url": LIVE_WEB,
    "gotoRecreationPage_and_get_html_content": LIVE_WEB,
}
_LOOPBACK = {"localhost", "127.0.0.1", "::1"}


def _web_urls(urls: Any) -> list[str]:
    """The URLs among ``urls`` that reach the internet (http(s) to a non-loopback host)."""
    out = []
    for u in urls if isinstance(urls, list) else []:
        parts = urllib.parse.urlsplit(str(u))
        if parts.scheme in ("http", "https") and parts.hostname not in _LOOPBACK:
            out.append(str(u))
    return out


# Documents that ``open`` hands to an office suite (the app must exist for the local backend).
_OFFICE_EXTS = {
    ".docx", ".doc", ".odt", ".xlsx", ".xls", ".ods", ".pptx", ".ppt", ".odp", ".rtf",
}  # fmt: skip
_OFFICE_BINS = ("soffice", "libreoffice")


_SHELL_SEPARATORS = {";", "&&", "||", "|", "&", "(", ")", "{", "}", "|&", ";;"}
_SHELL_KEYWORDS = {"if", "then", "else", "elif", "fi", "do", "done", "while", "until", "!", "time"}
_SHELL_BUILTINS = {
    "cd", "export", "echo", "source", ".", "set", "true", "false", "test", "[", "[[", "exit",
    "read", "printf", "pwd", "unset", "local", "return", "shift", "eval", "exec", "wait", "sleep",
}  # fmt: skip


def _is_assignment(word: str) -> bool:
    return "=" in word and not word.startswith(("/", ".")) and word.split("=", 1)[0].isidentifier()


def _programs(command: Any, shell: bool) -> list[str]:
    """The programs a launch/execute/command step runs, in order (empty when it cannot be told).

    A list without ``shell`` runs its first element. A shell command line runs the first word of
    each simple command (split at newlines, ``;``, ``&&``, ``||``, pipes; leading ``VAR=value``
    assignments and shell keywords skipped); shell builtins and programs given by a relative path
    (a file the task put there, e.g. ``./setup.sh``) are not programs to install.
    """
    if isinstance(command, list) and command:
        if not (shell and isinstance(command[0], str)):
            words = [str(command[0])]
            return [w for w in words if not _relative(w)]
        command = " ".join(map(str, command))
    if not isinstance(command, str):
        return []
    if not shell:
        try:
            first = next((w for w in shlex.split(command) if not _is_assignment(w)), None)
        except ValueError:
            return []
        return [first] if first and not _relative(first) else []
    lexer = shlex.shlex(command.replace("\n", " ; "), posix=True, punctuation_chars=";&|()")
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:
        return []
    out, expect = [], True
    for tok in tokens:
        if tok in _SHELL_SEPARATORS or tok.strip(";&|()") == "":
            expect = True
            continue
        if not expect:
            continue
        if tok in ("for", "case", "select"):  # for NAME in WORDS: no command until the separator
            expect = False
            continue
        if _is_assignment(tok) or tok in _SHELL_KEYWORDS:
            continue
        expect = False
        if tok.startswith("$") or tok in _SHELL_BUILTINS or _relative(tok):
            continue
        out.append(tok)
    return list(dict.fromkeys(out))


def _relative(prog: str) -> bool:
    """A program named by a relative path (``./setup.sh``, ``bin/tool``): a file of the task."""
    return "/" in prog and not prog.startswith("/")


def _files_needed(task: Task) -> list[str]:
    return cache.remote_files(task)


# Commands that reach the network (package managers, downloads): not runnable offline.
_NETWORK_CMD = re.compile(
    r"\b(apt(-get)?\s+(-\S+\s+)*(install|update)|pip3?\s+install|wget|curl|git\s+clone)\b"
    r"|https?://"
)
_URL = re.compile(r"https?://\S+")
_SUDO = re.compile(r"(^|[\s;&|])sudo\s")


def _command_texts(task: Task) -> list[str]:
    """Every command a setup/postconfig step or a command getter runs, as one string each."""
    cmds: list[Any] = []
    for s in (*task.config, *task.evaluator.postconfig):
        if s.type in ("launch", "execute", "command"):
            cmds.append(s.parameters.get("command"))
    for g in (*task.evaluator.result, *task.evaluator.expected):
        if g is not None and g.type in ("vm_command_line", "vm_command_error"):
            cmds.append(g.params.get("command"))
    return [c if isinstance(c, str) else " ".join(map(str, c or [])) for c in cmds]


def apps_needed(task: Task) -> list[str]:
    """The programs a task's steps and getters run (``a|b``: either one), in order."""
    apps: list[str] = []
    for s in (*task.config, *task.evaluator.postconfig):
        p = s.parameters
        if s.type in ("launch", "execute", "command"):
            shell = bool(p.get("shell", False)) or p.get("shell") == "true"
            apps.extend(_programs(p.get("command"), shell))
        elif s.type == "open":
            path = str(p.get("path", ""))
            if Path(path).suffix.lower() in _OFFICE_EXTS:
                apps.append("|".join(_OFFICE_BINS))
    for g in (*task.evaluator.result, *task.evaluator.expected):
        if g is not None and g.type in GETTERS:
            # programs a getter runs inside the desktop (e.g. gsettings for vm_wallpaper)
            apps.extend(getattr(GETTERS.get(g.type), "needs_apps", ()))
    return list(dict.fromkeys(apps))


def app_available(app: str, has_app: Callable[[str], bool] | None = None) -> bool:
    """Whether one of the ``|``-separated programs ``app`` is there (``has_app``, else PATH)."""
    check = has_app if has_app is not None else (lambda a: shutil.which(a) is not None)
    return any(check(a) for a in app.split("|"))


def unknown_types(task: Task) -> tuple[str, ...]:
    """The task's setup step, getter and metric types this package does not implement.

    Returns:
      ``"setup:X"``, ``"getter:X"`` and ``"metric:X"`` entries in order of first appearance
      (recorded, not a crash: ``capabilities`` reports them).
    """
    ev = task.evaluator
    out: list[str] = []
    for s in (*task.config, *ev.postconfig):
        if s.type not in SETUP_STEPS:
            out.append(f"setup:{s.type}")
    for g in (*ev.result, *ev.expected):
        if g is not None and g.type not in GETTERS:
            out.append(f"getter:{g.type}")
    for f in ev.func:
        if f not in METRICS:
            out.append(f"metric:{f}")
    return tuple(dict.fromkeys(out))


def capabilities(
    task: Task,
    backend_name: str,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    assume_cached: bool = False,
    backend_config: object | None = None,
) -> Runnable | NotRunnable:
    """Whether ``backend_name`` can run ``task`` here, and if not every reason why.

    Checks: proxy/live-web and account steps; commands that use the network (package installs,
    downloads) and, for host backends, ``sudo``; setup steps, getters and metrics this package does
    not implement; remote files (``download`` steps, ``cloud_file`` getters) absent from the local
    file cache (see ``osworld_jax.env.cache``); for host backends (``runs_on_host``: ``local``) the
    programs that launch/execute steps run and the office suite that ``open`` needs (the backend
    class's ``has_app(name) -> bool`` if it defines one, e.g. to search the jail's PATH, else
    ``shutil.which``); and backend-specific limits (a backend class may define
    ``capability_reasons(task) -> list[str]``); with ``backend_config``, both hooks get it as
    ``config=`` (e.g. the local backend then looks in its ``system_root``).

    Args:
      task: the task.
      backend_name: a ``BACKENDS`` name (``"local"``, ``"memory"``, ...).
      cache_dir: the local file cache (default: ``cache.default_cache_dir()``).
      assume_cached: answer as if every remote file were in the cache (what a user who ran
        ``python -m osworld_jax.env.cache fetch`` could run).
      backend_config: the backend's config (None: its defaults).

    Returns:
      ``Runnable()`` or ``NotRunnable(reasons)``.
    """
    backend_cls = BACKENDS.get(backend_name) if backend_name in BACKENDS else None
    host = backend_cls is not None and backend_cls.runs_on_host
    reasons: list[Reason] = []
    if task.proxy:
        reasons.append(Reason(LIVE_WEB, "task sets proxy=true"))
    web = _URL.search(task.instruction)
    if web and not task.evaluator.is_infeasible:
        reasons.append(Reason(LIVE_WEB, f"instruction names a web address ({web.group(0)[:60]})"))
    for s in (*task.config, *task.evaluator.postconfig):
        if s.type in _NETWORK_STEPS:
            reasons.append(Reason(_NETWORK_STEPS[s.type], f"setup step {s.type}"))
        elif s.type == "chrome_open_tabs" and _web_urls(s.parameters.get("urls_to_open")):
            reasons.append(Reason(LIVE_WEB, "setup step chrome_open_tabs opens web pages"))
    for g in (*task.evaluator.result, *task.evaluator.expected):
        if g is not None and g.type in _NETWORK_GETTERS:
            reasons.append(Reason(_NETWORK_GETTERS[g.type], f"getter {g.type}"))
    for u in unknown_types(task):
        kind, name = u.split(":", 1)
        if kind == "setup" and name in _NETWORK_STEPS:
            continue
        if kind == "getter" and name in _NETWORK_GETTERS:
            continue
        reasons.append(Reason({"setup": SETUP, "getter": GETTER, "metric": METRIC}[kind], name))
    for name, opts in zip(task.evaluator.func, task.evaluator.options, strict=True):
        check = option_checker(METRICS.get(name)) if name in METRICS else None
        if check is not None:
            reasons.extend(Reason(METRIC, d) for d in check(opts))
    for text in _command_texts(task):
        m = _NETWORK_CMD.search(text)
        if m:
            reasons.append(Reason(LIVE_WEB, f"command uses the network ({m.group(0).strip()})"))
        if host and _SUDO.search(text):
            reasons.append(Reason(ROOT, text[:80]))
    base_dir = task.path.parent if task.path is not None else None
    for url in _files_needed(task):
        if assume_cached and cache.is_remote(url):
            continue
        if cache.resolve(url, cache_dir, task.id, base_dir) is None:
            reasons.append(Reason(REMOTE_FILE, url))
    if host:
        has_app = getattr(backend_cls, "has_app", None)
        if has_app is not None and backend_config is not None:
            has_app = functools.partial(has_app, config=backend_config)
        for app in apps_needed(task):
            if not app_available(app, has_app):
                reasons.append(Reason(APP, app))
    hook = getattr(backend_cls, "capability_reasons", None)
    if hook is not None:
        found = hook(task) if backend_config is None else hook(task, config=backend_config)
        reasons.extend(Reason(BACKEND, r) for r in found)
    reasons = list(dict.fromkeys(reasons))
    return NotRunnable(tuple(reasons)) if reasons else Runnable()


def runnable_tasks(
    root: str | os.PathLike[str],
    backend_name: str,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    assume_cached: bool = False,
) -> list[Task]:
    """The tasks under ``root`` that ``backend_name`` can run here (``capabilities``)."""
    return [
        t
        for t in load_tasks(root)
        if capabilities(t, backend_name, cache_dir=cache_dir, assume_cached=assume_cached)
    ]


# --------------------------------------------------------------------------- report


@dataclasses.dataclass
class _DomainRow:
    total: int = 0
    runnable: int = 0
    infeasible: int = 0
    apps_only: int = 0
    kinds: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    details: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    missing_apps: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)

    def add(self, other: _DomainRow) -> None:
        self.total += other.total
        self.runnable += other.runnable
        self.infeasible += other.infeasible
        self.apps_only += other.apps_only
        self.kinds.update(other.kinds)
        self.details.update(other.details)
        self.missing_apps.update(other.missing_apps)


def report(
    root: str | os.PathLike[str],
    backend_name: str = "local",
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    assume_cached: bool = False,
    top: int = 3,
) -> str:
    """A per-domain table: total, runnable on ``backend_name`` here, top reasons.

    The ``infeas.`` column counts the runnable tasks that are ``infeasible`` (scored by answering
    FAIL); ``+apps`` counts the tasks whose only reason is "app not installed" (runnable once
    those programs are installed), and the lines after the table name the programs they wait
    for. With ``assume_cached`` every remote file counts as cached.
    Reason kinds are counted once per task; the detail column names the most common specific
    metric/app/step (remote file URLs are not listed one by one).
    """
    rows: dict[str, _DomainRow] = collections.defaultdict(_DomainRow)
    for p in iter_task_files(root):
        task = load_task(p)
        row = rows[task.domain]
        row.total += 1
        cap = capabilities(task, backend_name, cache_dir=cache_dir, assume_cached=assume_cached)
        if cap:
            row.runnable += 1
            row.infeasible += task.evaluator.is_infeasible
            continue
        assert isinstance(cap, NotRunnable)
        row.kinds.update({r.kind for r in cap.reasons})
        row.details.update({str(r) for r in cap.reasons if r.kind != REMOTE_FILE})
        if all(r.kind == APP for r in cap.reasons):
            row.apps_only += 1
            row.missing_apps.update({r.detail for r in cap.reasons})
    total = _DomainRow()
    for row in rows.values():
        total.add(row)
    cached = "  (remote files assumed cached)" if assume_cached else ""
    lines = [
        f"backend={backend_name}  tasks={total.total}  runnable={total.runnable} "
        f"(of which infeasible={total.infeasible})  +apps={total.apps_only}{cached}"
    ]
    head = (
        f"{'domain':<20} {'total':>5} {'runnable':>8} {'infeas.':>7} {'+apps':>5}"
        "  top reasons (tasks)"
    )
    lines += [head, "-" * len(head)]
    for name, row in [*sorted(rows.items()), ("ALL", total)]:
        reasons = "; ".join(f"{k} ({c})" for k, c in row.kinds.most_common(top))
        lines.append(
            f"{name:<20} {row.total:>5} {row.runnable:>8} {row.infeasible:>7} {row.apps_only:>5}"
            f"  {reasons}"
        )
    if total.kinds:  # every task runnable: no empty headings
        kinds = "; ".join(f"{k} {c}" for k, c in total.kinds.most_common())
        lines += ["", f"reason kinds (tasks): {kinds}"]
    if total.details:
        lines += ["", "most common specific reasons:"]
        lines += [f"  {c:>4}  {d}" for d, c in total.details.most_common(2 * top + 4)]
    if total.missing_apps:
        lines.append("")
        lines.append(f"programs the {total.apps_only} '+apps' tasks wait for (tasks):")
        for app, c in total.missing_apps.most_common():
            lines.append(f"  {c:>4}  {app}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: ``python -m osworld_jax.env {report,runnable} DIR [options]``.

    Options: ``--backend B``, ``--cache-dir C``, ``--assume-cached``. ``report`` prints the
    per-domain table; ``runnable`` prints ``domain/id`` of each task the backend can run here,
    one per line.
    """
    parser = cliargs.ArgumentParser(prog="python -m osworld_jax.env")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, text in (
        ("report", "per-domain runnable counts and reasons"),
        ("runnable", "list the tasks the backend can run here"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument(
            "dir",
            type=cliargs.existing_dir,
            help="a directory of task JSON files (<domain>/<id>.json)",
        )
        p.add_argument(
            "--backend", default="local", choices=BACKENDS.names(), help="default: local"
        )
        p.add_argument("--cache-dir", type=cliargs.dir_path, default=None, help="local file cache")
        p.add_argument(
            "--assume-cached",
            action="store_true",
            help="count every remote file as cached (what a full cache would allow)",
        )
    args = parser.parse_args(argv)
    try:
        if args.cmd == "runnable":
            for t in runnable_tasks(
                args.dir, args.backend, cache_dir=args.cache_dir, assume_cached=args.assume_cached
            ):
                print(f"{t.domain}/{t.id}")
            return 0
        print(
            report(
                args.dir, args.backend, cache_dir=args.cache_dir, assume_cached=args.assume_cached
            )
        )
    except TaskFormatError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
