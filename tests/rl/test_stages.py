import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from osworld_jax.agent import GroupPolicyConfig, OwnerRollout, Segment, pack_batch
from osworld_jax.data import TaskRef
from osworld_jax.env import OwnerResult, SandboxCreateError
from osworld_jax.model import ModelRuntimeConfig, Policy
from osworld_jax.model.tiny import tiny_config
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
    kept, adv, dropped = stages.advantages(ro, rl, GroupPolicyConfig())
    # Dr.GRPO: r - mean_g -> group 0: (1, 0) - 0.5 = (0.5, -0.5); group 1 constant -> 0.
    np.testing.assert_allclose(adv, [0.5, -0.5, 0.0, 0.0])
    assert dropped == ()
    batch, _ = pack_batch(kept, adv, num_layers=3, top_k=2)
    m = stages.step_metrics(
        ro,
        kept,
        adv,
        dropped,
        batch,
        {
            "gate_rejected_fraction": 0.25,
            "binary_kl_mean": 1e-3,
            "logprob_abs_diff": 0.1,
            "loss": 2.0,
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
    assert "train/step" not in m
    records = stages.owner_records(4, ro, kept, adv)
    assert [r["advantage"] for r in records] == [0.5, -0.5, 0.0, 0.0]
    assert records[2]["task_id"] == "t1" and records[0]["step"] == 4


def test_dropped_group_is_excluded_from_advantages():
    rl = RLConfig(num_prompts=2, num_owners=2)
    owners = owners_with_segments([1.0, 0.0, 1.0, 0.0], n=2)
    owners[3] = OwnerRollout(
        owner_id=3, group_id=1, segments=(), reward=None, failed=True, error="x"
    )
    ro = stages.StepRollouts(tasks=refs(2), owners=tuple(owners), turns=(1, 1, 1, 0))
    kept, adv, dropped = stages.advantages(ro, rl, GroupPolicyConfig(min_healthy_per_group=2))
    assert dropped == (1,) and [o.owner_id for o in kept] == [0, 1]
    assert adv[0] > 0 > adv[1]


@pytest.fixture(scope="module")
def tiny_policy():
    cfg = tiny_config(128, 1)
    return Policy(cfg, ModelRuntimeConfig(), rngs=nnx.Rngs(0))


def test_route_agreement(tiny_policy):
    rng = np.random.default_rng(0)
    tokens = rng.integers(2, 128, size=(2, 16)).astype(np.int32)
    positions = np.broadcast_to(np.arange(16, dtype=np.int32), (2, 16)).copy()
    seg_ids = np.ones((2, 16), np.int32)
    seg_ids[1, 12:] = 0  # padding never counts
    own = np.asarray(
        tiny_policy(
            jnp.asarray(tokens),
            positions=jnp.asarray(positions),
            segment_ids=jnp.asarray(seg_ids),
            return_logits=False,
        ).routed_experts
    )
    engine = own[..., ::-1].copy()  # same sets, other order -> agreement 1
    engine[:, :, 0] = -1  # the dense layer has no route
    batch = pack_like(tokens, positions, seg_ids, engine)
    assert stages.route_agreement(tiny_policy, batch) == 1.0
    moe = engine[:, :, 1:]
    changed = moe.copy()
    changed[0, :8, 0, :] = (changed[0, :8, 0, :] + 1) % 8  # 8 of 2 x (16 + 12) token-layers
    engine2 = engine.copy()
    engine2[:, :, 1:] = changed
    # token-layer pairs with a route: 28 real tokens x 2 MoE layers = 56; 8 disagree.
    assert stages.route_agreement(tiny_policy, pack_like(tokens, positions, seg_ids, engine2)) == (
        pytest.approx(48 / 56)
    )
    none = np.full_like(engine, -1)
    assert np.isnan(
        stages.route_agreement(tiny_policy, pack_like(tokens, positions, seg_ids, none))
    )


def pack_like(tokens, positions, seg_ids, routes):
    from osworld_jax.batch import Batch

    r, t = tokens.shape
    z = np.zeros((r, t), np.float32)
    return Batch(
        tokens=tokens,
        loss_mask=z,
        behavior_logprobs=z,
        advantages=z,
        positions=positions,
        segment_ids=seg_ids,
        owner_ids=np.zeros(r, np.int32),
        group_ids=np.zeros(r, np.int32),
        row_weight=np.ones(r, np.float32),
        routed_experts=routes.astype(np.int32),
    )


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
