"""The generation window (`stages.check_window`): every trainable token's weight version against
the version the step trains, stale owners masked or refused, the staleness histogram."""

import numpy as np
import pytest

from osworld_jax.agent import OwnerRollout, Segment, WeightVersionError
from osworld_jax.data import TaskRef
from osworld_jax.rl import RLConfig, stages


def owner(owner_id, versions, counts, group=0):
    """An owner with one segment: 2 prompt tokens, then ``counts[i]`` generated tokens of
    ``versions[i]`` (per-token versions, as a stitched request across refits has)."""
    n = 2 + sum(counts)
    ids = np.full((n,), -1, np.int32)
    at = 2
    for i, c in enumerate(counts):
        ids[at : at + c] = i
        at += c
    loss = (ids >= 0).astype(np.float32)
    seg = Segment(
        owner_id=owner_id,
        group_id=group,
        tokens=np.arange(n, dtype=np.int32),
        loss_mask=loss,
        behavior_logprobs=-loss,
        routed_experts=None,
        call_indices=(0,),
        weight_versions=(versions[-1],),
        token_version_ids=ids,
        version_table=tuple(versions),
    )
    return OwnerRollout(
        owner_id=owner_id, group_id=group, segments=(seg,), reward=1.0, failed=False, error=None
    )


def step_rollouts(*owners):
    refs = (TaskRef(task_id="t0", path="/t0.json", group_id="t0"),)
    return stages.StepRollouts(tasks=refs, owners=tuple(owners), turns=(1,) * len(owners))


def test_on_policy_step_is_all_zero_staleness():
    rl = RLConfig()
    out, m = stages.check_window(step_rollouts(owner(0, ["default"], [3])), rl, step=1)
    assert not out.owners[0].failed
    assert m["staleness/max"] == 0 and m["staleness/mean"] == 0
    assert m["staleness/tokens_0"] == 3 and m["staleness/tokens_beyond"] == 0
    assert m["owners/stale"] == 0


def test_within_the_window_trains_and_the_histogram_counts_tokens():
    """Step 5 trains version 4; k = 2 allows versions 2..4. An owner stitched across a refit
    (3 tokens of version 3, 2 of version 4) and one entirely of version 2."""
    rl = RLConfig(max_staleness=2)
    rollouts = step_rollouts(owner(0, ["3", "4"], [3, 2]), owner(1, ["2"], [4]))
    out, m = stages.check_window(rollouts, rl, step=5)
    assert [o.failed for o in out.owners] == [False, False]
    assert out.owners == rollouts.owners  # untouched
    assert [m[f"staleness/tokens_{d}"] for d in range(3)] == [2, 3, 4]
    assert m["staleness/tokens_beyond"] == 0
    assert m["staleness/max"] == 2
    assert m["staleness/mean"] == pytest.approx((0 * 2 + 1 * 3 + 2 * 4) / 9)


def test_an_owner_beyond_the_window_is_masked():
    """k = 1, step 4 trains version 3: an owner with one token of version 1 (2 stale) is
    failed (a masked row) whatever its other tokens; its sibling trains."""
    rl = RLConfig(max_staleness=1, stale_owners="mask")
    stale, fresh = owner(0, ["1", "3"], [1, 5]), owner(1, ["2", "3"], [2, 2])
    out, m = stages.check_window(step_rollouts(stale, fresh), rl, step=4)
    assert out.owners[0].failed and out.owners[0].reward is None
    assert out.owners[0].segments == ()
    assert "2 steps stale" in out.owners[0].error and "max_staleness = 1" in out.owners[0].error
    assert out.owners[1] is fresh
    assert m["owners/stale"] == 1
    assert m["staleness/tokens_beyond"] == 1 and m["staleness/max"] == 2


def test_an_owner_beyond_the_window_is_refused():
    rl = RLConfig(max_staleness=0, stale_owners="refuse")
    with pytest.raises(stages.StalenessError, match=r"owner 7 has tokens 1 steps stale"):
        stages.check_window(step_rollouts(owner(7, ["default"], [2])), rl, step=2)


def test_tokens_from_weights_newer_than_the_step_are_an_integrity_error():
    rl = RLConfig(max_staleness=3)
    with pytest.raises(stages.StalenessError, match=r"newer than the weights this step trains"):
        stages.check_window(step_rollouts(owner(0, ["5"], [1])), rl, step=3)


def test_failed_owners_pass_and_unknown_versions_name_the_owner():
    rl = RLConfig(max_staleness=1)
    failed = OwnerRollout(owner_id=0, group_id=0, segments=(), reward=None, failed=True, error="x")
    out, m = stages.check_window(step_rollouts(failed), rl, step=3)
    assert out.owners == (failed,) and m["staleness/max"] == 0
    with pytest.raises(WeightVersionError, match="owner 1"):
        stages.check_window(step_rollouts(owner(1, ["v-new"], [1])), rl, step=3)


def test_config_checks():
    from osworld_jax.errors import ConfigError

    with pytest.raises(ConfigError, match="max_staleness"):
        RLConfig(max_staleness=-1)
    with pytest.raises(ConfigError, match="stale_owners"):
        RLConfig(stale_owners="drop")
