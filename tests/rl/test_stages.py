import dataclasses
import json

import numpy as np
import pytest

from osworld_jax.agent import GroupPolicyConfig, OwnerRollout, Segment, pack_batch, select_groups
from osworld_jax.batch import BatchBounds
from osworld_jax.data import TaskRef
from osworld_jax.env import OwnerResult, SandboxCreateError
from osworld_jax.rl import RLConfig, stages


class FakeAgent:
    """Stands in for a finished TimedOwnerAgent (to_rollout builds the owner)."""

    def __init__(self, owner, group, n_out=3):
        self.owner, self.group, self.n_out = owner, group, n_out

    def to_rollout(self, result):
        return OwnerRollout(
            owner_id=self.owner,
            group_id=self.group,
            segments=(),
            reward=None if result.failed else result.reward,
            failed=result.failed,
            error=result.error,
        )


def result(owner, reward=None, failed=False, turns=1):
    return OwnerResult(
        owner_index=owner,
        reward=reward,
        failed=failed,
        error="boom" if failed else None,
        turns=turns,
        actions=(),
    )


def refs(b):
    return tuple(TaskRef(task_id=f"t{g}", path=f"/t{g}.json", group_id=f"t{g}") for g in range(b))


def raw(results, b=2, n=2):
    agents = {o: FakeAgent(o, o // n) for o in range(b * n)}
    return stages.RawRollouts(tasks=refs(b), agents=agents, results=tuple(results))


def test_collect_owners_group_major_and_infra_failures():
    rl = RLConfig(num_prompts=2, num_owners=2, max_failed_fraction=0.5)
    got = stages.collect_owners(
        raw([[result(0, 1.0), result(1, 0.0, turns=3)], SandboxCreateError("no desktop")]), rl, 7
    )
    assert [o.owner_id for o in got.owners] == [0, 1, 2, 3]
    assert [o.group_id for o in got.owners] == [0, 0, 1, 1]
    assert [o.failed for o in got.owners] == [False, False, True, True]
    assert "no desktop" in got.owners[2].error and "t1" in got.owners[2].error
    assert got.turns == (1, 3, 0, 0)


def test_collect_owners_stops_on_too_many_failures_and_on_bugs():
    rl = RLConfig(num_prompts=2, num_owners=2, max_failed_fraction=0.25)
    with pytest.raises(stages.RolloutStepError, match="2/4 owners failed.*no desktop"):
        stages.collect_owners(
            raw([[result(0, 1.0), result(1, 0.0)], SandboxCreateError("no desktop")]), rl, 3
        )
    with pytest.raises(ZeroDivisionError):  # not an InfraError: a bug stops the run
        stages.collect_owners(raw([[result(0, 1.0), result(1, 0.0)], ZeroDivisionError()]), rl, 3)


def test_owner_seed_is_stable_and_distinct():
    assert stages.owner_seed(None, 1, 2) is None
    a = stages.owner_seed(0, 5, 3)
    assert a == stages.owner_seed(0, 5, 3)
    assert len({stages.owner_seed(0, s, o) for s in range(5) for o in range(8)}) == 40


def owners_with_segments(rewards, n):
    out = []
    for i, r in enumerate(rewards):
        mask = np.array([0, 0, 1, 1], np.float32)
        s = Segment(
            owner_id=i,
            group_id=i // n,
            tokens=np.array([5, 6, 7, 8], np.int32),
            loss_mask=mask,
            behavior_logprobs=mask * -0.5,
            routed_experts=None,
            call_indices=(0,),
            weight_versions=("0",),
        )
        out.append(OwnerRollout(owner_id=i, group_id=i // n, segments=(s,), reward=r, failed=False))
    return out


def test_advantages_and_metrics_over_logical_owners():
    rl = RLConfig(num_prompts=2, num_owners=2, estimator="dr_grpo")
    owners = owners_with_segments([1.0, 0.0, 1.0, 1.0], n=2)
    ro = stages.StepRollouts(tasks=refs(2), owners=tuple(owners), turns=(1, 2, 1, 1))
    sel = select_groups(ro.owners, GroupPolicyConfig(), rl.num_prompts)
    adv = stages.owner_advantages(sel, rl.estimator)
    # Dr.GRPO: r - mean_g -> group 0: (1, 0) - 0.5 = (0.5, -0.5); group 1 constant -> 0.
    np.testing.assert_allclose(adv, [0.5, -0.5, 0.0, 0.0])
    assert sel.dropped_group_ids == ()
    batch = pack_batch(sel, adv, num_layers=3, top_k=2)
    m = stages.step_metrics(
        ro,
        sel,
        adv,
        batch,
        {
            "gate_rejected_fraction": 0.25,
            "binary_kl_mean": 1e-3,
            "logprob_abs_diff": 0.1,
            "loss": 2.0,
            "route_agreement": 0.75,
            "step": 1,
        },
        1.0,
    )
    assert m["reward/mean"] == pytest.approx(0.75) and m["reward/pass_rate"] == pytest.approx(0.75)
    assert m["reward/std"] == pytest.approx(np.std([1, 0, 1, 1]))
    assert m["owners/failed"] == 0 and m["groups/dropped"] == 0
    assert m["tokens/trainable"] == 8 and m["segments/per_owner"] == 1.0
    assert m["turns/mean"] == pytest.approx(1.25)
    assert m["gate/rejected_fraction"] == 0.25 and m["gate/binary_kl_mean"] == 1e-3
    assert m["logprob/train_rollout_abs_diff"] == 0.1 and m["train/loss"] == 2.0
    assert m["r3/route_agreement"] == 0.75 and "train/step" not in m
    records = stages.owner_records(4, ro, sel, adv)
    assert [r["advantage"] for r in records] == [0.5, -0.5, 0.0, 0.0]
    assert records[2]["task_id"] == "t1" and records[0]["step"] == 4


def test_parse_errors_valid_rows_and_is_weight_metrics():
    # Owner 3 failed (infra): its masked row is in batch/rows but not in rows/valid. Parse
    # errors 2 + 0 + 1 + 0 = 3 over 2 + 1 + 3 + 0 = 6 turns.
    rl = RLConfig(num_prompts=2, num_owners=2, estimator="dr_grpo")
    owners = owners_with_segments([1.0, 0.0, 1.0, 0.0], n=2)
    owners[3] = OwnerRollout(owner_id=3, group_id=1, segments=(), reward=None, failed=True)
    ro = stages.StepRollouts(
        tasks=refs(2), owners=tuple(owners), turns=(2, 1, 3, 0), parse_errors=(2, 0, 1, 0)
    )
    sel = select_groups(ro.owners, GroupPolicyConfig(min_healthy_per_group=1), rl.num_prompts)
    adv = stages.owner_advantages(sel, rl.estimator)
    batch = pack_batch(sel, adv, num_layers=3, top_k=2, dp_size=8)
    tm = stages.mean_update_metrics(
        [
            {"is_weight_mean": 1.0, "is_weight_max": 3.0},
            {"is_weight_mean": 2.0, "is_weight_max": 1.5},
        ]
    )
    assert tm == {"is_weight_mean": 1.5, "is_weight_max": 3.0, "updates": 2.0}  # max of maxes
    m = stages.step_metrics(ro, sel, adv, batch, tm, 1.0)
    assert m["batch/rows"] == 8  # 3 owners' rows + the failed owner's masked row + 4 padding
    assert m["rows/valid"] == 3 and m["tokens/valid"] == 12  # 3 rows x 4 real tokens
    assert m["actions/parse_errors"] == 3 and m["actions/parse_error_rate"] == pytest.approx(0.5)
    assert m["is_weight/mean"] == 1.5 and m["is_weight/max"] == 3.0
    records = stages.owner_records(1, ro, sel, adv)
    assert [r["parse_errors"] for r in records] == [2, 0, 1, 0]


def test_episode_files_record_each_calls_parse_error():
    from types import SimpleNamespace

    from osworld_jax.agent import CallRecord, History

    hist = History(owner_id=0, group_id=0, media_token_ids=frozenset())
    for i, text in enumerate(["asdf", "FAIL"]):
        hist.record_call(
            CallRecord(
                prompt_ids=np.arange(3 + 2 * i, dtype=np.int32),
                output_ids=np.array([7, 8], np.int32),
                output_logprobs=np.zeros(2, np.float32),
                routed_experts=None,
                finish_reason={"type": "stop"},
                weight_version="0",
                text=text,
            )
        )
    res = dataclasses.replace(result(0, 1.0, turns=2), parse_errors=("no code block", None))
    agent = SimpleNamespace(history=hist, result=res)
    ro = stages.StepRollouts(
        tasks=refs(1), owners=tuple(owners_with_segments([1.0], n=1)), turns=(2,)
    )
    raw = stages.RawRollouts(tasks=refs(1), agents={0: agent}, results=([res],))
    files = stages.episode_files(3, raw, ro, 1)
    record = json.loads(files["step_00000003_owner_0.json"])
    assert [c["parse_error"] for c in record["calls"]] == ["no code block", None]
    assert record["parse_errors"] == 1


def test_dropped_group_is_excluded_from_advantages():
    rl = RLConfig(num_prompts=2, num_owners=2)
    owners = owners_with_segments([1.0, 0.0, 1.0, 0.0], n=2)
    owners[3] = OwnerRollout(
        owner_id=3, group_id=1, segments=(), reward=None, failed=True, error="x"
    )
    ro = stages.StepRollouts(tasks=refs(2), owners=tuple(owners), turns=(1, 1, 1, 0))
    sel = select_groups(ro.owners, GroupPolicyConfig(min_healthy_per_group=2), rl.num_prompts)
    adv = stages.owner_advantages(sel, rl.estimator)
    assert sel.dropped_group_ids == (1,) and [o.owner_id for o in sel.owners] == [0, 1]
    assert adv[0] > 0 > adv[1]


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_baseline"])
def test_padding_to_the_bounds_leaves_the_advantages_unchanged(estimator):
    # Group 1 of 3 is dropped (one healthy owner) and owner 4 failed: 5 of the 9 bound owners
    # and 2 of 3 bound groups are used; the padded call equals the unpadded one.
    owners = owners_with_segments([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.5, 0.5], n=3)
    for i in (4, 5):
        owners[i] = OwnerRollout(owner_id=i, group_id=1, segments=(), reward=None, failed=True)
    owners[6] = OwnerRollout(owner_id=6, group_id=2, segments=(), reward=None, failed=True)
    sel = select_groups(owners, GroupPolicyConfig(baseline_population="logical_owners"), 3)
    assert sel.dropped_group_ids == (1,) and len(sel.owners) == 6
    bounds = BatchBounds(num_owners=9, num_groups=3, norm_length=8)
    padded = stages.owner_advantages(sel, estimator, bounds)
    exact = stages.owner_advantages(sel, estimator)
    np.testing.assert_allclose(padded, exact, rtol=1e-6, atol=1e-7)
    assert padded[3] == 0.0  # the failed owner of a kept group: a masked row, no advantage
    assert np.abs(padded).sum() > 0


def test_runnable_filter_drops_tasks_the_backend_cannot_run(tmp_path):
    import json

    from osworld_jax.data import DataConfig, TaskSetEmptyError, make_task_stream

    def task(tid, instruction):
        ev = {
            "func": "exact_match",
            "result": {"type": "vm_command_line", "command": ["true"]},
            "expected": {"type": "rule", "rules": {"expected": ""}},
        }
        (tmp_path / f"{tid}.json").write_text(
            json.dumps({"id": tid, "instruction": instruction, "config": [], "evaluator": ev})
        )

    task("web", "Open https://example.com and read the headline.")
    task("ok", "Type hello.")
    keep = stages.RunnableFilter("memory")
    stream = make_task_stream(
        DataConfig(task_set=str(tmp_path), shuffle=False, num_epochs=1),
        1,
        process_index=0,
        process_count=1,
        keep=keep,
    )
    assert [r.task_id for b in stream for r in b] == ["ok"]
    assert list(keep.skipped) == ["web"] and "example.com" in keep.skipped["web"][0]
    (tmp_path / "ok.json").unlink()
    with pytest.raises(TaskSetEmptyError, match="0 runnable"):
        make_task_stream(
            DataConfig(task_set=str(tmp_path)),
            1,
            process_index=0,
            process_count=1,
            keep=stages.RunnableFilter("memory"),
        )


def test_rollout_timing_and_cache_hit_rate():
    def agent(act, episode, cached, served):
        return dataclasses.make_dataclass(
            "A", ["act_seconds", "episode_seconds", "cached_tokens", "served_tokens"]
        )(act, episode, cached, served)

    agents = {0: agent(1.0, 3.0, 900, 1000), 1: agent(3.0, 4.0, 0, 3000), 2: agent(0, 0, 0, 0)}
    got = stages.RawRollouts(tasks=refs(1), agents=agents, results=([],)).timing()
    # owner 2 never ran an episode (its times are not averaged); 900 of 4,000 prompt tokens hit
    assert got == {
        "rollout/cache_hit_rate": 900 / 4000,
        "time/owner_generate": 2.0,
        "time/owner_env": 1.5,
    }
    assert stages.RawRollouts(tasks=refs(1), agents={}, results=([],)).timing() == {}
