"""Screenshots in the prompt: processor-owned image tokens, the last K shown, media as text.

The model is the tiny random Qwen3-VL-MoE checkpoint (its tokenizer, its Qwen3-VL-shaped chat
template and its image processor: a 1920x1080 screenshot is resized to 288x512, 18 x 32
patches of 16 px, merged 2 x 2: 144 image tokens).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses

import numpy as np
import pytest

from osworld_jax.agent import (
    AgentCallError,
    AgentConfig,
    CompactionConfig,
    OwnerAgent,
    SegmentIntegrityError,
    build_segments,
)
from osworld_jax.agent.context import OBSERVATION_DROPPED
from osworld_jax.agent.segments import image_runs
from osworld_jax.env.backend import Observation
from osworld_jax.errors import ConfigError, InfraError
from osworld_jax.rollout import SamplingParams

from .conftest import ScriptedClient, screenshot_png

INSTRUCTION = "Close the dialog."


def obs(i: int, *, size=(1920, 1080), screenshot=True) -> Observation:
    return Observation(
        screenshot=screenshot_png(*size, seed=i) if screenshot else None,
        a11y_tree=f"<button name='OK {i}'/>",
        terminal="",
        instruction=INSTRUCTION,
    )


def run(tok, config, observations, replies=("WAIT",), layers=2):
    client = ScriptedClient(tok, list(replies), layers=layers)
    agent = OwnerAgent(
        client, tok, config, owner_id=0, group_id=0, sampling=SamplingParams(max_new_tokens=32)
    )

    async def go():
        return [await agent.act(o) for o in observations]

    asyncio.run(go())
    return agent, client


def hf_prompt_ids(model_dir, messages, images):
    """What HF's Qwen-VL processor gives: the checkpoint's template rendered by transformers,
    each ``<|image_pad|>`` expanded to ``prod(grid) / merge^2`` of transformers' own image
    processor (Qwen3VLProcessor's expansion), tokenized by transformers."""
    import io
    import json

    from PIL import Image
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    hf_tok = AutoTokenizer.from_pretrained(model_dir)
    pre = json.loads((model_dir / "preprocessor_config.json").read_text())
    size = pre["size"]
    proc = Qwen2VLImageProcessorPil(
        patch_size=pre["patch_size"],
        temporal_patch_size=pre["temporal_patch_size"],
        merge_size=pre["merge_size"],
        size={"shortest_edge": size["shortest_edge"], "longest_edge": size["longest_edge"]},
        image_mean=pre["image_mean"],
        image_std=pre["image_std"],
    )
    text = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    for png in images:
        grid = proc(Image.open(io.BytesIO(png)), return_tensors="np")["image_grid_thw"][0]
        n = int(np.prod(grid)) // pre["merge_size"] ** 2
        text = text.replace("<|image_pad|>", "<|placeholder|>" * n, 1)
    text = text.replace("<|placeholder|>", "<|image_pad|>")
    return np.asarray(hf_tok(text, add_special_tokens=False)["input_ids"])


def test_screenshot_tokens_are_the_processors_and_match_hf(vl_tokenizer, vl_model_dir):
    # Two turns, screenshots of 1920x1080 and 1280x720: the prompt equals what transformers'
    # template + image processor give for the same messages; 144 tokens for 1920x1080
    # (288x512 px -> 18x32 patches / 4), and the client got the PNGs as base64 image_data.
    from osworld_jax.agent import system_prompt

    tok = vl_tokenizer
    config = AgentConfig(max_screenshots=3)
    o0, o1 = obs(0), obs(1, size=(1280, 720))
    agent, client = run(tok, config, [o0, o1], replies=["WAIT"])
    call0, call1 = agent.history.calls
    pad = tok.token_id("<|image_pad|>")
    assert int((call0.prompt_ids == pad).sum()) == 144
    assert (
        tok.image_processor.num_image_tokens(720, 1280)
        == int((call1.prompt_ids == pad).sum()) - 144
    )
    assert client.images[0] == [base64.b64encode(o0.screenshot).decode()]
    assert client.images[1] == [
        base64.b64encode(p).decode() for p in (o0.screenshot, o1.screenshot)
    ]
    assert call1.images == (o0.screenshot, o1.screenshot)

    def user(o, prefix=""):
        return [
            {"type": "text", "text": prefix + "Screenshot: "},
            {"type": "image"},
            {"type": "text", "text": f"\n\nAccessibility tree:\n{o.a11y_tree}"},
        ]

    messages = [
        {"role": "system", "content": system_prompt(config)},
        {"role": "user", "content": user(o0, f"Task instruction: {INSTRUCTION}\n\n")},
        {"role": "assistant", "content": "WAIT"},
        {"role": "user", "content": user(o1)},
    ]
    want = hf_prompt_ids(vl_model_dir, messages, [o0.screenshot, o1.screenshot])
    np.testing.assert_array_equal(call1.prompt_ids, want)
    (seg,) = build_segments(agent.history)
    assert seg.images == (o0.screenshot, o1.screenshot)
    assert image_runs(seg.tokens, pad) == 2
    assert not seg.loss_mask[seg.tokens == pad].any()  # image tokens are never trained on


def test_the_prompt_keeps_the_last_k_screenshots_a_declared_compaction(vl_tokenizer):
    # K = 2 over 4 turns: calls 0, 1 extend each other (1, 2 images); call 2's screenshot would
    # be the third: the context is re-rendered with screenshot 0 as a text placeholder
    # (compaction "screenshots", a new segment), likewise call 3 drops screenshot 1. The former
    # sliding window (no low-water mark), reachable by config.
    tok = vl_tokenizer
    observations = [obs(i) for i in range(4)]
    config = AgentConfig(
        max_screenshots=2, screenshots_after_compaction=None, placeholder_old_observations=False
    )
    agent, client = run(tok, config, observations)
    comps = agent.history.compactions
    assert [(c.before_call, c.reason, c.screenshots) for c in comps] == [
        (2, "screenshots", 2),
        (3, "screenshots", 2),
    ]
    assert [c.dropped_observations for c in comps] == [0, 0]  # observations are all kept
    segs = build_segments(agent.history)
    assert [s.call_indices for s in segs] == [(0, 1), (2,), (3,)]
    shots = [o.screenshot for o in observations]
    assert [s.images for s in segs] == [tuple(shots[:2]), tuple(shots[1:3]), tuple(shots[2:4])]
    for seg in segs:
        assert image_runs(seg.tokens, tok.token_id("<|image_pad|>")) == 2
    text = tok.decode(agent.history.calls[3].prompt_ids, skip_special_tokens=False)
    assert text.count("Screenshot: (removed: the prompt shows only the last 2 screenshot(s))") == 2
    assert text.count("<|vision_start|>") == 2
    assert "OK 0" in text and "OK 3" in text  # the observations' text stays
    assert client.starts[2] == 0 and client.starts[3] == 0  # a rebuild asks for every route
    assert [len(x) for x in client.images] == [1, 2, 2, 2]


def long_obs(i: int) -> Observation:
    tree = "\n".join(f"<button name='OK {i}.{k}'/>" for k in range(6))
    return Observation(
        screenshot=screenshot_png(1920, 1080, seed=i), a11y_tree=tree, terminal="", instruction="i"
    )


def test_chunked_compaction_one_segment_trains_several_replies(vl_tokenizer):
    # K = 3, low-water 1, 7 turns: calls 0-2 extend (1, 2, 3 images); call 3's screenshot would
    # be the fourth: the rebuild shows only it (a declared compaction), calls 4, 5 extend it,
    # call 6 compacts again. Segments (0, 1, 2), (3, 4, 5), (6,): token-exact (build_segments
    # checks every extension), every reply trained once, as the sliding window trains them.
    tok = vl_tokenizer
    pad = tok.token_id("<|image_pad|>")
    observations = [long_obs(i) for i in range(7)]
    replies = [f"WAIT {i}" for i in range(7)]
    agent, client = run(tok, AgentConfig(max_screenshots=3), observations, replies=replies)
    comps = agent.history.compactions
    assert [(c.before_call, c.reason, c.screenshots) for c in comps] == [
        (3, "screenshots", 1),
        (6, "screenshots", 1),
    ]
    segs = build_segments(agent.history)
    assert [s.call_indices for s in segs] == [(0, 1, 2), (3, 4, 5), (6,)]
    shots = [o.screenshot for o in observations]
    assert [s.images for s in segs] == [tuple(shots[0:3]), tuple(shots[3:6]), (shots[6],)]
    assert [image_runs(s.tokens, pad) for s in segs] == [3, 3, 1]
    assert [len(x) for x in client.images] == [1, 2, 3, 1, 2, 3, 1]
    for seg in segs:
        assert not seg.loss_mask[seg.tokens == pad].any()
    old_config = AgentConfig(
        max_screenshots=3, screenshots_after_compaction=None, placeholder_old_observations=False
    )
    old, _ = run(tok, old_config, observations, replies=replies)
    old_segs = build_segments(old.history)
    assert len(old_segs) == 5  # (0, 1, 2), (3,), (4,), (5,), (6,)

    def trained(segments):
        return [s.tokens[s.loss_mask > 0].tolist() for s in segments]

    new_ids = [t for ids in trained(segs) for t in ids]
    old_ids = [t for ids in trained(old_segs) for t in ids]
    assert new_ids == old_ids  # the same replies, each once, in order
    # Old observation text outside the kept window is a placeholder; the window's stays.
    call3 = tok.decode(agent.history.calls[3].prompt_ids, skip_special_tokens=False)
    call5 = tok.decode(agent.history.calls[5].prompt_ids, skip_special_tokens=False)
    assert "OK 0.0" not in call3 and "OK 2.0" not in call3 and "OK 3.0" in call3
    assert call3.count(OBSERVATION_DROPPED) == 3
    assert all(f"OK {i}.5" in call5 for i in (3, 4, 5)) and "OK 1.0" not in call5


def test_the_seeds_window_last_2_groups_initial_context_protected(vl_tokenizer):
    # The seed's window: the last 2 screenshots (one per observation: an image group), at most
    # 10 active images, the initial context protected; the window slides (no low-water mark)
    # and every 3 actions the context is compacted to the last 2 observations. 6 turns, the
    # shown screenshots ("|" after the protected one):
    #   calls 0-2 extend each other: [0], [0 | 1], [0 | 1, 2]
    #   call 3: 3 actions since the first render: every_k_actions -> [0 | 2, 3], turn 1 in
    #     the action history (as step 2: step 1 is the protected observation)
    #   calls 4, 5: the window would hold 3: screenshots -> [0 | 3, 4], [0 | 4, 5]
    # The first observation's screenshot and text are in every prompt; never more than 3
    # images; every segment is token-exact (build_segments checks it).
    tok = vl_tokenizer
    observations = [long_obs(i) for i in range(6)]
    replies = [f"WAIT {i}" for i in range(6)]
    config = AgentConfig(
        max_screenshots=2,
        screenshots_after_compaction=None,
        max_active_images=10,
        protect_initial_observation=True,
        compaction=CompactionConfig(every_k_actions=3, keep_last_observations=2),
    )
    agent, client = run(tok, config, observations, replies=replies)
    shots = [o.screenshot for o in observations]
    assert [len(x) for x in client.images] == [1, 2, 3, 3, 3, 3]
    assert [c.images for c in agent.history.calls] == [
        (shots[0],),
        (shots[0], shots[1]),
        (shots[0], shots[1], shots[2]),
        (shots[0], shots[2], shots[3]),
        (shots[0], shots[3], shots[4]),
        (shots[0], shots[4], shots[5]),
    ]
    comps = agent.history.compactions
    assert [(c.before_call, c.reason) for c in comps] == [
        (3, "every_k_actions"),
        (4, "screenshots"),
        (5, "screenshots"),
    ]
    assert [(c.dropped_observations, c.kept_observations) for c in comps] == [
        (1, 3),  # turn 1 summarised; turn 0 (protected), turns 2, 3 kept
        (1, 4),
        (1, 5),
    ]
    segs = build_segments(agent.history)
    assert [s.call_indices for s in segs] == [(0, 1, 2), (3,), (4,), (5,)]
    for call in agent.history.calls:
        text = tok.decode(call.prompt_ids, skip_special_tokens=False)
        assert "OK 0.5" in text and f"Task instruction: {observations[0].instruction}" in text
    last = tok.decode(agent.history.calls[5].prompt_ids, skip_special_tokens=False)
    assert "2. WAIT 1" in last  # the action history numbers steps after the protected one
    assert "OK 1.0" not in last and "OK 5.5" in last
    # The cap binds when it is smaller than the window: 2 images = the protected one + 1.
    capped = dataclasses.replace(config, max_active_images=2)
    agent, client = run(tok, capped, observations[:3], replies=replies[:3])
    assert [len(x) for x in client.images] == [1, 2, 2]
    with pytest.raises(ConfigError, match="max_active_images"):
        AgentConfig(max_active_images=1, protect_initial_observation=True)


def test_low_water_mark_is_checked():
    with pytest.raises(ConfigError, match="screenshots_after_compaction"):
        AgentConfig(max_screenshots=3, screenshots_after_compaction=4)
    assert (
        AgentConfig(max_screenshots=3, screenshots_after_compaction=None).screenshot_low_water == 3
    )


def test_no_screenshots_for_a_text_model_or_k_zero(vl_tokenizer, agent_tokenizer):
    # A text model (no image processor) and max_screenshots = 0 both drop the screenshot and
    # send no image_data; the segment has no images.
    for tok, config in [
        (agent_tokenizer, AgentConfig()),
        (vl_tokenizer, AgentConfig(max_screenshots=0)),
    ]:
        agent, client = run(tok, config, [obs(0), obs(1)])
        assert client.images == [None, None]
        (seg,) = build_segments(agent.history)
        assert seg.images == ()
        assert tok.token_id("<|image_pad|>") not in seg.tokens.tolist()
        assert "Screenshot" not in tok.decode(seg.tokens, skip_special_tokens=False)


def test_a_turn_without_screenshot_and_a_screenshot_without_text(vl_tokenizer):
    o0 = Observation(
        screenshot=screenshot_png(640, 480), a11y_tree="", terminal="", instruction="i"
    )
    o1 = obs(1, screenshot=False)
    agent, client = run(vl_tokenizer, AgentConfig(), [o0, o1])
    text = vl_tokenizer.decode(agent.history.calls[1].prompt_ids, skip_special_tokens=False)
    assert "(no observation available)" not in text.split("<|im_start|>user")[1]
    assert client.images[1] == client.images[0]  # turn 1 adds no image
    assert len(build_segments(agent.history)) == 1


def test_an_undecodable_screenshot_fails_the_owner(vl_tokenizer):
    bad = Observation(screenshot=b"\x89PNG not really", a11y_tree="x", terminal="", instruction="i")
    with pytest.raises(AgentCallError, match="not a usable image") as e:
        run(vl_tokenizer, AgentConfig(), [bad])
    assert isinstance(e.value, InfraError)


def test_generated_media_tokens_stay_as_text_and_leave_the_loss(vl_tokenizer):
    # Reply 0 is "ok<|image_pad|>go" + <|im_end|>: the context keeps "ok", the *text* of
    # <|image_pad|> (neutralised, not the special id) and "go<|im_end|>"; only "ok" is trained
    # on (the tokens after the media token were generated in a context the trainer never sees);
    # their route rows are -1 and call 1 asks the server to route from there again.
    tok = vl_tokenizer
    pad = tok.token_id("<|image_pad|>")
    agent, client = run(tok, AgentConfig(), [obs(0), obs(1)], replies=["ok<|image_pad|>go", "DONE"])
    call0, call1 = agent.history.calls
    raw = tok.encode("ok<|image_pad|>go").tolist() + [tok.token_id("<|im_end|>")]
    j = raw.index(pad)
    assert call0.trainable == j
    kept = call0.output_ids.tolist()
    assert kept[:j] == raw[:j] and pad not in kept
    assert tok.decode(kept[j:], skip_special_tokens=False).startswith("<\u200b|image_pad|>go")
    # Every <|image_pad|> of call 1's prompt belongs to its two screenshots.
    assert int((call1.prompt_ids == pad).sum()) == 2 * 144
    p = call0.prompt_ids.size
    assert client.starts[1] == p + j
    (seg,) = build_segments(agent.history)
    np.testing.assert_array_equal(seg.loss_mask[p : p + j], 1.0)
    assert not seg.loss_mask[p + j : call1.prompt_ids.size].any()
    np.testing.assert_array_equal(seg.behavior_logprobs[p + j : call1.prompt_ids.size], 0.0)
    # Routes: call 0 covered positions < p + j; call 1 re-routed from p + j on (the fake's route
    # at position q for call c is (q + c) % 8).
    np.testing.assert_array_equal(seg.routed_experts[: p + j, 0, 0], np.arange(p + j) % 8)
    q = np.arange(p + j, call1.length - 1)
    np.testing.assert_array_equal(seg.routed_experts[p + j : call1.length - 1, 0, 0], (q + 1) % 8)


def test_segment_images_must_extend_and_fill_the_placeholders(vl_tokenizer):
    import dataclasses

    agent, _ = run(vl_tokenizer, AgentConfig(), [obs(0), obs(1)])
    events = agent.history.events
    swapped = dataclasses.replace(events[1], images=(events[1].images[1], events[1].images[0]))
    agent.history.events[1] = swapped
    with pytest.raises(SegmentIntegrityError, match="do not start with the previous"):
        build_segments(agent.history)
    agent.history.events[1] = dataclasses.replace(events[1], images=events[1].images[:1])
    with pytest.raises(SegmentIntegrityError, match="2 image-token runs but the call carries 1"):
        build_segments(agent.history)


def test_budget_counts_image_tokens(vl_tokenizer):
    # 144 image tokens per screenshot: with a 700-token prompt budget the third turn cannot be
    # appended (budget compaction) and no prompt passes the budget.
    config = AgentConfig(
        max_screenshots=3,
        compaction=CompactionConfig(max_context_tokens=764, reserved_generation_tokens=64),
    )
    agent, _ = run(vl_tokenizer, config, [obs(i) for i in range(4)])
    assert any(c.reason == "budget" for c in agent.history.compactions)
    assert all(c.prompt_ids.size <= 700 for c in agent.history.calls)
