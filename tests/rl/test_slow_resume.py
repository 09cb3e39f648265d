"""Slow end-to-end test of scripts/train.py with no config flags: Ctrl-C after step 1, then the
same --run_dir resumes."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.rl.runs import REPO, live_processes_mentioning


def _train_cmd(run_dir, steps):
    return [
        sys.executable,
        str(REPO / "scripts" / "train.py"),
        f"--run_dir={run_dir}",
        f"--steps={steps}",
    ]


@pytest.mark.slow
def test_default_run_ctrl_c_and_resume(tmp_path):
    """scripts/train.py with no config flags (configs/default.gin: tiny model, embedded server,
    local sandboxes, bundled tasks); Ctrl-C after step 1; the same --run_dir resumes at step 2."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OSWORLD_JAX_TEST_RUN": str(run_dir)}
    t0 = time.monotonic()
    proc = subprocess.Popen(
        _train_cmd(run_dir, 3), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 480
    while not (run_dir / "checkpoints" / "1").is_dir():
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint of step 1"
        time.sleep(1)
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=180)[0].decode()
    print(f"first run {time.monotonic() - t0:.0f}s:\n{out[-1500:]}")
    assert proc.returncode == 130, out[-3000:]
    assert "interrupted" in out
    assert not live_processes_mentioning(str(run_dir))  # server and sandboxes are gone
    steps_done = [
        json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps_done[0] == 1
    for name in ("operative_config.gin", "experiment.json", "base_model/config.json"):
        assert (run_dir / name).is_file()
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))

    assert f"run directory: {run_dir}" in out
    # The step after the last complete checkpoint may have logged before its save finished.
    ckpt = max(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())

    # Resuming as a text-model run is refused in one line before anything starts (no jax work).
    other = [f"--gin_file={REPO / 'configs' / g}" for g in ("default.gin", "text_only.gin")]
    refused = subprocess.run(
        [*_train_cmd(run_dir, max(steps_done) + 1), *other],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert refused.returncode == 2, refused.stdout + refused.stderr
    line = refused.stderr.strip()
    assert line.startswith(f"error: {run_dir} was trained with another config; changed: "), line
    assert "ModelSourceConfig.tiny_kind: 'qwen3_vl_moe' -> 'qwen3_moe'" in line, line
    assert "AgentConfig.max_screenshots: 3 -> 0" in line and "--allow_config_change" in line
    assert "\n" not in line and "RLConfig.steps" not in line  # run length may change

    t1 = time.monotonic()
    again = subprocess.run(
        _train_cmd(run_dir, max(steps_done) + 1),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(f"resumed run {time.monotonic() - t1:.0f}s:\n{again.stdout[-1500:]}")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    resumed = records[len(steps_done) :]
    assert [r["step"] for r in resumed] == [max(steps_done) + 1]
    assert (run_dir / "checkpoints" / str(max(steps_done) + 1)).is_dir()
    assert not live_processes_mentioning(str(run_dir))
    assert f"resuming from checkpoint {ckpt}" in again.stdout
    assert f"results in {run_dir} ({run_dir.parent / 'latest'} points here)" in again.stdout
    assert (run_dir.parent / "latest").resolve() == run_dir.resolve()

    # Rerunning the finished run says so, at once.
    done = subprocess.run(
        _train_cmd(run_dir, max(steps_done) + 1),
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(
        f"{run_dir} is finished: its checkpoint {max(steps_done) + 1} is at or past the last step"
    ), done.stdout
