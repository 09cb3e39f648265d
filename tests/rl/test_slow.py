"""Slow end-to-end tests of learning: the learning run, the evaluate -> freeze band scripts, the
two-process run. Run with ``pytest --runslow tests/rl/test_slow.py``. The default run with
screenshots and its notebook are in test_slow_screenshots.py, Ctrl-C and resume of
scripts/train.py in test_slow_resume.py (separate files: xdist gives each worker whole files)."""

import json
import os
import subprocess
import sys
import time

import pytest

from osworld_jax import config
from osworld_jax.rl import train
from tests.rl import learnable
from tests.rl.runs import REPO, live_processes_mentioning

# The learning demo's suite (osworld_jax/demo/learnable.py) through the real pipeline: the
# embedded server subprocess samples one token per owner, the memory desktop scores it, segments
# -> GRPO advantages -> train_step with R3 -> HF export -> /update_weights_from_disk refit. The
# demo's bindings (a higher LR than the recipes' 5e-6) so that a random tiny model learns in a
# few CPU minutes; scripts/demo_learning.py runs the same.
LEARNING_STEPS = learnable.STEPS
LEARN = list(learnable.BINDINGS)


@pytest.fixture(scope="module")
def learning_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("learning")
    tasks = learnable.write_tasks(root / "tasks")
    exp = config.load_experiment(["default.gin"], [*LEARN, f"DataConfig.task_set = '{tasks}'"])
    run_dir = root / "run"
    config.write_operative_config(run_dir, exp)
    t0 = time.monotonic()
    result = train(exp, run_dir)
    print(f"learning run: {time.monotonic() - t0:.0f}s")
    return run_dir, result


@pytest.mark.slow
def test_the_loop_learns(learning_run):
    _, result = learning_run
    rewards = [h["reward/mean"] for h in result.history]
    print("reward curve:", " ".join(f"{r:.2f}" for r in rewards))
    assert [h["step"] for h in result.history] == list(range(1, LEARNING_STEPS + 1))
    assert sum(rewards[:3]) / 3 < 0.35
    assert sum(rewards[-3:]) / 3 > 0.8
    for h in result.history:
        # Every refit took: the server sampled with exactly the trainer's weights and routes.
        assert h["gate/rejected_fraction"] == 0.0
        assert h["logprob/train_rollout_abs_diff"] < 1e-3
        assert h["r3/route_agreement"] > 0.99
        assert h["owners/failed"] == 0 and h["owners/total"] == 16


@pytest.mark.slow
def test_evaluate_then_freeze_the_band(learning_run, tmp_path, capsys):
    """scripts/evaluate.py (pass@8 of the untrained tiny model, served embedded) -> calibration
    JSONL -> scripts/freeze_band.py -> a verified frozen task set that training can read."""
    import runpy

    from osworld_jax.data import load_task_refs, verify_sha256sums

    run_dir, _ = learning_run
    tasks = run_dir.parent / "tasks"
    calib = tmp_path / "calib.jsonl"
    argv = [
        "evaluate.py",
        "--gin_file=default.gin",
        *(f"--gin_param={p}" for p in LEARN),
        f"--model_path={run_dir / 'base_model'}",
        f"--task_set={tasks}",
        "--reps=8",
        f"--out={calib}",
        f"--run_dir={tmp_path / 'eval'}",
    ]
    for script, args in [
        ("evaluate.py", argv),
        (
            "freeze_band.py",
            [
                "freeze_band.py",
                f"--calibration={calib}",
                f"--task_dir={tasks}",
                f"--out_dir={tmp_path / 'band'}",
                "--reps=8",
                "--num_repeats=2",
            ],
        ),
    ]:
        old, sys.argv = sys.argv, args
        try:
            with pytest.raises(SystemExit) as code:
                runpy.run_path(str(REPO / "scripts" / script), run_name="__main__")
        finally:
            sys.argv = old
        assert code.value.code == 0, capsys.readouterr()
    lines = [json.loads(x) for x in calib.read_text().splitlines()]
    assert sorted(x["task_id"] for x in lines) == [f"vowel-{i}" for i in range(4)]
    assert all(x["reps"] == 8 and x["failed"] == 0 for x in lines)
    rate = sum(x["passes"] for x in lines) / 32
    print("untrained pass rate", rate, [x["passes"] for x in lines])
    assert rate < 0.5  # the untrained model (cf. the learning test's first steps)
    band = [x["task_id"] for x in lines if 0 < x["passes"] < 8]
    assert band, lines
    verify_sha256sums(tmp_path / "band")
    refs = load_task_refs(tmp_path / "band")
    assert sorted({r.task_id for r in refs}) == sorted(band) and len(refs) == 2 * len(band)


@pytest.mark.slow
def test_two_process_run_matches_one_process(learning_run, tmp_path):
    """DistributedConfig with 2 processes x 1 CPU device (gloo): process 0 rolls out and
    broadcasts; both train their half of the rows (mesh data=2), checkpoint and export.
    Process 1 reaches each export after process 0 wrote it (mp_train_worker.py): before the
    fix it then skipped the export's barrier and hung (issue 16 item 15)."""
    import socket

    tasks = learning_run[0].parent / "tasks"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        coordinator = f"127.0.0.1:{s.getsockname()[1]}"
    run_dir = tmp_path / "run"
    env = dict(os.environ)  # the worker sets its device count in XLA_FLAGS
    env["OSWORLD_JAX_TEST_RUN"] = str(run_dir)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(REPO / "tests" / "rl" / "mp_train_worker.py"),
                str(run_dir),
                str(tasks),
                "3",
                coordinator,
                str(i),
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=480)[0].decode() for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    w0, w1 = (json.loads((run_dir / f"worker_{i}.json").read_text()) for i in range(2))
    assert (w0["process_count"], w0["steps"], w1["steps"]) == (2, [1, 2, 3], [])
    one_process = [h["reward/mean"] for h in learning_run[1].history[:3]]
    assert w0["rewards"][0] == one_process[0]  # same weights, same sampling seeds
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in records:  # the broadcast batch trained both halves; every refit took
        assert r["gate/rejected_fraction"] == 0.0
        assert r["logprob/train_rollout_abs_diff"] < 1e-3
    assert (run_dir / "checkpoints" / "3").is_dir()
    assert (run_dir / "weights" / "step_00000003" / "tokenizer.json").is_file()
    assert not live_processes_mentioning(str(run_dir))
