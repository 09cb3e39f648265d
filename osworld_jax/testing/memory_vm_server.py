"""The OSWorld in-VM server's HTTP routes over a ``MemoryDesktop`` (aiohttp handlers).

``serve_vm_route(desktop, method, route, request)`` answers one in-VM protocol request
(``/screenshot``, ``/execute``, ``/setup/*``, ``/file``, ...) as upstream's server does, from the
in-memory desktop: ``python -c CODE`` executions apply CODE's pyautogui calls to the desktop (read
with ``ast``, never executed), other commands run in its small command interpreter. The fake
sandbox service (``sandbox_service``) serves it behind each sandbox's proxy route.
"""

from __future__ import annotations

import shlex

from aiohttp import web

from osworld_jax.testing.memory_desktop import MemoryDesktop

__all__ = ["json_error", "serve_vm_route"]


def json_error(status: int, code: str, message: str) -> web.Response:
    """An error reply in the sandbox service's shape, ``{"code", "message"}``."""
    return web.json_response({"code": code, "message": message}, status=status)


async def serve_vm_route(
    d: MemoryDesktop, method: str, route: str, request: web.Request
) -> web.StreamResponse:
    """Answers the in-VM protocol request ``method route`` from desktop ``d``."""
    if (method, route) == ("GET", "/screenshot"):
        return web.Response(body=d.png(), content_type="image/png")
    if (method, route) in (("POST", "/execute"), ("POST", "/setup/execute")):
        body = await request.json()
        command, shell = body.get("command"), bool(body.get("shell", False))
        if (
            isinstance(command, list)
            and len(command) >= 3
            and command[1] == "-c"
            and str(command[0]).startswith("python")
        ):
            d.act(str(command[2]))
            return web.json_response(
                {"status": "success", "output": "", "error": "", "returncode": 0}
            )
        result = d.run(command, shell=shell)
        if not shell and result["returncode"] == 127:
            # Upstream's server runs an argv (a string is shlex-split) with subprocess.run: a
            # program that does not exist raises FileNotFoundError, answered 500 with
            # {"status": "error", "message": str(e)}.
            argv = shlex.split(command) if isinstance(command, str) else command
            message = f"[Errno 2] No such file or directory: {str(argv[0])!r}"
            return web.json_response({"status": "error", "message": message}, status=500)
        return web.json_response(result)
    if (method, route) == ("GET", "/accessibility"):
        return web.json_response({"AT": d.a11y()})
    if (method, route) == ("GET", "/terminal"):
        return web.json_response({"output": d.terminal_text})
    if (method, route) == ("POST", "/screen_size"):
        w, h = d.screen
        return web.json_response({"width": w, "height": h})
    if (method, route) == ("POST", "/file"):
        form = await request.post()
        try:
            return web.Response(body=d.read(str(form.get("file_path", ""))))
        except FileNotFoundError:
            return json_error(404, "NOT_FOUND", "file not found")
    if (method, route) == ("POST", "/setup/upload"):
        form = await request.post()
        data = form.get("file_data")
        if isinstance(data, web.FileField):
            payload = data.file.read()
        else:
            payload = str(data or "").encode()
        await d.upload(str(form.get("file_path", "")), payload)
        return web.Response(text="ok")
    if (method, route) == ("POST", "/setup/launch"):
        body = await request.json()
        await d.launch(body.get("command"), bool(body.get("shell", False)))
        return web.Response(text="ok")
    if (method, route) == ("POST", "/setup/open_file"):
        body = await request.json()
        await d.open_file(str(body.get("path", "")))
        return web.Response(text="ok")
    if (method, route) in (("POST", "/setup/activate_window"), ("POST", "/setup/close_window")):
        body = await request.json()
        fn = d.activate_window if route.endswith("activate_window") else d.close_window
        await fn(
            str(body.get("window_name", "")),
            bool(body.get("strict", False)),
            bool(body.get("by_class", False)),
        )
        return web.Response(text="ok")
    return json_error(404, "NOT_FOUND", f"no in-VM route {method} {route}")
