"""What a new user sees: --validate_only, a failed start, resume refusals, runs/latest."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from osworld_jax import config
from osworld_jax.rl.rundir import (
    RESOLVED_CONFIG,
    config_changes,
    point_latest_at,
    write_run_config,
)
from tests.rl.runs import REPO, quick_args, quick_tasks


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
        "valid: nothing was run or written (drop --validate_only to train)",
    ]
    assert not run_dir.exists() and not (tmp_path / "runs").exists()
