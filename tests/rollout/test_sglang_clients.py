"""The embedded server answers the exact requests real SGLang clients send (issue 14, item 4).

Each body below is what the client's source builds (SGLang 0.5.23 ``sglang/lang/backend/
runtime_endpoint.py`` ``generate`` / ``select`` with ``SglSamplingParams`` defaults,
``sglang/utils.py`` ``wait_for_server``; slime ``slime/rollout/sglang_rollout.py`` ``generate``
and ``slime/backends/sglang_utils/server_control.py``; verl
``verl/workers/rollout/sglang_rollout/async_sglang_server.py`` ``generate``).
"""

from __future__ import annotations

import asyncio
import json
import shutil

import aiohttp
import numpy as np
import pytest

from osworld_jax.contract.errors import EngineError
from osworld_jax.rollout import RolloutConfig, SamplingParams, SGLangClient, decode_routed_experts

from .conftest import ENGINE_KW, serving
from .test_server import post

PROMPT = [7, 42, 300, 511, 12, 99, 250]


def run(coro):
    return asyncio.run(coro)


async def get(url: str, path: str, headers: dict | None = None) -> tuple[int, object]:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + path, headers=headers) as r:
            text = await r.text()
            try:
                return r.status, json.loads(text)
            except json.JSONDecodeError:
                return r.status, text


def sgl_gen_body(text: str) -> dict:
    """``RuntimeEndpoint.generate`` for ``sgl.gen("a", max_tokens=8, temperature=0.6,
    return_logprob=True, logprob_start_len=0, return_text_in_logprobs=True)``."""
    return {
        "text": text,
        "sampling_params": {
            "skip_special_tokens": True,
            "spaces_between_special_tokens": True,
            "max_new_tokens": 8,
            "min_new_tokens": 0,
            "n": 1,
            "stop": [],
            "stop_token_ids": [],
            "stop_regex": [],
            "temperature": 0.6,
            "top_p": 1.0,
            "top_k": -1,
            "min_p": 0.0,
            "frequency_penalty": 0.0,
            "presence_penalty": 0.0,
            "ignore_eos": False,
            "regex": None,
            "json_schema": None,
        },
        "return_logprob": True,
        "logprob_start_len": 0,
        "return_text_in_logprobs": True,
    }


def test_sgl_gen_with_empty_lists_and_token_texts(engine):
    tok = engine.tokenizer

    async def main():
        async with serving(engine) as url:
            status, reply = await post(url, "/generate", sgl_gen_body("open the terminal"))
            assert status == 200, reply
            meta = reply["meta_info"]
            ids = tok.encode("open the terminal").ids
            for entries, want_ids in (
                (meta["output_token_logprobs"], reply["output_ids"]),
                (meta["input_token_logprobs"], ids),
            ):
                assert [e[1] for e in entries] == want_ids
                # the third element is each token's own text, special tokens kept
                assert [e[2] for e in entries] == [
                    tok.decode([t], skip_special_tokens=False) for t in want_ids
                ]
            # Every other list- / object- / string-valued parameter: empty is neutral.
            body = sgl_gen_body("open the terminal")
            body["sampling_params"].update(
                stop_regex="", logit_bias={}, custom_params={}, json_schema="", regex="", ebnf=""
            )
            body.update(image_data=[], token_ids_logprob=[], lora_path=None, top_logprobs_num=0)
            status, reply = await post(url, "/generate", body)
            assert status == 200, reply
            # Non-empty values of what this server does not implement stay a named 400.
            body["sampling_params"]["stop_regex"] = ["\\d+"]
            status, reply = await post(url, "/generate", body)
            assert status == 400 and "stop_regex" in reply["error"]["message"]

    run(main())


def test_sgl_select_requests(engine):
    """``RuntimeEndpoint.select``: prefix, choices with token texts (healing), unconditional."""
    tok = engine.tokenizer
    prefix, choices = "open the terminal then", ["yes", "no", "maybe"]

    async def main():
        async with serving(engine) as url:
            status, pre = await post(
                url, "/generate", {"text": prefix, "sampling_params": {"max_new_tokens": 0}}
            )
            assert status == 200 and pre["output_ids"] == []
            prompt_len = pre["meta_info"]["prompt_tokens"]
            start = max(prompt_len - 2, 0)
            status, obj = await post(
                url,
                "/generate",
                {
                    "text": [prefix + c for c in choices],
                    "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                    "return_logprob": True,
                    "return_text_in_logprobs": True,
                    "logprob_start_len": start,
                },
            )
            assert status == 200 and len(obj) == len(choices)
            for c, r in zip(choices, obj, strict=True):
                inp = r["meta_info"]["input_token_logprobs"]
                ids = tok.encode(prefix + c).ids
                assert [e[1] for e in inp] == ids[start:]
                assert all(isinstance(e[0], float) for e in inp)  # start > 0: no null entry
                # select's token healing reads the first entry's text
                healed = inp[0][-1]
                assert isinstance(healed, str) and healed in prefix + c
                assert r["meta_info"]["output_token_logprobs"] == []
            # unconditional likelihoods: token ids back, logprob_start_len left at -1
            status, unc = await post(
                url,
                "/generate",
                {
                    "input_ids": [
                        [e[1] for e in r["meta_info"]["input_token_logprobs"]] for r in obj
                    ],
                    "sampling_params": {"max_new_tokens": 0},
                    "return_logprob": True,
                },
            )
            assert status == 200 and all(r["meta_info"]["input_token_logprobs"] == [] for r in unc)

    run(main())


def test_wait_for_server_and_v1_models(engine):
    async def main():
        async with serving(engine) as url:
            # sglang.utils.wait_for_server: GET /v1/models with "Authorization: Bearer None"
            status, models = await get(url, "/v1/models", {"Authorization": "Bearer None"})
            assert status == 200
            assert models["object"] == "list" and len(models["data"]) == 1
            card = models["data"][0]
            assert card["id"] == card["root"] == engine.config.model_path
            assert card["object"] == "model" and card["owned_by"] == "sglang"
            assert card["max_model_len"] == engine.context_length and card["parent"] is None
            assert isinstance(card["created"], int)
            status, one = await get(url, "/v1/models/" + card["id"])
            assert status == 200 and one["id"] == card["id"]
            status, missing = await get(url, "/v1/models/nope")
            assert status == 404 and missing["error"]["code"] == "model_not_found"

    run(main())


def num_requests_from_load(load) -> int:
    """slime's ``server_control.num_requests_from_load`` (its idle test after abort_all)."""
    if isinstance(load, list):
        return sum(num_requests_from_load(x) for x in load)
    if not isinstance(load, dict):
        return 0
    if "loads" in load:
        return num_requests_from_load(load["loads"])
    for key in ("num_reqs", "num_total_reqs", "total_reqs"):
        if isinstance(load.get(key), int):
            return load[key]
    running = load.get("num_running_reqs", load.get("total_running_reqs"))
    waiting = load.get("num_waiting_reqs", load.get("total_waiting_reqs"))
    return (running if isinstance(running, int) else 0) + (
        waiting if isinstance(waiting, int) else 0
    )


CORE_KEYS = {
    "timestamp", "dp_rank", "num_running_reqs", "num_waiting_reqs",
    "num_waiting_uncached_tokens", "num_used_tokens", "num_total_tokens", "num_active_tokens",
    "num_prealloc_ready_tokens", "max_total_num_tokens", "max_running_requests", "token_usage",
    "gen_throughput", "cache_hit_rate", "utilization", "total_prefill_uncached_tokens",
    "total_prefill_busy_us", "decode_moments",
}  # fmt: skip


def test_v1_loads_as_slime_polls_it(engine):
    async def main():
        async with serving(engine) as url:
            status, idle = await get(url, "/v1/loads?include=core")
            assert status == 200 and set(idle) == {
                "timestamp", "version", "accelerator", "num_accelerators", "loads"
            }  # fmt: skip
            assert [set(x) for x in idle["loads"]] == [CORE_KEYS]
            assert num_requests_from_load(idle) == 0
            # a request held in place: slime sees it, aborts all, and sees the server idle
            await post(url, "/pause_generation", {"mode": "in_place"})
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 50}}
            task = asyncio.create_task(post(url, "/generate", body))
            for _ in range(200):
                _, busy = await get(url, "/v1/loads?include=core")
                if num_requests_from_load(busy) == 1:
                    break
                await asyncio.sleep(0.01)
            assert num_requests_from_load(busy) == 1
            _, full = await get(url, "/v1/loads")
            assert {"memory", "queues"} <= set(full["loads"][0])
            assert full["loads"][0]["queues"]["paused"] == 1
            await post(url, "/abort_request", {"abort_all": True})
            status, reply = await task
            assert status == 200 and reply["meta_info"]["finish_reason"]["type"] == "abort"
            await post(url, "/continue_generation", {})
            _, after = await get(url, "/v1/loads?include=core")
            assert num_requests_from_load(after) == 0
            status, bad = await get(url, "/v1/loads?include=core,bogus")
            assert status == 400 and "bogus" in bad["error"]["message"]
            status, prom = await get(url, "/v1/loads?format=prometheus")
            assert status == 200 and 'sglang_num_running_reqs{dp_rank="0"} 0' in prom

    run(main())


def test_routed_experts_start_len_accepts_zero_to_prompt_tokens(engine):
    cfg = engine.model_config
    new = 4

    def body(start, max_new=new):
        return {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True},
            "return_routed_experts": True,
            "routed_experts_start_len": start,
        }

    def routes(reply, start):
        m = reply["meta_info"]
        rows = max(0, m["prompt_tokens"] + m["completion_tokens"] - 1 - start)
        return decode_routed_experts(
            m["routed_experts"],
            rows=rows,
            num_layers=cfg.num_hidden_layers,
            top_k=cfg.num_experts_per_tok,
            rid="t",
        )

    async def main():
        async with serving(engine) as url:
            _, full = await post(url, "/generate", body(0))
            everything = routes(full, 0)
            assert everything.shape[0] == len(PROMPT) + new - 1
            for start in range(len(PROMPT) + 1):  # every value in [0, prompt_tokens]
                status, r = await post(url, "/generate", body(start))
                assert status == 200, (start, r)
                np.testing.assert_array_equal(routes(r, start), everything[start:])
            # prompt-only at start == prompt_tokens: zero rows, as SGLang's max(0, ...)
            status, z = await post(url, "/generate", body(len(PROMPT), max_new=0))
            assert status == 200 and routes(z, len(PROMPT)).shape[0] == 0
            status, bad = await post(url, "/generate", body(len(PROMPT) + 1))
            assert status == 400 and "routed_experts_start_len" in bad["error"]["message"]
            # the client accepts start == prompt_tokens too
            rc = RolloutConfig(
                urls=(url,),
                return_routed_experts=True,
                num_layers=cfg.num_hidden_layers,
                num_experts_per_tok=cfg.num_experts_per_tok,
            )
            sp = SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True)
            async with SGLangClient(None, rc) as client:
                g = await client.generate(PROMPT, sp, routed_experts_start_len=len(PROMPT))
            np.testing.assert_array_equal(g.routed_experts, everything[len(PROMPT) :])

    run(main())


@pytest.fixture(scope="module")
def bare_ckpt(tiny_ckpt, tmp_path_factory):
    """The tiny checkpoint without any tokenizer file (as verl / slime may serve one)."""
    out = tmp_path_factory.mktemp("bare")
    for f in tiny_ckpt.iterdir():
        if not f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, out / f.name)
    assert not list(out.glob("tokenizer*"))
    return out


def test_skip_tokenizer_init_serves_tokens(engine, bare_ckpt):
    from osworld_jax.server.engine import Engine, EngineConfig

    with pytest.raises(EngineError, match=r"no tokenizer\.json.*--skip-tokenizer-init"):
        Engine(EngineConfig(model_path=str(bare_ckpt), **ENGINE_KW))
    bare = Engine(
        EngineConfig(model_path=str(bare_ckpt), skip_tokenizer_init=True, **ENGINE_KW)
    ).start()
    # verl's request (SGLangHttpServer.generate), with R3 on
    verl = {
        "rid": "verl-0",
        "input_ids": PROMPT,
        "sampling_params": {
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "repetition_penalty": 1.0,
            "max_new_tokens": 8,
            "sampling_seed": 9,
        },
        "return_logprob": True,
        "image_data": None,
        "return_routed_experts": True,
    }

    async def main():
        async with serving(bare) as bare_url, serving(engine) as url:
            status, got = await post(bare_url, "/generate", verl)
            assert status == 200, got
            _, want = await post(url, "/generate", verl)
            assert "text" not in got  # SGLang's token-only reply
            assert got["output_ids"] == want["output_ids"]
            assert got["meta_info"]["routed_experts"] == want["meta_info"]["routed_experts"]
            assert [e[:2] for e in got["meta_info"]["output_token_logprobs"]] == [
                e[:2] for e in want["meta_info"]["output_token_logprobs"]
            ]
            # texts in logprobs are null without a tokenizer
            status, r = await post(bare_url, "/generate", {**verl, "return_text_in_logprobs": True})
            assert all(e[2] is None for e in r["meta_info"]["output_token_logprobs"])
            # what needs a tokenizer is a named 400, as in SGLang
            for bad, word in (
                ({"text": "hi", "sampling_params": {"max_new_tokens": 1}}, "text"),
                ({**verl, "sampling_params": {"stop": ["x"]}}, "stop"),
                ({**verl, "sampling_params": {"min_new_tokens": 2}}, "min_new_tokens"),
            ):
                status, r = await post(bare_url, "/generate", bad)
                assert status == 400 and word in r["error"]["message"], r
                assert "--skip-tokenizer-init" in r["error"]["message"]
            # the client's own requests work token-in / token-out; with a detokenizer it
            # rebuilds the text the tokenizer server sends (matched stop token trimmed)
            rc = RolloutConfig(urls=(bare_url,))
            async with SGLangClient(None, rc) as client:
                g = await client.generate(PROMPT, SamplingParams(max_new_tokens=3))
            assert g.completion_tokens == 3 and g.text == ""
            sp = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
            async with SGLangClient(None, RolloutConfig(urls=(url,))) as client:
                free = await client.generate(PROMPT, sp)
            sp = sp.replace(stop_token_ids=(free.output_ids[5],))
            tok = engine.tokenizer
            texts = []
            for u, detok in ((url, None), (bare_url, tok.decode)):
                async with SGLangClient(None, RolloutConfig(urls=(u,)), detokenize=detok) as c:
                    texts.append(await c.generate(PROMPT, sp))
            assert texts[0].finish_reason["type"] == "stop"
            assert texts[1].output_ids == texts[0].output_ids
            assert texts[1].text == texts[0].text != ""
            status, info = await get(bare_url, "/server_info")
            assert info["skip_tokenizer_init"] is True

    try:
        run(main())
    finally:
        bare.shutdown()
