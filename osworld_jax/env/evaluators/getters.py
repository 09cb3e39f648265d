"""OSWorld getters: fetch the observed (``result``) or reference (``expected``) state.

Semantics follow upstream ``desktop_env/evaluators/getters`` (``file.py``, ``general.py``,
``info.py``, ``misc.py``): file getters copy a file to the evaluation's scratch directory and
return its local path (``None`` when the file does not exist); with ``multi`` they take parallel
``path``/``dest`` lists and return the files picked by ``gives`` (default ``[0]``: one index gives
a path, several a list); command getters return the command's stdout (``vm_command_line``) or
stderr (``vm_command_error``); ``rule`` returns its ``rules`` object.

Getters that need more than the in-VM protocol's routes run a short Python program inside the
desktop (``osworld_jax.env.desktop_python.run_python``) and read its JSON output, so they work the
same on every backend.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from osworld_jax.env import cache
from osworld_jax.env.backend import SandboxEvalError, SandboxStepError
from osworld_jax.env.desktop_python import run_python
from osworld_jax.env.evaluators.registry import GETTERS, EvalContext
from osworld_jax.env.protocol import VMProtocol, is_transient
from osworld_jax.env.setup import work_file_problem


def _multi(params: Mapping[str, Any]) -> tuple[list[Any], list[str], bool]:
    paths, dests = params.get("path"), params.get("dest")
    multi = bool(params.get("multi", False))
    if multi:
        if not isinstance(paths, list) or not isinstance(dests, list) or len(paths) != len(dests):
            raise SandboxEvalError(
                f"getter with multi=true needs parallel path/dest lists: {params}"
            )
        return list(paths), [str(d) for d in dests], True
    if paths is None:
        raise SandboxEvalError(f"file getter without 'path': {dict(params)}")
    return [paths], [str(dests if dests is not None else Path(str(paths)).name)], False


def _gives(params: Mapping[str, Any], out: list[Any]) -> Any:
    """Upstream's ``gives`` (default ``[0]``): the listed indices, in file order.

    One index gives that file's path itself, several a list (``[]`` an empty list).
    """
    gives = params.get("gives", [0])
    wanted = set(gives if isinstance(gives, list) else [gives])
    picked = [x for i, x in enumerate(out) if i in wanted]
    return picked[0] if len(picked) == 1 else picked


def _scratch(ctx: EvalContext, dest: str) -> Path:
    target = (ctx.work_dir / dest).resolve()
    if ctx.work_dir.resolve() not in target.parents:
        raise SandboxEvalError(f"getter dest {dest!r} escapes the evaluation directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    return target


async def _fetch(vm: VMProtocol, path: str) -> bytes | None:
    try:
        return await vm.file(path)
    except FileNotFoundError:
        return None
    except SandboxStepError as e:
        if is_transient(e):
            raise
        # Clients differ in how a missing file surfaces (404, error body): ask the desktop. Not
        # a regular file the desktop's user can read (missing, or a symlink the agent planted to
        # a root-only file such as /etc/shadow) is the agent's doing: None, scored 0 (masking it
        # would let an agent that expects to fail dodge the penalty).
        probe = await vm.execute(["test", "-f", path])
        if probe.get("returncode") not in (0, None):
            return None
        if (await vm.execute(["test", "-r", path])).get("returncode") == 1:  # 1: not readable
            return None
        raise


@GETTERS.register("vm_file")
async def vm_file(vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext) -> Any:
    """Copies ``path`` from the desktop to ``work_dir/dest``; returns the local path or None."""
    paths, dests, multi = _multi(params)
    out: list[str | None] = []
    for p, d in zip(paths, dests, strict=True):
        data = await _fetch(vm, str(p))
        if data is None:
            out.append(None)
            continue
        target = _scratch(ctx, d)
        target.write_bytes(data)
        out.append(str(target))
    return _gives(params, out)


@GETTERS.register("cloud_file")
async def cloud_file(vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext) -> Any:
    """A reference file by URL, from the local file cache (never the network)."""
    urls, dests, multi = _multi(params)
    out: list[str] = []
    for u, d in zip(urls, dests, strict=True):
        local = cache.resolve(str(u), ctx.cache_dir, ctx.task_id, ctx.base_dir)
        if local is None:
            raise SandboxEvalError(f"getter cloud_file: {u} is not in the local file cache")
        target = _scratch(ctx, d)
        target.write_bytes(local.read_bytes())
        out.append(str(target))
    return _gives(params, out)


@GETTERS.register("cache_file")
async def cache_file(vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext) -> Any:
    """A file a postconfig ``execute`` step saved (``stdout: name``) in the evaluation dir."""
    paths = params.get("path")
    names = paths if isinstance(paths, list) else [paths]
    out: list[str] = []
    for n in names:
        problem = work_file_problem(n)
        if problem is not None:
            raise SandboxEvalError(f"task {ctx.task_id}: getter cache_file: path = {problem}")
    for n in names:
        p = ctx.work_dir / str(n)  # one file name: checked above
        if p.is_symlink() or not p.is_file():
            raise SandboxEvalError(f"getter cache_file: {n!r} was not produced by postconfig")
        out.append(str(p))
    return out if isinstance(paths, list) else out[0]


async def _run(vm: VMProtocol, params: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``/execute`` reply of the getter's command; None when the server answers that it
    cannot run it (upstream's getters return None for any non-200 reply; transient failures
    still raise, to be retried).
    """  # noqa: D205
    try:
        return await vm.execute(params["command"], shell=bool(params.get("shell", False)))
    except SandboxStepError as e:
        if is_transient(e) or getattr(e, "status", None) is None:
            raise
        return None


@GETTERS.register("vm_command_line")
async def vm_command_line(vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext) -> Any:
    """The stdout of ``command`` run in the desktop (None if it cannot run)."""
    r = await _run(vm, params)
    return None if r is None else r.get("output")


@GETTERS.register("vm_command_error")
async def vm_command_error(vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext) -> Any:
    """The stderr of ``command`` run in the desktop (None if it cannot run)."""
    r = await _run(vm, params)
    return None if r is None else r.get("error")


@GETTERS.register("vm_terminal_output")
async def vm_terminal_output(vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext) -> Any:
    """The text of the desktop's terminal, or None when there is none (upstream's ``null``).

    Upstream's ``/terminal`` answers ``{"output": null}`` when no terminal window is found; our
    VM protocol reads that as "": an empty text is taken as no terminal (tasks ``13584542``,
    ``4127319a``: ``check_include_exclude`` scores None 0 without looking at the rules).
    """
    text = await vm.terminal()
    return text if text else None


@GETTERS.register("accessibility_tree")
async def accessibility_tree(vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext) -> Any:
    """The accessibility tree as XML text."""
    return await vm.accessibility()


@GETTERS.register("vm_screen_size")
async def vm_screen_size(vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext) -> Any:
    """``{"width": w, "height": h}`` of the desktop's screen."""
    w, h = await vm.screen_size()
    return {"width": w, "height": h}


@GETTERS.register("rule")
async def rule(vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext) -> Any:
    """The literal ``rules`` object of the task file."""
    return params["rules"]


_LIST_TREE = """
import json, os, sys
def tree(d):
    node = {"type": "directory", "name": os.path.basename(d), "children": []}
    try:
        for e in os.listdir(d):
            full = os.path.join(d, e)
            leaf = {"type": "file", "name": e}
            node["children"].append(tree(full) if os.path.isdir(full) else leaf)
    except OSError as err:
        return {"error": str(err)}
    return node
p = os.path.expanduser(sys.argv[1])
print(json.dumps(tree(p) if os.path.isdir(p) else None))
"""


@GETTERS.register("list_directory")
async def list_directory(vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext) -> Any:
    """The directory tree at ``path`` in the desktop, as upstream's ``/list_directory`` gives it.

    ``{"type": "directory", "name": basename, "children": [...]}`` with files as ``{"type":
    "file", "name": ...}`` and subdirectories nested (``os.listdir`` order); None when ``path``
    is not a directory.
    """
    return await run_python(vm, _LIST_TREE, str(params["path"]))


@GETTERS.register("content_from_vm_file")
async def content_from_vm_file(vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext) -> Any:
    """Part of a desktop file: ``file_type: xlsx`` with ``file_content: last_row`` gives the
    sheet's last row (first sheet, header row excluded) as a list of strings (pandas' ``str``).
    """  # noqa: D205
    kind, what = params.get("file_type"), params.get("file_content")
    if kind != "xlsx" or what != "last_row":
        raise SandboxEvalError(f"getter content_from_vm_file: {kind}/{what} is not supported")
    path = str(params["path"])
    local = await vm_file(vm, {"path": path, "dest": Path(path).name}, ctx)
    if local is None:
        raise FileNotFoundError(path)
    import pandas as pd

    return pd.read_excel(local).iloc[-1].astype(str).tolist()
