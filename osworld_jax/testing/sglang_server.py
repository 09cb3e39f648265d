"""A scriptable fake SGLang server for rollout-client tests (aiohttp, 127.0.0.1, free port).

Its outputs are pure functions of the absolute position, so a request that is aborted and
resubmitted must stitch to exactly the reply of an uninterrupted request:
token(pos) = (31 * pos + 7) % 1000, logprob(pos) = -0.001 * pos - 0.01,
route(row, layer, k) = (5 * row + 3 * layer + k) % 64 (row = the input position).

It also takes weights in memory as real SGLang does, keeping what it received in ``received``
(HF name -> CPU torch tensor): ``/update_weights_from_tensor`` deserializes tensor-parallel
rank 0's payload as SGLang's ``MultiprocessingSerializer.deserialize`` does (base64, then
unpickle: CPU tensors arrive through torch.multiprocessing's shared memory), either format;
``/init_weights_update_group`` + ``/update_weights_from_distributed`` run in a child process
that joins the trainer's gloo group (`osworld_jax.testing.sglang_group`). torch is imported
only by those routes.
"""

from __future__ import annotations

import asyncio
import base64
import pickle
import socket
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aiohttp import web

from osworld_jax.contract.routes import encode_routed_experts

#: Route shape of the fake model: layers, experts per token.
L, K = 3, 2


@dataclass(frozen=True)
class FlattenedTensorMetadata:
    """The fields of SGLang's ``FlattenedTensorMetadata`` (a test double of its class)."""

    name: str
    shape: Any
    dtype: Any
    start_idx: int
    end_idx: int
    numel: int


def token_at(pos: int) -> int:
    """The token the fake model emits at absolute position ``pos``."""
    return (31 * pos + 7) % 1000


def logprob_at(pos: int) -> float:
    """The logprob the fake model reports for the token at ``pos``."""
    return -0.001 * pos - 0.01


def routes_for(rows: range) -> np.ndarray:
    """The routed experts i32[len(rows), L, K] of the input positions ``rows``."""
    r = np.asarray(rows, dtype=np.int32)[:, None, None]
    lay = np.arange(L, dtype=np.int32)[None, :, None]
    k = np.arange(K, dtype=np.int32)[None, None, :]
    return ((5 * r + 3 * lay + k) % 64).astype(np.int32)


@dataclass
class FakeServer:
    """A fake SGLang server whose ``/generate`` acts out a script.

    Actions for /generate are popped from ``script`` (default ``ok``):
    ``ok``, ``500``, ``hang`` (sleeps past the client timeout), ``short_routes``,
    ``bad_logprob_ids``, ``few_logprobs``, ``abort:N`` (abort after N tokens), ``wait`` (generate
    slowly until paused: a pause aborts it with its partial output), ``400``, ``stale``.
    """

    version: str = "v0"
    script: list[str] = field(default_factory=list)
    flush_busy: int = 0
    fail_update: bool = False
    requests: list[dict[str, Any]] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)
    received: dict[str, Any] = field(default_factory=dict)
    update_bodies: list[dict[str, Any]] = field(default_factory=list)
    _group: Any = None
    paused: bool = False
    port: int = 0
    _runner: web.AppRunner | None = None
    _pause_event: asyncio.Event | None = None

    @property
    def url(self) -> str:
        """The server's base URL."""
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> FakeServer:
        """Listens on a free loopback port (``url``); returns self."""
        self._pause_event = asyncio.Event()
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/health", self.ok)
        app.router.add_get("/model_info", self.model_info)
        app.router.add_post("/pause_generation", self.pause)
        app.router.add_post("/continue_generation", self.cont)
        app.router.add_post("/flush_cache", self.flush)
        app.router.add_post("/update_weights_from_disk", self.update)
        app.router.add_post("/abort_request", self.abort_request)
        app.router.add_post("/update_weights_from_tensor", self.update_from_tensor)
        app.router.add_post("/init_weights_update_group", self.init_group)
        app.router.add_post("/update_weights_from_distributed", self.update_from_distributed)
        app.router.add_post("/begin_weight_update", self.session)
        app.router.add_post("/end_weight_update", self.session)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        site = web.SockSite(self._runner, sock)
        await site.start()
        return self

    async def stop(self) -> None:
        """Stops listening (and the distributed child, if one was started)."""
        assert self._runner is not None
        await self._runner.cleanup()
        if self._group is not None:
            await asyncio.to_thread(self._group.stop)
            self._group = None

    async def ok(self, request: web.Request) -> web.Response:
        """``GET /health``."""
        self.calls.append("health")
        return web.Response(text="ok")

    async def model_info(self, request: web.Request) -> web.Response:
        """``GET /model_info`` (the current weight version)."""
        self.calls.append("model_info")
        return web.json_response({"model_path": "/fake", "weight_version": self.version})

    async def pause(self, request: web.Request) -> web.Response:
        """``POST /pause_generation``: ``wait`` requests return aborted."""
        self.calls.append("pause")
        self.paused = True
        assert self._pause_event is not None
        self._pause_event.set()
        return web.json_response({"status": "ok"})

    async def cont(self, request: web.Request) -> web.Response:
        """``POST /continue_generation``."""
        self.calls.append("continue")
        self.paused = False
        self._pause_event = asyncio.Event()
        return web.json_response({"status": "ok"})

    async def flush(self, request: web.Request) -> web.Response:
        """``POST /flush_cache``: 400 "busy" ``flush_busy`` times, then 200."""
        self.calls.append("flush")
        if self.flush_busy > 0:
            self.flush_busy -= 1
            return web.Response(status=400, text="busy")
        return web.Response(text="flushed")

    async def update(self, request: web.Request) -> web.Response:
        """``POST /update_weights_from_disk``: takes the new weight version (or fails)."""
        body = await request.json()
        self.calls.append("update")
        if self.fail_update:
            return web.json_response({"success": False, "message": "bad path"}, status=400)
        self.version = body["weight_version"]
        return web.json_response({"success": True, "message": "ok", "num_paused_requests": 0})

    def _took(self, body: dict[str, Any], pairs: list[tuple[str, Any]]) -> web.Response:
        for name, tensor in pairs:
            self.received[name] = tensor.clone()  # SGLang copies into its parameters
        if body.get("weight_version") is not None:
            self.version = body["weight_version"]
        return web.json_response({"success": True, "message": "ok"})

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        """``POST /update_weights_from_tensor``: rank 0's payload, either ``load_format``."""
        body = await request.json()
        self.calls.append("update_tensor")
        self.update_bodies.append(
            {k: v for k, v in body.items() if k != "serialized_named_tensors"}
        )
        if self.fail_update:
            return web.json_response({"success": False, "message": "refused"}, status=400)
        import torch  # noqa: F401  (the payload's tensors rebuild through torch)

        obj = pickle.loads(base64.b64decode(body["serialized_named_tensors"][0], validate=True))
        if body.get("load_format") == "flattened_bucket":
            flat = obj["flattened_tensor"]
            pairs = [
                (m.name, flat[m.start_idx : m.end_idx].reshape(m.shape)) for m in obj["metadata"]
            ]
        else:
            pairs = list(obj)
        return self._took(body, pairs)

    async def init_group(self, request: web.Request) -> web.Response:
        """``POST /init_weights_update_group``: the child process joins as ``rank_offset``."""
        body = await request.json()
        self.calls.append("init_group")
        self.update_bodies.append(body)
        from osworld_jax.testing.sglang_group import GroupWorker

        if self._group is None:
            self._group = await asyncio.to_thread(GroupWorker)
        try:
            await asyncio.to_thread(self._group.ask, "init", body)
        except RuntimeError as e:
            return web.json_response({"success": False, "message": str(e)}, status=400)
        return web.json_response({"success": True, "message": "joined"})

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        """``POST /update_weights_from_distributed``: the child receives the broadcast."""
        body = await request.json()
        self.calls.append("update_distributed")
        self.update_bodies.append(body)
        if self._group is None:
            return web.json_response({"success": False, "message": "no group"}, status=400)
        try:
            pairs = await asyncio.to_thread(self._group.ask, "update", body)
        except RuntimeError as e:
            return web.json_response({"success": False, "message": str(e)}, status=400)
        return self._took(body, pairs)

    async def session(self, request: web.Request) -> web.Response:
        """``POST /begin_weight_update`` and ``/end_weight_update`` (recorded in ``calls``)."""
        self.calls.append(request.path.strip("/"))
        return web.json_response({"success": True})

    async def abort_request(self, request: web.Request) -> web.Response:
        """``POST /abort_request`` (recorded in ``calls``)."""
        body = await request.json()
        self.calls.append(f"abort_request:{body['rid']}")
        return web.Response()

    def reply(self, body: dict[str, Any], n: int, finish: dict[str, Any], **bad: Any) -> Any:
        """The ``/generate`` reply of ``n`` tokens for ``body``, corrupted as ``bad`` says."""
        prompt = body["input_ids"]
        p = len(prompt)
        out = [token_at(p + i) for i in range(n)]
        lps: list[list[Any]] = [[logprob_at(p + i), t, None] for i, t in enumerate(out)]
        meta: dict[str, Any] = {
            "id": body["rid"],
            "finish_reason": finish,
            "prompt_tokens": p,
            "completion_tokens": n,
            "cached_tokens": 0,
            "weight_version": bad.get("version", self.version),
            "e2e_latency": 0.0,
            "output_token_logprobs": lps,
        }
        if bad.get("bad_logprob_ids") and n:
            lps[-1][1] += 1
        if bad.get("few_logprobs") and n:
            lps.pop()
        if body.get("return_routed_experts"):
            start = body.get("routed_experts_start_len", 0)
            end = p + n - 1 - (1 if bad.get("short_routes") else 0)
            meta["routed_experts"] = encode_routed_experts(routes_for(range(start, end)))
        return {"text": f"<{n} tokens>", "output_ids": out, "meta_info": meta}

    async def generate(self, request: web.Request) -> web.Response:
        """``POST /generate``: acts out the next ``script`` entry."""
        body = await request.json()
        self.requests.append(body)
        action = self.script.pop(0) if self.script else "ok"
        m = body["sampling_params"]["max_new_tokens"]
        length = {"type": "length", "length": m}
        if action == "500":
            return web.Response(status=500, text="internal error")
        if action == "400":
            return web.json_response({"error": "bad request"}, status=400)
        if action == "hang":
            await asyncio.sleep(1.0)  # past the test client's 0.3 s timeout
        if action.startswith("abort:"):
            n = min(m, int(action.split(":")[1]))
            return web.json_response(self.reply(body, n, {"type": "abort", "message": "paused"}))
        if action.startswith("wait"):
            assert self._pause_event is not None
            await self._pause_event.wait()
            n = min(m, 2)
            return web.json_response(
                self.reply(body, n, {"type": "abort", "message": "pause_generation"})
            )
        bad: dict[str, Any] = (
            {action: True} if action in ("short_routes", "bad_logprob_ids", "few_logprobs") else {}
        )
        if action == "stale":
            bad = {"version": "old"}
        return web.json_response(self.reply(body, m, length, **bad))
