"""Hostile requests against the embedded server (issue 16, items 5-7): each was an attack first.

5. size and shape limits (413 / 400, never a 500 or a stall of ``/health``);
6. a non-streaming client that disconnects frees its slot;
7. ``/update_weights_from_disk`` refuses a checkpoint that is not the served architecture.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import aiohttp
import numpy as np
import pytest

from osworld_jax.model.safetensors_io import SafetensorsFile, write_safetensors
from osworld_jax.server.protocol import ServerLimits

from .conftest import make_ckpt, serving
from .test_server import post

PROMPT = [7, 42, 300, 511, 12, 99, 250]


def run(coro):
    return asyncio.run(coro)


def body_with(**sp) -> dict:
    return {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, **sp}}


def test_size_and_shape_limits(engine):
    limits = ServerLimits(max_request_bytes=1 << 16, max_json_depth=8, max_json_values=4096)

    async def main():
        async with serving(engine, limits) as url:
            big = json.dumps(body_with(stop=["x" * (1 << 17)])).encode()
            status, reply = await post(url, "/generate", big, raw=True)
            assert status == 413 and "--max-request-bytes" in reply["error"]["message"]
            # chunked (no Content-Length): still 413
            async with aiohttp.ClientSession() as s:

                async def chunks():
                    for i in range(0, len(big), 4096):
                        yield big[i : i + 4096]

                async with s.post(url + "/generate", data=chunks()) as r:
                    assert r.status == 413
            for deep in (b"[" * 30_000 + b"]" * 30_000, b'{"a":' * 9 + b"1" + b"}" * 9):
                status, reply = await post(url, "/generate", deep, raw=True)
                assert status == 400 and "nests deeper than 8" in reply["error"]["message"]
            many = json.dumps({"input_ids": [1] * 4096, "sampling_params": {}}).encode()
            status, reply = await post(url, "/generate", many, raw=True)  # counted, not parsed
            assert status == 400 and "more than 4096 values" in reply["error"]["message"]
            nested_ok = {"input_ids": [PROMPT], "sampling_params": [{"max_new_tokens": 1}]}
            status, _ = await post(url, "/generate", nested_ok)
            assert status == 200
            for sp, word in (
                ({"stop": [f"s{i}" for i in range(33)]}, "33 strings"),
                ({"stop": "y" * 1025}, "1025 characters"),
                ({"stop": [""]}, "non-empty"),
            ):
                status, reply = await post(url, "/generate", body_with(**sp))
                assert status == 400 and word in reply["error"]["message"], reply
            status, _ = await post(url, "/generate", body_with(stop=["z" * 1024] * 32))
            assert status == 200
            # control endpoints share the limits
            status, _ = await post(url, "/pause_generation", b"[" * 50_000, raw=True)
            assert status == 400
            status, _ = await post(url, "/abort_request", big, raw=True)
            assert status == 413

    run(main())


@pytest.mark.serial  # a 1 s latency bound: not beside another worker's compile on 2 cores
def test_hostile_requests_never_stall_health(engine):
    """While hostile bodies are in flight, ``/health`` answers every poll within 1 s."""
    ctx = engine.context_length

    async def main():
        async with serving(engine) as url:  # default limits
            latencies: list[float] = []
            failures: list[str] = []
            stop = asyncio.Event()

            async def poll():
                async with aiohttp.ClientSession() as s:
                    while not stop.is_set():
                        t = time.perf_counter()
                        try:
                            async with s.get(
                                url + "/health", timeout=aiohttp.ClientTimeout(total=1.0)
                            ) as r:
                                if r.status != 200:
                                    failures.append(f"status {r.status}")
                        except TimeoutError:
                            failures.append("timeout")
                        latencies.append(time.perf_counter() - t)
                        await asyncio.sleep(0.02)

            attacks = [
                json.dumps(body_with(stop=["a" * 50_000_000])).encode(),  # 50 MB stop string
                json.dumps(
                    body_with(stop=["b" * 1_000_000])
                ).encode(),  # 1 MB, under the body limit
                json.dumps({"text": "c" * 8_000_000, "sampling_params": {}}).encode(),
                json.dumps({"text": "d e f " * (ctx * 2), "sampling_params": {}}).encode(),
                b"[" * 100_000 + b"]" * 100_000,
                json.dumps({"input_ids": list(range(3_000_000))}).encode(),
            ]
            poller = asyncio.create_task(poll())
            await asyncio.sleep(0.2)
            async with asyncio.timeout(60):
                results = await asyncio.gather(
                    *(post(url, "/generate", a, raw=True) for a in attacks)
                )
            stop.set()
            await poller
            statuses = [s for s, _ in results]
            assert statuses == [413, 400, 400, 400, 400, 400], results
            assert not failures, failures
            print(f"/health under attack: {len(latencies)} polls, max {max(latencies):.3f} s")
            assert max(latencies) < 1.0

    run(main())


def test_disconnected_client_frees_its_slot(engine):
    async def main():
        async with serving(engine) as url:
            port = int(url.rsplit(":", 1)[1])
            await post(url, "/pause_generation", {"mode": "in_place"})  # hold it in its slot
            try:
                body = json.dumps(
                    {
                        "input_ids": PROMPT,
                        "rid": "gone-1",
                        "sampling_params": {"max_new_tokens": 90},
                    }
                ).encode()
                sock = socket.create_connection(("127.0.0.1", port))
                sock.sendall(
                    b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                # also a request that is only queued behind it
                queued = asyncio.create_task(
                    post(url, "/generate", {**json.loads(body), "rid": "gone-10"})
                )

                def where(rid: str) -> str | None:
                    if any(r is not None and r.rid == rid for r in engine.slots):
                        return "slot"
                    return "waiting" if any(r.rid == rid for r in engine.waiting) else None

                for _ in range(500):
                    if where("gone-1") and where("gone-10"):
                        break
                    await asyncio.sleep(0.01)
                # admit both into slots while paused (a prefill, no decode): held mid-generation
                await asyncio.wrap_future(engine.call(engine._admit))
                assert where("gone-1") == where("gone-10") == "slot"
                sock.close()  # the client vanishes mid-generation
                t = time.perf_counter()
                while where("gone-1") is not None and time.perf_counter() - t < 5:
                    await asyncio.sleep(0.02)
                print(f"slot freed {time.perf_counter() - t:.2f} s after the disconnect")
                assert where("gone-1") is None
                # only the vanished client's request: the prefix-sharing one still runs
                assert where("gone-10") is not None
            finally:
                await post(url, "/continue_generation", {})
            status, reply = await queued
            assert status == 200 and reply["meta_info"]["finish_reason"]["type"] != "abort"

    run(main())


def _with_extra_layer(src, dst, *, seed: int):
    """``src``'s architecture (config.json) plus a second file holding one more layer's tensors."""
    from osworld_jax.model import Qwen3MoeConfig
    from osworld_jax.model.tiny import make_tiny_checkpoint

    layers = Qwen3MoeConfig.from_json(src).num_hidden_layers
    make_ckpt(dst, seed=seed)  # same architecture, other weights
    more = make_tiny_checkpoint(
        dst.parent / "more", seed=seed, initializer_range=0.1, num_hidden_layers=layers + 1
    )
    f = SafetensorsFile(more / "model.safetensors")
    extra = {n: np.array(f.get(n)) for n in f.names() if f"layers.{layers}." in n}
    assert extra
    write_safetensors(dst / "model-extra.safetensors", extra)


@pytest.mark.parametrize("attack", ["config_layers", "extra_layer_tensors", "tensor_shape"])
def test_refit_refuses_another_architecture(engine, tiny_ckpt, tmp_path, attack):
    from osworld_jax.model import Qwen3MoeConfig
    from osworld_jax.model.tiny import make_tiny_checkpoint

    layers = Qwen3MoeConfig.from_json(tiny_ckpt).num_hidden_layers
    bad = tmp_path / "bad"
    if attack == "config_layers":
        make_tiny_checkpoint(bad, seed=1, initializer_range=0.1, num_hidden_layers=layers + 1)
        want = f"config.json: num_hidden_layers is {layers + 1}, the served model has {layers}"
    elif attack == "extra_layer_tensors":
        _with_extra_layer(tiny_ckpt, bad, seed=1)
        want = f"tensor model.layers.{layers}."
    else:
        make_ckpt(bad, seed=1)
        f = SafetensorsFile(bad / "model.safetensors")
        tensors = {n: np.array(f.get(n)) for n in f.names()}
        del f
        name = "model.layers.0.self_attn.q_proj.weight"
        tensors[name] = tensors[name][:-1]
        write_safetensors(bad / "model.safetensors", tensors)
        want = f"tensor {name} has shape"
    greedy = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}

    async def main():
        async with serving(engine) as url:
            _, before = await post(url, "/generate", greedy)
            status, reply = await post(
                url,
                "/update_weights_from_disk",
                {"model_path": str(bad), "weight_version": "evil", "abort_all_requests": True},
            )
            assert status == 400 and reply["success"] is False, reply
            assert want in reply["message"] and "still serving" in reply["message"], reply
            _, after = await post(url, "/generate", greedy)
            return before, after

    version = engine.weight_version
    before, after = run(main())
    assert after["output_ids"] == before["output_ids"]  # the old weights still serve
    assert after["meta_info"]["weight_version"] == version == engine.weight_version
    assert engine.model_path == str(tiny_ckpt)
