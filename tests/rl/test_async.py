"""The asynchronous loop (``RLConfig.max_staleness``) end to end, and k = 0 against the
synchronous loop as it was written before the producer: same metrics, bit for bit."""

import dataclasses
import json
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from osworld_jax import config
from osworld_jax.agent import pack_batch, select_groups
from osworld_jax.data import make_task_stream
from osworld_jax.rl import stages, train
from osworld_jax.rl.metrics import StageTimer
from osworld_jax.rl.run import RunResources
from osworld_jax.rl.rundir import complete_checkpoints
from tests.rl.runs import (
    QUICK,
    REPO,
    live_processes_mentioning,
    quick_args,
    quick_tasks,
    run_env,
    train_cmd,
)


def _synchronous_loop(experiment, run_dir, steps):
    """The RL loop before rollouts could run ahead (one process): draw -> rollout -> segments
    -> advantages -> batch -> train_step -> refit -> checkpoint -> metrics."""
    rl = experiment.rl
    history = []
    with RunResources(experiment, Path(run_dir)) as run:
        for step in range(run.start_step + 1, steps + 1):
            t = StageTimer()
            tasks = next(run.stream)
            raw = run.runner.run(run.rollout(tasks, step))
            rollouts = stages.collect_owners(raw, rl, step)
            selection = select_groups(rollouts.owners, experiment.group, rl.num_prompts)
            adv = stages.owner_advantages(selection, rl.estimator, run.trainer.bounds)
            batch = pack_batch(selection, adv, **run.pack_kwargs)
            run.state, tm = run.trainer.train_step(run.state, batch)
            run.refit(step)
            run.save(step, force=step == steps)
            m = stages.step_metrics(rollouts, selection, adv, batch, tm, rl.success_reward)
            history.append({"step": step, **m, **t.metrics()})
    return history


def _experiment(tasks, *extra):
    params = [p for p in QUICK if not p.startswith("CheckpointConfig")]
    return config.load_experiment(
        ["default.gin"], [*params, f"DataConfig.task_set = '{tasks}'", *extra]
    )


@pytest.mark.slow
def test_k0_one_minibatch_is_the_synchronous_loop_bit_for_bit(tmp_path):
    """Two runs agree bit for bit only if their rollouts do: the embedded server batches the
    requests that arrive together and shares cached prefixes between owners, so with several
    requests in flight a logprob can differ in its last bit with the arrival order. One
    request at a time and no prefix cache make each request's numbers its own.

    The reference refits a server of its own process through the disk; ours runs the server
    in its process (``launch = 'colocated'``) and hands the weights over in memory: the same
    numbers, so the in-memory refit serves exactly what the exported checkpoint held."""
    tasks = quick_tasks(tmp_path)
    exp = _experiment(
        tasks,
        "RLConfig.max_staleness = 0",
        "AgentEnvConfig.max_turns = 2",
        "SamplingParams.max_new_tokens = 4",
        "ServerConfig.max_running_requests = 1",
        "ServerConfig.extra_args = ('--disable-radix-cache',)",
    )
    reference = _synchronous_loop(exp, tmp_path / "reference", 2)
    colocated = exp.replace(server=dataclasses.replace(exp.server, launch="colocated"))
    assert colocated.server.refits_in_memory and not exp.server.refits_in_memory
    ours = train(colocated, tmp_path / "ours", 2).history
    assert [r["step"] for r in ours] == [1, 2]
    for ref, got in zip(reference, ours, strict=True):
        keys = [k for k in ref if not k.startswith("time/")]
        assert len(keys) > 20
        for k in keys:
            np.testing.assert_array_equal(np.float64(got[k]), np.float64(ref[k]), err_msg=k)
        assert got["staleness/max"] == 0 and got["owners/stale"] == 0


def _stream_tasks(tasks, steps):
    exp = _experiment(tasks)
    stream = make_task_stream(exp.data, exp.rl.num_prompts, process_index=0, process_count=1)
    return [[t.task_id for t in next(stream)] for _ in range(steps)]


@pytest.mark.slow
def test_kill_9_during_an_async_step_resumes_exactly(tmp_path):
    """k = 1: rollouts of step s + 1 run while step s trains. Killed (SIGKILL) once checkpoint
    2 is complete, the same command resumes after the newest complete checkpoint: every step
    trained once, and each step's tasks are the stream's (the checkpoint holds the stream's
    position at the draw of its own step, not of the step rolling out ahead)."""
    tasks = quick_tasks(tmp_path)
    run_dir = tmp_path / "run"
    cmd = train_cmd(run_dir, *quick_args(tasks, "RLConfig.max_staleness = 1"), steps=5)
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=run_env(run_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 480
    while 2 not in complete_checkpoints(run_dir):
        assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint of step 2"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    resume = complete_checkpoints(run_dir)[-1]
    assert resume < 5
    first = (run_dir / "metrics.jsonl").read_text().splitlines()
    # The kill can land after a later step's metrics line but before its checkpoint completed:
    # the resumed run trims the log to its checkpoint (tests/rl/test_rundir.py), so only the
    # lines up to it are kept.
    kept = [x for x in first if json.loads(x)["step"] <= resume]

    again = subprocess.run(
        cmd, cwd=REPO, env=run_env(run_dir), capture_output=True, text=True, timeout=480
    )
    assert again.returncode == 0, again.stderr[-3000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert lines[: len(kept)] == kept
    records = [json.loads(x) for x in lines]
    resumed = records[len(kept) :]
    assert [r["step"] for r in resumed] == list(range(resume + 1, 6))
    assert complete_checkpoints(run_dir)[-1] == 5
    assert all(r["staleness/max"] <= 1 and r["owners/stale"] == 0 for r in records)
    assert max(r["staleness/max"] for r in records) == 1  # it did run ahead

    owners = [json.loads(x) for x in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    b, n = 2, 2  # QUICK: B groups of N owners
    got = []
    for step in range(1, 6):  # a step run twice (killed, then resumed): its last records
        last = [o for o in owners if o["step"] == step][-b * n :]
        got.append([last[g * n]["task_id"] for g in range(b)])
    assert got == _stream_tasks(tasks, 5)
    assert not live_processes_mentioning(str(run_dir))
