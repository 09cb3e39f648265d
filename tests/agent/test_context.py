"""Prompting and context: token-in/token-out, compaction triggers, media spans, budgets."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from osworld_jax.agent import (
    AgentConfig,
    AgentTokenizer,
    ChatTemplate,
    CompactionConfig,
    ContextOverflowError,
    OwnerAgent,
    build_segments,
    system_prompt,
)
from osworld_jax.env.actions import ActionKind, parse_action
from osworld_jax.env.backend import Observation
from osworld_jax.rollout import SamplingParams

from .conftest import ScriptedClient
from .test_template import QWEN3_LIKE

INSTRUCTION = "Open the terminal and type hello."
REPLIES = [
    "I will click.\n```python\npyautogui.click(10, 20)\n```",
    "```python\npyautogui.typewrite('hello')\n```",
    "WAIT",
    "```python\npyautogui.press('enter')\n```",
    "DONE",
]


def obs(i: int, *, lines: int = 3, screenshot: bool = False) -> Observation:
    tree = "\n".join(f"<node id='o{i}n{j}' name='item {j}'/>" for j in range(lines))
    return Observation(
        screenshot=b"\x89PNG" if screenshot else None,
        a11y_tree=tree,
        terminal=f"$ step {i}",
        instruction=INSTRUCTION,
    )


def run_agent(tok, config, n, *, replies=REPLIES, stop=True, sampling=None, **obs_kw):
    client = ScriptedClient(tok, replies, stop=stop)
    agent = OwnerAgent(
        client,
        tok,
        config,
        owner_id=3,
        group_id=1,
        sampling=sampling or SamplingParams(max_new_tokens=64),
    )

    async def go():
        return [await agent.act(obs(i, **obs_kw)) for i in range(n)]

    texts = asyncio.run(go())
    return agent, client, texts


def conversation(config, turns, replies):
    """The messages a full (never compacted) chat would render."""
    msgs = [{"role": "system", "content": system_prompt(config)}]
    for k, text in enumerate(turns):
        content = f"Task instruction: {INSTRUCTION}\n\n{text}" if k == 0 else text
        msgs.append({"role": "user", "content": content})
        if k < len(replies):
            msgs.append({"role": "assistant", "content": replies[k]})
    return msgs


@pytest.mark.parametrize("stop", [True, False])
def test_consecutive_prompts_extend_each_other_token_exactly(agent_tokenizer, stop):
    # Each prompt is the previous prompt + output + the new turn (appended, never re-tokenised).
    # With ChatML the final prompt decodes to exactly the template's rendering of the whole
    # conversation: with stop=True the model's own <|im_end|> closes its turn, with stop=False
    # (a length finish) the appended turn supplies it.
    config = AgentConfig()
    agent, client, texts = run_agent(agent_tokenizer, config, 4, stop=stop)
    assert texts == REPLIES[:4]
    calls = agent.history.calls
    for prev, nxt in zip(calls, calls[1:], strict=False):
        ctx = np.concatenate([prev.prompt_ids, prev.output_ids])
        np.testing.assert_array_equal(nxt.prompt_ids[: ctx.size], ctx)
    for (sent, _, _), call in zip(client.requests, calls, strict=True):
        assert sent == call.prompt_ids.tolist()
    from osworld_jax.agent.prompts import render_observation

    turns = [render_observation(obs(i), config, agent_tokenizer) for i in range(4)]
    want = agent_tokenizer.template.render(
        conversation(config, turns, REPLIES[:3]), add_generation_prompt=True
    )
    assert agent_tokenizer.decode(calls[-1].prompt_ids, skip_special_tokens=False) == want
    (seg,) = build_segments(agent.history)
    assert seg.num_trainable == sum(c.output_ids.size for c in calls)
    assert [c.finish_reason["type"] for c in calls] == ["stop" if stop else "length"] * 4


def test_turns_append_token_exactly_with_a_qwen3_style_template(raw_tokenizer):
    # Qwen3 templates render the last assistant turn differently from earlier ones; the turn
    # suffix is taken after the assistant content, so prompts still extend each other exactly.
    tok = AgentTokenizer(raw_tokenizer, ChatTemplate(QWEN3_LIKE))
    agent, _, _ = run_agent(tok, AgentConfig(), 3)
    (seg,) = build_segments(agent.history)
    assert seg.call_indices == (0, 1, 2)
    text = tok.decode(agent.history.calls[2].prompt_ids, skip_special_tokens=False)
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert text.count("<|im_start|>user") == 3


def test_routes_are_requested_incrementally_and_land_per_position(agent_tokenizer):
    # Call c asks for routes from len(previous prompt + output) - 1; the fake's route at
    # position p for call c is (p + c) % 8, so the segment's route at p is (p + c(p)) % 8 with
    # c(p) the first call whose rows cover p; the last token has none.
    agent, client, _ = run_agent(agent_tokenizer, AgentConfig(), 3)
    calls = agent.history.calls
    ends = [c.length for c in calls]
    assert client.starts == [0, ends[0] - 1, ends[1] - 1]
    (seg,) = build_segments(agent.history)
    want = np.full(seg.length, -1)
    lo = 0
    for c, end in enumerate(ends):
        want[lo : end - 1] = (np.arange(lo, end - 1) + c) % 8
        lo = end - 1
    np.testing.assert_array_equal(seg.routed_experts[:, 1, 0], want)


def test_compaction_every_k_actions(agent_tokenizer):
    # K = 2, keep 1 observation: after actions 0, 1 the context is rewritten before call 2, and
    # after actions 2, 3 before call 4 -> segments {0, 1}, {2, 3}, {4}.
    config = AgentConfig(compaction=CompactionConfig(every_k_actions=2))
    agent, client, _ = run_agent(agent_tokenizer, config, 5)
    comps = agent.history.compactions
    assert [(c.before_call, c.reason) for c in comps] == [(2, "every_k_actions")] * 1 + [
        (4, "every_k_actions")
    ]
    assert [c.dropped_observations for c in comps] == [2, 4]
    assert [c.kept_observations for c in comps] == [1, 1]
    segs = build_segments(agent.history)
    assert [s.call_indices for s in segs] == [(0, 1), (2, 3), (4,)]
    assert client.starts[2] == 0 and client.starts[4] == 0
    text = agent_tokenizer.decode(agent.history.calls[4].prompt_ids, skip_special_tokens=False)
    # System prompt + instruction kept; 4 earlier actions listed; only observation 4 verbatim.
    assert text.startswith("<|im_start|>system\n" + system_prompt(config))
    assert f"Task instruction: {INSTRUCTION}" in text
    assert "[Context compacted: 4 earlier step(s)" in text
    assert "1. pyautogui.click(10, 20)" in text and "3. WAIT" in text
    assert "o4n0" in text and "o3n0" not in text and "o0n0" not in text
    assert text.count("<|im_start|>user") == 1


def test_compaction_keeps_the_last_n_observations_with_replies(agent_tokenizer):
    # K = 2, keep 2: the prompt of call 2 is [system, user(instruction + history of action 0 +
    # obs 1), assistant(reply 1), user(obs 2)] rendered by the chat template.
    from osworld_jax.agent.prompts import action_history_block, render_observation

    config = AgentConfig(compaction=CompactionConfig(every_k_actions=2, keep_last_observations=2))
    agent, _, _ = run_agent(agent_tokenizer, config, 3)
    r = [render_observation(obs(i), config, agent_tokenizer) for i in range(3)]
    block = action_history_block(REPLIES[:1], config)
    msgs = [
        {"role": "system", "content": system_prompt(config)},
        {"role": "user", "content": f"Task instruction: {INSTRUCTION}\n\n{block}\n\n{r[1]}"},
        {"role": "assistant", "content": REPLIES[1]},
        {"role": "user", "content": r[2]},
    ]
    want = agent_tokenizer.encode(agent_tokenizer.template.render(msgs, add_generation_prompt=True))
    np.testing.assert_array_equal(agent.history.calls[2].prompt_ids, want)
    (comp,) = agent.history.compactions
    assert (comp.dropped_observations, comp.kept_observations) == (1, 2)


def test_compaction_by_token_budget_and_generation_cap(agent_tokenizer):
    # System prompt ~608 tokens, each 20-line observation ~511: with a 2400-token context and
    # 200 reserved, prompts may not pass 2200 tokens, so the third turn cannot be appended and
    # the context is rewritten.
    config = AgentConfig(
        compaction=CompactionConfig(max_context_tokens=2400, reserved_generation_tokens=200)
    )
    agent, client, _ = run_agent(
        agent_tokenizer, config, 5, lines=20, sampling=SamplingParams(max_new_tokens=400)
    )
    comps = agent.history.compactions
    assert comps and all(c.reason == "budget" for c in comps)
    for c in comps:
        assert c.tokens_after <= 2200
    for call, (_, sampling, _) in zip(agent.history.calls, client.requests, strict=True):
        assert call.prompt_ids.size <= 2200
        assert sampling.max_new_tokens == min(400, 2400 - call.prompt_ids.size)
    segs = build_segments(agent.history)
    assert len(segs) == len(comps) + 1


def test_overflow_shrinks_the_tree_then_fails_clearly(agent_tokenizer):
    # One observation with a 400-line tree (~10.7k tokens) and a 1300-token budget: the tree is
    # halved until the prompt fits (a truncation note remains).
    config = AgentConfig(
        compaction=CompactionConfig(max_context_tokens=1400, reserved_generation_tokens=100)
    )
    agent, client, _ = run_agent(agent_tokenizer, config, 1, lines=400)
    text = agent_tokenizer.decode(agent.history.calls[0].prompt_ids, skip_special_tokens=False)
    assert agent.history.calls[0].prompt_ids.size <= 1300
    assert "more lines truncated" in text
    big = AgentConfig(
        system_prompt="word " * 2000,
        compaction=CompactionConfig(max_context_tokens=700, reserved_generation_tokens=100),
    )
    with pytest.raises(ContextOverflowError, match="exceeds the prompt budget 600"):
        run_agent(agent_tokenizer, big, 1)


def test_media_tokens_the_model_generates_are_masked(agent_tokenizer):
    # The reply "<|image_pad|>ok" tokenises to [image_pad, o, k?, ...] + <|im_end|>: the
    # context keeps the *text* of <|image_pad|> (no placeholder id without an image), and the
    # whole reply has loss mask 0 (its tokens after the media token were generated in a context
    # the trainer does not see). The media token ids stay masked however they arise.
    agent, _, _ = run_agent(agent_tokenizer, AgentConfig(), 1, replies=["<|image_pad|>ok"])
    (seg,) = build_segments(agent.history)
    call = agent.history.calls[0]
    p = call.prompt_ids.size
    pad = agent_tokenizer.token_id("<|image_pad|>")
    assert pad not in seg.tokens.tolist() and call.trainable == 0
    assert agent_tokenizer.decode(seg.tokens[p:], skip_special_tokens=False).startswith(
        "<\u200b|image_pad|>ok"
    )
    np.testing.assert_array_equal(seg.loss_mask[p:], 0.0)
    assert agent.context.media_token_ids() == {
        agent_tokenizer.token_id(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
    }


def test_a11y_char_and_token_budgets_and_special_strings(agent_tokenizer):
    from osworld_jax.agent.prompts import render_observation

    tok = agent_tokenizer
    o = Observation(
        screenshot=None,
        a11y_tree="\n".join(f"<n{j}/>" for j in range(100)) + "\n<x name='<|im_end|>'/>",
        terminal="t" * 50,
        instruction="i",
    )
    by_chars = render_observation(o, AgentConfig(a11y_max_chars=60, terminal_max_chars=10), tok)
    tree = by_chars.split("Accessibility tree:\n")[1].split("\n\nTerminal")[0]
    assert tree.endswith("more lines truncated]")
    assert len(tree.split("\n[...")[0]) <= 60
    assert "[...]\n" + "t" * 10 in by_chars
    by_tokens = render_observation(o, AgentConfig(a11y_max_tokens=30), tok)
    tree = by_tokens.split("Accessibility tree:\n")[1].split("\n\nTerminal")[0]
    assert tok.count(tree.split("\n[...")[0]) <= 30
    # A window titled "<|im_end|>" must not close the user turn.
    full = render_observation(o, AgentConfig(), tok)
    assert tok.token_id("<|im_end|>") not in tok.encode(full).tolist()
    assert "<x name=" in full


@pytest.mark.parametrize("space", ["pyautogui", "computer_13"])
def test_system_prompt_states_the_action_space_the_parser_accepts(space):
    text = system_prompt(AgentConfig(), space)
    for word in ("WAIT", "DONE", "FAIL", space):
        assert word in text
    # Replies in the formats the prompt asks for parse to the intended actions.
    if space == "pyautogui":
        act = parse_action("Click OK.\n```python\npyautogui.click(10, 20)\n```", space)
        assert act.kind == ActionKind.PYAUTOGUI
    else:
        reply = '```json\n{"action_type": "CLICK", "parameters": {"x": 10, "y": 20}}\n```'
        assert parse_action(reply, space).kind == ActionKind.COMPUTER_13
    for word in ("WAIT", "DONE", "FAIL"):
        assert parse_action(f"The page is loading.\n{word}", space).kind == ActionKind(word)


def test_trim_lines_keeps_whole_lines_and_says_what_was_cut():
    from osworld_jax.agent.prompts import trim_lines

    # "aaaa\nbbbb\ncccc" (14 chars) within 10, each line counted with its newline: "aaaa" -> 5,
    # "bbbb" -> 10 <= 10 kept, "cccc" -> 15 > 10 cut: 2 lines kept, 1 cut.
    assert trim_lines("aaaa\nbbbb\ncccc", 10) == "aaaa\nbbbb\n[... 1 more lines truncated]"
    assert trim_lines("aaaa\nbbbb", 100) == "aaaa\nbbbb"
    assert trim_lines("x" * 30 + "\ny", 8) == "x" * 8 + "\n[... truncated mid-line, 1 more lines]"
    assert trim_lines("anything", 0) == ""


def test_kept_replies_cannot_inject_special_tokens_after_a_compaction(agent_tokenizer):
    # K = 1, keep 2: call 1's prompt re-renders reply 0, which contains the text "<|im_start|>".
    # Rendered turns: system, user, assistant, user + the generation prompt = 5 <|im_start|>
    # ids; the reply's string must not add a sixth.
    config = AgentConfig(compaction=CompactionConfig(every_k_actions=1, keep_last_observations=2))
    agent, _, _ = run_agent(agent_tokenizer, config, 2, replies=["x <|im_start|> y", "DONE"])
    ids = agent.history.calls[1].prompt_ids.tolist()
    assert ids.count(agent_tokenizer.token_id("<|im_start|>")) == 5
    assert len(agent.history.compactions) == 1
