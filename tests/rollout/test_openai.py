"""The OpenAI-compatible endpoints, driven by the official ``openai`` client (AsyncOpenAI).

References: transformers' ``apply_chat_template`` on the checkpoint (the prompt), the native
``/generate`` of the same server (the tokens and their logprobs) and HF's forward (the top
logprobs).
"""

from __future__ import annotations

import asyncio
import base64

import aiohttp
import numpy as np
import openai
import pytest

from .conftest import hf_vl_logits_and_routes, hf_vl_model, log_softmax, serving
from .test_images import png
from .test_server import post


def run(coro):
    return asyncio.run(coro)


def image_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def hf_prompt(path, messages) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )


async def _openai(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def test_chat_with_an_image_matches_generate_transformers_and_streams(vl_engine, vl_ckpt):
    eng = vl_engine
    shot = png(20, 64, 96)
    messages = [
        {"role": "system", "content": "You operate a desktop."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is on the screen?"},
                {"type": "image_url", "image_url": {"url": image_url(shot)}},
            ],
        },
    ]
    # transformers renders the same conversation with an image part
    hf_messages = [
        messages[0],
        {"role": "user", "content": [messages[1]["content"][0], {"type": "image"}]},
    ]
    text = hf_prompt(vl_ckpt, hf_messages)

    async def main():
        async with serving(eng) as url:
            client = await _openai(url)
            models = await client.models.list()
            model = models.data[0].id
            kw = dict(model=model, messages=messages, max_tokens=8, temperature=0)
            chat = await client.chat.completions.create(**kw, logprobs=True, top_logprobs=3)
            stream = await client.chat.completions.create(
                **kw, stream=True, logprobs=True, stream_options={"include_usage": True}
            )
            chunks = [c async for c in stream]
            _, native = await post(
                url,
                "/generate",
                {
                    "text": text,
                    "image_data": [base64.b64encode(shot).decode()],
                    "sampling_params": {"max_new_tokens": 8, "temperature": 0},
                    "return_logprob": True,
                    "logprob_start_len": 0,
                },
            )
            await client.close()
            return model, chat, chunks, native

    model, chat, chunks, native = run(main())
    assert model == eng.model_path
    choice = chat.choices[0]
    meta = native["meta_info"]
    assert chat.object == "chat.completion" and chat.model == model
    assert choice.message.role == "assistant" and choice.message.content == native["text"]
    assert choice.finish_reason == meta["finish_reason"]["type"]
    assert chat.usage.prompt_tokens == meta["prompt_tokens"] == len(meta["input_token_logprobs"])
    assert chat.usage.completion_tokens == meta["completion_tokens"]
    assert chat.usage.total_tokens == meta["prompt_tokens"] + meta["completion_tokens"]
    assert chat.usage.prompt_tokens_details.image_tokens == meta["image_tokens"] == 6
    tokens = choice.logprobs.content
    assert [t.logprob for t in tokens] == [e[0] for e in meta["output_token_logprobs"]]
    assert [t.token for t in tokens] == [
        eng.tokenizer.decode([i], skip_special_tokens=False) for i in native["output_ids"]
    ]
    # top_logprobs against transformers: the 3 most likely next tokens, best first
    from osworld_jax.model import ImageProcessor

    prompt = [e[1] for e in meta["input_token_logprobs"]]
    pixel_values, grid = ImageProcessor.from_pretrained(vl_ckpt)(shot)
    logits, _ = hf_vl_logits_and_routes(
        hf_vl_model(vl_ckpt), prompt + native["output_ids"], pixel_values, grid
    )
    for k, t in enumerate(tokens):
        lp = log_softmax(logits[len(prompt) - 1 + k])
        want: dict[str, float] = {}  # best first; ids sharing a text keep the best (SGLang)
        for i in np.argsort(-lp)[:3]:
            want.setdefault(eng.tokenizer.decode([int(i)], skip_special_tokens=False), lp[i])
        assert [x.token for x in t.top_logprobs] == list(want)
        np.testing.assert_allclose(
            [x.logprob for x in t.top_logprobs], list(want.values()), atol=1e-5
        )
        assert t.top_logprobs[0].logprob == t.logprob  # greedy: the chosen token is the best
        assert t.bytes == list(t.token.encode())
    # streaming: role first, deltas add up, finish, then the usage chunk
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == native["text"]
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == choice.finish_reason
    streamed = [
        x
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for x in c.choices[0].logprobs.content
    ]
    assert [x.logprob for x in streamed] == [t.logprob for t in tokens]  # none lost
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == chat.usage.total_tokens
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].object == "chat.completion.chunk"


def test_completions_echo_logprobs_batch_and_stream(vl_engine):
    eng = vl_engine
    text = "open the terminal and type"

    async def main():
        async with serving(eng) as url:
            client = await _openai(url)
            kw = dict(model="default", prompt=text, max_tokens=6, temperature=0)
            plain = await client.completions.create(**kw, logprobs=2)
            echo = await client.completions.create(**kw, logprobs=2, echo=True)
            batch = await client.completions.create(**{**kw, "prompt": [text, "click ok"]})
            ids = await client.completions.create(**{**kw, "prompt": [7, 42, 300]})
            stream = await client.completions.create(**kw, logprobs=1, stream=True)
            chunks = [c async for c in stream]
            _, native = await post(
                url,
                "/generate",
                {
                    "text": text,
                    "sampling_params": {"max_new_tokens": 6, "temperature": 0},
                    "return_logprob": True,
                    "logprob_start_len": 0,
                },
            )
            await client.close()
            return plain, echo, batch, ids, chunks, native

    plain, echo, batch, ids, chunks, native = run(main())
    meta = native["meta_info"]
    c = plain.choices[0]
    assert plain.object == "text_completion" and c.text == native["text"]
    assert c.logprobs.token_logprobs == [e[0] for e in meta["output_token_logprobs"]]
    assert all(len(t) <= 2 for t in c.logprobs.top_logprobs) and c.logprobs.text_offset[0] == -1
    assert plain.usage.prompt_tokens == meta["prompt_tokens"]
    e = echo.choices[0]
    assert e.text == text + c.text
    n_in = meta["prompt_tokens"]
    assert e.logprobs.token_logprobs[:n_in] == [x[0] for x in meta["input_token_logprobs"]]
    assert e.logprobs.token_logprobs[0] is None and e.logprobs.top_logprobs[0] is None
    assert e.logprobs.token_logprobs[n_in:] == c.logprobs.token_logprobs
    assert [x.index for x in batch.choices] == [0, 1] and batch.choices[0].text == c.text
    assert batch.usage.prompt_tokens > plain.usage.prompt_tokens
    assert ids.usage.prompt_tokens == 3
    assert "".join(x.choices[0].text for x in chunks) == c.text
    assert chunks[-1].choices[0].finish_reason == "length"
    streamed = [
        lp for x in chunks if x.choices[0].logprobs for lp in x.choices[0].logprobs.token_logprobs
    ]
    assert streamed == c.logprobs.token_logprobs


def test_sampling_defaults_stop_and_refusals(vl_engine, tmp_path):
    eng = vl_engine

    async def main():
        async with serving(eng) as url:
            client = await _openai(url)
            base = dict(model="default", messages=[{"role": "user", "content": "hello"}])
            greedy = await client.chat.completions.create(**base, temperature=0, max_tokens=12)
            cut = greedy.choices[0].message.content[2:5]
            stopped = await client.chat.completions.create(
                **base, temperature=0, max_completion_tokens=12, stop=[cut]
            )
            refused = []
            for extra in (
                {"n": 2},
                {"frequency_penalty": 0.5},
                {
                    "tool_choice": "required",
                    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                },
                {"response_format": {"type": "json_object"}},
                {"top_logprobs": 30, "logprobs": True},
                {"messages": []},
                {
                    "messages": [
                        {
                            "role": "user",
                            "content": [
                                {
                                    "type": "image_url",
                                    "image_url": {"url": str(tmp_path / "missing.png")},
                                }
                            ],
                        }
                    ]
                },
            ):
                with pytest.raises(openai.BadRequestError) as err:
                    await client.chat.completions.create(**{**base, "max_tokens": 2, **extra})
                refused.append(str(err.value))
            with pytest.raises(openai.BadRequestError):
                await client.completions.create(model="default", prompt="", max_tokens=2)
            ok = await client.chat.completions.create(**base, max_tokens=2)
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/v1/chat/completions", data=b"[1]") as r:
                    raw = (r.status, await r.json())
            await client.close()
            return greedy, stopped, cut, refused, ok, raw

    greedy, stopped, cut, refused, ok, raw = run(main())
    content = greedy.choices[0].message.content
    assert len(cut) == 3  # the greedy reply is long enough to cut
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].matched_stop == cut
    assert stopped.choices[0].message.content == content[: content.find(cut)]
    assert "n=2" in refused[0] and "frequency_penalty" in refused[1]
    assert "tool_choice" in refused[2] and "response_format" in refused[3]
    assert "top_logprobs" in refused[4] and "Messages cannot be empty" in refused[5]
    assert "request image 0" in refused[6] and "no such file" in refused[6]
    assert ok.choices[0].finish_reason == "length" and ok.usage.completion_tokens == 2
    assert raw[0] == 400 and raw[1]["object"] == "error" and raw[1]["code"] == 400
    assert raw[1]["message"] == "the body must be a JSON object"
