"""The run's lifecycle (`osworld_jax.rl.lifecycle`): plan, refuse, fail, report.

Unit-level: run directories are laid out by hand (a checkpoint is a directory orbax finished,
``checkpoints/<step>``) and ``loop.train`` is replaced by a stand-in that writes what a run
writes and raises what a run raises, so each rule is checked without a run.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from osworld_jax import config
from osworld_jax.contract.errors import RefitError
from osworld_jax.errors import ConfigError, PreflightError
from osworld_jax.rl import lifecycle
from osworld_jax.rl.analysis import find_run_dir
from osworld_jax.rl.lifecycle import (
    ERROR_FILE,
    Plan,
    RunRefused,
    RunRequest,
    launch,
    out_of_memory_line,
    plan_run,
    zero_reward_note,
)
from osworld_jax.rl.loop import TrainResult
from osworld_jax.rl.metrics import MetricsLogger, StageTimer, stage_text
from osworld_jax.rl.rundir import write_run_config
from osworld_jax.rl.stages import SkippedStepsError


@pytest.fixture(scope="module")
def default():
    return config.load_experiment(["default.gin"])


def _finished_run(root, exp, last=3):
    """A run dir as ``scripts/train.py`` leaves it after ``last`` steps (config, ckpt, export)."""
    run_dir = root / "runs" / "a"
    run_dir.mkdir(parents=True)
    write_run_config(run_dir, exp)
    for step in (last - 1, last):
        (run_dir / "checkpoints" / str(step)).mkdir(parents=True)
        (run_dir / "weights" / f"step_{step:08d}").mkdir(parents=True)
    return run_dir


def _lr(exp, lr):
    opt = dataclasses.replace(exp.trainer.optimizer, learning_rate=lr)
    return exp.replace(trainer=dataclasses.replace(exp.trainer, optimizer=opt))


def test_a_finished_run_with_another_config_is_refused_naming_the_change(tmp_path, default, capsys):
    run_dir = _finished_run(tmp_path, default)
    same = RunRequest(experiment=default, run_dir=run_dir)
    assert plan_run(same) == Plan(resume_from=3, finished=True)
    other = RunRequest(experiment=_lr(default, 1e-5), run_dir=run_dir)
    with pytest.raises(RunRefused) as e:
        plan_run(other)
    msg = str(e.value)
    assert msg.startswith(f"{run_dir} was finished at step 3 with another config; changed: ")
    assert "OptimizerConfig.learning_rate: 0.0001 -> 1e-05" in msg
    assert f"ModelSourceConfig.path = '{run_dir}/weights/step_00000003'" in msg  # a new name
    assert "--allow_config_change with --steps=N, N > 3" in msg  # or this directory
    # The command: refused in one line, exit 2; runs/latest is not re-pointed.
    assert launch(other) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: ")
    assert not (tmp_path / "runs" / "latest").exists()
    assert launch(same) == 0  # finished: says so, exit 0, runs/latest still not moved
    out, err = capsys.readouterr()
    assert out.startswith(f"{run_dir} is finished: its checkpoint 3") and err == ""
    assert not (tmp_path / "runs" / "latest").exists()
    # A run that is not finished resumes with the change only when asked to.
    longer = dataclasses.replace(other, steps=5)
    with pytest.raises(RunRefused, match="or pass --allow_config_change to go on"):
        plan_run(longer)
    allowed = plan_run(dataclasses.replace(longer, allow_config_change=True))
    assert allowed == Plan(
        resume_from=3, changes=("OptimizerConfig.learning_rate: 0.0001 -> 1e-05",)
    )
    assert plan_run(RunRequest(experiment=default, run_dir=tmp_path / "new")) == Plan(None)


def _fake_train(monkeypatch, effect):
    """Replaces the loop: ``effect(run_dir)`` writes what a run writes, then raises/returns."""

    def train(experiment, run_dir, steps=None, *, operative_gin=None):
        return effect(run_dir)

    monkeypatch.setattr(lifecycle, "train", train)


def _one_line(err):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_refused_start_leaves_nothing_and_hints_at_the_one_gpu_recipe(
    tmp_path, default, monkeypatch, capsys
):
    def preflight(run_dir):
        (run_dir / "base_model").mkdir(parents=True)  # made before the preflight runs
        raise PreflightError("preflight failed:\n  - rollout server http://sglang-0 unreachable")

    _fake_train(monkeypatch, preflight)
    seed = default.replace(server=dataclasses.replace(default.server, launch="none"))
    run_dir = tmp_path / "new" / "run"
    assert launch(RunRequest(experiment=seed, run_dir=run_dir)) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("hint: the osworld_flash_* recipes name the seed's")
    assert "configs/gpu_1x_h100.gin" in err
    assert not (tmp_path / "new").exists()  # nothing was started: nothing is left

    def interrupted(run_dir):
        (run_dir / "base_model").mkdir(parents=True)
        raise KeyboardInterrupt

    _fake_train(monkeypatch, interrupted)
    assert launch(RunRequest(experiment=default, run_dir=run_dir)) == 130
    assert "interrupted before the run started; removed" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_a_run_that_fails_after_it_started_keeps_its_directory_and_error(
    tmp_path, default, monkeypatch, capsys
):
    def server_gone(run_dir):
        run_dir.mkdir(parents=True)
        (run_dir / "server.log").write_text("INFO listening\n")
        (run_dir / "metrics.jsonl").write_text("")
        try:
            raise ConnectionRefusedError("Connect call failed ('127.0.0.1', 5)")
        except ConnectionRefusedError as e:
            raise RefitError("refit to 'weights/step_00000001' failed on every server") from e

    _fake_train(monkeypatch, server_gone)
    run_dir = tmp_path / "run"
    assert launch(RunRequest(experiment=default, run_dir=run_dir)) == 1
    line = _one_line(capsys.readouterr().err)
    assert line == (
        "error: the rollout server stopped answering (RefitError: refit to "
        "'weights/step_00000001' failed on every server); rerun the same command to start "
        f"again (no checkpoint yet); logs in {run_dir} (server.log, error.txt)"
    )
    text = (run_dir / ERROR_FILE).read_text()
    assert text.startswith(line + "\n") and "ConnectionRefusedError" in text  # + the traceback
    assert (run_dir / "server.log").is_file()
    assert not (tmp_path / "latest").exists()  # runs/latest follows runs that ran

    def oom(run_dir):
        (run_dir / "checkpoints" / "1").mkdir(parents=True)
        raise RuntimeError(
            "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 29022806016 bytes.\n"
            "BufferAssignment OOM Debugging. ... jit_train_step"
        )

    _fake_train(monkeypatch, oom)
    assert launch(RunRequest(experiment=default, run_dir=run_dir, steps=5)) == 1
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("error: out of device memory in jit_train_step (tried to allocate ")
    assert "27.03 GiB): more micro-batches (TrainerConfig.num_micro_batches)" in line
    assert line.endswith(f"logs in {run_dir} (server.log, error.txt)")

    def bug(run_dir):
        (run_dir / "weights").mkdir(exist_ok=True)
        (run_dir / "weights" / "step_00000002").mkdir()
        raise ValueError("a bug")

    _fake_train(monkeypatch, bug)
    (run_dir / "checkpoints" / "1").rmdir()  # a fresh start in the kept directory
    assert launch(RunRequest(experiment=default, run_dir=run_dir)) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err  # a bug keeps its traceback
    assert err.strip().splitlines()[-1].startswith("error: ValueError: a bug (logs in ")
    assert (run_dir / ERROR_FILE).read_text().startswith("error: ValueError: a bug\n")


def test_config_errors_after_the_start_keep_the_run(tmp_path, default, monkeypatch, capsys):
    def late(run_dir):
        run_dir.mkdir(parents=True)
        (run_dir / "server.log").write_text("")
        raise ConfigError("checkpoint 1 has no task-stream state\nsecond line")

    _fake_train(monkeypatch, late)
    assert launch(RunRequest(experiment=default, run_dir=tmp_path / "r")) == 1
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("error: checkpoint 1 has no task-stream state (+1 lines in error.txt)")
    assert (tmp_path / "r" / "server.log").is_file()


def test_a_run_that_ran_reports_a_zero_reward_and_points_latest(
    tmp_path, default, monkeypatch, capsys
):
    history = [{"step": s, "reward/mean": 0.0} for s in (1, 2, 3)]

    def ran(run_dir):
        (run_dir / "checkpoints" / "3").mkdir(parents=True)
        return TrainResult(run_dir, 1, 3, history, "steps 1..3")

    _fake_train(monkeypatch, ran)
    run_dir = tmp_path / "runs" / "b"
    assert launch(RunRequest(experiment=default, run_dir=run_dir)) == 0
    out = capsys.readouterr().out
    assert "reward stayed 0 at all 3 steps" in out and "scripts/demo_learning.py" in out
    assert (tmp_path / "runs" / "latest").resolve() == run_dir.resolve()


def test_zero_reward_note(default):
    zeros = [{"reward/mean": 0.0}, {"steps/skipped": 1.0}, {"reward/mean": 0.0}]
    tiny = zero_reward_note(zeros, default)
    assert len(tiny) == 2 and tiny[0].startswith("reward stayed 0 at all 2 steps")
    assert tiny[1].endswith(".venv/bin/python scripts/demo_learning.py")
    real = default.replace(model=dataclasses.replace(default.model, path="/models/qwen"))
    assert "scripts/freeze_band.py" in zero_reward_note(zeros, real)[1]
    assert zero_reward_note([*zeros, {"reward/mean": 0.25}], default) == []
    assert zero_reward_note([{"steps/skipped": 1.0}], default) == []


@pytest.mark.parametrize(
    ("text", "in_server", "program", "size", "knob"),
    [
        (
            "XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
            "29022806016 bytes. [jit_train_step]",
            False,
            "jit_train_step",
            "27.03 GiB",
            "TrainerConfig.num_micro_batches",
        ),
        (
            "E0101 ... RESOURCE_EXHAUSTED: Failed to allocate request for 12.21GiB "
            "(13110307717B) on device ordinal 0 while running jit__prefill",
            True,
            "jit__prefill",
            "12.21 GiB",
            "ServerConfig.device_memory_fraction), fewer requests",
        ),
        (
            "jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory allocating 536870912 "
            "bytes in jit(_decode).",
            False,  # a server program named in the trainer's own error: the server's knobs
            "jit__decode",
            "512 MiB",
            "ServerConfig.max_running_requests",
        ),
    ],
)
def test_out_of_memory_is_one_line_naming_program_size_and_knob(
    text, in_server, program, size, knob
):
    line = out_of_memory_line(text, where="runs/x (server.log)", in_server=in_server)
    assert line is not None and "\n" not in line
    assert line.startswith(f"error: out of device memory in {program} (tried to allocate {size})")
    assert knob in line and line.endswith("; logs in runs/x (server.log)")


def test_no_out_of_memory_in_plain_errors():
    assert out_of_memory_line("ValueError: shapes differ", where="x", in_server=False) is None


def test_the_progress_line_says_each_stage_as_it_starts(tmp_path, capsys):
    said = []
    t = StageTimer(on_stage=said.append)
    for name in ("data", "rollout", "train"):
        with t.stage(name):
            assert said[-1] == name  # before the body runs
    assert set(t.seconds) == {"data", "rollout", "train"}
    assert stage_text(1, "rollout", first=True) == (
        "step 1: rollouts (desktops start + fork, the server compiles)"
    )
    assert stage_text(4, "train", first=False) == "step 4: train step"
    with MetricsLogger(tmp_path, total_steps=3, progress_bar=True) as log:
        log.stage(stage_text(1, "train", first=True))
    assert "step 1: train step (compiling it)" in capsys.readouterr().err


def test_the_notebook_finds_the_run_from_any_directory(tmp_path):
    clone = tmp_path / "clone"
    run = clone / "runs" / "20260101-000000"
    run.mkdir(parents=True)
    (run / "experiment.json").write_text(json.dumps({"rl": {"metrics_dir": "."}}))
    (clone / "notebooks").mkdir()
    assert find_run_dir({}, clone / "notebooks") == run  # the newest run, from notebooks/
    (clone / "runs" / "latest").symlink_to(run.name)
    assert find_run_dir({}, clone / "notebooks") == clone / "runs" / "latest"
    env = {"OSWORLD_RUN_DIR": "runs/20260101-000000"}  # relative to the clone, from below it
    assert find_run_dir(env, clone / "notebooks") == run.resolve()
    with pytest.raises(FileNotFoundError, match="OSWORLD_RUN_DIR=runs/nope: not a run"):
        find_run_dir({"OSWORLD_RUN_DIR": "runs/nope"}, clone / "notebooks")


def test_an_out_of_memory_in_the_server_is_read_from_this_runs_part_of_its_log(
    tmp_path, default, monkeypatch, capsys
):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    oom = (
        "E external/xla/...: RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
        "13110307717 bytes. ... jit__prefill\n"
    )
    (run_dir / "server.log").write_text(oom)  # an earlier run's: not this one's

    def skipped(run_dir):
        with open(run_dir / "server.log", "a") as f:
            f.write("INFO listening\n")
        raise SkippedStepsError("3 steps skipped in a row: RolloutStepError: no healthy server")

    _fake_train(monkeypatch, skipped)
    assert launch(RunRequest(experiment=default, run_dir=run_dir)) == 1
    assert _one_line(capsys.readouterr().err).startswith(
        "error: the rollout server stopped answering (SkippedStepsError: 3 steps skipped"
    )

    def out_of_memory(run_dir):
        with open(run_dir / "server.log", "a") as f:
            f.write(oom)
        raise SkippedStepsError("3 steps skipped in a row: RolloutStepError: 4/4 owners failed")

    _fake_train(monkeypatch, out_of_memory)
    assert launch(RunRequest(experiment=default, run_dir=run_dir)) == 1
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(
        "error: out of device memory in jit__prefill (tried to allocate 12.21 GiB): give the "
        "server more of the device (ServerConfig.device_memory_fraction)"
    ), line
