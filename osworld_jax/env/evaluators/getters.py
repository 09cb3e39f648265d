"""OSWorld getters: fetch the observed (``result``) or reference (``expected``) state.

Semantics follow upstream ``desktop_env/evaluators/getters``: file getters copy a file to the
evaluation's scratch directory and return its local path (``None`` when the file does not exist;
with ``multi`` a list, narrowed by ``gives``); command getters return the command's stdout
(``vm_command_line``) or stderr (``vm_command_error``); ``rule`` returns its ``rules`` object.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from osworld_jax.env import cache
from osworld_jax.env.backend import SandboxEvalError, SandboxStepError
from osworld_jax.env.evaluators.registry import GETTERS, EvalContext
from osworld_jax.env.protocol import VMProtocol, is_transient


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
    gives = params.get("gives")
    if gives is None:
        return out
    return [out[i] for i in gives] if isinstance(gives, list) else out[gives]


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
        # Clients differ in how a missing file surfaces (404, error body): ask the desktop.
        probe = await vm.execute(["test", "-f", path])
        if probe.get("returncode") not in (0, None):
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
    return _gives(params, out) if multi else out[0]


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
    return _gives(params, out) if multi else out[0]


@GETTERS.register("cache_file")
async def cache_file(vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext) -> Any:
    """A file a postconfig ``execute`` step saved (``stdout: name``) in the evaluation dir."""
    paths = params.get("path")
    names = paths if isinstance(paths, list) else [paths]
    out: list[str] = []
    for n in names:
        p = ctx.work_dir / str(n)
        if not p.is_file():
            raise SandboxEvalError(f"getter cache_file: {n!r} was not produced by postconfig")
        out.append(str(p))
    return out if isinstance(paths, list) else out[0]


@GETTERS.register("vm_command_line")
async def vm_command_line(vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext) -> Any:
    """The stdout of ``command`` run in the desktop."""
    r = await vm.execute(params["command"], shell=bool(params.get("shell", False)))
    return r.get("output")


@GETTERS.register("vm_command_error")
async def vm_command_error(vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext) -> Any:
    """The stderr of ``command`` run in the desktop."""
    r = await vm.execute(params["command"], shell=bool(params.get("shell", False)))
    return r.get("error")


@GETTERS.register("vm_terminal_output")
async def vm_terminal_output(vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext) -> Any:
    """The text of the desktop's terminal."""
    return await vm.terminal()


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


@GETTERS.register("list_directory")
async def list_directory(vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext) -> Any:
    """The sorted names of the entries of directory ``path`` in the desktop (None if absent)."""
    r = await vm.execute(["ls", "-1A", str(params["path"])])
    if r.get("returncode") not in (0, None):
        return None
    return sorted(line for line in str(r.get("output") or "").splitlines() if line)
