"""A bad step is skipped, not fatal (issue 29 item 4).

`stages.StepSkips` (unit) and the loop (slow): a step whose rollout is unusable trains nothing,
is logged with ``steps/skipped`` and its cause, still refits and checkpoints the task stream's
position, and a run stops only after more than ``RLConfig.max_consecutive_skipped_steps`` in a
row, naming every cause.
"""

from __future__ import annotations

import json

import pytest

from osworld_jax import config
from osworld_jax.agent import GroupPolicyError
from osworld_jax.errors import ConfigError
from osworld_jax.rl import RLConfig, stages, train
from tests.rl import learnable
from tests.rl.test_slow import LEARN


def test_step_skips_counts_a_run_of_bad_steps_and_names_the_causes():
    skips = stages.StepSkips(2)
    assert skips.skip(4, "RolloutStepError: 9/16 owners failed") == {
        "steps/skipped": 1.0,
        "steps/consecutive_skipped": 1.0,
        "steps/skip_cause": "RolloutStepError: 9/16 owners failed",
    }
    assert skips.trained() == {"steps/skipped": 0.0, "steps/consecutive_skipped": 0.0}
    skips.skip(6, "a")
    assert skips.skip(7, "b")["steps/consecutive_skipped"] == 2.0  # 2 in a row: allowed
    with pytest.raises(stages.SkippedStepsError, match=r"3 bad steps in a row .* = 2\); "
                       r"causes: step 6: a; step 7: b; step 8: c"):  # fmt: skip
        skips.skip(8, "c")
    with pytest.raises(stages.SkippedStepsError, match="1 bad steps in a row"):
        stages.StepSkips(0).skip(1, "x")  # 0: the first bad step stops the run
    with pytest.raises(ConfigError, match="max_consecutive_skipped_steps"):
        RLConfig(max_consecutive_skipped_steps=-1)
    assert stages.RolloutStepError in stages.BAD_STEP_ERRORS
    assert GroupPolicyError in stages.BAD_STEP_ERRORS


def _run(tmp_path, monkeypatch, name, bad_steps, *params):
    """train() of the learnable suite where ``collect_owners`` fails at ``bad_steps``."""
    real = stages.collect_owners
    drawn: dict[int, list[str]] = {}

    def collect(raw, rl, step):
        drawn[step] = [t.task_id for t in raw.tasks]
        if step in bad_steps:
            raise stages.RolloutStepError(f"step {step}: 3/4 owners failed (injected)")
        return real(raw, rl, step)

    monkeypatch.setattr(stages, "collect_owners", collect)
    tasks = learnable.write_tasks(tmp_path / "tasks")
    base = [*LEARN, f"DataConfig.task_set = '{tasks}'", "RLConfig.num_owners = 2"]
    exp = config.load_experiment(
        ["default.gin"], [*base, "CheckpointConfig.save_every = 1", *params]
    )
    return exp, tmp_path / name, drawn


@pytest.mark.slow
def test_the_loop_skips_bad_steps_and_stops_after_too_many(tmp_path, monkeypatch):
    # One run: step 1 trains, steps 2 and 3 are bad and skipped (limit 2), step 4 is the third
    # bad step in a row and stops the run naming all three causes.
    exp, run_dir, drawn = _run(
        tmp_path, monkeypatch, "skip", {2, 3, 4}, "RLConfig.max_consecutive_skipped_steps = 2"
    )
    with pytest.raises(
        stages.SkippedStepsError,
        match=r"3 bad steps in a row .*step 2: .*injected.*; step 3: .*; step 4: .*injected",
    ):
        train(exp, run_dir, 4)
    history = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [1, 2, 3]
    assert [h["steps/skipped"] for h in history] == [0.0, 1.0, 1.0]
    assert [h["steps/consecutive_skipped"] for h in history] == [0.0, 1.0, 2.0]
    assert "3/4 owners failed (injected)" in history[1]["steps/skip_cause"]
    assert "train/loss" in history[0] and "train/loss" not in history[1]
    # Skipped steps still refit and checkpoint (the stream's position after their draw), and
    # the stream advanced as for trained steps: steps 1-4 drew their batches in stream order (a
    # resume from a checkpoint redraws the next step exactly: tests/rl/test_resume.py).
    assert (run_dir / "checkpoints" / "3").exists()
    assert sorted(drawn) == [1, 2, 3, 4]
    records = [json.loads(x) for x in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert {r["step"] for r in records} == {1}  # skipped steps write no owner records
