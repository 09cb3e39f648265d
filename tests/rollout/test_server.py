"""The embedded server against HF transformers and the trainer's forward (float32, in-process)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osworld_jax.contract.errors import EngineError
from osworld_jax.model import forward, load_hf_checkpoint
from osworld_jax.rollout import RolloutConfig, SamplingParams, SGLangClient, decode_routed_experts

from .conftest import hf_logits_and_routes, hf_model, log_softmax, serving, start_engine

PROMPTS = [[7, 42, 300, 511, 12, 99, 250], [1, 2, 3], list(range(100, 140))]


def run(coro):
    return asyncio.run(coro)


async def post(url: str, path: str, body: Any, raw: bool = False) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s:
        data = body if raw else json.dumps(body)
        async with s.post(url + path, data=data) as r:
            text = await r.text()
            try:
                return r.status, json.loads(text)
            except json.JSONDecodeError:
                return r.status, text


def gen_body(ids, **sp):
    return {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 12, "ignore_eos": True, **sp},
        "return_logprob": True,
        "logprob_start_len": 0,
        "return_routed_experts": True,
    }


def routes_of(reply, cfg) -> np.ndarray:
    m = reply["meta_info"]
    rows = m["prompt_tokens"] + m["completion_tokens"] - 1
    return decode_routed_experts(
        m["routed_experts"],
        rows=rows,
        num_layers=cfg.num_hidden_layers,
        top_k=cfg.num_experts_per_tok,
        rid="test",
    )


@pytest.fixture(scope="module")
def replies(engine):
    """Greedy and sampled (T=0.7, seeded, top-p/top-k) replies for each prompt."""
    bodies = []
    for ids in PROMPTS:
        bodies.append(gen_body(ids, temperature=0.0))
        bodies.append(gen_body(ids, temperature=0.7, top_p=0.9, top_k=50, sampling_seed=3))

    async def main():
        async with serving(engine) as url:
            return await asyncio.gather(*(post(url, "/generate", b) for b in bodies))

    out = run(main())
    assert all(status == 200 for status, _ in out), out
    return [(b, r) for b, (_, r) in zip(bodies, out, strict=True)]


def test_logprobs_and_routes_match_hf(engine, tiny_ckpt, replies):
    model = hf_model(tiny_ckpt)
    cfg = engine.model_config
    errs, prompt_errs = [], []
    for body, reply in replies:
        ids, out = body["input_ids"], reply["output_ids"]
        meta = reply["meta_info"]
        assert meta["completion_tokens"] == len(out) == 12
        assert meta["finish_reason"] == {"type": "length", "length": 12}
        t = body["sampling_params"]["temperature"] or 1.0  # greedy logprobs are at T = 1
        logits, routers = hf_logits_and_routes(model, ids + out)
        # logits[j] predicts token j + 1: output token i sits at len(ids) + i.
        ref = log_softmax(logits / t)[np.arange(len(ids) - 1, len(ids) + len(out) - 1), out]
        got = np.array([lp for lp, tok, _ in meta["output_token_logprobs"]])
        assert [tok for _, tok, _ in meta["output_token_logprobs"]] == out
        errs.append(np.abs(got - ref).mean())
        # Prompt logprobs at temperature 1; the first prompt token has none.
        inp = meta["input_token_logprobs"]
        assert inp[0][0] is None and [tok for _, tok, _ in inp] == ids
        ref_in = log_softmax(logits)[np.arange(len(ids) - 1), ids[1:]]
        prompt_errs.append(np.abs(np.array([lp for lp, _, _ in inp[1:]]) - ref_in).mean())
        # Routes: exactly prompt + completion - 1 rows, equal to HF's router top-k.
        routes = routes_of(reply, cfg)
        chex.assert_shape(routes, (len(ids) + len(out) - 1, cfg.num_hidden_layers, 2))
        for layer in range(cfg.num_hidden_layers):
            if layer in routers:
                want = np.sort(np.argsort(-routers[layer], axis=-1)[: len(routes), :2], axis=-1)
                np.testing.assert_array_equal(np.sort(routes[:, layer], axis=-1), want)
            else:
                assert (routes[:, layer] == -1).all()  # dense layer
        if body["sampling_params"]["temperature"] == 0.0:  # greedy == HF argmax
            assert out == list(logits[len(ids) - 1 : -1].argmax(-1))
    print(f"server vs HF: output logprob MAE max {max(errs):.2e}, prompt {max(prompt_errs):.2e}")
    assert max(errs) < 1e-4 and max(prompt_errs) < 1e-4


def test_trainer_logprobs_and_route_replay_match_server(engine, tiny_ckpt, replies):
    policy = load_hf_checkpoint(tiny_ckpt, dtype=jnp.float32)
    cfg = policy.config
    fwd = jax.jit(forward, static_argnums=(1, 2))
    max_err, replay_agree, replay_rows = 0.0, 0, 0
    for body, reply in replies:
        ids, out = body["input_ids"], reply["output_ids"]
        t = body["sampling_params"]["temperature"] or 1.0
        n = len(ids) + len(out)
        # One padded shape (64) for every reply, as the trainer's batches are padded.
        seq = np.zeros((1, 64), np.int32)
        seq[0, :n] = ids + out
        seg = (np.arange(64) < n).astype(np.int32)[None]
        routes = routes_of(reply, cfg)  # [n - 1, L, K]: route of token j when it was the input
        replay = np.full((1, 64, *routes.shape[1:]), -1, np.int32)
        replay[0, : n - 1] = routes
        for replay_experts in (None, replay):
            o = fwd(
                policy.params(),
                cfg,
                policy.runtime,
                seq,
                segment_ids=seg,
                replay_experts=replay_experts,
            )
            lp = jax.nn.log_softmax(o.logits[0] / t, axis=-1)
            trainer = np.asarray(lp[np.arange(len(ids) - 1, n - 1), np.asarray(out)])
            server = np.array([lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]])
            max_err = max(max_err, float(np.abs(trainer - server).max()))
            if replay_experts is not None:
                used = np.asarray(o.routed_experts[0, : n - 1])  # [n - 1, L, K]
                same = (np.sort(used, -1) == np.sort(routes, -1)).all(axis=(-1, -2))
                replay_agree += int(same.sum())
                replay_rows += same.size
    print(f"trainer vs server logprobs: max abs {max_err:.2e}; replay {replay_agree}/{replay_rows}")
    assert max_err < 1e-5
    assert replay_agree == replay_rows  # 100% of rows


def test_sampling_semantics(engine):
    async def main():
        async with serving(engine) as url:
            ids = PROMPTS[0]
            seeded = [gen_body(ids, temperature=1.0, sampling_seed=11) for _ in range(2)]
            a, b = await asyncio.gather(*(post(url, "/generate", x) for x in seeded))
            assert a[1]["output_ids"] == b[1]["output_ids"]  # same seed, same sample
            # top_k=1 at any temperature is greedy; its logprobs are still at that temperature.
            _, g = await post(url, "/generate", gen_body(ids, temperature=0.0))
            _, k1 = await post(url, "/generate", gen_body(ids, temperature=2.0, top_k=1))
            assert k1["output_ids"] == g["output_ids"]
            lp_g = [x[0] for x in g["meta_info"]["output_token_logprobs"]]
            lp_k1 = [x[0] for x in k1["meta_info"]["output_token_logprobs"]]
            assert all(x < y for x, y in zip(lp_k1, lp_g, strict=True))  # flatter at T = 2
            # stop_token_ids: finish at the first occurrence of a token greedy produces.
            stop_tok = g["output_ids"][4]
            first = g["output_ids"].index(stop_tok)
            _, s = await post(
                url, "/generate", gen_body(ids, temperature=0.0, stop_token_ids=[stop_tok])
            )
            assert s["output_ids"] == g["output_ids"][: first + 1]
            assert s["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
            # a stop string cuts the text (trimmed) but keeps the tokens that produced it.
            text = engine.tokenizer.decode(g["output_ids"])
            stop = text[len(text) // 2 : len(text) // 2 + 2]
            if stop.strip():
                _, st = await post(url, "/generate", gen_body(ids, temperature=0.0, stop=[stop]))
                assert st["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
                assert stop not in st["text"] and text.startswith(st["text"])
            # max_new_tokens 0: prompt logprobs and prompt routes only (p - 1 rows).
            _, z = await post(url, "/generate", gen_body(ids, max_new_tokens=0))
            assert z["output_ids"] == [] and z["meta_info"]["finish_reason"]["type"] == "length"
            np.testing.assert_array_equal(
                routes_of(z, engine.model_config), routes_of(g, engine.model_config)[: len(ids) - 1]
            )
            zin, gin = (
                z["meta_info"]["input_token_logprobs"],
                g["meta_info"]["input_token_logprobs"],
            )
            assert zin[0][0] is None and [t for _, t, _ in zin] == ids
            np.testing.assert_allclose([x[0] for x in zin[1:]], [x[0] for x in gin[1:]], atol=1e-5)
            # EOS stops unless ignore_eos; min_new_tokens suppresses it (and stop ids) before.
            eos = engine.eos_ids[0]
            body = gen_body(ids, temperature=0.0, min_new_tokens=5, stop_token_ids=[stop_tok])
            _, m = await post(url, "/generate", body)
            assert stop_tok not in m["output_ids"][:5]
            assert eos not in m["output_ids"][:5]

    run(main())


def test_batch_text_and_streaming(engine):
    async def main():
        async with serving(engine) as url:
            body = gen_body([PROMPTS[0], PROMPTS[1]], temperature=0.0)
            body["rid"] = ["b0", "b1"]
            status, batch = await post(url, "/generate", body)
            assert status == 200 and [r["meta_info"]["id"] for r in batch] == ["b0", "b1"]
            _, single = await post(url, "/generate", gen_body(PROMPTS[1], temperature=0.0))
            assert batch[1]["output_ids"] == single["output_ids"]
            # text in, text out through tokenizer.json
            _, t = await post(
                url,
                "/generate",
                {"text": "open the terminal", "sampling_params": {"max_new_tokens": 4}},
            )
            assert t["meta_info"]["prompt_tokens"] == len(
                engine.tokenizer.encode("open the terminal").ids
            )
            assert t["text"] == engine.tokenizer.decode(t["output_ids"])
            # SSE: cumulative events, the last equals the non-streamed reply, then [DONE].
            events = []
            async with aiohttp.ClientSession() as s:
                b = {**gen_body(PROMPTS[1], temperature=0.0), "stream": True}
                async with s.post(url + "/generate", json=b) as r:
                    assert r.headers["Content-Type"].startswith("text/event-stream")
                    async for line in r.content:
                        if line.startswith(b"data: "):
                            events.append(line[6:].strip())
            assert events[-1] == b"[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert [len(c["output_ids"]) for c in chunks] == list(range(1, 13))
            assert chunks[-1]["output_ids"] == single["output_ids"]
            assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
            assert (
                chunks[-1]["meta_info"]["routed_experts"] == single["meta_info"]["routed_experts"]
            )
            assert all("routed_experts" not in c["meta_info"] for c in chunks[:-1])

    run(main())


def test_malformed_bodies_get_400(engine):
    bad = [
        b"{not json",
        b"",
        json.dumps([1, 2]).encode(),
        json.dumps({"sampling_params": {}}).encode(),
        json.dumps({"input_ids": [1], "text": "x"}).encode(),
        json.dumps({"input_ids": []}).encode(),
        json.dumps({"input_ids": ["a"]}).encode(),
        json.dumps({"input_ids": [10**9]}).encode(),
        json.dumps({"input_ids": [1] * 200}).encode(),  # longer than the context
        json.dumps({"input_ids": [1], "sampling_params": {"temperature": -1}}).encode(),
        json.dumps({"input_ids": [1], "sampling_params": {"top_p": 0}}).encode(),
        json.dumps({"input_ids": [1], "sampling_params": {"top_k": 0}}).encode(),
        json.dumps({"input_ids": [1], "sampling_params": {"max_new_tokens": -2}}).encode(),
        json.dumps({"input_ids": [1], "sampling_params": {"bogus": 1}}).encode(),
        json.dumps({"input_ids": [1], "sampling_params": {"repetition_penalty": 1.3}}).encode(),
        json.dumps({"input_ids": [1], "sampling_params": {"stop": 5}}).encode(),
        json.dumps({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 3}).encode(),
        json.dumps(
            {"input_ids": [1, 2], "return_routed_experts": True, "routed_experts_start_len": 3}
        ).encode(),
        json.dumps({"input_ids": [[1], [2]], "rid": ["only-one"]}).encode(),
        json.dumps({"input_ids": [1], "image_data": "abc"}).encode(),
        json.dumps({"input_ids": [1], "stream": "yes"}).encode(),
    ]

    async def main():
        async with serving(engine) as url:
            for body in bad:
                status, reply = await post(url, "/generate", body, raw=True)
                assert status == 400, (body, status, reply)
                assert isinstance(reply, dict) and "error" in reply, (body, reply)
            for path, body in [
                ("/update_weights_from_disk", b"{}"),
                ("/pause_generation", b'{"mode": "sideways"}'),
                ("/abort_request", b"[]"),
            ]:
                status, reply = await post(url, path, body, raw=True)
                assert status == 400, (path, reply)

    run(main())


def test_abort_and_pause_return_partial_output(engine):
    async def main():
        async with serving(engine) as url:
            long = gen_body(PROMPTS[0], temperature=0.0, max_new_tokens=100)
            cfg = engine.model_config

            async def wait_for_progress(prefix: str):
                while not any(
                    r is not None and r.rid.startswith(prefix) and len(r.output_ids) >= 3
                    for r in engine.slots
                ):
                    await asyncio.sleep(0.005)

            task = asyncio.create_task(post(url, "/generate", {**long, "rid": "ab-1"}))
            await wait_for_progress("ab-")
            await post(url, "/abort_request", {"rid": "ab-"})  # prefix match
            status, r = await task
            m = r["meta_info"]
            assert status == 200 and m["finish_reason"]["type"] == "abort"
            n = m["completion_tokens"]
            assert 3 <= n < 100 and len(r["output_ids"]) == n
            assert len(m["output_token_logprobs"]) == n
            assert routes_of(r, cfg).shape[0] == len(PROMPTS[0]) + n - 1

            # pause(abort): in-flight requests return partial; flush is 400 while one waits.
            task = asyncio.create_task(post(url, "/generate", {**long, "rid": "pz-1"}))
            await wait_for_progress("pz-")
            status, _ = await post(url, "/pause_generation", {"mode": "abort"})
            assert status == 200
            status, r = await task
            assert r["meta_info"]["finish_reason"]["type"] == "abort"
            assert 3 <= r["meta_info"]["completion_tokens"] < 100
            queued = asyncio.create_task(post(url, "/generate", gen_body(PROMPTS[1])))
            await asyncio.sleep(0.2)
            status, _ = await post(url, "/flush_cache", {})
            assert status == 400  # a request waits while paused
            await post(url, "/pause_generation", {"mode": "abort"})
            status, _ = await post(url, "/flush_cache", {})
            assert status == 200
            assert (await queued)[1]["meta_info"]["finish_reason"]["type"] == "abort"
            await post(url, "/continue_generation", {})
            status, r = await post(url, "/generate", gen_body(PROMPTS[1]))
            assert r["meta_info"]["finish_reason"]["type"] == "length"

    run(main())


def test_64_concurrent_requests_through_the_client(engine):
    cfg = engine.model_config

    async def main():
        async with serving(engine) as url:
            rc = RolloutConfig(
                urls=(url,),
                return_routed_experts=True,
                num_layers=cfg.num_hidden_layers,
                num_experts_per_tok=cfg.num_experts_per_tok,
            )
            sp = SamplingParams(temperature=0.8, max_new_tokens=10, ignore_eos=True)
            async with SGLangClient(None, rc) as client:
                gens = await asyncio.gather(
                    *(
                        client.generate([5 + i % 50, 9, 33, 70 + i], sp, rid=f"c{i}")
                        for i in range(64)
                    )
                )
        assert len(gens) == 64
        for g in gens:  # every reply validated by the client: logprobs, ids, route rows
            assert g.completion_tokens == 10 and g.finish_reason["type"] == "length"
            assert g.routed_experts is not None and g.routed_experts.shape[0] == 4 + 10 - 1
            assert g.weight_version == "v0"

    run(main())


def test_refit_switches_to_the_new_weights(tiny_ckpt, tiny_ckpt_b):
    eng = start_engine(tiny_ckpt, weight_version="v0")  # same shapes: no new compiles
    ids = PROMPTS[0]
    cfg = eng.model_config

    def hf_greedy(path, n=12):
        import torch

        model, seq = hf_model(path), list(ids)
        with torch.no_grad():
            for _ in range(n):
                seq.append(int(model(torch.as_tensor([seq])).logits[0, -1].argmax()))
        return seq[len(ids) :]

    async def main():
        async with serving(eng) as url:
            rc = RolloutConfig(
                urls=(url,),
                return_routed_experts=True,
                num_layers=cfg.num_hidden_layers,
                num_experts_per_tok=cfg.num_experts_per_tok,
            )
            sp = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
            async with SGLangClient(None, rc) as client:
                before = await client.generate(ids, sp, rid="before")
                report = await client.refit(str(tiny_ckpt_b), "v1")
                assert report == {url: None}
                after = await client.generate(ids, sp, rid="after")
                async with aiohttp.ClientSession() as s:
                    async with s.get(url + "/model_info") as r:
                        info = await r.json()
            return before, after, info

    try:
        before, after, info = run(main())
    finally:
        eng.shutdown()
    assert before.output_ids == hf_greedy(tiny_ckpt) and before.weight_version == "v0"
    assert after.output_ids == hf_greedy(tiny_ckpt_b) and after.weight_version == "v1"
    assert before.output_ids != after.output_ids
    assert info["weight_version"] == "v1" and info["model_path"] == str(tiny_ckpt_b)


def test_pause_retract_and_in_place_resume_exactly(engine):
    """A retracted request is re-prefilled from prompt + output; greedy output, logprobs and
    routes equal an uninterrupted run's. In-place pause keeps the slot (flush answers 400)."""
    cfg = engine.model_config

    async def main():
        async with serving(engine) as url:
            body = gen_body(PROMPTS[0], temperature=0.0, max_new_tokens=30)
            _, ref = await post(url, "/generate", body)
            for mode in ("retract", "in_place"):
                rid = f"{mode}-1"
                task = asyncio.create_task(post(url, "/generate", {**body, "rid": rid}))
                while not any(
                    r is not None and r.rid == rid and len(r.output_ids) >= 3 for r in engine.slots
                ):
                    await asyncio.sleep(0.005)
                assert (await post(url, "/pause_generation", {"mode": mode}))[0] == 200
                await asyncio.sleep(0.1)
                assert not task.done()  # neither mode ends the request
                assert (await post(url, "/flush_cache", {}))[0] == 400
                await post(url, "/continue_generation", {})
                status, r = await task
                assert r["output_ids"] == ref["output_ids"], mode
                lp = [x[0] for x in r["meta_info"]["output_token_logprobs"]]
                lp_ref = [x[0] for x in ref["meta_info"]["output_token_logprobs"]]
                np.testing.assert_allclose(lp, lp_ref, atol=1e-5)
                np.testing.assert_array_equal(routes_of(r, cfg), routes_of(ref, cfg))

    run(main())


def test_precompile_leaves_no_compile_for_traffic(engine):
    """After `precompile`, serving prompts of that length compiles nothing new."""
    from osworld_jax.server import runner

    engine.precompile(len(PROMPTS[0]), len(PROMPTS[0]) + 12)
    before = (runner._prefill._cache_size(), runner._decode._cache_size())

    async def main():
        async with serving(engine) as url:
            bodies = [gen_body(PROMPTS[0], temperature=0.5) for _ in range(5)]
            out = await asyncio.gather(*(post(url, "/generate", b) for b in bodies))
            assert all(s == 200 for s, _ in out)

    run(main())
    assert (runner._prefill._cache_size(), runner._decode._cache_size()) == before


def test_bucket_set_is_small_fixed_and_the_memory_plans_it(engine):
    from osworld_jax.model.serving import CacheLayout
    from osworld_jax.server.buckets import serving_buckets
    from osworld_jax.server.program_memory import layout_buckets

    # The default run's server (8 slots x 4096 tokens): 4 lengths, 4 decode batches, whatever
    # the prompt lengths; past the slot length a prompt is refused, not compiled.
    default = serving_buckets(slot_len=4096, num_slots=8, min_bucket=16)
    assert default.lengths == (512, 1024, 2048, 4096) and default.batches == (1, 2, 4, 8)
    assert serving_buckets(slot_len=4096, num_slots=64, min_bucket=16).batches == (8, 16, 32, 64)
    assert {default.length(n) for n in range(1, 4097)} == set(default.lengths)
    assert {default.batch(n) for n in range(1, 9)} == set(default.batches)
    # A prefill after a kept prefix: (suffix bucket, window) pairs, the windows the two largest.
    assert {default.window(n) for n in range(1, 4097)} == {2048, 4096}
    assert [default.prefill_rows(s) for s in default.lengths] == [8, 8, 4, 2]
    # --extra-length-buckets 3072: a 2,100-token prompt pads to 3,072; nothing past the slot.
    extra = serving_buckets(slot_len=4096, num_slots=8, min_bucket=16, extra_lengths=(3072,))
    assert extra.length(2100) == 3072 and extra.window(4000) == 4096 and extra.length(1900) == 2048
    with pytest.raises(EngineError, match="slot length 4096"):
        serving_buckets(slot_len=4096, num_slots=8, extra_lengths=(5000,))
    # The engine's set is the one the memory plan compiles (one function).
    r = engine.runner
    layout = CacheLayout(engine.context_length, r.num_slots, r.slot_len)
    planned = layout_buckets(layout, engine.config.min_bucket, engine.config.max_prefill_batch)
    assert (planned.lengths, planned.max_prefill_batch) == (r.buckets.lengths, 8)


def test_traffic_after_warming_every_bucket_compiles_nothing(engine):
    """`precompile()` warms the whole text set once; prompts of any length then reuse it."""
    from osworld_jax.server import runner

    assert engine.precompile() == 2 * len(engine.runner.buckets.lengths) + len(
        engine.runner.buckets.lengths
    ) * len(engine.runner.buckets.batches)
    before = (runner._prefill._cache_size(), runner._decode._cache_size())
    rng = np.random.default_rng(0)
    lengths = [1, 5, 40, 63, 64, 65, 100]  # both length buckets; alone and batched

    async def main():
        async with serving(engine) as url:
            for group in ([100], lengths):
                bodies = [
                    {
                        "input_ids": rng.integers(1, 500, n).tolist(),
                        "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
                    }
                    for n in group
                ]
                out = await asyncio.gather(*(post(url, "/generate", b) for b in bodies))
                assert all(status == 200 for status, _ in out)

    run(main())
    assert (runner._prefill._cache_size(), runner._decode._cache_size()) == before


def test_endpoints_answer_503_until_the_engine_is_ready():
    from aiohttp import web

    from osworld_jax.server.app import build_app
    from osworld_jax.server.http_base import ENGINE_KEY

    async def main():
        app = build_app(None)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as s:
                for path in ("/health", "/model_info"):
                    async with s.get(url + path) as r:
                        assert r.status == 503
                status, _ = await post(url, "/generate", {"input_ids": [1]})
                assert status == 503
                app[ENGINE_KEY].error = "engine failed to start: boom"
                async with s.get(url + "/health") as r:
                    assert r.status == 500 and "boom" in await r.text()
        finally:
            await runner.cleanup()

    run(main())


def test_refit_mid_generation_resubmits_and_stitches_exactly(tiny_ckpt):
    """16 greedy requests in flight, a refit to the same weights under a new version: each
    aborted request is resubmitted and its stitched ids, logprobs and route rows equal an
    uninterrupted run's."""
    eng = start_engine(tiny_ckpt, weight_version="v0")
    cfg = eng.model_config
    prompts = [[3 + i, 40, 41, 42 + i] for i in range(16)]

    async def main():
        async with serving(eng) as url:
            rc = RolloutConfig(
                urls=(url,),
                return_routed_experts=True,
                num_layers=cfg.num_hidden_layers,
                num_experts_per_tok=cfg.num_experts_per_tok,
                max_abort_resubmits=2,
            )
            sp = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
            async with SGLangClient(None, rc) as client:
                ref = await asyncio.gather(
                    *(client.generate(p, sp, rid=f"ref{i}") for i, p in enumerate(prompts))
                )
                tasks = [
                    asyncio.create_task(client.generate(p, sp, rid=f"live{i}"))
                    for i, p in enumerate(prompts)
                ]
                while sum(len(r.output_ids) for r in eng.slots if r is not None) < 16 * 3:
                    await asyncio.sleep(0.005)
                await client.refit(str(tiny_ckpt), "v1")
                live = await asyncio.gather(*tasks)
            return ref, live

    try:
        ref, live = run(main())
    finally:
        eng.shutdown()
    # Running requests come back with partial v0 output; queued ones are resubmitted whole.
    assert sum(len(g.weight_versions) > 1 for g in live) >= 4
    for r, g, p in zip(ref, live, prompts, strict=True):
        assert g.output_ids == r.output_ids and g.completion_tokens == 40
        np.testing.assert_allclose(g.output_logprobs, r.output_logprobs, atol=1e-5)
        assert g.routed_experts.shape == (len(p) + 40 - 1, cfg.num_hidden_layers, 2)
        np.testing.assert_array_equal(g.routed_experts, r.routed_experts)
        assert g.weight_version == "v1"
        if len(g.weight_versions) > 1:
            assert g.weight_versions[0] == "v0" and g.weight_versions[-1] == "v1"
            assert g.num_resubmits >= 1


def test_a_turn_extending_the_last_reuses_its_kv_and_matches_hf(engine, tiny_ckpt):
    """Turn 2 = turn 1's prompt + reply + new tokens: the slot's kept rows serve the shared
    prefix (cached_tokens), and logprobs and every route row still equal transformers'. With
    prompt logprobs from 0, or after /flush_cache, nothing is reused."""
    cfg = engine.model_config
    turn1 = [(7 * i + 3) % 500 + 10 for i in range(60)]

    async def main():
        async with serving(engine) as url:
            _, r1 = await post(url, "/generate", gen_body(turn1, temperature=0.0, max_new_tokens=8))
            turn2 = turn1 + r1["output_ids"] + [11, 12, 13, 14, 15]
            b2 = {**gen_body(turn2, temperature=0.7, sampling_seed=1, max_new_tokens=8)}
            b2["logprob_start_len"] = -1
            _, r2 = await post(url, "/generate", b2)
            _, full = await post(url, "/generate", {**b2, "logprob_start_len": 0})
            await post(url, "/flush_cache", {})
            _, flushed = await post(url, "/generate", b2)
            return turn2, r1, r2, full, flushed

    turn2, r1, r2, full, flushed = run(main())
    assert r1["meta_info"]["cached_tokens"] == 0
    assert r2["meta_info"]["cached_tokens"] == len(turn1) + 8 - 1  # prompt + reply - last
    assert full["meta_info"]["cached_tokens"] == 0  # prompt logprobs need every position
    assert flushed["meta_info"]["cached_tokens"] == 0
    for r in (full, flushed):
        assert r["output_ids"] == r2["output_ids"]
        assert r["meta_info"]["routed_experts"] == r2["meta_info"]["routed_experts"]
    out = r2["output_ids"]
    logits, routers = hf_logits_and_routes(hf_model(tiny_ckpt), turn2 + out)
    pos = np.arange(len(turn2) - 1, len(turn2) + len(out) - 1)
    want = log_softmax(logits[pos] / 0.7)[np.arange(len(out)), out]
    got = np.array([e[0] for e in r2["meta_info"]["output_token_logprobs"]])
    np.testing.assert_allclose(got, want, atol=1e-5)
    routes = routes_of(r2, cfg)
    for layer, router in routers.items():
        top = np.sort(np.argsort(-router, axis=-1)[: len(routes), :2], axis=-1)
        np.testing.assert_array_equal(np.sort(routes[:, layer], axis=-1), top)
