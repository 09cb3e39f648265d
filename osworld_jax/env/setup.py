"""Setup and postconfig steps of OSWorld tasks, run through the in-VM protocol (no jax).

Each step type maps to an async handler in ``SETUP_STEPS``. Semantics follow OSWorld's
``desktop_env/controllers/setup.py``: ``download`` places files (here: from the local file cache,
never the network), ``launch`` starts a program without waiting, ``execute``/``command`` run one
and wait (``until`` retries until the output matches), ``open`` opens a file with its default
application, ``sleep`` waits, ``activate_window``/``close_window`` act on windows by title/class.
Upstream's placeholders (``{CLIENT_PASSWORD}``, ``{SCREEN_WIDTH_HALF}``, ...) are filled in first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging
import os
import re
import shutil
import sqlite3
import tempfile
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from osworld_jax.env import cache
from osworld_jax.env.backend import SandboxCreateError, SandboxStepError
from osworld_jax.env.desktop_python import run_python
from osworld_jax.env.protocol import VMProtocol, is_transient
from osworld_jax.env.urls import compare_urls
from osworld_jax.registry import Registry

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SetupContext:
    """What a step handler may use besides the VM.

    Attributes:
      cache_dir: the local file cache (see ``osworld_jax.env.cache``); None = the default.
      task_id: the task's id (the cache's ``<task id>/<basename>`` key).
      base_dir: the task file's directory (relative URLs of bundled tasks resolve against it).
      sleep: the coroutine used for ``sleep`` steps (tests pass a fast one).
      work_dir: where ``execute`` steps with ``stdout``/``stderr`` file names save the command's
        output (upstream's per-task cache dir; the ``cache_file`` getter reads it back); None
        means such steps fail.
      client_password: the value of the ``{CLIENT_PASSWORD}`` placeholder (upstream's default
        VM password is ``"password"``).
    """

    cache_dir: str | os.PathLike[str] | None = None
    task_id: str | None = None
    base_dir: str | os.PathLike[str] | None = None
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    work_dir: str | os.PathLike[str] | None = None
    client_password: str = "password"


StepHandler = Callable[[VMProtocol, Mapping[str, Any], SetupContext], Awaitable[None]]
SETUP_STEPS: Registry[StepHandler] = Registry("setup step type")

# How many times ``execute`` re-runs a command whose output does not yet match ``until``.
_UNTIL_ATTEMPTS = 5
_UNTIL_DELAY_S = 0.3


class SetupStepError(SandboxCreateError):
    """A setup or postconfig step failed; the message names the step and why."""


def _require(params: Mapping[str, Any], key: str, step: str) -> Any:
    if key not in params:
        raise SetupStepError(f"setup step {step!r}: missing parameter {key!r}")
    return params[key]


@SETUP_STEPS.register("download")
async def _download(vm: VMProtocol, params: Mapping[str, Any], ctx: SetupContext) -> None:
    files = _require(params, "files", "download")
    for f in files:
        url, path = f.get("url"), f.get("path")
        if not url or not path:
            raise SetupStepError(f"setup step 'download': each file needs url and path, got {f}")
        local = cache.resolve(url, ctx.cache_dir, ctx.task_id, ctx.base_dir)
        if local is None:
            raise SetupStepError(
                f"setup step 'download': {url} is not in the local file cache "
                f"({ctx.cache_dir or cache.default_cache_dir()})"
            )
        await vm.upload(path, Path(local).read_bytes())


@SETUP_STEPS.register("launch")
async def _launch(vm: VMProtocol, params: Mapping[str, Any], ctx: SetupContext) -> None:
    """Starts ``command`` without waiting (upstream ``SetupController._launch_setup``).

    A string command with ``shell`` false and more than one word is split on whitespace, as
    upstream's controller does before sending it (``command.split()``: quotes are not shell
    syntax there, so ``gedit '/home/user/My File.txt'`` launches ``gedit`` with the two
    arguments ``'/home/user/My`` and ``File.txt'``); a one-word string goes as it is.
    """
    command, shell = _require(params, "command", "launch"), bool(params.get("shell", False))
    if isinstance(command, str) and not shell and len(command.split()) > 1:
        command = command.split()
    await vm.launch(command, shell=shell)


def _until_met(result: Mapping[str, Any], until: Mapping[str, Any]) -> bool:
    """Upstream's ``until``: met when ANY listed condition holds (returncode equal, or the
    ``stdout`` / ``stderr`` string contained in the command's output / error).
    """  # noqa: D205
    return (
        ("returncode" in until and result.get("returncode") == until["returncode"])
        or ("stdout" in until and str(until["stdout"]) in str(result.get("output") or ""))
        or ("stderr" in until and str(until["stderr"]) in str(result.get("error") or ""))
    )


def work_file_problem(name: Any) -> str | None:
    """Why ``name`` is not one file name inside a work dir (upstream joins it onto its cache
    dir: ``os.path.join(cache_dir, stdout)``), or None: a ``/``, ``.``, ``..``, an empty
    name or a NUL would reach outside it (or nowhere)."""  # noqa: D205, D209
    text = str(name)
    if not isinstance(name, str) or text in ("", ".", "..") or "/" in text or "\0" in text:
        return f"{text!r} must be one file name in the task's work dir (no '/', not '.' or '..')"
    return None


def _save_outputs(params: Mapping[str, Any], result: Mapping[str, Any], ctx: SetupContext) -> None:
    for key, field in (("stdout", "output"), ("stderr", "error")):
        name = params.get(key)
        if not name:
            continue
        problem = work_file_problem(name)
        if problem is not None:
            raise SetupStepError(f"task {ctx.task_id}: setup step 'execute': {key} = {problem}")
        if ctx.work_dir is None:
            raise SetupStepError(f"setup step 'execute': {key}={name!r} needs a work dir")
        # O_NOFOLLOW: a link in the work dir is never written through
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
        with open(os.open(Path(ctx.work_dir) / name, flags, 0o644), "w") as f:
            f.write(str(result.get(field) or ""))


@SETUP_STEPS.register("execute")
@SETUP_STEPS.register("command")
async def _execute(vm: VMProtocol, params: Mapping[str, Any], ctx: SetupContext) -> None:
    command = _require(params, "command", "execute")
    for key in ("stdout", "stderr"):  # before the command runs: a bad name runs nothing
        problem = work_file_problem(params[key]) if params.get(key) else None
        if problem is not None:
            raise SetupStepError(f"task {ctx.task_id}: setup step 'execute': {key} = {problem}")
    shell = bool(params.get("shell", False)) or params.get("shell") == "true"
    until = params.get("until") or {}
    for attempt in range(_UNTIL_ATTEMPTS if until else 1):
        result = await vm.execute(command, shell=shell)
        if not until or _until_met(result, until):
            _save_outputs(params, result, ctx)
            return
        if attempt + 1 < _UNTIL_ATTEMPTS:
            await ctx.sleep(_UNTIL_DELAY_S)
    raise SetupStepError(f"setup step 'execute': {command!r} never met until={dict(until)}")


@SETUP_STEPS.register("open")
async def _open(vm: VMProtocol, params: Mapping[str, Any], ctx: SetupContext) -> None:
    await vm.open_file(_require(params, "path", "open"))


@SETUP_STEPS.register("sleep")
async def _sleep(vm: VMProtocol, params: Mapping[str, Any], ctx: SetupContext) -> None:
    await ctx.sleep(float(_require(params, "seconds", "sleep")))


async def _window_step(
    vm: VMProtocol, params: Mapping[str, Any], step: str, activate: bool
) -> None:
    """``activate_window`` / ``close_window``: a window that is not there is logged, not fatal.

    Upstream logs any non-200 reply of these routes (e.g. 404 "window not found") and goes on;
    only a transient failure (5xx after the caller's retries, a dropped connection) raises.
    """
    name = _require(params, "window_name", step)
    if not name:
        raise SetupStepError(f"setup step {step!r}: empty window_name")
    fn = vm.activate_window if activate else vm.close_window
    try:
        await fn(
            name,
            strict=bool(params.get("strict", False)),
            by_class=bool(params.get("by_class", False)),
        )
    except SandboxStepError as e:
        if is_transient(e) or not isinstance(getattr(e, "status", None), int):
            raise
        log.warning("setup step %s %r: %s (ignored, as upstream)", step, name, e)


@SETUP_STEPS.register("activate_window")
async def _activate(vm: VMProtocol, params: Mapping[str, Any], ctx: SetupContext) -> None:
    await _window_step(vm, params, "activate_window", True)


@SETUP_STEPS.register("close_window")
async def _close(vm: VMProtocol, params: Mapping[str, Any], ctx: SetupContext) -> None:
    await _window_step(vm, params, "close_window", False)


@SETUP_STEPS.register("upload_file")
async def _upload_file(vm: VMProtocol, params: Mapping[str, Any], ctx: SetupContext) -> None:
    # Upstream: ``files: [{local_path, path}]``; the local path resolves like a download URL
    # (an absolute path, ``file://``, or relative to the task file's directory).
    for f in _require(params, "files", "upload_file"):
        src, dest = f.get("local_path"), f.get("path")
        if not src or not dest:
            raise SetupStepError(
                f"setup step 'upload_file': each file needs local_path and path, got {f}"
            )
        local = cache.resolve(src, ctx.cache_dir, ctx.task_id, ctx.base_dir)
        if local is None:
            raise SetupStepError(f"setup step 'upload_file': {src} not found")
        await vm.upload(dest, Path(local).read_bytes())


# ---------------------------------------------------------------- Chrome (DevTools in the desktop)

# Chrome's DevTools inside the desktop: the tasks start it on 1337 and forward 9222 to it.
DEVTOOLS_PORTS = ("9222", "1337")

_DEVTOOLS = """
import json, sys, time, urllib.parse, urllib.request
cmd, ports, wait, args = sys.argv[1], sys.argv[2].split(","), float(sys.argv[3]), sys.argv[4:]
def call(port, path, method="GET"):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    with urllib.request.urlopen(req, timeout=30) as r:
        body = r.read()
    try:
        return json.loads(body)
    except ValueError:
        return body.decode()
port = None
end = time.monotonic() + wait
while port is None:
    for p in ports:
        try:
            pages = [t for t in call(p, "/json/list") if t.get("type") == "page"]
            port = p
            break
        except Exception:
            continue
    if port is None:
        if time.monotonic() > end:
            break
        time.sleep(0.5)
if port is None:
    print(json.dumps({"error": "no DevTools endpoint on ports " + ",".join(ports)}))
    sys.exit(0)
if cmd == "list":
    print(json.dumps([{"id": t["id"], "url": t.get("url", "")} for t in pages]))
elif cmd == "open":
    for i, url in enumerate(args):
        call(port, "/json/new?" + urllib.parse.quote(url, safe=":/?&=%#+@,;~"), "PUT")
        if i == 0 and pages:
            call(port, "/json/close/" + pages[0]["id"])  # the tab Chrome started with
    print(json.dumps({"opened": len(args)}))
elif cmd == "close":
    for tid in args:
        call(port, "/json/close/" + tid)
    print(json.dumps({"closed": len(args)}))
"""


# How long the steps wait for Chrome's DevTools endpoint: a step right after ``launch`` finds
# Chrome still starting (upstream retries its connection 15 times, 5 s apart).
DEVTOOLS_WAIT_S = 75.0


async def _devtools(vm: VMProtocol, cmd: str, *args: str) -> Any:
    out = await run_python(
        vm,
        _DEVTOOLS,
        cmd,
        ",".join(DEVTOOLS_PORTS),
        f"{DEVTOOLS_WAIT_S:g}",
        *args,
        error=SetupStepError,
    )
    if isinstance(out, dict) and "error" in out:
        raise SetupStepError(f"setup step chrome: {out['error']}")
    return out


@SETUP_STEPS.register("chrome_open_tabs")
async def _chrome_open_tabs(vm: VMProtocol, params: Mapping[str, Any], ctx: SetupContext) -> None:
    # Upstream opens each URL in a new tab and, after the first, closes the tab Chrome opened
    # with; it does not wait for the pages to finish loading beyond its own goto timeout.
    urls = [str(u) for u in _require(params, "urls_to_open", "chrome_open_tabs")]
    await _devtools(vm, "open", *urls)


@SETUP_STEPS.register("chrome_close_tabs")
async def _chrome_close_tabs(vm: VMProtocol, params: Mapping[str, Any], ctx: SetupContext) -> None:
    # Upstream closes, for each URL, the first open tab whose URL compare_urls-equals it.
    tabs = list(await _devtools(vm, "list"))
    close: list[str] = []
    for url in _require(params, "urls_to_close", "chrome_close_tabs"):
        for t in tabs:
            if compare_urls(t["url"], str(url)):
                close.append(t["id"])
                tabs.remove(t)
                break
    if close:
        await _devtools(vm, "close", *close)


# Chrome's timestamps count microseconds from 1601-01-01.
_CHROME_EPOCH = dt.datetime(1601, 1, 1)


@SETUP_STEPS.register("update_browse_history")
async def _update_browse_history(
    vm: VMProtocol, params: Mapping[str, Any], ctx: SetupContext
) -> None:
    # Upstream: copy an empty Chrome History database (a file of the remote cache), add each
    # entry with its visit time "visit_time_from_now_in_seconds" ago, upload it as the profile's
    # History.
    local = cache.resolve(cache.HISTORY_EMPTY_URL, ctx.cache_dir, ctx.task_id, ctx.base_dir)
    if local is None:
        raise SetupStepError(
            f"setup step 'update_browse_history': {cache.HISTORY_EMPTY_URL} is not in the local "
            f"file cache ({ctx.cache_dir or cache.default_cache_dir()})"
        )
    with tempfile.TemporaryDirectory(prefix="osworld-history-") as tmp:
        db = Path(tmp) / "History"
        shutil.copyfile(local, db)
        con = sqlite3.connect(db)
        try:
            for item in _require(params, "history", "update_browse_history"):
                when = dt.datetime.now() - dt.timedelta(
                    seconds=item["visit_time_from_now_in_seconds"]
                )
                stamp = int((when - _CHROME_EPOCH).total_seconds() * 1_000_000)
                cur = con.execute(
                    "INSERT INTO urls (url, title, visit_count, typed_count, last_visit_time, "
                    "hidden) VALUES (?, ?, 1, 0, ?, 0)",
                    (item["url"], item["title"], stamp),
                )
                con.execute(
                    "INSERT INTO visits (url, visit_time, from_visit, transition, segment_id, "
                    "visit_duration) VALUES (?, ?, 0, 805306368, 0, 0)",
                    (cur.lastrowid, stamp),
                )
            con.commit()
        finally:
            con.close()
        await vm.upload("~/.config/google-chrome/Default/History", db.read_bytes())


_PLACEHOLDER = re.compile(
    r"\{(CLIENT_PASSWORD|SCREEN_WIDTH|SCREEN_HEIGHT|SCREEN_WIDTH_HALF|SCREEN_HEIGHT_HALF)\}"
)


def _has_placeholder(value: Any) -> bool:
    if isinstance(value, str):
        return _PLACEHOLDER.search(value) is not None
    if isinstance(value, Mapping):
        return any(_has_placeholder(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_has_placeholder(v) for v in value)
    return False


def _substitute(value: Any, table: Mapping[str, str]) -> Any:
    if isinstance(value, str):
        return _PLACEHOLDER.sub(lambda m: table[m.group(1)], value)
    if isinstance(value, Mapping):
        return {k: _substitute(v, table) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_substitute(v, table) for v in value]
    return value


async def fill_placeholders(
    params: Mapping[str, Any], vm: VMProtocol, client_password: str = "password"
) -> Mapping[str, Any]:
    """Fills upstream's placeholders in step or getter parameters.

    ``{CLIENT_PASSWORD}``, ``{SCREEN_WIDTH}``, ``{SCREEN_HEIGHT}`` and their ``_HALF`` variants;
    the screen size comes from the desktop.
    """
    if not _has_placeholder(params):
        return params
    w, h = await vm.screen_size()
    table = {
        "CLIENT_PASSWORD": client_password,
        "SCREEN_WIDTH": str(w),
        "SCREEN_HEIGHT": str(h),
        "SCREEN_WIDTH_HALF": str(w // 2),
        "SCREEN_HEIGHT_HALF": str(h // 2),
    }
    return dict(_substitute(params, table))


async def run_setup(
    steps: Iterable[Any],
    vm: VMProtocol,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    only_types: Iterable[str] | None = None,
    ctx: SetupContext | None = None,
) -> None:
    """Runs setup (or postconfig) steps in order.

    Args:
      steps: ``SetupStep``s (or any object with ``type`` and ``parameters``).
      vm: the desktop's in-VM client.
      cache_dir: the local file cache for ``download`` (ignored when ``ctx`` is given).
      only_types: when given, other step types are skipped (fork re-runs only launch/open).
      ctx: the full context (task id, base dir, sleep); default: built from ``cache_dir``.

    Raises:
      SetupStepError: an unsupported step type, a missing parameter, a file absent from the
        cache, or an ``until`` condition never met (the message names the step).
    """
    ctx = ctx if ctx is not None else SetupContext(cache_dir=cache_dir)
    keep = set(only_types) if only_types is not None else None
    for i, step in enumerate(steps):
        if keep is not None and step.type not in keep:
            continue
        if step.type not in SETUP_STEPS:
            raise SetupStepError(f"setup step {i} type {step.type!r} is not supported")
        params = await fill_placeholders(step.parameters, vm, ctx.client_password)
        await SETUP_STEPS.get(step.type)(vm, params, ctx)
