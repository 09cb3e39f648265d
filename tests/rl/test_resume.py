"""A corrupt latest checkpoint: one line naming it, and a documented way back to the previous one.

Issue 16 item 10. ``scripts/train.py`` as a user runs it: two steps, checkpoint 2 damaged on disk,
the same command again (one line naming step 2, its file and the flag to use), then the command
with ``CheckpointConfig.restore_step = 1``: the run resumes at step 2 and finishes step 3, and
the damaged checkpoint and the stale export are kept, set aside.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from osworld_jax.rl.rundir import complete_checkpoints
from tests.rl.runs import (
    REPO,
    live_processes_mentioning,
    quick_args,
    quick_tasks,
    run_env,
    train_cmd,
)


def _train(run_dir, tasks, steps, *extra):
    return subprocess.run(
        train_cmd(run_dir, *quick_args(tasks, *extra), steps=steps),
        cwd=REPO,
        env=run_env(run_dir),
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_corrupt_latest_checkpoint_is_named_and_the_previous_one_resumes(tmp_path):
    tasks, run_dir = quick_tasks(tmp_path), tmp_path / "run"
    first = _train(run_dir, tasks, 2)
    assert first.returncode == 0, first.stderr[-3000:]
    assert complete_checkpoints(run_dir) == [1, 2]
    data = max((run_dir / "checkpoints/2/state").rglob("d/*"), key=lambda p: p.stat().st_size)
    garbled = bytearray(data.read_bytes())
    garbled[64::7] = bytes(b ^ 0x5A for b in garbled[64::7])
    data.write_bytes(bytes(garbled))

    gin = (run_dir / "operative_config.gin").read_text()
    again = _train(run_dir, tasks, 3)
    assert again.returncode == 1, again.stderr[-3000:]
    assert "Traceback" not in again.stderr, again.stderr[-3000:]
    line = again.stderr.strip().splitlines()[-1]
    print(line)
    assert re.fullmatch(
        rf"error: checkpoint 2 is corrupt: {re.escape(str(run_dir))}/checkpoints/2/state "
        r"\(array [\w.]+\): ZSTD_decompressStream\(\) failed: [^;]+; resume from checkpoint 1, "
        r"the previous complete one, with --gin_param='CheckpointConfig.restore_step = 1' "
        r"\(the newer checkpoints are set aside, not deleted\)",
        line,
    ), line
    assert not live_processes_mentioning(str(run_dir))
    assert (run_dir / "operative_config.gin").read_text() == gin  # a failed start writes none

    resumed = _train(run_dir, tasks, 3, "CheckpointConfig.restore_step = 1")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # step 2 again, from checkpoint 1: the resume trims the logs back to the checkpoint
    # (rundir.trim_logs_to_checkpoint), so the set-aside step 2 leaves no line behind
    assert steps == [1, 2, 3]
    assert complete_checkpoints(run_dir) == [2, 3]  # default.gin keeps 2
    assert (run_dir / "checkpoints/2.set-aside/state").is_dir()  # kept, out of orbax's sight
    assert (run_dir / "weights/step_00000002.set-aside").is_dir()  # the old step 2 export
    assert (run_dir / "weights/step_00000003/config.json").is_file()
    assert "CheckpointConfig.restore_step = 1" in (run_dir / "operative_config.gin").read_text()
    assert not live_processes_mentioning(str(run_dir))
