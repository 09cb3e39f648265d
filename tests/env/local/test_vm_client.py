"""VMClient against a scripted in-process server: wire formats and the typed error contract."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from aiohttp import web

from osworld_jax.env.backend import SandboxStepError, SandboxTimeout
from osworld_jax.env.protocol import VMProtocol, is_transient
from osworld_jax.env.vm_client import SandboxRequestError, SandboxTransientError, VMClient

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 16


class Recorder:
    """A fake in-VM server that records every request and answers per route."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict]] = []
        self.status: dict[str, int] = {}
        self.delay_s = 0.0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.StreamResponse:
        route = "/" + request.match_info["tail"]
        info: dict = {"content_type": request.content_type}
        if request.content_type == "application/json":
            info["json"] = await request.json()
        elif request.content_type == "multipart/form-data":
            form = await request.post()
            info["form"] = {
                k: (v.file.read() if hasattr(v, "file") else v)  # type: ignore[union-attr]
                for k, v in form.items()
            }
        elif request.content_type == "application/x-www-form-urlencoded":
            info["form"] = dict(await request.post())
        self.requests.append((request.method, route, info))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        status = self.status.get(route, 200)
        if status != 200:
            return web.json_response({"status": "error", "message": "scripted"}, status=status)
        if route == "/screenshot":
            return web.Response(body=PNG, content_type="image/png")
        if route == "/execute":
            return web.json_response(
                {"status": "success", "output": "out\n", "error": "", "returncode": 3}
            )
        if route == "/accessibility":
            return web.json_response({"AT": "<desktop-frame/>"})
        if route == "/terminal":
            return web.json_response({"output": None, "status": "success"})
        if route == "/screen_size":
            return web.json_response({"width": 1920, "height": 1080})
        if route == "/file":
            return web.Response(body=b"\x00bytes\r\n")
        return web.Response(text="ok")


async def _serve(rec: Recorder, sock: Path) -> web.AppRunner:
    runner = web.AppRunner(rec.app())
    await runner.setup()
    await web.UnixSite(runner, str(sock)).start()
    return runner


def run_with_server(tmp_path: Path, body, rec: Recorder | None = None, **client_kw):
    rec = rec or Recorder()
    sock = tmp_path / "vm.sock"

    async def main():
        runner = await _serve(rec, sock)
        client = VMClient(f"unix://{sock}", **client_kw)
        try:
            return await body(client, rec)
        finally:
            await client.aclose()
            await runner.cleanup()

    return asyncio.run(main())


def test_wire_formats(tmp_path):
    async def body(c: VMClient, rec: Recorder):
        assert isinstance(c, VMProtocol)
        assert await c.screenshot() == PNG
        res = await c.execute(["ls", "-l"], shell=False)
        assert res == {"status": "success", "output": "out\n", "error": "", "returncode": 3}
        await c.execute("echo hi", shell=True)
        assert await c.accessibility() == "<desktop-frame/>"
        assert await c.terminal() == ""  # null output -> ""
        assert await c.screen_size() == (1920, 1080)
        assert await c.file("~/a.bin") == b"\x00bytes\r\n"
        await c.upload("/home/user/x/y.bin", b"\x00\r\n--binary\xff")
        await c.launch(["mousepad", "a.txt"])
        await c.open_file("/home/user/a.txt")
        await c.activate_window("Mousepad", strict=True)
        await c.close_window("Calc", by_class=True)
        return rec.requests

    reqs = run_with_server(tmp_path, body)
    by_route = {(m, r): info for m, r, info in reqs}
    assert [(m, r) for m, r, _ in reqs][:3] == [
        ("GET", "/screenshot"),
        ("POST", "/execute"),
        ("POST", "/execute"),
    ]
    assert reqs[1][2]["json"] == {"command": ["ls", "-l"], "shell": False}
    assert reqs[2][2]["json"] == {"command": "echo hi", "shell": True}
    assert ("GET", "/accessibility") in by_route and ("GET", "/terminal") in by_route
    assert ("POST", "/screen_size") in by_route
    assert by_route[("POST", "/file")]["form"] == {"file_path": "~/a.bin"}
    up = by_route[("POST", "/setup/upload")]["form"]
    assert up["file_path"] == "/home/user/x/y.bin"
    assert up["file_data"] == b"\x00\r\n--binary\xff"
    assert by_route[("POST", "/setup/launch")]["json"] == {
        "command": ["mousepad", "a.txt"],
        "shell": False,
    }
    assert by_route[("POST", "/setup/open_file")]["json"] == {"path": "/home/user/a.txt"}
    assert by_route[("POST", "/setup/activate_window")]["json"] == {
        "window_name": "Mousepad",
        "strict": True,
        "by_class": False,
    }
    assert by_route[("POST", "/setup/close_window")]["json"] == {
        "window_name": "Calc",
        "strict": False,
        "by_class": True,
    }


@pytest.mark.parametrize(
    ("route", "status", "exc", "transient"),
    [
        ("/screen_size", 500, SandboxTransientError, True),
        ("/execute", 503, SandboxTransientError, True),
        ("/execute", 400, SandboxRequestError, False),
        ("/execute", 403, SandboxRequestError, False),
        # upstream's 500 + {"status": "error"}: the command cannot run (issue 16 item 14)
        ("/execute", 500, SandboxRequestError, False),
    ],
)
def test_http_errors_are_typed(tmp_path, route, status, exc, transient):
    rec = Recorder()
    rec.status[route] = status

    async def body(c: VMClient, _):
        with pytest.raises(exc) as info:
            await (c.execute(["true"]) if route == "/execute" else c.screen_size())
        return info.value

    err = run_with_server(tmp_path, body, rec)
    assert isinstance(err, SandboxStepError)
    assert err.status == status
    assert is_transient(err) is transient
    assert route in str(err) and str(status) in str(err)


def test_missing_file_is_file_not_found(tmp_path):
    rec = Recorder()
    rec.status["/file"] = 404

    async def body(c: VMClient, _):
        with pytest.raises(FileNotFoundError, match="nope.txt"):
            await c.file("/home/user/nope.txt")

    run_with_server(tmp_path, body, rec)


def test_timeout_is_sandbox_timeout(tmp_path):
    rec = Recorder()
    rec.delay_s = 2.0

    async def body(c: VMClient, _):
        with pytest.raises(SandboxTimeout) as info:
            await c.screen_size()
        return info.value

    err = run_with_server(tmp_path, body, rec, timeout=0.2)
    assert is_transient(err)


def test_not_png_and_malformed_replies(tmp_path):
    async def handle(request: web.Request) -> web.Response:
        if request.path == "/screenshot":
            return web.Response(body=b"GIF89a", content_type="image/png")
        return web.Response(text=json.dumps({"nothing": 1}), content_type="application/json")

    async def main():
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.UnixSite(runner, str(tmp_path / "s.sock")).start()
        c = VMClient(f"unix://{tmp_path / 's.sock'}")
        try:
            with pytest.raises(SandboxStepError, match="not a PNG"):
                await c.screenshot()
            with pytest.raises(SandboxStepError, match="malformed"):
                await c.accessibility()
            with pytest.raises(SandboxStepError, match="malformed"):
                await c.execute(["x"])
            with pytest.raises(SandboxStepError, match="malformed"):
                await c.screen_size()
        finally:
            await c.aclose()
            await runner.cleanup()

    asyncio.run(main())


def test_connection_failure_is_transient(tmp_path):
    async def main():
        c = VMClient(f"unix://{tmp_path / 'absent.sock'}")
        try:
            with pytest.raises(SandboxTransientError) as info:
                await c.screenshot()
        finally:
            await c.aclose()
        assert info.value.status is None and is_transient(info.value)
        with pytest.raises(SandboxTimeout):
            await c.wait_ready(deadline=0.2)
        await c.aclose()

    asyncio.run(main())


def test_http_url_over_tcp_loopback():
    async def main():
        rec = Recorder()
        runner = web.AppRunner(rec.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        c = VMClient(f"http://127.0.0.1:{port}/")
        try:
            assert await c.screen_size() == (1920, 1080)
        finally:
            await c.aclose()
            await runner.cleanup()

    asyncio.run(main())


def test_bad_base_urls():
    with pytest.raises(ValueError, match="http"):
        VMClient("ftp://x")
    with pytest.raises(ValueError, match="absolute"):
        VMClient("unix://relative.sock")
