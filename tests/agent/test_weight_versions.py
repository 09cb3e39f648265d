"""The weight version of every generated token: Generation -> CallRecord -> Segment -> owner.

A reply a refit interrupted is stitched from parts that ran on different weights; every token
keeps its part's version all the way to the owner's (oldest, newest) range, which the RL loop
checks against its staleness window.
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from osworld_jax.agent import (
    AgentConfig,
    CallRecord,
    Compaction,
    History,
    OwnerAgent,
    OwnerRollout,
    Segment,
    WeightVersionError,
    build_segments,
    weight_version_number,
)
from osworld_jax.env.agent_env import OwnerResult
from osworld_jax.env.backend import Observation
from osworld_jax.rollout import SamplingParams

from .conftest import ScriptedClient

OBS = Observation(screenshot=None, a11y_tree="<editor/>", terminal="", instruction="Type cat.")
HEALTHY = OwnerResult(owner_index=0, reward=1.0, failed=False, error=None, turns=2, actions=())


class Refitting(ScriptedClient):
    """Scripted replies whose call ``c`` is split into parts ``parts[c]``: ``(version, n)``
    pairs, the last part taking the remaining tokens (as a client stitches a refit's abort)."""

    def __init__(self, tok, replies, parts):
        super().__init__(tok, replies)
        self.parts = parts

    async def generate(self, input_ids, sampling, *, rid, routed_experts_start_len=0):
        gen = await super().generate(
            input_ids, sampling, rid=rid, routed_experts_start_len=routed_experts_start_len
        )
        parts = self.parts[len(self.requests) - 1]
        lengths = [n for _, n in parts[:-1]]
        lengths.append(gen.completion_tokens - sum(lengths))
        return dataclasses.replace(
            gen,
            weight_version=parts[-1][0],
            weight_versions=tuple(v for v, _ in parts),
            part_lengths=tuple(lengths),
        )


def run(tok, client, n_calls):
    agent = OwnerAgent(
        client, tok, AgentConfig(), owner_id=4, group_id=1, sampling=SamplingParams()
    )

    async def go():
        for _ in range(n_calls):
            await agent.act(OBS)

    asyncio.run(go())
    return agent


def test_a_reply_split_by_a_refit_keeps_each_tokens_version(agent_tokenizer):
    # Call 0: 3 tokens on "6", aborted by the refit, the rest on "7"; call 1 wholly on "7".
    client = Refitting(
        agent_tokenizer, ["pyautogui.click(100, 200)", "DONE"], [[("6", 3), ("7", 0)], [("7", 0)]]
    )
    agent = run(agent_tokenizer, client, 2)
    c0, c1 = agent.history.calls
    n0, n1 = c0.output_ids.size, c1.output_ids.size
    assert n0 > 3
    assert (c0.weight_versions, c0.part_lengths) == (("6", "7"), (3, n0 - 3))
    assert c0.output_weight_versions() == ("6",) * 3 + ("7",) * (n0 - 3)
    assert c0.weight_version == "7" and c1.output_weight_versions() == ("7",) * n1
    (seg,) = build_segments(agent.history)  # call 1 extends call 0: one segment
    p0, p1 = c0.prompt_ids.size, c1.prompt_ids.size
    #   positions  [0, p0)   [p0, p0+3)  [p0+3, p0+n0)  [p0+n0, p1)  [p1, p1+n1)
    #   version      -1          "6"          "7"           -1           "7"
    want = np.full(seg.length, -1)
    want[p0 : p0 + 3] = 0
    want[p0 + 3 : p0 + n0] = 1
    want[p1:] = 1
    assert seg.version_table == ("6", "7")
    np.testing.assert_array_equal(seg.token_version_ids, want)
    np.testing.assert_array_equal(seg.token_version_ids >= 0, seg.loss_mask > 0)
    assert seg.trainable_tokens_by_version() == {"6": 3, "7": n0 - 3 + n1}
    owner = agent.to_rollout(HEALTHY)
    assert owner.trainable_tokens_by_version() == {"6": 3, "7": n0 - 3 + n1}
    assert sum(owner.trainable_tokens_by_version().values()) == owner.num_trainable
    assert owner.weight_version_range() == (6, 7)


@pytest.mark.parametrize("first", [3, 12])
def test_versions_stop_where_a_generated_media_token_ends_the_trainable_reply(
    agent_tokenizer, first
):
    # "ok now <|image_pad|> more": from the media token (index j) on nothing is trainable and
    # no token is the model's as-is, so the parts are cut at j (7 with this tokenizer):
    # first=3 -> ("1": 3, "2": j - 3); first=12 >= j -> ("1": j) only.
    client = Refitting(agent_tokenizer, ["ok now <|image_pad|> more"], [[("1", first), ("2", 0)]])
    agent = run(agent_tokenizer, client, 1)
    (call,) = agent.history.calls
    j = call.trainable
    assert j is not None and 3 < j < 12 and call.num_generated == j
    if first < j:
        assert (call.weight_versions, call.part_lengths) == (("1", "2"), (first, j - first))
    else:
        assert (call.weight_versions, call.part_lengths) == (("1",), (j,))
    (seg,) = build_segments(agent.history)
    p = call.prompt_ids.size
    np.testing.assert_array_equal(seg.token_version_ids[p + j :], -1)
    np.testing.assert_array_equal(seg.token_version_ids >= 0, seg.loss_mask > 0)
    want = {"1": min(first, j)} | ({"2": j - first} if first < j else {})
    assert agent.to_rollout(HEALTHY).trainable_tokens_by_version() == want


def record(prompt, output, version, parts=None, **kw):
    versions, lengths = zip(*parts, strict=True) if parts else ((), ())
    return CallRecord(
        prompt_ids=prompt,
        output_ids=output,
        output_logprobs=[-0.5] * len(output),
        routed_experts=None,
        finish_reason={"type": "stop"},
        weight_version=version,
        weight_versions=versions,
        part_lengths=lengths,
        rid=f"r-{version}",
        **kw,
    )


def test_each_segment_has_its_own_version_table_and_the_owner_spans_them():
    # Segment 0: call [1 2] -> [3 4 5] on "2"; compaction; segment 1: call [9] -> [6 7] split
    # "3" | "5" (a refit), then [9 6 7 8] -> [4] on "5". Oldest "2", newest "5".
    h = History(owner_id=9, group_id=2)
    h.record_call(record([1, 2], [3, 4, 5], "2"))
    h.declare_compaction(
        Compaction(
            before_call=1,
            reason="budget",
            dropped_observations=1,
            kept_observations=1,
            tokens_before=5,
            tokens_after=1,
        )
    )
    h.record_call(record([9], [6, 7], "5", parts=[("3", 1), ("5", 1)]))
    h.record_call(record([9, 6, 7, 8], [4], "5"))
    s0, s1 = build_segments(h)
    assert s0.version_table == ("2",) and s1.version_table == ("3", "5")
    np.testing.assert_array_equal(s0.token_version_ids, [-1, -1, 0, 0, 0])
    np.testing.assert_array_equal(s1.token_version_ids, [-1, 0, 1, -1, 1])
    owner = OwnerRollout(owner_id=9, group_id=2, segments=(s0, s1), reward=0.0, failed=False)
    assert owner.trainable_tokens_by_version() == {"2": 3, "3": 1, "5": 2}
    assert owner.weight_version_range() == (2, 5)


def test_version_numbers_are_decimal_steps_or_declared_aliases():
    assert weight_version_number("12") == 12 and weight_version_number("0") == 0
    assert weight_version_number("default", aliases={"default": 0}) == 0
    for bad in ("default", " 1", "+1", "1_0", "-1", "\u0661", "v1", ""):
        with pytest.raises(WeightVersionError) as e:
            weight_version_number(bad, owner_id=3)
        msg = str(e.value)
        assert msg.startswith(f"owner 3: weight version {bad!r} is not a step number")
        assert "\n" not in msg and "--weight-version 0" in msg
    h = History(owner_id=5, group_id=0)
    h.record_call(record([1], [2, 3], "default"))
    owner = OwnerRollout(
        owner_id=5, group_id=0, segments=tuple(build_segments(h)), reward=1.0, failed=False
    )
    with pytest.raises(WeightVersionError, match="owner 5: weight version 'default'"):
        owner.weight_version_range()
    assert owner.weight_version_range(aliases={"default": 0}) == (0, 0)
    failed = OwnerRollout(owner_id=6, group_id=0, segments=(), reward=None, failed=True)
    assert failed.weight_version_range() is None and failed.trainable_tokens_by_version() == {}


def test_inconsistent_version_bookkeeping_is_refused():
    with pytest.raises(ValueError, match=r"call 'r-2': part lengths \(1, 1\) sum to 2, not 3"):
        record([1], [2, 3, 4], "2", parts=[("1", 1), ("2", 1)])
    with pytest.raises(ValueError, match="call 'r-2': 2 weight versions but 0 part lengths"):
        CallRecord(
            prompt_ids=[1],
            output_ids=[2],
            output_logprobs=[-1.0],
            routed_experts=None,
            finish_reason={"type": "stop"},
            weight_version="2",
            weight_versions=("1", "2"),
            rid="r-2",
        )
    seg = dict(
        owner_id=1,
        group_id=0,
        tokens=np.array([1, 2, 3]),
        loss_mask=np.array([0.0, 1.0, 1.0]),
        behavior_logprobs=np.zeros(3),
        routed_experts=None,
        call_indices=(0, 1),
    )
    with pytest.raises(ValueError, match="owner 1: token 2 has loss mask 1 but no weight version"):
        Segment(**seg, weight_versions=("1",), token_version_ids=[-1, 0, -1], version_table=("1",))
    with pytest.raises(
        ValueError, match=r"owner 1: token_version_ids must be 3 indices in \[-1, 1"
    ):
        Segment(**seg, weight_versions=("1",), token_version_ids=[-1, 0, 1], version_table=("1",))
    # A hand-built segment without per-token versions: answered only when its calls agree.
    assert Segment(**seg, weight_versions=("4", "4")).trainable_tokens_by_version() == {"4": 2}
    with pytest.raises(ValueError, match=r"owner 1: .* no per-token versions .*\['3', '4'\]"):
        Segment(**seg, weight_versions=("3", "4")).trainable_tokens_by_version()
