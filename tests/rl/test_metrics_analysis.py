import json
import struct

import numpy as np
import pytest

from osworld_jax.rl import analysis
from osworld_jax.rl.metrics import MetricsLogger, StageTimer, read_metrics


def test_stage_timer_sums_stages():
    t = StageTimer()
    with t.stage("rollout"):
        pass
    with t.stage("rollout"):
        pass
    with t.stage("train"):
        pass
    m = t.metrics()
    assert set(m) == {"time/rollout", "time/train", "time/step"}
    assert m["time/step"] == pytest.approx(m["time/rollout"] + m["time/train"])


def _tf_events(path):
    """The Event protos of a TensorBoard event file, read by its TFRecord framing: a uint64
    length, its masked CRC32C, the bytes, their masked CRC32C (CRCs not checked here)."""
    from tensorboardX.proto.event_pb2 import Event

    data, at, out = path.read_bytes(), 0, []
    while at < len(data):
        (n,) = struct.unpack("<Q", data[at : at + 8])
        out.append(Event.FromString(data[at + 12 : at + 12 + n]))
        at += 12 + n + 4
    return out


def test_logger_writes_jsonl_tensorboard_and_summary(tmp_path):
    log = MetricsLogger(tmp_path, total_steps=3, progress_bar=False)
    log.log(
        1,
        {
            "reward/mean": 0.25,
            "reward/pass_rate": 0.0,
            "owners/failed": 1,
            "time/rollout": 2.0,
            "note": "text",
            "arr": np.arange(2),
        },
    )
    log.log(
        2,
        {
            "reward/mean": 0.75,
            "reward/pass_rate": 0.5,
            "owners/failed": 0,
            "time/rollout": 4.0,
            "r3/route_agreement": float("nan"),
        },
    )
    log.close()
    log.close()  # idempotent
    recs = read_metrics(tmp_path)
    assert [r["step"] for r in recs] == [1, 2]
    assert recs[0]["note"] == "text" and recs[0]["arr"] == [0, 1]
    (events,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    scalars = {(e.step, v.tag): v.simple_value for e in _tf_events(events) for v in e.summary.value}
    assert scalars[(1, "reward/mean")] == 0.25 and scalars[(2, "reward/mean")] == 0.75
    assert scalars[(1, "owners/failed")] == 1.0 and (2, "r3/route_agreement") not in scalars
    # TensorBoard's own reader (what `tensorboard --logdir` runs; it checks every record's CRCs)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 0.25), (2, 0.75)]
    assert [(e.step, e.value) for e in acc.Scalars("time/rollout")] == [(1, 2.0), (2, 4.0)]
    s = log.summary()
    assert "0.250 -> 0.750" in s and "failed owners 1" in s and "rollout=3.0s" in s


def test_read_metrics_keeps_the_last_record_of_a_step(tmp_path):
    # A resumed run may repeat a step that was logged but not checkpointed.
    lines = [
        {"step": 1, "reward/mean": 0.1},
        {"step": 2, "reward/mean": 0.2},
        {"step": 2, "reward/mean": 0.3},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert [r["reward/mean"] for r in read_metrics(tmp_path)] == [0.1, 0.3]


def test_analysis_loaders(tmp_path):
    (tmp_path / "experiment.json").write_text(json.dumps({"rl": {"metrics_dir": "m"}}))
    m = tmp_path / "m"
    m.mkdir()
    recs = [
        {"step": 1, "reward/mean": 0.0, "time/rollout": 1.0, "time/train": 2.0},
        {"step": 2, "reward/mean": 0.5, "time/rollout": 3.0, "flag": True},
    ]
    (m / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in recs))
    owners = [
        {"step": 1, "task_id": "a", "reward": 1.0, "failed": False, "advantage": 0.5},
        {"step": 1, "task_id": "a", "reward": 0.0, "failed": False, "advantage": -0.5},
        {"step": 1, "task_id": "b", "reward": None, "failed": True, "advantage": None},
        {"step": 2, "task_id": "b", "reward": 1.0, "failed": False, "advantage": 0.0},
    ]
    (m / "rollouts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in owners))
    cols = analysis.load_metrics(tmp_path)
    np.testing.assert_array_equal(cols["step"], [1, 2])
    np.testing.assert_array_equal(cols["reward/mean"], [0.0, 0.5])
    assert np.isnan(cols["time/train"][1]) and "flag" not in cols
    assert list(analysis.stage_times(cols)) == ["rollout", "train"]
    rolls = analysis.load_rollouts(tmp_path)
    assert analysis.per_task_pass_rate(rolls) == {"a": (1, 2), "b": (1, 1)}
    adv = analysis.advantages_by_step(rolls)
    np.testing.assert_array_equal(adv[1], [0.5, -0.5])
    np.testing.assert_array_equal(adv[2], [0.0])
