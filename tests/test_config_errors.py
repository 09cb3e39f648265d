"""Value errors at the gin edge: one line naming the binding, what is wrong, the expected form."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from osworld_jax import config
from osworld_jax.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def error_of(param: str) -> str:
    with pytest.raises(ConfigError) as info:
        config.load_experiment(["default.gin"], [param])
    msg = str(info.value)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize(
    ("param", "want"),
    [
        (
            "DataConfig.task_set = bundled",
            "--gin_param[0]:1: DataConfig.task_set = bundled: bundled is not a value: strings "
            "need quotes, e.g. DataConfig.task_set = 'bundled'",
        ),
        (
            "DataConfig.task_set = /data/tasks",
            "--gin_param[0]:1: DataConfig.task_set = /data/tasks: /data/tasks is not a value: "
            "strings need quotes, e.g. DataConfig.task_set = '/data/tasks'",
        ),
        (
            "OptimizerConfig.learning_rate = 1e-5x",
            "--gin_param[0]:1: OptimizerConfig.learning_rate = 1e-5x: '1e-5x' is not a Python "
            "literal; expected a number, e.g. 1e-05",
        ),
        (
            "DataConfig.task_set = 'bundled",
            "--gin_param[0]:1: DataConfig.task_set = 'bundled: 'bundled has no closing quote; "
            "expected a quoted string, e.g. 'text'",
        ),
        (
            "RLConfig.stepz = 3",
            "--gin_param[0]:1: RLConfig.stepz = 3: Configurable 'RLConfig' doesn't have a "
            "parameter named 'stepz'; did you mean RLConfig.steps?",
        ),
        (
            "RLConfig.learning_rat = 1e-5",  # a field of another configurable
            "--gin_param[0]:1: RLConfig.learning_rat = 1e-5: Configurable 'RLConfig' doesn't "
            "have a parameter named 'learning_rat'; did you mean OptimizerConfig.learning_rate?",
        ),
        (
            "RLConfg.steps = 3",
            "--gin_param[0]:1: RLConfg.steps = 3: No configurable matching 'RLConfg'; did you "
            "mean RLConfig?",
        ),
        (
            "RLConfig.steps = '3'",
            "--gin_param[0]:1: RLConfig.steps = '3': expected an integer, e.g. 8",
        ),
    ],
)
def test_value_errors_are_one_line_with_the_expected_form(param, want):
    assert error_of(param) == want


def test_a_file_binding_names_its_file_and_line(tmp_path):
    f = tmp_path / "x.gin"
    f.write_text("RLConfig.steps = 2\nDataConfig.task_set = bundled\n")
    with pytest.raises(ConfigError) as info:
        config.load_experiment(["default.gin", f], [])
    assert str(info.value) == (
        f"{f}:2: DataConfig.task_set = bundled: bundled is not a value: strings need quotes, "
        "e.g. DataConfig.task_set = 'bundled'"
    )


def test_train_py_prints_the_line_and_writes_nothing(tmp_path):
    """The real command: exit 2, the one line on stderr, no run directory (before any jax work)."""
    run_dir = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "train.py"), f"--run_dir={run_dir}",
         "--gin_param=DataConfig.task_set = bundled"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "config error: --gin_param[0]:1: DataConfig.task_set = bundled: bundled is not a value: "
        "strings need quotes, e.g. DataConfig.task_set = 'bundled'"
    ]
    assert not run_dir.exists() and not (tmp_path / "runs").exists()
