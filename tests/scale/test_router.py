"""One router URL in front of several servers (``RolloutConfig.urls = (router,)``).

``StubRouter`` behaves like SGLang's router as far as the client can tell: ``/generate`` goes to
one worker (round robin here), ``/pause_generation``, ``/flush_cache``,
``/update_weights_from_disk`` and ``/continue_generation`` are forwarded to every worker, and a
broadcast answers success when any worker succeeded (the client cannot see per-worker results).
Behind it run the scriptable fake servers of the rollout tests.
"""

from __future__ import annotations

import asyncio
import itertools
import socket

import aiohttp
import pytest
from aiohttp import web

from osworld_jax.contract.errors import RefitError
from osworld_jax.rollout import ReplyValidationError, RolloutConfig, SamplingParams, SGLangClient
from osworld_jax.testing.sglang_server import FakeServer, K, L

BROADCAST = (
    "/pause_generation",
    "/continue_generation",
    "/flush_cache",
    "/update_weights_from_disk",
)


class StubRouter:
    def __init__(self, workers: list[str]):
        self.workers = workers
        self._rr = itertools.count()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self.url = ""

    async def start(self) -> StubRouter:
        self._session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/health", self.first)
        app.router.add_get("/model_info", self.first)
        for path in BROADCAST:
            app.router.add_post(path, self.broadcast)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        await web.SockSite(self._runner, sock).start()
        return self

    async def stop(self) -> None:
        assert self._runner is not None and self._session is not None
        await self._runner.cleanup()
        await self._session.close()

    async def _forward(self, method: str, url: str, body: bytes) -> web.Response:
        assert self._session is not None
        async with self._session.request(
            method, url, data=body, headers={"Content-Type": "application/json"}
        ) as r:
            return web.Response(status=r.status, body=await r.read())

    async def generate(self, request: web.Request) -> web.Response:
        worker = self.workers[next(self._rr) % len(self.workers)]
        return await self._forward("POST", worker + "/generate", await request.read())

    async def first(self, request: web.Request) -> web.Response:
        return await self._forward("GET", self.workers[0] + request.path, b"")

    async def broadcast(self, request: web.Request) -> web.Response:
        body = await request.read()
        answers = await asyncio.gather(
            *(self._forward("POST", w + request.path, body) for w in self.workers)
        )
        ok = [a for a in answers if a.status == 200]
        return ok[0] if ok else answers[0]


def _config(url: str) -> RolloutConfig:
    return RolloutConfig(
        urls=(url,),
        return_routed_experts=True,
        num_layers=L,
        num_experts_per_tok=K,
        max_retries=0,
        health_check_interval_s=60,
    )


def test_router_url_spreads_requests_and_stale_workers_are_caught():
    sp = SamplingParams(max_new_tokens=4)

    async def main():
        good, stale = await FakeServer().start(), await FakeServer(fail_update=True).start()
        router = await StubRouter([good.url, stale.url]).start()
        try:
            async with SGLangClient(None, _config(router.url)) as client:
                assert client.active_urls == [router.url]  # one logical server
                before = await asyncio.gather(
                    *(client.generate([1, 2, 3], sp, rid=f"b{i}") for i in range(4))
                )
                report = await client.refit("/ckpt/step_1", "v1")
                after = await asyncio.gather(
                    *(client.generate([1, 2, 3], sp, rid=f"a{i}") for i in range(4)),
                    return_exceptions=True,
                )
            return good, stale, before, report, after
        finally:
            await router.stop()
            await good.stop()
            await stale.stop()

    good, stale, before, report, after = asyncio.run(main())
    # The router spread the step over both workers.
    assert len(good.requests) >= 2 and len(stale.requests) >= 2
    assert all(g.weight_version == "v0" and g.completion_tokens == 4 for g in before)
    # The refit reached both workers through the router; one failed behind its back.
    assert "update" in good.calls and "update" in stale.calls
    assert report == {next(iter(report)): None} and good.version == "v1"
    assert stale.version == "v0"
    # Every reply is checked: the worker left on old weights is never used silently.
    ok = [g for g in after if not isinstance(g, BaseException)]
    rejected = [e for e in after if isinstance(e, ReplyValidationError)]
    assert len(ok) == 2 and all(g.weight_version == "v1" for g in ok)
    assert len(rejected) == 2 and all("'v0'" in str(e) and "v1" in str(e) for e in rejected)


def test_router_whose_refit_fails_on_every_worker_leaves_rotation():
    async def main():
        a = await FakeServer(fail_update=True).start()
        b = await FakeServer(fail_update=True).start()
        router = await StubRouter([a.url, b.url]).start()
        try:
            async with SGLangClient(None, _config(router.url)) as client:
                with pytest.raises(RefitError, match="failed on every server"):
                    await client.refit("/ckpt/step_1", "v1")
                return client.active_urls
        finally:
            await router.stop()
            await a.stop()
            await b.stop()

    assert asyncio.run(main()) == []  # out of rotation: no request reaches old weights
