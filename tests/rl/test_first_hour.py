"""What a new user sees: --validate_only, a failed start, resume refusals, runs/latest."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from osworld_jax import config
from osworld_jax.rl.rundir import (
    RESOLVED_CONFIG,
    config_changes,
    point_latest_at,
    write_run_config,
)
from tests.rl.runs import (
    REPO,
    live_processes_mentioning,
    quick_args,
    quick_tasks,
    run_env,
    train_cmd,
)


def _train_module():
    spec = importlib.util.spec_from_file_location("train_script", REPO / "scripts" / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_changes_name_model_data_and_algorithm_bindings_not_run_length(tmp_path):
    exp = config.load_experiment(["default.gin"])
    write_run_config(tmp_path, exp)
    assert config_changes(tmp_path, exp) == []
    longer = dataclasses.replace(exp, rl=dataclasses.replace(exp.rl, steps=50, progress_bar=False))
    ckpt = dataclasses.replace(exp.trainer.checkpoint, save_every=5, keep=1)
    longer = longer.replace(trainer=dataclasses.replace(exp.trainer, checkpoint=ckpt))
    assert config_changes(tmp_path, longer) == []  # run-length knobs may change
    text = config.load_experiment(["default.gin", "text_only.gin"], ["RLConfig.estimator = 'rloo'"])
    assert config_changes(tmp_path, text) == [
        "ModelSourceConfig.tiny_kind: 'qwen3_vl_moe' -> 'qwen3_moe'",
        "AgentConfig.max_screenshots: 3 -> 0",
        "RLConfig.estimator: 'grpo' -> 'rloo'",
    ]
    assert config_changes(tmp_path / "never-started", text) == []


def test_a_field_added_since_the_run_is_a_change_only_off_its_default(tmp_path):
    """A run written before a config field existed resumes under code that has it."""
    exp = config.load_experiment(["default.gin"])
    write_run_config(tmp_path, exp)
    path = tmp_path / RESOLVED_CONFIG
    old = json.loads(path.read_text())
    assert old["rl"]["estimator"] == "grpo"  # RLConfig's default
    del old["rl"]["estimator"]  # as a run of older code wrote it
    del old["distributed"]["collective_timeout_s"]  # a run-length class's field
    path.write_text(json.dumps(old))
    assert config_changes(tmp_path, exp) == []
    rloo = exp.replace(rl=dataclasses.replace(exp.rl, estimator="rloo"))
    assert config_changes(tmp_path, rloo) == ["RLConfig.estimator: '<absent>' -> 'rloo'"]


def test_latest_points_at_the_newest_run(tmp_path):
    runs = tmp_path / "runs"
    for name in ("a", "b"):
        (runs / name).mkdir(parents=True)
        assert point_latest_at(runs / name) == runs / "latest"
        assert (runs / "latest").resolve() == (runs / name).resolve()
    assert (runs / "latest").readlink() == Path("b")  # relative: the runs dir can move
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "latest").mkdir()  # a real directory named latest is left alone
    (tmp_path / "other" / "c").mkdir()
    assert point_latest_at(tmp_path / "other" / "c") is None


def test_a_failed_start_leaves_no_directory_behind(tmp_path, capsys):
    train = _train_module()
    run_dir = tmp_path / "new" / "run"
    rc = train.main([f"--run_dir={run_dir}", "--gin_param=ModelSourceConfig.path = '/nonexistent'",
                     *quick_args(quick_tasks(tmp_path))])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and "model path '/nonexistent' does not exist" in err, err
    assert not (tmp_path / "new").exists()


def test_validate_only_checks_without_writing(tmp_path):
    """The real command: config, preflight, memory estimate; no run directory, nothing compiled."""
    run_dir = tmp_path / "run"
    tasks = quick_tasks(tmp_path)
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "train.py"), "--validate_only",
         f"--run_dir={run_dir}", *quick_args(tasks)],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "config: ok",
        "model: the tiny model (3 layers, 8 experts)",
        f"preflight: ok (sandbox backend 'memory', task set '{tasks}')",
        "memory: one train step of 4 rows x 128 tokens needs ~19 MiB per device (of 1)",
        "memory plan: the compiled programs' plan needs the run's accelerator (this machine "
        "runs jax on cpu): the figures above are the analytic estimate",
        "valid: nothing was run or written (drop --validate_only to train)",
    ]
    assert not run_dir.exists() and not (tmp_path / "runs").exists()


def _script(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _env_cli(argv):
    from osworld_jax.env.capabilities import main

    return main(argv)


@pytest.mark.parametrize(
    ("cli", "argv", "says"),
    [
        ("env", ["report", "{bundled}", "--backend", "loacl"], "invalid choice: 'loacl'"),
        ("env", ["runnable", "{tmp}/nope"], "nope does not exist"),
        ("env", ["report", "{bundled}", "--cache-dir", "{file}"], "is not a directory"),
        ("train", ["--steps=0"], "argument --steps: must be a positive integer, got '0'"),
        ("train", ["--run_dir={file}"], "is a file, not a run directory"),
        ("evaluate", ["--reps=x", "--out={tmp}/c.jsonl"], "must be a positive integer"),
        ("evaluate", ["--reps=2", "--out={tmp}/no/c.jsonl"], "its directory"),
        ("evaluate", ["--reps=2", "--out={tmp}/c.jsonl", "--server_url=sglang-0:30000"], "URL"),
        ("evaluate", ["--reps=2", "--out={tmp}/c.jsonl", "--model_path={tmp}/no"], "not a dir"),
        ("freeze_band", ["--calibration={tmp}/no", "--task_dir={tmp}", "--out_dir={tmp}/b"],
         "no does not exist"),
        ("freeze_band", ["--calibration={file}", "--task_dir={tmp}", "--out_dir={tmp}"],
         "already exists"),
        ("freeze_band", ["--calibration={file}", "--task_dir={tmp}", "--out_dir={tmp}/b",
                         "--low=3", "--high=2"], "--high 2 must be above --low 3"),
        ("demo_learning", ["--run_dir={file}"], "is a file"),
        ("analyze", ["{tmp}", "--timeout=-1"], "must be a positive integer"),
    ],
)  # fmt: skip
def test_every_cli_refuses_a_wrong_value_in_one_line(cli, argv, says, tmp_path, capsys):
    """Issue 45 item 4: exit 2 and one line naming the argument, before anything starts."""
    file = tmp_path / "a-file"
    file.write_text("{}\n")
    bundled = REPO / "osworld_jax" / "env" / "bundled"
    argv = [a.format(tmp=tmp_path, file=file, bundled=bundled) for a in argv]
    main = _env_cli if cli == "env" else _script(cli)
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert ": error: " in err and says in err and err.endswith("--help)\n"), err


SEED_CONFIG = REPO / "osworld_jax" / "model" / "assets" / "qwen3_vl_30b_a3b_instruct"


def test_validate_only_estimates_a_seed_recipe_from_config_json_alone(tmp_path, capsys):
    """Issue 45 item 7: no weights on disk, only config.json (a dir, or the file itself)."""
    from osworld_jax.rl.lifecycle import validate_only

    shapes = tmp_path / "model"
    shapes.mkdir()
    shutil.copyfile(SEED_CONFIG / "config.json", shapes / "config.json")
    outs = []
    for path in (shapes, shapes / "config.json"):
        exp = config.load_experiment(
            ["osworld_flash_b8n8_r3_dr_grpo.gin"],
            [f"ModelSourceConfig.path = '{path}'", "RolloutConfig.urls = ('http://127.0.0.1:9',)",
             "ExperimentConfig.sandbox = 'memory'"],
        )  # fmt: skip
        assert validate_only(exp) == 2
        outs.append(capsys.readouterr())
    for (out, err), path in zip(outs, (shapes, shapes / "config.json"), strict=True):
        assert out.splitlines() == [
            "config: ok",
            f"model: {path} (48 layers, 128 experts; shapes from config.json, no weights)",
            # the seed's window: 2 screenshots of 1920x1080 at Qwen3-VL's published
            # processor (2 x 8160 patches) in 49,152-token rows
            "memory: one train step of 64 rows x 49152 tokens (16320 image patches per row) "
            "needs ~259.4 GiB per device (of 8)",
        ]
        assert "weights" in err or "is not a directory" in err
        assert "rollout server http://127.0.0.1:9 is unreachable" in err
        assert err.splitlines()[-1].startswith("hint: ") and "configs/gpu_1x_h100.gin" in err


@pytest.mark.slow
def test_a_run_whose_server_dies_keeps_its_directory_and_says_so_in_a_few_lines(tmp_path):
    """Issue 40: the embedded server killed when the first rollout starts: the run dir stays
    (server.log, the error in error.txt), stderr is a few lines and no traceback."""
    tasks, run_dir = quick_tasks(tmp_path), tmp_path / "new" / "run"
    proc = subprocess.Popen(
        # The client gives a dead server 5 s instead of its default minute: the same path.
        train_cmd(run_dir, *quick_args(tasks, "RolloutConfig.unavailable_wait_s = 5.0"), steps=2),
        cwd=REPO,
        env=run_env(run_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    log, killed = run_dir / "server.log", []
    while not killed and proc.poll() is None:  # the first /generate: the first rollout
        if log.is_file() and "POST /generate" in log.read_text(errors="replace"):
            for pid, cmd in live_processes_mentioning(str(run_dir)):
                if "osworld_jax.server.serve" in cmd:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
        time.sleep(0.05)
    out, err = (x.decode() for x in proc.communicate(timeout=600))
    assert killed and proc.returncode == 1, out[-2000:] + err[-3000:]
    lines = err.strip().splitlines()
    print(err)
    assert "Traceback" not in err and len(lines) <= 10, err
    assert lines[-1].startswith("error: the rollout server stopped answering ("), lines[-1]
    assert lines[-1].endswith(
        "rerun the same command to start again (no checkpoint yet); "
        f"logs in {run_dir} (server.log, run.log, error.txt)"
    ), lines[-1]
    assert (run_dir / "server.log").is_file()
    assert (run_dir / "error.txt").read_text().startswith(lines[-1] + "\n")
    kept = (run_dir / "run.log").read_text()  # what stderr showed of the loggers, kept
    shown = [x.split(":", 2)[2] for x in lines[:-1] if x.startswith(("WARNING:", "ERROR:"))]
    assert shown and all(x in kept for x in shown), (shown, kept)
    assert not live_processes_mentioning(str(run_dir))
