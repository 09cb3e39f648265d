"""History -> segments on hand-built histories (each expected value derived in a comment)."""

from __future__ import annotations

import numpy as np
import pytest

from osworld_jax.agent import (
    CallRecord,
    Compaction,
    History,
    SegmentIntegrityError,
    build_segments,
)


def call(prompt, output, logprobs=None, *, routes=True, base=0, lk=(1, 2), wv="v1"):
    """A call; routes row j = [base + j, base + j + 1000] (per layer), shape [P + O - 1, L, K]."""
    n = len(prompt) + len(output) - 1
    re_ = None
    if routes:
        l_, k_ = lk
        re_ = base + np.arange(n)[:, None, None] + 1000 * np.arange(k_)[None, None, :]
        re_ = np.broadcast_to(re_, (n, l_, k_)).astype(np.int32)
    if logprobs is None:
        logprobs = [-0.1 * (i + 1) for i in range(len(output))]
    return CallRecord(
        prompt_ids=prompt,
        output_ids=output,
        output_logprobs=logprobs,
        routed_experts=re_,
        finish_reason={"type": "stop", "matched": 2},
        weight_version=wv,
    )


def compaction(before):
    return Compaction(
        before_call=before,
        reason="every_k_actions",
        dropped_observations=1,
        kept_observations=1,
        tokens_before=0,
        tokens_after=0,
    )


def test_no_compaction_gives_one_segment():
    # call 0: prompt [10 11 12] -> output [20 21]; call 1 appends observation [13 14] to the
    # context [10 11 12 20 21] and generates [22]. One segment = call 1's prompt + output:
    #   tokens    10 11 12  20   21  13 14  22
    #   loss_mask  0  0  0   1    1   0  0   1
    #   logprobs   0  0  0 -.1  -.2   0  0 -.3
    h = History(owner_id=3, group_id=1)
    h.record_call(call([10, 11, 12], [20, 21], [-0.1, -0.2]))
    h.record_call(call([10, 11, 12, 20, 21, 13, 14], [22], [-0.3]))
    (seg,) = build_segments(h)
    np.testing.assert_array_equal(seg.tokens, [10, 11, 12, 20, 21, 13, 14, 22])
    np.testing.assert_array_equal(seg.loss_mask, [0, 0, 0, 1, 1, 0, 0, 1])
    np.testing.assert_allclose(seg.behavior_logprobs, [0, 0, 0, -0.1, -0.2, 0, 0, -0.3], rtol=1e-6)
    assert (seg.owner_id, seg.group_id, seg.call_indices) == (3, 1, (0, 1))
    assert seg.tokens.dtype == np.int32 and seg.loss_mask.dtype == np.float32
    assert seg.num_trainable == 3


def test_two_declared_compactions_give_three_segments():
    # call 0 [1 2 3]->[4] | compaction | call 1 [1 2 9]->[5 6]; call 2 [1 2 9 5 6 7]->[8] extends
    # call 1 | compaction | call 3 [1 7]->[9]. Segments: {0}, {1, 2}, {3} with tokens
    # [1 2 3 4], [1 2 9 5 6 7 8], [1 7 9].
    h = History(owner_id=0, group_id=0)
    h.record_call(call([1, 2, 3], [4]))
    h.declare_compaction(compaction(1))
    h.record_call(call([1, 2, 9], [5, 6]))
    h.record_call(call([1, 2, 9, 5, 6, 7], [8]))
    h.declare_compaction(compaction(3))
    h.record_call(call([1, 7], [9]))
    segs = build_segments(h)
    assert [s.call_indices for s in segs] == [(0,), (1, 2), (3,)]
    np.testing.assert_array_equal(segs[0].tokens, [1, 2, 3, 4])
    np.testing.assert_array_equal(segs[1].tokens, [1, 2, 9, 5, 6, 7, 8])
    np.testing.assert_array_equal(segs[1].loss_mask, [0, 0, 0, 1, 1, 0, 1])
    np.testing.assert_array_equal(segs[2].tokens, [1, 7, 9])
    assert [s.num_trainable for s in segs] == [1, 3, 1]


def test_declared_compaction_seals_even_when_the_prompt_happens_to_extend():
    # A declared rewrite is a new segment even if its ids happen to extend the old context.
    h = History(owner_id=0, group_id=0)
    h.record_call(call([1, 2], [3]))
    h.declare_compaction(compaction(1))
    h.record_call(call([1, 2, 3, 4], [5]))
    assert [s.call_indices for s in build_segments(h)] == [(0,), (1,)]


def test_undeclared_prefix_break_names_owner_call_and_position():
    # Context after call 0 is [10 11 12 20 21]; call 1's prompt has 99 at position 4 (where 21
    # was generated): the first differing position is 4.
    h = History(owner_id=7, group_id=2)
    h.record_call(call([10, 11, 12], [20, 21]))
    h.record_call(call([10, 11, 12, 20, 99, 13], [22]))
    with pytest.raises(SegmentIntegrityError, match=r"owner 7: call 1 .* position 4") as e:
        build_segments(h)
    assert (e.value.owner_id, e.value.call_index, e.value.position) == (7, 1, 4)


def test_prompt_shorter_than_context_is_a_break_at_its_end():
    # call 2's prompt [1 2 3] is a strict prefix of the context [1 2 3 4 5 6 7] of call 1: the
    # first position it cannot match is its own length, 3.
    h = History(owner_id=1, group_id=0)
    h.record_call(call([1, 2], [3]))
    h.record_call(call([1, 2, 3, 4, 5], [6, 7]))
    h.record_call(call([1, 2, 3], [8]))
    with pytest.raises(SegmentIntegrityError) as e:
        build_segments(h)
    assert (e.value.call_index, e.value.position) == (2, 3)


def test_generated_media_tokens_are_masked():
    # media ids {5, 6}; call 0 generates [20 5 5 6 21]: only 20 and 21 are trainable.
    # Their logprobs stay recorded (the mask, not the logprob, decides training).
    h = History(owner_id=0, group_id=0, media_token_ids=frozenset({5, 6}))
    h.record_call(call([1, 5, 5, 2], [20, 5, 5, 6, 21]))
    (seg,) = build_segments(h)
    np.testing.assert_array_equal(seg.loss_mask, [0, 0, 0, 0, 1, 0, 0, 0, 1])
    np.testing.assert_allclose(seg.behavior_logprobs[4:], [-0.1, -0.2, -0.3, -0.4, -0.5])


def test_routed_expert_rows_land_at_their_positions():
    # Server reply shape: [prompt_tokens + completion_tokens - 1, L, K].
    # call 0: P=3, O=2 -> 4 rows (base 100); call 1: P=7, O=1 -> 7 rows (base 300).
    # Row j is the route when token j was the input. The last call re-routes its whole prefix,
    # so rows 0..6 are call 1's rows (300 + j, 1300 + j); row 7 (the last generated token, never
    # an input) is -1.
    h = History(owner_id=0, group_id=0)
    h.record_call(call([10, 11, 12], [20, 21], base=100, lk=(2, 2)))
    h.record_call(call([10, 11, 12, 20, 21, 13, 14], [22], base=300, lk=(2, 2)))
    (seg,) = build_segments(h)
    assert seg.routed_experts.shape == (8, 2, 2)
    for j in range(7):
        np.testing.assert_array_equal(seg.routed_experts[j], [[300 + j, 1300 + j]] * 2)
    np.testing.assert_array_equal(seg.routed_experts[7], -1)


def test_incremental_routes_fill_only_their_new_positions():
    # call 0: P=3, O=2, start 0 -> rows for positions 0..3 (base 100 -> 100..103).
    # call 1: P=7, O=1, start 4 (the previous output's last token, never an input before)
    # -> 7 - 4 = 3 rows for positions 4..6 with values 300, 301, 302. Position 7: -1.
    h = History(owner_id=0, group_id=0)
    h.record_call(call([10, 11, 12], [20, 21], base=100))
    c1 = call([10, 11, 12, 20, 21, 13, 14], [22], routes=False)
    c1 = CallRecord(
        prompt_ids=c1.prompt_ids,
        output_ids=c1.output_ids,
        output_logprobs=c1.output_logprobs,
        routed_experts=(300 + np.arange(3)[:, None, None] + np.zeros((1, 1, 2))).astype(np.int32),
        finish_reason=c1.finish_reason,
        weight_version="v1",
        routed_experts_start=4,
    )
    h.record_call(c1)
    (seg,) = build_segments(h)
    np.testing.assert_array_equal(
        seg.routed_experts[:, 0, 0], [100, 101, 102, 103, 300, 301, 302, -1]
    )


def test_routes_of_an_earlier_call_fill_what_a_later_call_did_not_return():
    # call 1 returned no routes: call 0's 4 rows (base 100) stay at positions 0..3, the rest -1.
    h = History(owner_id=0, group_id=0)
    h.record_call(call([10, 11, 12], [20, 21], base=100))
    h.record_call(call([10, 11, 12, 20, 21, 13, 14], [22], routes=False))
    (seg,) = build_segments(h)
    np.testing.assert_array_equal(seg.routed_experts[:4, 0, 0], [100, 101, 102, 103])
    np.testing.assert_array_equal(seg.routed_experts[4:], -1)


def test_no_routes_anywhere_gives_none():
    h = History(owner_id=0, group_id=0)
    h.record_call(call([1, 2], [3], routes=False))
    (seg,) = build_segments(h)
    assert seg.routed_experts is None


def test_routed_experts_with_a_wrong_row_count_is_an_integrity_error():
    # P=3, O=2 needs 4 rows; 5 rows (an over-count across turns) is rejected.
    h = History(owner_id=4, group_id=0)
    bad = CallRecord(
        prompt_ids=[1, 2, 3],
        output_ids=[4, 5],
        output_logprobs=[-1.0, -1.0],
        routed_experts=np.zeros((5, 1, 2), np.int32),
        finish_reason={"type": "length", "length": 2},
        weight_version="v0",
    )
    h.record_call(bad)
    with pytest.raises(SegmentIntegrityError, match=r"owner 4: call 0 .*\[prompt \+ output - 1"):
        build_segments(h)


def test_compaction_must_be_declared_in_order():
    h = History(owner_id=0, group_id=0)
    h.record_call(call([1], [2]))
    with pytest.raises(ValueError, match="before call 3"):
        h.declare_compaction(compaction(3))


def test_empty_history_has_no_segments():
    assert build_segments(History(owner_id=0, group_id=0)) == []
