"""A refit to new weights while requests run on the embedded server: no token lost, every token's
weight version recorded, the new part's logprobs and routes those of the new weights (against
transformers on both checkpoints), new requests held until the swap, late old replies accepted.

The client talks to the server through `Proxy`, a recording HTTP relay that can hold a request
or a reply, so that every interleaving below is forced, not hoped for.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import aiohttp
import numpy as np
from aiohttp import web

from osworld_jax.rollout import RolloutConfig, SamplingParams, SGLangClient

from .conftest import hf_logits_and_routes, hf_model, log_softmax, serving, start_engine

PROMPTS = [[7 + i, 42, 300, 511, 12, 99 + i] for i in range(4)]  # P = 6
N = 48  # output tokens per request: 6 + 48 stays inside the shared 64-position buckets
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=N, ignore_eos=True)


class Proxy:
    """An HTTP relay in front of ``upstream`` that records ``/generate`` traffic and can hold it.

    Attributes:
      log: ``(path, rid)`` of every request in arrival order (rid only for ``/generate``).
      generates: wire rid -> (request body, reply body) of every ``/generate``.
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.log: list[tuple[str, str | None]] = []
        self.generates: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
        self._hold_path: dict[str, tuple[asyncio.Event, asyncio.Event]] = {}
        self._hold_reply: dict[str, tuple[asyncio.Event, asyncio.Event]] = {}

    def hold_request(self, path: str) -> tuple[asyncio.Event, asyncio.Event]:
        """(arrived, release): the next requests to ``path`` wait, unforwarded, for release."""
        self._hold_path[path] = (asyncio.Event(), asyncio.Event())
        return self._hold_path[path]

    def hold_reply(self, rid: str) -> tuple[asyncio.Event, asyncio.Event]:
        """(answered, release): the upstream reply to ``rid`` waits in transit for release."""
        self._hold_reply[rid] = (asyncio.Event(), asyncio.Event())
        return self._hold_reply[rid]

    def index(self, path: str, rid: str | None = None) -> int:
        """Position of the first ``(path, rid)`` in ``log``."""
        return self.log.index((path, rid))

    async def _relay(self, request: web.Request) -> web.Response:
        raw = await request.read()
        body = json.loads(raw) if request.path == "/generate" else None
        rid = body.get("rid") if body is not None else None
        self.log.append((request.path, rid))
        if request.path in self._hold_path:
            arrived, release = self._hold_path[request.path]
            arrived.set()
            await release.wait()
        async with self._session.request(
            request.method,
            self.upstream + request.path_qs,
            data=raw,
            headers={"Content-Type": request.headers.get("Content-Type", "application/json")},
        ) as r:
            data, status, ctype = await r.read(), r.status, r.headers.get("Content-Type")
        if body is not None and status == 200:
            self.generates[rid] = (body, json.loads(data))
            if rid in self._hold_reply:
                answered, release = self._hold_reply[rid]
                answered.set()
                await release.wait()
        return web.Response(body=data, status=status, headers={"Content-Type": ctype or ""})

    async def __aenter__(self) -> str:
        self._session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._relay)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(self._runner, sock).start()
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        await self._runner.cleanup()
        await self._session.close()


def client_config(url: str, cfg: Any) -> RolloutConfig:
    return RolloutConfig(
        urls=(url,),
        return_routed_experts=True,
        num_layers=cfg.num_hidden_layers,
        num_experts_per_tok=cfg.num_experts_per_tok,
        max_abort_resubmits=2,
    )


def reference(model: Any, prompt: list[int], out: list[int]) -> tuple[np.ndarray, Any, dict]:
    """(greedy ids, logprobs, routers) of ``model`` teacher-forced on prompt + out."""
    logits, routers = hf_logits_and_routes(model, prompt + out)
    pos = np.arange(len(prompt) - 1, len(prompt) + len(out) - 1)
    lps = log_softmax(logits[pos])[np.arange(len(out)), out]  # greedy: T_lp = 1
    return logits[pos].argmax(-1), lps, routers


def top_k_routes(routers: dict, rows: slice, k: int) -> dict[int, np.ndarray]:
    return {
        layer: np.sort(np.argsort(-r[rows], axis=-1)[:, :k], axis=-1)
        for layer, r in routers.items()
    }


async def control(url: str, path: str, body: dict[str, Any]) -> None:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        assert r.status == 200, await r.text()


def freeze_when_all_have(engine: Any, rids: set[str], n: int) -> asyncio.Event:
    """An event set once the engine paused itself (``in_place``, between two steps) right after
    the decode step that left every request of ``rids`` in a slot with at least ``n`` tokens."""
    loop, frozen, step = asyncio.get_running_loop(), asyncio.Event(), engine._decode_step

    def step_then_freeze() -> None:  # on the engine thread
        step()
        ready = [r for r in engine.slots if r is not None and r.rid in rids]
        if len(ready) == len(rids):
            if all(len(r.output_ids) >= n for r in ready):
                engine.pause("in_place")  # runs before the next step
                loop.call_soon_threadsafe(frozen.set)
                engine._decode_step = step

    engine._decode_step = step_then_freeze
    return frozen


def test_refit_mid_request_to_new_weights_records_every_tokens_version(tiny_ckpt, tiny_ckpt_b):
    eng = start_engine(tiny_ckpt, weight_version="0")
    cfg = eng.model_config

    async def main() -> tuple[list, list, Proxy]:
        async with serving(eng) as server_url:
            proxy = Proxy(server_url)
            async with proxy as url, SGLangClient(None, client_config(url, cfg)) as client:
                # Queue the four while paused, so that they are admitted together; the engine
                # pauses itself (in place) after the first decode step that leaves each with
                # >= 3 tokens: they are frozen mid-generation, whatever the machine's load.
                frozen = freeze_when_all_have(eng, {f"live{i}" for i in range(4)}, 3)
                await control(server_url, "/pause_generation", {"mode": "in_place"})
                live = [
                    asyncio.create_task(client.generate(p, GREEDY, rid=f"live{i}"))
                    for i, p in enumerate(PROMPTS)
                ]
                while len(eng.waiting) < 4:
                    await asyncio.sleep(0.01)
                await control(server_url, "/continue_generation", {})
                await asyncio.wait_for(frozen.wait(), timeout=120)
                running = {r.rid: len(r.output_ids) for r in eng.slots if r is not None}
                assert len(running) == 4 and 3 <= min(running.values()) <= max(running.values()) < N
                arrived, release = proxy.hold_request("/update_weights_from_disk")
                refit = asyncio.create_task(client.refit(str(tiny_ckpt_b), "1"))
                await arrived.wait()  # paused (abort) and flushed: the first parts came back
                new = [
                    asyncio.create_task(client.generate(p, GREEDY, rid=f"new{i}"))
                    for i, p in enumerate(PROMPTS[:2])
                ]
                await asyncio.sleep(0.3)  # they would have been sent by now
                release.set()
                assert await refit == {url: None}
                return await asyncio.gather(*live), await asyncio.gather(*new), proxy

    try:
        live, new, proxy = asyncio.run(main())
    finally:
        eng.shutdown()
    model_a, model_b = hf_model(tiny_ckpt), hf_model(tiny_ckpt_b)
    k = cfg.num_experts_per_tok
    # Nothing reached the server between the pause and the end of the swap: the resubmissions
    # and the requests made during the refit went out after /continue_generation.
    cont = proxy.index("/continue_generation")
    later = [i for i, (path, rid) in enumerate(proxy.log) if path == "/generate" and rid]
    later = [i for i in later if "resubmit" in proxy.log[i][1] or proxy.log[i][1].startswith("new")]
    assert len(later) == 6 and min(later) > cont > proxy.index("/update_weights_from_disk")

    for i, (g, prompt) in enumerate(zip(live, PROMPTS, strict=True)):
        p = len(prompt)
        assert g.weight_versions == ("0", "1") and g.num_resubmits == 1
        n0 = g.part_lengths[0]
        assert 3 <= n0 < N and g.part_lengths == (n0, N - n0) and g.completion_tokens == N
        assert g.token_weight_versions() == ("0",) * n0 + ("1",) * (N - n0)
        # Token-exact: part 0 as the server sent it, part 1 continued from prompt + part 0.
        sent0, reply0 = proxy.generates[f"live{i}"]
        sent1, reply1 = proxy.generates[f"live{i}.resubmit1"]
        assert reply0["meta_info"]["finish_reason"]["type"] == "abort"
        assert reply0["meta_info"]["weight_version"] == "0" == g.weight_versions[0]
        assert reply1["meta_info"]["weight_version"] == "1"
        assert reply0["output_ids"] + reply1["output_ids"] == g.output_ids
        assert sent0["input_ids"] == prompt and sent1["input_ids"] == prompt + g.output_ids[:n0]
        assert sent1["sampling_params"]["max_new_tokens"] == N - n0
        assert sent1["routed_experts_start_len"] == p + n0 - 1
        # Part 0 is model A's greedy continuation, part 1 model B's; each token's logprob is its
        # own model's (teacher-forced transformers on the whole stitched sequence).
        ids_a, lp_a, routers_a = reference(model_a, prompt, g.output_ids)
        ids_b, lp_b, routers_b = reference(model_b, prompt, g.output_ids)
        lp = np.asarray(g.output_logprobs)
        np.testing.assert_array_equal(g.output_ids[:n0], ids_a[:n0])
        np.testing.assert_array_equal(g.output_ids[n0:], ids_b[n0:])
        np.testing.assert_allclose(lp[:n0], lp_a[:n0], atol=1e-5)
        np.testing.assert_allclose(lp[n0:], lp_b[n0:], atol=1e-5)
        assert np.abs(lp_a[n0:] - lp_b[n0:]).max() > 1e-2  # the check tells A from B
        # Route rows: [0, p + n0 - 1) from part 0 (model A), the rest from part 1 (model B).
        routes = g.routed_experts
        assert routes.shape == (p + N - 1, cfg.num_hidden_layers, k)
        cut = p + n0 - 1
        for layer, want in top_k_routes(routers_a, slice(0, cut), k).items():
            np.testing.assert_array_equal(np.sort(routes[:cut, layer], axis=-1), want)
        for layer, want in top_k_routes(routers_b, slice(cut, p + N - 1), k).items():
            np.testing.assert_array_equal(np.sort(routes[cut:, layer], axis=-1), want)

    for g, prompt in zip(new, PROMPTS, strict=False):  # submitted during the refit
        assert g.weight_versions == ("1",) and g.part_lengths == (N,) and g.num_resubmits == 0
        ids_b, lp_b, _ = reference(model_b, prompt, g.output_ids)
        np.testing.assert_array_equal(g.output_ids, ids_b)
        np.testing.assert_allclose(g.output_logprobs, lp_b, atol=1e-5)


def test_a_reply_finished_on_the_old_weights_and_delivered_after_the_refit_is_kept(
    tiny_ckpt, tiny_ckpt_b
):
    """The request finishes on "0" before the pause; its reply reaches the client only after
    the refit to "1" completed. It is the model's output at "0": accepted, recorded as "0"."""
    eng = start_engine(tiny_ckpt, weight_version="0")
    cfg = eng.model_config
    sp = GREEDY.replace(max_new_tokens=8)

    async def main() -> tuple[Any, Any, Proxy, str | None]:
        async with serving(eng) as server_url:
            proxy = Proxy(server_url)
            async with proxy as url, SGLangClient(None, client_config(url, cfg)) as client:
                answered, release = proxy.hold_reply("late")
                late = asyncio.create_task(client.generate(PROMPTS[0], sp, rid="late"))
                await answered.wait()  # finished upstream on "0", in transit
                await client.refit(str(tiny_ckpt_b), "1")  # the whole swap meanwhile
                version = client.weight_version
                release.set()
                g = await late
                after = await client.generate(PROMPTS[0], sp, rid="after")
                return g, after, proxy, version

    try:
        g, after, proxy, version = asyncio.run(main())
    finally:
        eng.shutdown()
    assert version == "1"
    _, reply = proxy.generates["late"]
    assert proxy.index("/generate", "late") < proxy.index("/pause_generation")
    assert g.output_ids == reply["output_ids"] and g.num_resubmits == 0
    np.testing.assert_allclose(
        g.output_logprobs, [e[0] for e in reply["meta_info"]["output_token_logprobs"]]
    )
    assert g.weight_version == "0" and g.token_weight_versions() == ("0",) * 8
    _, lp_a, _ = reference(hf_model(tiny_ckpt), PROMPTS[0], g.output_ids)
    np.testing.assert_allclose(g.output_logprobs, lp_a, atol=1e-5)
    assert after.weight_version == "1" and after.token_weight_versions() == ("1",) * 8


def test_a_request_that_reaches_the_server_after_the_pause_is_aborted_at_the_next_poll(
    tiny_ckpt, tiny_ckpt_b
):
    """A request sent before the refit began and arriving after ``/pause_generation`` waits in
    the paused server's queue, so ``/flush_cache`` answers 400: the client aborts it at once and
    the next poll flushes (it used to wait ten polls, 2 s of an asynchronous step's refit)."""
    eng = start_engine(tiny_ckpt, weight_version="0")
    cfg = eng.model_config
    calls: list[tuple[str, int]] = []
    late: dict[str, Any] = {}

    async def main() -> None:
        async with serving(eng) as url, SGLangClient(None, client_config(url, cfg)) as client:
            real = client._control

            async def control(s, path, body, timeout):
                status, text = await real(s, path, body, timeout)
                calls.append((path, status))
                if path == "/pause_generation" and "task" not in late:  # one in transit
                    body = {"input_ids": PROMPTS[1], "sampling_params": {"max_new_tokens": 4}}
                    late["task"] = asyncio.create_task(post_json(url + "/generate", body))
                    while not await asyncio.to_thread(
                        lambda: eng.call(lambda: len(eng.waiting)).result()
                    ):
                        await asyncio.sleep(0.01)
                return status, text

            client._control = control  # type: ignore[method-assign]
            await client.refit(str(tiny_ckpt_b), "1")
            late["reply"] = await late["task"]

    try:
        asyncio.run(main())
    finally:
        eng.shutdown()
    flushes = [c for c in calls if c[0] == "/flush_cache"]
    assert flushes == [("/flush_cache", 400), ("/flush_cache", 200)], calls
    assert calls[:4] == [
        ("/pause_generation", 200), ("/flush_cache", 400),
        ("/pause_generation", 200), ("/flush_cache", 200),
    ]  # fmt: skip
    assert late["reply"]["meta_info"]["finish_reason"]["type"] == "abort"


async def post_json(url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return await r.json()
