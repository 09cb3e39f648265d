"""Image prompts on the embedded server (a tiny Qwen3-VL-MoE), against transformers.

The reference is HF ``Qwen3VLMoeForConditionalGeneration`` on the same checkpoint, fed the
processor's pixels and the expanded prompt + output in one forward (its M-RoPE positions come
from ``get_rope_index`` over the whole sequence, so the server's KV-cache decode positions,
``max(prompt position) + 1 + k``, are checked too). The trainer's side is our own `forward`
with `mrope_positions` and R3 replay of the server's routes.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import struct
import zlib

import aiohttp
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from osworld_jax.model import ImageProcessor, forward, load_hf_checkpoint, mrope_positions
from osworld_jax.rollout import RolloutConfig, SamplingParams, SGLangClient
from osworld_jax.server.images import expand_image_tokens

from .conftest import hf_vl_logits_and_routes, hf_vl_model, log_softmax, serving
from .test_server import post, routes_of

PAD = "<|vision_start|><|image_pad|><|vision_end|>"
SCREENSHOT = os.path.join(
    os.path.dirname(__file__), "..", "model", "assets", "desktop_1920x1080.png"
)


def run(coro):
    return asyncio.run(coro)


def png(seed: int, h: int, w: int, fmt: str = "PNG") -> bytes:
    pixels = np.random.RandomState(seed).randint(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, fmt)
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def chat(engine, *parts: str) -> list[int]:
    text = "<|im_start|>user\n" + "".join(parts) + "<|im_end|>\n<|im_start|>assistant\n"
    return list(engine.tokenizer.encode(text).ids)


def body(ids, images, **sp):
    return {
        "input_ids": ids,
        "image_data": images,
        "sampling_params": {"max_new_tokens": 10, "ignore_eos": True, **sp},
        "return_logprob": True,
        "logprob_start_len": 0,
        "return_routed_experts": True,
    }


def expanded(engine, ids: list[int], grid: np.ndarray) -> list[int]:
    """The prompt with each single pad replaced by t h w / 4 pads (written out here)."""
    pad = engine.model_config.image_token_id
    counts = iter(int(np.prod(g)) // 4 for g in grid)
    out: list[int] = []
    for t in ids:
        out += [pad] * next(counts) if t == pad else [t]
    return out


@pytest.mark.slow  # ~30 s on the shared CPU: three HF forwards and the trainer's compile
def test_image_logprobs_and_routes_match_transformers_and_the_trainer(vl_engine, vl_ckpt):
    """Greedy and sampled image prompts (one and two images, PNG and JPEG, base64 and data:
    URL): output logprobs at the sampling temperature, prompt logprobs, every route row (image
    tokens included) and the prompt token count equal transformers'; the trainer's forward with
    R3 replay of the server's routes gives the same logprobs (float32) on 100% of rows."""
    eng = vl_engine
    cfg = eng.model_config
    a, b, c = png(0, 64, 96), png(1, 128, 64), png(2, 80, 72, "JPEG")
    cases = [
        (chat(eng, "Look: ", PAD, " then click"), [a], dict(temperature=0.0)),
        (
            chat(eng, PAD, " and ", PAD, " differ?"),
            [b64(b), "data:image/jpeg;base64," + b64(c)],
            dict(temperature=0.8, top_p=0.9, sampling_seed=3),
        ),
        (chat(eng, "Screen ", PAD), ["data:image/png;base64," + b64(a)], dict(temperature=1.0)),
    ]
    raw = [[a], [b, c], [a]]
    bodies = [body(ids, [x if isinstance(x, str) else b64(x) for x in ims], **sp)
              for ids, ims, sp in cases]  # fmt: skip

    async def main():
        async with serving(eng) as url:
            return await asyncio.gather(*(post(url, "/generate", x) for x in bodies))

    replies = run(main())
    assert all(s == 200 for s, _ in replies), replies
    processor = ImageProcessor.from_pretrained(vl_ckpt)
    model = hf_vl_model(vl_ckpt)
    policy = load_hf_checkpoint(vl_ckpt, dtype=jnp.float32)
    fwd = jax.jit(forward, static_argnums=(1, 2))
    worst, worst_in, worst_train, agree, rows = 0.0, 0.0, 0.0, 0, 0
    for (ids, _, sp), images, (_, reply) in zip(cases, raw, replies, strict=True):
        pixel_values, grid = processor(images)
        prompt = expanded(eng, ids, grid)
        out, meta = reply["output_ids"], reply["meta_info"]
        assert meta["prompt_tokens"] == len(prompt) > len(ids)  # the expanded prompt
        assert meta["image_tokens"] == int(grid.prod(-1).sum()) // 4
        assert [t for _, t, _ in meta["input_token_logprobs"]] == prompt
        seq = prompt + out
        logits, routers = hf_vl_logits_and_routes(model, seq, pixel_values, grid)
        t = sp["temperature"] or 1.0  # greedy logprobs are at temperature 1
        pos = np.arange(len(prompt) - 1, len(seq) - 1)  # logits[j] predicts token j + 1
        want = log_softmax(logits[pos] / t)[np.arange(len(out)), out]
        got = np.array([lp for lp, _, _ in meta["output_token_logprobs"]])
        worst = max(worst, float(np.abs(got - want).max()))
        want_in = log_softmax(logits[: len(prompt) - 1])[np.arange(len(prompt) - 1), prompt[1:]]
        got_in = np.array([x[0] for x in meta["input_token_logprobs"][1:]])
        worst_in = max(worst_in, float(np.abs(got_in - want_in).max()))
        if sp["temperature"] == 0.0:
            assert out == list(logits[pos].argmax(-1))
        routes = routes_of(reply, cfg)  # every token but the last sampled one has a row
        chex.assert_shape(routes, (len(seq) - 1, cfg.num_hidden_layers, cfg.num_experts_per_tok))
        for layer in range(cfg.num_hidden_layers):
            if layer in routers:
                top = np.argsort(-routers[layer], axis=-1)[: len(seq) - 1, :2]
                np.testing.assert_array_equal(np.sort(routes[:, layer], -1), np.sort(top, -1))
            else:
                assert (routes[:, layer] == -1).all()
        # The trainer: one padded row, M-RoPE positions, the server's routes replayed.
        n, length = len(seq), 128
        tokens = np.zeros((1, length), np.int32)
        tokens[0, :n] = seq
        seg = (np.arange(length) < n).astype(np.int32)[None]
        replay = np.full((1, length, *routes.shape[1:]), -1, np.int32)
        replay[0, : n - 1] = routes
        o = fwd(
            policy.params(),
            cfg,
            policy.runtime,
            tokens,
            positions=mrope_positions(tokens, grid, cfg, segment_ids=seg),
            segment_ids=seg,
            replay_experts=replay,
            pixel_values=pixel_values,
            image_grid_thw=grid,
        )
        lp = np.asarray(jax.nn.log_softmax(o.logits[0] / t, axis=-1))[pos, out]
        worst_train = max(worst_train, float(np.abs(lp - got).max()))
        used = np.sort(np.asarray(o.routed_experts[0, : n - 1]), -1)
        same = (used == np.sort(routes, -1)).all(axis=(-1, -2))
        agree, rows = agree + int(same.sum()), rows + same.size
    print(
        f"image prompts vs HF: output {worst:.1e}, prompt {worst_in:.1e}; trainer "
        f"{worst_train:.1e}; replayed routes {agree}/{rows}"
    )
    assert worst < 1e-5 and worst_in < 1e-5 and worst_train < 1e-5
    assert agree == rows


def test_expanded_and_collapsed_placeholders_serve_the_same_prompt(vl_engine, vl_ckpt):
    eng = vl_engine
    a, b = png(3, 64, 64), png(4, 96, 64)
    ids = chat(eng, PAD, "x", PAD)
    _, grid = ImageProcessor.from_pretrained(vl_ckpt)([a, b])
    counts = [int(np.prod(g)) // 4 for g in grid]
    full = expand_image_tokens(ids, counts, eng.model_config, "test")
    assert full == expanded(eng, ids, grid)
    # the first placeholder expanded, the second left as one pad (a count of 1 leaves it)
    mixed = expand_image_tokens(ids, [counts[0], 1], eng.model_config, "test")
    assert len(ids) < len(mixed) < len(full)

    async def main():
        async with serving(eng) as url:
            images = [b64(a), b64(b)]
            return await asyncio.gather(
                *(
                    post(url, "/generate", body(p, images, temperature=0.0))
                    for p in (ids, full, mixed)
                )
            )

    (s1, r1), *rest = run(main())
    assert s1 == 200
    for s, r in rest:
        assert s == 200 and r["output_ids"] == r1["output_ids"]
        assert r["meta_info"]["prompt_tokens"] == r1["meta_info"]["prompt_tokens"] == len(full)
        assert r["meta_info"]["routed_experts"] == r1["meta_info"]["routed_experts"]


def _bomb_png(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height pixels (a few hundred bytes on the wire)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    row = b"\x00" + b"\x00" * (3 * width)
    data = zlib.compress(row * 4, 9)  # a truncated image: decoding would need it all
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", data) + chunk(b"IEND", b"")


def test_bad_images_get_400_naming_request_and_image_and_the_server_keeps_serving(
    vl_engine, tmp_path
):
    eng = vl_engine
    good = b64(png(5, 64, 64))
    one, two = chat(eng, "a ", PAD), chat(eng, PAD, PAD)
    pad = eng.model_config.image_token_id
    run_of_3 = chat(eng, "<|vision_start|>", "<|image_pad|>" * 3, "<|vision_end|>")
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    (tmp_path / "dir.png").mkdir()
    (tmp_path / "text.png").write_text("not an image")
    cases = [
        ({"input_ids": one, "image_data": [b64(b"\x89PNG not really")]}, "request image 0"),
        ({"input_ids": one, "image_data": ["%%%not base64%%%"]}, "not base64"),
        ({"input_ids": one, "image_data": [str(tmp_path / "missing.png")]}, "no such file"),
        ({"input_ids": one, "image_data": [str(fifo)]}, "not a regular file"),
        ({"input_ids": one, "image_data": [str(tmp_path / "dir.png")]}, "request image 0"),
        ({"input_ids": one, "image_data": [str(tmp_path / "text.png")]}, "formats are refused"),
        ({"input_ids": one, "image_data": ["data:image/png;base64"]}, "without a ','"),
        ({"input_ids": one, "image_data": ["https://example.com/a.png"]}, "URLs are not"),
        ({"input_ids": one, "image_data": [b64(_bomb_png(9000, 9000))]}, "--max-image-pixels"),
        ({"input_ids": run_of_3, "image_data": [good]}, "holds 3 <|image_pad|>"),
        ({"input_ids": one, "image_data": [good, good]}, "only 1 image placeholders"),
        ({"input_ids": two, "image_data": [good]}, "more image placeholders"),
        ({"input_ids": two}, "more image placeholders"),
        (
            {"input_ids": [*one[:3], pad, *one[3:]], "image_data": [good]},
            "not inside",
        ),
        (
            {"input_ids": one, "image_data": [5]},
            "request image 0: image_data entries must be strings",
        ),
        ({"input_ids": [one, one], "image_data": [[good]]}, "1 entries for a batch of 2 requests"),
        ({"input_ids": [one, two], "image_data": [[good], [good, "@@"]]}, "request 1 image 1"),
        ({"input_ids": [one, one], "image_data": [[good], [b64(b"junk")]]}, "request 1 image 0"),
    ]

    async def main():
        async with serving(eng) as url:
            for b, words in cases:
                status, reply = await post(url, "/generate", b)
                assert status == 400, (b, reply)
                message = reply["error"]["message"]
                assert words in message, (words, message)
                assert "request" in message, message
            status, reply = await post(url, "/generate", body(one, [good], max_new_tokens=2))
            assert status == 200 and reply["meta_info"]["completion_tokens"] == 2
            async with aiohttp.ClientSession() as s:
                async with s.get(url + "/model_info") as r:
                    info = await r.json()
            assert info["has_image_understanding"] and info["model_type"] == "qwen3_vl_moe"

    run(main())


def test_batched_image_data_as_sglang_normalises_it(vl_engine):
    eng = vl_engine
    a, b = b64(png(6, 64, 64)), b64(png(7, 64, 96))
    one, two = chat(eng, "q ", PAD), chat(eng, PAD, " vs ", PAD)

    def greedy(ids, images, **kw):
        return {**body(ids, images, temperature=0.0, max_new_tokens=4), **kw}

    async def main():
        async with serving(eng) as url:
            batch = greedy([one, two], [[a], [b, a]])
            singles = [greedy(one, [a]), greedy(two, [b, a])]
            wrapped = greedy([one, one], [a, b])  # one image per request, each wrapped
            broadcast = greedy([one, one], a)  # a lone string goes to every request
            lone = greedy(one, a)  # a single request's single string
            out = await asyncio.gather(
                *(post(url, "/generate", x) for x in (batch, *singles, wrapped, broadcast, lone))
            )
            assert all(s == 200 for s, _ in out), out
            return [r for _, r in out]

    batch, s1, s2, wrapped, broadcast, lone = run(main())
    assert [r["output_ids"] for r in batch] == [s1["output_ids"], s2["output_ids"]]
    assert wrapped[0]["output_ids"] == s1["output_ids"] == lone["output_ids"]
    assert [r["output_ids"] for r in broadcast] == [s1["output_ids"]] * 2
    assert wrapped[1]["output_ids"] != s1["output_ids"]  # the other image


def test_requests_sharing_text_but_not_the_image_do_not_share_kv(vl_engine):
    """The same text prefix with another image gives that image's answer, never the first's,
    in any order and concurrently: replies equal each image's reply on an idle server. The
    same image again reuses the kept rows (its image is not recomputed); another image reuses
    nothing from its first token on."""
    eng = vl_engine
    a, b = b64(png(8, 64, 64)), b64(png(9, 64, 64))  # same size: same token count
    ids = chat(eng, "Click the button in ", PAD, " now")
    first_image = ids.index(eng.model_config.image_token_id)

    def greedy(image):
        return {**body(ids, [image], temperature=0.0), "logprob_start_len": -1}

    async def main():
        async with serving(eng) as url:
            await post(url, "/flush_cache", {})
            solo_a = await post(url, "/generate", greedy(a))
            solo_b = await post(url, "/generate", greedy(b))
            again_a = await post(url, "/generate", greedy(a))
            both = await asyncio.gather(*(post(url, "/generate", greedy(x)) for x in (b, a)))
            return solo_a[1], solo_b[1], again_a[1], both[0][1], both[1][1]

    solo_a, solo_b, again_a, con_b, con_a = run(main())
    assert solo_a["output_ids"] != solo_b["output_ids"]
    assert solo_b["meta_info"]["cached_tokens"] <= first_image  # never a's image rows
    assert con_b["meta_info"]["cached_tokens"] in (0, solo_b["meta_info"]["prompt_tokens"] - 1)
    n = solo_a["meta_info"]["prompt_tokens"]
    assert again_a["meta_info"]["cached_tokens"] == n - 1  # a's kept rows, image a included
    for x, ref in ((again_a, solo_a), (con_a, solo_a), (con_b, solo_b)):
        assert x["output_ids"] == ref["output_ids"]
        np.testing.assert_allclose(
            [e[0] for e in x["meta_info"]["output_token_logprobs"]],
            [e[0] for e in ref["meta_info"]["output_token_logprobs"]],
            atol=1e-5,
        )
        assert x["meta_info"]["routed_experts"] == ref["meta_info"]["routed_experts"]


def test_a_turn_with_a_new_screenshot_reuses_the_previous_turn_and_matches_hf(vl_engine, vl_ckpt):
    """Turn 2 = turn 1 (image a) + reply + a user message with image b: the kept rows serve
    turn 1 (image a is not recomputed; only b goes through the ViT), and the logprobs and all
    route rows of turn 2 equal transformers' forward of the whole sequence."""
    eng = vl_engine
    cfg = eng.model_config
    raw_a, raw_b = png(30, 64, 96), png(31, 96, 64)
    turn1 = chat(eng, "First screen ", PAD)

    def req(ids, images):
        b = body(ids, images, temperature=0.0, max_new_tokens=6)
        return {**b, "logprob_start_len": -1}

    async def main():
        async with serving(eng) as url:
            await post(url, "/flush_cache", {})
            _, r1 = await post(url, "/generate", req(turn1, [b64(raw_a)]))
            turn2 = turn1 + r1["output_ids"] + chat(eng, "Then ", PAD)  # placeholders
            _, r2 = await post(url, "/generate", req(turn2, [b64(raw_a), b64(raw_b)]))
            return turn2, r1, r2

    turn2, r1, r2 = run(main())
    m1, m2 = r1["meta_info"], r2["meta_info"]
    assert m1["cached_tokens"] == 0
    assert m2["cached_tokens"] == m1["prompt_tokens"] + m1["completion_tokens"] - 1
    pixel_values, grid = ImageProcessor.from_pretrained(vl_ckpt)([raw_a, raw_b])
    out = r2["output_ids"]
    seq = expanded(eng, turn2, grid) + out
    assert m2["prompt_tokens"] == len(seq) - len(out)
    logits, routers = hf_vl_logits_and_routes(hf_vl_model(vl_ckpt), seq, pixel_values, grid)
    pos = np.arange(m2["prompt_tokens"] - 1, len(seq) - 1)
    want = log_softmax(logits[pos])[np.arange(len(out)), out]
    got = np.array([e[0] for e in m2["output_token_logprobs"]])
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert out == list(logits[pos].argmax(-1))
    routes = routes_of(r2, cfg)  # the kept rows' routes are served again: every row is there
    assert routes.shape[0] == len(seq) - 1
    for layer, router in routers.items():
        top = np.sort(np.argsort(-router, axis=-1)[: len(seq) - 1, :2], axis=-1)
        np.testing.assert_array_equal(np.sort(routes[:, layer], axis=-1), top)


def test_a_1920x1080_screenshot_by_path_data_url_and_base64(vl_engine):
    eng = vl_engine
    with open(SCREENSHOT, "rb") as f:
        shot = f.read()
    ids = chat(eng, "What is on ", PAD, "?")
    forms = [SCREENSHOT, "data:image/png;base64," + b64(shot), b64(shot)]

    async def main():
        async with serving(eng) as url:
            return await asyncio.gather(
                *(post(url, "/generate", body(ids, [x], temperature=0.0)) for x in forms)
            )

    out = run(main())
    assert all(s == 200 for s, _ in out), out
    replies = [r for _, r in out]
    assert replies[0]["meta_info"]["image_tokens"] == 144  # 288 x 512 pixels
    assert replies[0]["meta_info"]["prompt_tokens"] == len(ids) - 1 + 144
    assert replies[1] and all(r["output_ids"] == replies[0]["output_ids"] for r in replies)


def test_client_refit_mid_generation_on_image_prompts_stitches_exactly(vl_engine):
    """Image prompts in flight through `SGLangClient`, a refit to the same weights under a new
    version: each aborted request is resubmitted with its images; stitched ids, logprobs and
    the prompt + output - 1 route rows equal an uninterrupted run's."""
    eng = vl_engine
    cfg = eng.model_config
    images = [[b64(png(10 + i, 64, 64 + 32 * (i % 2)))] for i in range(6)]
    prompts = [chat(eng, f"task {i} ", PAD) for i in range(6)]

    async def main():
        async with serving(eng) as url:
            rc = RolloutConfig(
                urls=(url,),
                return_routed_experts=True,
                num_layers=cfg.num_hidden_layers,
                num_experts_per_tok=cfg.num_experts_per_tok,
                max_abort_resubmits=2,
            )
            sp = SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)
            async with SGLangClient(None, rc) as client:
                ref = await asyncio.gather(
                    *(
                        client.generate(p, sp, rid=f"ref{i}", image_data=im)
                        for i, (p, im) in enumerate(zip(prompts, images, strict=True))
                    )
                )
                tasks = [
                    asyncio.create_task(client.generate(p, sp, rid=f"live{i}", image_data=im))
                    for i, (p, im) in enumerate(zip(prompts, images, strict=True))
                ]
                while sum(len(r.output_ids) for r in eng.slots if r is not None) < 4 * 3:
                    await asyncio.sleep(0.005)
                await client.refit(eng.model_path, "v-image")
                live = await asyncio.gather(*tasks)
            return ref, live

    ref, live = run(main())
    assert sum(len(g.weight_versions) > 1 for g in live) >= 2
    for r, g, p in zip(ref, live, prompts, strict=True):
        assert g.prompt_tokens == r.prompt_tokens > len(p)  # the served (expanded) prompt
        assert g.output_ids == r.output_ids and g.completion_tokens == 30
        np.testing.assert_allclose(g.output_logprobs, r.output_logprobs, atol=1e-5)
        assert g.routed_experts.shape == (g.prompt_tokens + 30 - 1, cfg.num_hidden_layers, 2)
        np.testing.assert_array_equal(g.routed_experts, r.routed_experts)
        assert g.weight_version == "v-image"


def test_dropped_patches_are_restored_from_the_encoded_bytes(vl_ckpt):
    """A prefilled request keeps only its images' encoded bytes; a re-prefill (a retracted
    request whose kept rows were taken) recomputes exactly the same patches."""
    from osworld_jax.server.images import ImageLimits, load_request_images

    processor = ImageProcessor.from_pretrained(vl_ckpt)
    items = [b64(png(40, 64, 96)), b64(png(41, 96, 64, "JPEG"))]
    full = load_request_images(items, "request", processor, ImageLimits(), 256)
    assert full is not None and full.levels is not None

    def patches(images):  # the float32 patches the levels look up to
        return processor.patches_from_levels(np.concatenate(images.levels))

    np.testing.assert_array_equal(patches(full), processor([base64.b64decode(x) for x in items])[0])
    light = full.without_pixels()
    assert light.levels is None and light.digests == full.digests
    again = light.restore(processor)
    np.testing.assert_array_equal(patches(again), patches(full))
    np.testing.assert_array_equal(again.grid_thw, full.grid_thw)


def test_the_gpu_defaults_scan_and_packed_vision_serve_the_same_values(vl_engine, vl_ckpt):
    """An engine with the accelerators' defaults (layers and ViT blocks under ``lax.scan``;
    ``--mm-attention-backend cudnn``, XLA on this CPU) and the GPU recipe's 4-step decode calls
    (M-RoPE positions past the image advance inside the call) serves an image prompt with the
    prompt and output logprobs and routes of the unrolled one-step default engine (greedy,
    float32)."""
    from osworld_jax.server.engine import Engine, EngineConfig
    from osworld_jax.server.serve import engine_config, parse_args

    from .conftest import VL_ENGINE_KW

    args = parse_args(["--model-path", str(vl_ckpt), "--scan-layers", "on"])
    assert (args.mm_attention_backend, engine_config(args).scan_layers) == ("cudnn", True)
    assert engine_config(parse_args(["--model-path", "x"])).scan_layers is None  # auto
    scanned = Engine(
        EngineConfig(
            model_path=str(vl_ckpt),
            scan_layers=True,
            num_continuous_decode_steps=4,
            **VL_ENGINE_KW,
        )
    ).start()
    assert scanned.runner.runtime.scan_layers and not vl_engine.runner.runtime.scan_layers
    assert scanned.runner.runtime.vision_attention == "cudnn"
    request = body(chat(vl_engine, "Screen ", PAD, " now"), [b64(png(7, 96, 64))], temperature=0.0)

    async def main(engine):
        async with serving(engine) as url:
            return await post(url, "/generate", request)

    try:
        (s1, want), (s2, got) = run(main(vl_engine)), run(main(scanned))
    finally:
        scanned.shutdown()
    assert s1 == s2 == 200, (want, got)
    assert got["output_ids"] == want["output_ids"] and len(want["output_ids"]) > 4
    for key in ("input_token_logprobs", "output_token_logprobs"):
        a = np.array([x[0] for x in want["meta_info"][key][1:]], np.float64)
        b = np.array([x[0] for x in got["meta_info"][key][1:]], np.float64)
        np.testing.assert_allclose(b, a, atol=1e-6, rtol=0)
    assert got["meta_info"]["routed_experts"] == want["meta_info"]["routed_experts"]
