"""Group policy, per-owner advantages and packing into the Batch contract."""

from __future__ import annotations

import math

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from osworld_jax.agent import (
    CallRecord,
    Compaction,
    GroupPolicyConfig,
    GroupPolicyError,
    GroupSelection,
    History,
    OwnerRollout,
    PackingError,
    Segment,
    bucket_length,
    build_segments,
    pack_batch,
    select_groups,
    split_selection,
)
from osworld_jax.algorithms import aggregate_loss
from osworld_jax.batch import BatchBounds, check_batch
from osworld_jax.errors import ConfigError
from osworld_jax.rl.stages import owner_advantages as selection_advantages

L, K = 2, 2


def owner_advantages(owners, estimator):
    """The RL loop's reward -> advantage path over exactly ``owners``."""
    return selection_advantages(GroupSelection.of(owners), estimator)


def pack(owners, adv, **kw):
    """``pack_batch`` of exactly ``owners`` (no group policy), and their selection."""
    sel = GroupSelection.of(owners)
    return pack_batch(sel, adv, **kw), sel


def segment(owner, group, n_prompt, n_out, *, seed=0, media=()):
    """A one-call segment with distinct tokens/logprobs/routes derived from ``seed``."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(10, 100, n_prompt)
    out = rng.integers(10, 100, n_out)
    out[: len(media)] = media
    h = History(owner_id=owner, group_id=group, media_token_ids=frozenset({7}))
    h.record_call(
        CallRecord(
            prompt_ids=prompt,
            output_ids=out,
            output_logprobs=-rng.random(n_out),
            routed_experts=rng.integers(0, 8, (n_prompt + n_out - 1, L, K)),
            finish_reason={"type": "stop"},
            weight_version="v0",
        )
    )
    (seg,) = build_segments(h)
    return seg


def owner(i, group, reward, segs=(), failed=False):
    return OwnerRollout(
        owner_id=i,
        group_id=group,
        segments=tuple(segs),
        reward=None if failed else reward,
        failed=failed,
        error="sandbox died" if failed else None,
    )


def reference_pack(owners, adv, t, r):
    """Plain-Python reference of pack_batch, token by token."""
    gids = sorted({o.group_id for o in owners})
    out = {
        "tokens": [[0] * t for _ in range(r)],
        "loss_mask": [[0.0] * t for _ in range(r)],
        "behavior_logprobs": [[0.0] * t for _ in range(r)],
        "advantages": [[0.0] * t for _ in range(r)],
        "positions": [list(range(t)) for _ in range(r)],
        "segment_ids": [[0] * t for _ in range(r)],
        "owner_ids": [0] * r,
        "group_ids": [0] * r,
        "row_weight": [0.0] * r,
        "routed_experts": [[[[-1] * K for _ in range(L)] for _ in range(t)] for _ in range(r)],
    }
    row = 0
    for i, o in enumerate(owners):
        segs = [] if o.failed else list(o.segments)
        for seg in segs or [None]:
            out["owner_ids"][row] = i
            out["group_ids"][row] = gids.index(o.group_id)
            if seg is not None:
                out["row_weight"][row] = 1.0
                for p in range(seg.length):
                    out["tokens"][row][p] = int(seg.tokens[p])
                    m = float(seg.loss_mask[p])
                    out["loss_mask"][row][p] = m
                    out["behavior_logprobs"][row][p] = float(seg.behavior_logprobs[p])
                    out["advantages"][row][p] = float(adv[i]) * m
                    out["segment_ids"][row][p] = 1
                    for layer in range(L):
                        for k in range(K):
                            out["routed_experts"][row][p][layer][k] = int(
                                seg.routed_experts[p, layer, k]
                            )
            row += 1
    return out


@settings(max_examples=25, deadline=None)
@given(
    spec=st.lists(
        st.tuples(
            st.integers(0, 3),  # group
            st.booleans(),  # failed
            st.lists(st.tuples(st.integers(1, 20), st.integers(1, 12)), min_size=1, max_size=3),
        ),
        min_size=1,
        max_size=6,
    ),
    dp=st.sampled_from([1, 2, 4]),
)
def test_pack_batch_equals_a_plain_python_reference(spec, dp):
    owners = []
    for i, (g, failed, segs) in enumerate(spec):
        built = [segment(i, g, p, o, seed=100 * i + j) for j, (p, o) in enumerate(segs)]
        owners.append(owner(i, g, float(i % 2), built, failed=failed))
    adv = np.linspace(-1.0, 1.0, len(owners)).astype(np.float32)
    batch, sel = pack(owners, adv, num_layers=L, top_k=K, dp_size=dp, min_length=16)
    check_batch(batch)
    rows = sum(1 if o.failed else len(o.segments) for o in owners)
    longest = (
        max(s.length for o in owners if not o.failed for s in o.segments)
        if any(not o.failed for o in owners)
        else 1
    )
    # T = next power of two >= max(longest, 16); R = rows rounded up to a multiple of dp.
    t = 1 << (max(longest, 16) - 1).bit_length()
    r = math.ceil(rows / dp) * dp
    assert batch.tokens.shape == (r, t)
    ref = reference_pack(owners, adv, t, r)
    for name, want in ref.items():
        np.testing.assert_allclose(
            getattr(batch, name), np.array(want), rtol=0, atol=0, err_msg=name
        )
    assert len(sel.owners) == len(owners)
    assert sel.num_groups == len({o.group_id for o in owners})
    assert batch.owner_ids.max() < len(owners) and batch.group_ids.max() < sel.num_groups


def test_failed_owner_is_one_masked_row_and_siblings_are_kept():
    # Group 5: owners 0 (2 segments), 1 (failed), 2 (1 segment). Rows: 0, 0, 1, 2 + 0 padding
    # (dp 2 -> R = 4). The failed owner's row has weight 0, an all-zero mask and no advantage.
    owners = [
        owner(0, 5, 1.0, [segment(0, 5, 4, 3, seed=1), segment(0, 5, 5, 2, seed=2)]),
        owner(1, 5, None, failed=True),
        owner(2, 5, 0.0, [segment(2, 5, 3, 3, seed=3)]),
    ]
    batch, sel = pack(owners, [0.5, 0.0, -0.5], num_layers=L, top_k=K, dp_size=2)
    np.testing.assert_array_equal(batch.owner_ids, [0, 0, 1, 2])
    np.testing.assert_array_equal(batch.row_weight, [1, 1, 0, 1])
    np.testing.assert_array_equal(batch.group_ids, [0, 0, 0, 0])
    assert batch.loss_mask[2].sum() == 0 and batch.segment_ids[2].sum() == 0
    assert np.all(batch.routed_experts[2] == -1)
    assert batch.loss_mask[3].sum() == 3 and batch.advantages[3].sum() == pytest.approx(-1.5)
    assert (len(sel.owners), sel.num_groups, batch.tokens.shape[1]) == (3, 1, 128)


def test_rows_padded_to_dp_size_are_fully_masked():
    owners = [owner(0, 0, 1.0, [segment(0, 0, 3, 2)])]
    (batch, _) = pack(owners, [1.0], num_layers=L, top_k=K, dp_size=4)
    assert batch.tokens.shape[0] == 4
    np.testing.assert_array_equal(batch.row_weight, [1, 0, 0, 0])
    assert batch.loss_mask[1:].sum() == 0 and batch.advantages[1:].sum() == 0
    assert np.all(batch.routed_experts[1:] == -1) and np.all(batch.tokens[1:] == 0)
    # Padding continues counting positions; segment ids are 0 on padding.
    np.testing.assert_array_equal(batch.positions[0, :7], np.arange(7))
    np.testing.assert_array_equal(batch.segment_ids[0, :6], [1, 1, 1, 1, 1, 0])


def test_length_and_row_buckets():
    assert bucket_length(5, None) == 128
    assert bucket_length(129, None) == 256
    assert bucket_length(256, None) == 256
    assert bucket_length(300, [256, 512, 1024]) == 512
    with pytest.raises(PackingError, match="exceeds the largest length bucket 512"):
        bucket_length(600, [256, 512])
    owners = [owner(i, 0, 1.0, [segment(i, 0, 3, 2, seed=i)]) for i in range(3)]
    (batch, _) = pack(
        owners,
        [0, 0, 0],
        num_layers=L,
        top_k=K,
        dp_size=2,
        row_buckets=[8, 16],
        length_buckets=[64],
    )
    assert batch.tokens.shape == (8, 64)


def test_routes_with_the_wrong_layer_count_are_rejected():
    owners = [owner(0, 0, 1.0, [segment(0, 0, 3, 2)])]
    with pytest.raises(PackingError, match=r"expected \(4, 2\)"):
        pack(owners, [1.0], num_layers=4, top_k=K)


def test_routes_take_the_smallest_type_of_the_models_expert_ids():
    owners = [owner(0, 0, 1.0, [segment(0, 0, 3, 2, seed=s)]) for s in range(2)]
    wide, _ = pack(owners, [1.0, -1.0], num_layers=L, top_k=K)
    small, _ = pack(owners, [1.0, -1.0], num_layers=L, top_k=K, num_experts=128)
    assert wide.routed_experts.dtype == np.int32 and small.routed_experts.dtype == np.int8
    np.testing.assert_array_equal(small.routed_experts, wide.routed_experts)  # -1 kept
    assert small.routed_experts.nbytes * 4 == wide.routed_experts.nbytes
    seg = segment(0, 0, 3, 2)
    seg.routed_experts[0, 0, 0] = 200  # an id the int8 of 128 experts cannot hold
    with pytest.raises(PackingError, match="expert id 200, the model has 128 experts"):
        pack([owner(0, 0, 1.0, [seg])], [1.0], num_layers=L, top_k=K, num_experts=128)


def test_generated_media_tokens_get_no_advantage():
    # Output starts with media token 7 (history media id): its mask and advantage are 0.
    seg = segment(0, 0, 3, 4, media=(7,))
    (batch, _) = pack([owner(0, 0, 1.0, [seg])], [2.0], num_layers=L, top_k=K)
    np.testing.assert_array_equal(batch.loss_mask[0, :7], [0, 0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(batch.advantages[0, :7], [0, 0, 0, 0, 2, 2, 2])


def three_segment_owner_history():
    """Owner 0: 4 calls, compactions before calls 1 and 3 -> 3 segments with 2, 3 and 1 tokens.

    call 0 [1 2]->[3 4] | C | call 1 [1 5]->[6]; call 2 [1 5 6 8]->[9 9] | C | call 3 [1 7]->[2]
    """
    h = History(owner_id=0, group_id=0)

    def rec(p, o):
        h.record_call(
            CallRecord(
                prompt_ids=p,
                output_ids=o,
                output_logprobs=[-0.5] * len(o),
                routed_experts=None,
                finish_reason={"type": "stop"},
                weight_version="v0",
            )
        )

    def comp(c):
        h.declare_compaction(
            Compaction(
                before_call=c,
                reason="budget",
                dropped_observations=1,
                kept_observations=1,
                tokens_before=0,
                tokens_after=0,
            )
        )

    rec([1, 2], [3, 4])
    comp(1)
    rec([1, 5], [6])
    rec([1, 5, 6, 8], [9, 9])
    comp(3)
    rec([1, 7], [2])
    return h


def test_three_segment_owner_same_advantage_weighted_once():
    # Owners A (3 segments, reward 1) and B (1 segment, reward 0) in one group.
    # GRPO: mean 0.5, Bessel std sqrt(2 * 0.25 / 1) = 0.70711 -> A = +0.70711, B = -0.70711.
    a = OwnerRollout(
        owner_id=0,
        group_id=0,
        segments=tuple(build_segments(three_segment_owner_history())),
        reward=1.0,
        failed=False,
    )
    b = owner(1, 0, 0.0, [segment(1, 0, 3, 4, seed=9)])
    adv = owner_advantages([a, b], "grpo")
    np.testing.assert_allclose(adv, [0.70711, -0.70711], rtol=1e-4)
    batch, sel = pack([a, b], adv, num_layers=L, top_k=K)
    np.testing.assert_array_equal(batch.owner_ids, [0, 0, 0, 1])
    for row, n_trainable in zip(range(3), (2, 3, 1), strict=True):
        m = batch.loss_mask[row] > 0
        assert m.sum() == n_trainable
        np.testing.assert_allclose(batch.advantages[row][m], adv[0])
        assert np.all(batch.advantages[row][~m] == 0)
    # seq-mean-token-mean with token loss 1 on A's tokens and 3 on B's: owners pooled,
    # (1 + 3) / 2 = 2. Rows as owners would give (1 + 1 + 1 + 3) / 4 = 1.5.
    token_loss = np.where(batch.owner_ids[:, None] == 0, 1.0, 3.0) * batch.loss_mask
    pooled = aggregate_loss(
        jnp.asarray(token_loss),
        jnp.asarray(batch.loss_mask),
        mode="seq-mean-token-mean",
        owner_ids=jnp.asarray(batch.owner_ids),
        num_owners=len(sel.owners),
    )
    per_row = aggregate_loss(
        jnp.asarray(token_loss), jnp.asarray(batch.loss_mask), mode="seq-mean-token-mean"
    )
    np.testing.assert_allclose([float(pooled), float(per_row)], [2.0, 1.5], rtol=1e-6)


MODES = [
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "prompt-mean-token-mean",
]


def _aggregate(batch, sel, token_loss, mode, owner_ids):
    return float(
        aggregate_loss(
            jnp.asarray(token_loss),
            jnp.asarray(batch.loss_mask * batch.row_weight[:, None]),
            mode=mode,
            group_ids=jnp.asarray(batch.group_ids),
            num_groups=sel.num_groups,
            owner_ids=None if owner_ids is None else jnp.asarray(owner_ids),
            num_owners=None if owner_ids is None else len(sel.owners),
            norm_length=64.0,
        )
    )


@pytest.mark.parametrize("mode", MODES)
def test_owner_aggregation_of_segmented_rows_equals_the_unsegmented_rollout(mode):
    # Without compaction each owner is one segment = its whole rollout: aggregating the packed
    # rows with owner_ids equals aggregating one row per owner built straight from the histories
    # (own owner per row), with a failed owner and dp padding rows in the packed batch only.
    owners = [
        owner(0, 0, 1.0, [segment(0, 0, 5, 6, seed=1)]),
        owner(1, 0, 0.0, [segment(1, 0, 4, 9, seed=2)]),
        owner(2, 1, None, failed=True),
        owner(3, 1, 1.0, [segment(3, 1, 7, 3, seed=3)]),
        owner(4, 1, 0.0, [segment(4, 1, 2, 5, seed=4)]),
    ]
    adv = owner_advantages(owners, "grpo")
    batch, sel = pack(owners, adv, num_layers=L, top_k=K, dp_size=4)
    token_loss = -batch.advantages * batch.behavior_logprobs
    got = _aggregate(batch, sel, token_loss, mode, batch.owner_ids)
    healthy = [o for o in owners if not o.failed]
    ref_batch, ref_sel = pack(healthy, adv[[0, 1, 3, 4]], num_layers=L, top_k=K)
    ref_loss = -ref_batch.advantages * ref_batch.behavior_logprobs
    want = _aggregate(ref_batch, ref_sel, ref_loss, mode, None)
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_owner_aggregation_pools_an_owners_segments_like_one_sequence(mode):
    # The 3-segment owner (2 + 3 + 1 trainable tokens) aggregated with owner_ids equals one
    # concatenated row holding its 6 trainable tokens with the same losses.
    a = OwnerRollout(
        owner_id=0,
        group_id=0,
        segments=tuple(build_segments(three_segment_owner_history())),
        reward=1.0,
        failed=False,
    )
    b = owner(1, 0, 0.0, [segment(1, 0, 3, 4, seed=9)])
    adv = owner_advantages([a, b], "dr_grpo")  # +0.5, -0.5
    batch, sel = pack([a, b], adv, num_layers=L, top_k=K)
    token_loss = -batch.advantages * batch.behavior_logprobs
    got = _aggregate(batch, sel, token_loss, mode, batch.owner_ids)
    # Unsegmented: row 0 = A's trainable losses concatenated, row 1 = B's.
    t = batch.tokens.shape[1]
    flat_loss = np.zeros((2, t), np.float32)
    flat_mask = np.zeros((2, t), np.float32)
    for o in (0, 1):
        rows = batch.owner_ids == o
        vals = token_loss[rows][batch.loss_mask[rows] > 0]
        flat_loss[o, : vals.size] = vals
        flat_mask[o, : vals.size] = 1.0
    want = float(
        aggregate_loss(
            jnp.asarray(flat_loss),
            jnp.asarray(flat_mask),
            mode=mode,
            group_ids=jnp.zeros((2,), jnp.int32),
            num_groups=1,
            norm_length=64.0,
        )
    )
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_group_below_minimum_is_dropped():
    # Group 0: 3 healthy. Group 1: 1 healthy + 1 failed (< 2) -> dropped. Group 2: 2 healthy.
    owners = [
        owner(0, 0, 1.0, [segment(0, 0, 3, 2)]),
        owner(1, 0, 0.0, [segment(1, 0, 3, 2)]),
        owner(2, 0, 1.0, [segment(2, 0, 3, 2)]),
        owner(3, 1, 1.0, [segment(3, 1, 3, 2)]),
        owner(4, 1, None, failed=True),
        owner(5, 2, 0.0, [segment(5, 2, 3, 2)]),
        owner(6, 2, 1.0, [segment(6, 2, 3, 2)]),
    ]
    sel = select_groups(owners, GroupPolicyConfig(), num_prompts=3)
    assert sel.dropped_group_ids == (1,)
    assert [o.owner_id for o in sel.owners] == [0, 1, 2, 5, 6]
    np.testing.assert_array_equal(sel.group_index, [0, 0, 0, 1, 1])
    np.testing.assert_array_equal(sel.rewards, [1, 0, 1, 0, 1])
    assert sel.num_groups == 2 and sel.valid.all()
    with pytest.raises(GroupPolicyError, match=r"groups \[1\] .*on_dropped_group='fail'"):
        select_groups(owners, GroupPolicyConfig(on_dropped_group="fail"), num_prompts=3)
    # 2 of 3 groups survive; a fraction of 0.9 needs ceil(2.7) = 3.
    with pytest.raises(GroupPolicyError, match="only 2 of 3 prompt groups .* at least 3"):
        select_groups(owners, GroupPolicyConfig(min_step_batch_fraction=0.9), num_prompts=3)


def test_failed_owner_baseline_population():
    # One group: rewards 1, 0, failed (an unknown reward). dr_grpo over the logical owners with a
    # known reward {1, 0} -> mean 0.5 -> [+.5, -.5, (masked) 0]; the seed's all_owners keeps the
    # failed owner as a reward-0 placeholder: mean 1/3 -> [2/3, -1/3, (masked) 0].
    owners = [
        owner(0, 0, 1.0, [segment(0, 0, 3, 2)]),
        owner(1, 0, 0.0, [segment(1, 0, 3, 2)]),
        owner(2, 0, None, failed=True),
    ]
    np.testing.assert_allclose(owner_advantages(owners, "dr_grpo"), [0.5, -0.5, 0.0], atol=1e-6)
    sel = select_groups(owners, GroupPolicyConfig(baseline_population="logical_owners"), 1)
    np.testing.assert_array_equal(sel.valid, [True, True, False])
    sel = select_groups(owners, GroupPolicyConfig(baseline_population="all_owners"), 1)
    np.testing.assert_array_equal(sel.valid, [True, True, True])
    np.testing.assert_array_equal(sel.token_counts, [2, 2, 0])  # a placeholder has no tokens
    np.testing.assert_allclose(
        selection_advantages(sel, "dr_grpo"), [2 / 3, -1 / 3, 0.0], atol=1e-6
    )
    with pytest.raises(ConfigError, match="baseline_population = 'healthy' is retired"):
        GroupPolicyConfig(baseline_population="healthy")


@pytest.mark.parametrize("estimator", ["dr_grpo", "grpo", "rloo", "reinforce_baseline"])
def test_all_owners_keeps_a_failed_owner_as_a_reward_0_placeholder(estimator):
    # Rewards 1, 0, 1 and an infrastructure failure, trainable tokens 1, 1, 2 (the failed
    # owner: none). Where the two populations differ, by hand:
    #   logical_owners {1, 0, 1}: mean 2/3, centred [1/3, -2/3, 1/3]
    #   all_owners {1, 0, 1, 0}: mean 1/2, centred [1/2, -1/2, 1/2] (placeholder -1/2, masked)
    #   dr_grpo: the centred rewards
    #   grpo (Bessel): logical sqrt((1/9 + 4/9 + 1/9) / 2) = sqrt(1/3) -> [.57735, -1.1547, .57735]
    #                  all sqrt((4 x 1/4) / 3) = sqrt(1/3) -> [.86603, -.86603, .86603]
    #   rloo: n/(n-1) x centred: logical 3/2 -> [1/2, -1, 1/2]; all 4/3 -> [2/3, -2/3, 2/3]
    #   reinforce_baseline, token weights w = [1, 1, 2] (placeholder 0):
    #     logical: mu = (1/3 - 2/3 + 2/3) / 4 = 1/12; deviations [1/4, -3/4, 1/4];
    #              var = (1/16 + 9/16 + 2/16) / 4 = 3/16 -> [1/sqrt3, -sqrt3, 1/sqrt3]
    #     all: mu = (1/2 - 1/2 + 1) / 4 = 1/4; deviations [1/4, -3/4, 1/4]: the same values
    #          (whitening removes the shift of the mean; the populations differ in the group
    #          mean, not in the whitened spread here)
    s3 = math.sqrt(3)
    want = {
        "dr_grpo": ([1 / 3, -2 / 3, 1 / 3], [0.5, -0.5, 0.5]),
        "grpo": ([1 / 3 * s3, -2 / 3 * s3, 1 / 3 * s3], [0.5 * s3, -0.5 * s3, 0.5 * s3]),
        "rloo": ([0.5, -1.0, 0.5], [2 / 3, -2 / 3, 2 / 3]),
        "reinforce_baseline": ([1 / s3, -s3, 1 / s3], [1 / s3, -s3, 1 / s3]),
    }[estimator]
    owners = [
        owner(0, 0, 1.0, [segment(0, 0, 3, 1)]),
        owner(1, 0, 0.0, [segment(1, 0, 3, 1)]),
        owner(2, 0, 1.0, [segment(2, 0, 3, 2)]),
        owner(3, 0, None, failed=True),
    ]
    for population, expected in zip(("logical_owners", "all_owners"), want, strict=True):
        sel = select_groups(owners, GroupPolicyConfig(baseline_population=population), 1)
        adv = selection_advantages(sel, estimator)
        np.testing.assert_allclose(adv[:3], expected, rtol=1e-5, err_msg=population)
        assert adv[3] == 0.0  # the failed owner's own row is masked under both


@pytest.mark.parametrize("estimator", ["dr_grpo", "grpo", "rloo", "reinforce_baseline"])
def test_one_infra_failure_in_a_group_of_4_gives_the_advantages_of_a_group_of_3(estimator):
    # Rewards 1, 0, 0 and an infrastructure failure. The 3 healthy owners get exactly the
    # advantages of the group of 3 {1, 0, 0} (mean 1/3), by hand:
    #   dr_grpo: r - 1/3 = [2/3, -1/3, -1/3]
    #   grpo: std (Bessel, n-1 = 2) = sqrt((4/9 + 1/9 + 1/9) / 2) = sqrt(1/3) = 0.57735
    #         -> [2/3, -1/3, -1/3] / 0.57735 = [1.1547, -0.57735, -0.57735]
    #   rloo: 3/2 (r - 1/3) = [1, -0.5, -0.5]
    #   reinforce_baseline (1 token each): centred [2/3, -1/3, -1/3] already has mean 0 and var
    #         (4/9 + 1/9 + 1/9) / 3 = 2/9 -> / sqrt(2/9) = [1.41421, -0.70711, -0.70711]
    # A 4-segment owner counts once: the population is logical owners, not rows.
    want = {
        "dr_grpo": [2 / 3, -1 / 3, -1 / 3],
        "grpo": [2 / 3 / math.sqrt(1 / 3), -1 / 3 / math.sqrt(1 / 3), -1 / 3 / math.sqrt(1 / 3)],
        "rloo": [1.0, -0.5, -0.5],
        "reinforce_baseline": [math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2)],
    }[estimator]
    four = [
        owner(0, 0, 1.0, [segment(0, 0, 3, 1, seed=s) for s in range(4)]),
        owner(1, 0, 0.0, [segment(1, 0, 3, 1)]),
        owner(2, 0, 0.0, [segment(2, 0, 3, 1)]),
        owner(3, 0, None, failed=True),
    ]
    three = four[:3]
    if estimator == "reinforce_baseline":  # equal token counts: one trainable token per owner
        four[0] = owner(0, 0, 1.0, [segment(0, 0, 3, 1)])
        three = four[:3]
    sel = select_groups(four, GroupPolicyConfig(), 1)
    adv4 = selection_advantages(sel, estimator)
    adv3 = selection_advantages(GroupSelection.of(three), estimator)
    np.testing.assert_allclose(adv4[:3], want, rtol=1e-5)
    np.testing.assert_allclose(adv4[:3], adv3, rtol=1e-6)
    assert adv4[3] == 0.0  # the failed owner: a masked row, no advantage


def test_reinforce_baseline_gets_token_counts_per_owner():
    # token_counts are trainable tokens summed over an owner's segments: the estimator runs
    # (it raises without them) and a constant group gives 0.
    owners = [owner(i, 0, 1.0, [segment(i, 0, 3, 2 + i)]) for i in range(2)]
    adv = owner_advantages(owners, "reinforce_baseline")
    chex.assert_tree_all_finite(adv)
    np.testing.assert_allclose(adv, [0.0, 0.0], atol=1e-6)


def test_owner_rollout_requires_a_reward_when_healthy():
    with pytest.raises(ValueError, match="needs a reward"):
        OwnerRollout(owner_id=0, group_id=0, segments=(), reward=None, failed=False)


def test_segment_is_the_contract_row_type():
    seg = segment(0, 0, 3, 2)
    assert isinstance(seg, Segment)
    assert seg.routed_experts.shape == (5, L, K)
    np.testing.assert_array_equal(seg.routed_experts[4], -1)


# ------------------------------------------------------------------ minibatches (split_selection)


def _groups_of(part):
    return sorted({int(g) for g in part.group_index})


def test_split_selection_whole_groups_hand_values():
    # 5 groups (ids 3, 7, 8, 12, 20 -> index 0..4) of 2 owners; advantages 0.0, 0.1, ..., 0.9.
    ids = [3, 7, 8, 12, 20]
    owners = [
        owner(2 * k + j, g, float(j), [segment(2 * k + j, g, 3, 2)])
        for k, g in enumerate(ids)
        for j in range(2)
    ]
    sel = GroupSelection.of(owners)
    adv = np.arange(10, dtype=np.float32) / 10
    (a, adv_a), (b, adv_b) = split_selection(sel, adv, 2)  # 5 into 2: 3 + 2
    assert _groups_of(a) == [0, 1, 2] and _groups_of(b) == [3, 4]
    assert [o.owner_id for o in a.owners] == [0, 1, 2, 3, 4, 5]
    np.testing.assert_array_equal(a.owner_index, [0, 1, 2, 3, 4, 5])
    np.testing.assert_array_equal(b.owner_index, [6, 7, 8, 9])  # the whole selection's ids
    np.testing.assert_array_equal(b.group_index, [3, 3, 4, 4])
    np.testing.assert_array_equal(adv_a, adv[:6])
    np.testing.assert_array_equal(adv_b, adv[6:])  # sliced, never recomputed
    np.testing.assert_array_equal(b.rewards, [0, 1, 0, 1])
    assert a.num_groups == b.num_groups == 5
    # 7 groups into 3: 3 + 2 + 2; 2 groups into 4: two minibatches of one group each.
    seven = GroupSelection.of([owner(i, i, 1.0, [segment(i, i, 3, 2)]) for i in range(7)])
    parts = split_selection(seven, np.zeros(7), 3)
    assert [_groups_of(p) for p, _ in parts] == [[0, 1, 2], [3, 4], [5, 6]]
    two = GroupSelection.of(owners[:4])
    assert [_groups_of(p) for p, _ in split_selection(two, adv[:4], 4)] == [[0], [1]]
    # One minibatch (and an empty selection): the selection itself, today's batch.
    [(same, same_adv)] = split_selection(sel, adv, 1)
    assert same is sel
    np.testing.assert_array_equal(same_adv, adv)
    [(empty, _)] = split_selection(GroupSelection.of([]), np.zeros(0), 3)
    assert empty.owners == ()


def test_split_selection_keeps_interleaved_groups_whole():
    # Selection order A B A C B C (a failed owner in B): a group never spans two minibatches.
    spec = [(0, 10), (1, 11), (2, 10), (3, 12), (4, 11), (5, 12)]
    owners = [owner(i, g, 1.0, [segment(i, g, 3, 2)]) for i, g in spec]
    owners[4] = owner(4, 11, None, failed=True)
    sel = GroupSelection.of(owners)
    (a, adv_a), (b, _) = split_selection(sel, np.arange(6, dtype=np.float32), 2)
    assert [o.owner_id for o in a.owners] == [0, 1, 2, 4] and [o.owner_id for o in b.owners] == [
        3,
        5,
    ]
    np.testing.assert_array_equal(a.owner_index, [0, 1, 2, 4])
    np.testing.assert_array_equal(a.failed, [False, False, False, True])
    np.testing.assert_array_equal(adv_a, [0, 1, 2, 4])


def test_split_selection_packs_the_whole_batchs_rows():
    # Packing each part gives exactly the whole batch's rows of its owners, same ids (within the
    # same BatchBounds), a failed owner's masked row included.
    owners = [
        owner(i, i // 2, float(i % 2), [segment(i, i // 2, 3 + i % 3, 2 + i, seed=i)])
        for i in range(10)
    ]
    owners[3] = owner(3, 1, None, failed=True)
    sel = GroupSelection.of(owners)
    adv = np.linspace(-1, 1, 10).astype(np.float32)
    kw = dict(num_layers=L, top_k=K, length_buckets=(32,))
    whole = pack_batch(sel, adv, **kw)
    parts = [pack_batch(p, a, **kw) for p, a in split_selection(sel, adv, 3)]
    assert [p.tokens.shape[0] for p in parts] == [4, 4, 2]  # groups 0-1, 2-3, 4
    bounds = BatchBounds(num_owners=10, num_groups=5, norm_length=32)
    for p in parts:
        bounds.check(p)
    for name in (
        "tokens",
        "loss_mask",
        "behavior_logprobs",
        "advantages",
        "owner_ids",
        "group_ids",
        "row_weight",
        "routed_experts",
        "segment_ids",
        "positions",
    ):
        joined = np.concatenate([getattr(p, name) for p in parts])
        np.testing.assert_array_equal(joined, getattr(whole, name), err_msg=name)


def test_split_selection_advantages_are_the_whole_batchs():
    # batch_mean's baseline is the mean over every owner of the step: the parts carry the
    # whole-batch advantages (r - 0.5), not a per-minibatch recomputation (r - part mean).
    rewards = [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    owners = [owner(i, i // 3, r, [segment(i, i // 3, 3, 2)]) for i, r in enumerate(rewards)]
    sel = GroupSelection.of(owners)
    adv = selection_advantages(sel, "batch_mean")
    np.testing.assert_allclose(adv, [0.5, 0.5, 0.5, -0.5, -0.5, -0.5], atol=1e-6)
    (a, adv_a), (b, adv_b) = split_selection(sel, adv, 2)
    np.testing.assert_array_equal(adv_a, [0.5] * 3)
    np.testing.assert_array_equal(adv_b, [-0.5] * 3)
    np.testing.assert_allclose(selection_advantages(a, "batch_mean"), [0, 0, 0], atol=1e-6)


def test_each_minibatch_normalises_over_its_own_groups():
    # prompt-mean-token-mean with token loss = group index: the whole batch's loss is the mean
    # over its 5 groups (0+1+2+3+4)/5 = 2; the parts' are means over their own groups, 1 and 3.5.
    owners = [owner(i, i, 1.0, [segment(i, i, 3, 2 + i)]) for i in range(5)]
    sel = GroupSelection.of(owners)
    kw = dict(num_layers=L, top_k=K, length_buckets=(16,))

    def loss(batch):
        return float(
            aggregate_loss(
                jnp.asarray(batch.group_ids[:, None] * np.ones_like(batch.loss_mask)),
                jnp.asarray(batch.loss_mask * batch.row_weight[:, None]),
                mode="prompt-mean-token-mean",
                group_ids=jnp.asarray(batch.group_ids),
                num_groups=5,
            )
        )

    assert loss(pack_batch(sel, np.zeros(5), **kw)) == pytest.approx(2.0)
    parts = [pack_batch(p, a, **kw) for p, a in split_selection(sel, np.zeros(5), 2)]
    assert [loss(p) for p in parts] == [pytest.approx(1.0), pytest.approx(3.5)]


def test_split_selection_errors():
    sel = GroupSelection.of([owner(0, 0, 1.0, [segment(0, 0, 3, 2)])])
    with pytest.raises(ConfigError, match=r"^split_selection: num_minibatches 0 < 1$"):
        split_selection(sel, np.zeros(1), 0)
    with pytest.raises(PackingError, match="split_selection: 2 advantages for 1 owners"):
        split_selection(sel, np.zeros(2), 2)
