"""The RL loop: ``train(experiment, run_dir, steps)``.

Each step: B tasks from grain -> B x N owners rolled out concurrently -> segments -> group
policy + advantages -> device batch -> train_step (R3) -> export + refit every server ->
metrics -> orbax checkpoint (with the task-stream position). One optimizer step per rollout
batch: pi_old is the current policy, whose logprobs ``train_step`` computes itself for the gate
(no separate old-logprob pass). Set-up and tear-down live in
`osworld_jax.rl.run` (`RunResources`), the stage helpers in `osworld_jax.rl.stages`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from osworld_jax.agent import pack_batch, select_groups
from osworld_jax.rl import stages
from osworld_jax.rl.config import ExperimentConfig
from osworld_jax.rl.metrics import StageTimer
from osworld_jax.rl.run import RunResources
from osworld_jax.trainer.distributed import broadcast_host_batch


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What a finished (or resumed-and-finished) run reports.

    Attributes:
      run_dir: the run directory.
      first_step: the first step this call ran (``last_step + 1`` if nothing was left to do).
      last_step: the run's final step.
      history: the metrics records this call logged, one per step.
      summary: a few human-readable lines.
    """

    run_dir: Path
    first_step: int
    last_step: int
    history: list[dict[str, Any]]
    summary: str


def train(
    experiment: ExperimentConfig,
    run_dir: str | Path,
    steps: int | None = None,
    *,
    operative_gin: str | None = None,
) -> TrainResult:
    """Runs (or resumes) the RL loop of ``experiment`` in ``run_dir`` up to step ``steps``.

    Args:
      experiment: the built configuration.
      run_dir: the run directory; if it holds a checkpoint, the run resumes after it.
      steps: the last step to run (default ``experiment.rl.steps``).
      operative_gin: gin's operative config, written to ``operative_config.gin`` with
        ``experiment.json`` once the run is starting (never by a start that fails).
    """
    rl, last_step = experiment.rl, steps if steps is not None else experiment.rl.steps
    run = RunResources(experiment, Path(run_dir), operative_gin)
    with run, run.metrics_logger(last_step) as log:
        for step in range(run.start_step + 1, last_step + 1):
            t, batch = StageTimer(), None
            with t.stage("data"):
                tasks = next(run.stream)  # every process draws: one checkpointed position
            if run.rolls_out:  # process 0 of a multi-host job; the only process otherwise
                with t.stage("rollout"):
                    raw = run.runner.run(run.rollout(tasks, step))
                with t.stage("segments"):
                    rollouts = stages.collect_owners(raw, rl, step)
                with t.stage("advantages"):
                    selection = select_groups(rollouts.owners, experiment.group, rl.num_prompts)
                    adv = stages.owner_advantages(selection, rl.estimator, run.trainer.bounds)
                with t.stage("batch"):
                    batch = pack_batch(selection, adv, **run.pack_kwargs)
            with t.stage("broadcast"):
                batch = broadcast_host_batch(batch)  # no-op for one process
            with t.stage("train"):
                run.state, tm = run.trainer.train_step(run.state, batch)
            with t.stage("refit"):
                run.refit(step)
            with t.stage("checkpoint"):
                run.save(step, force=step == last_step)
            if log is not None:
                m = stages.step_metrics(rollouts, selection, adv, batch, tm, rl.success_reward)
                log.log(step, {**m, **t.metrics(), **raw.timing()})
                run.write_owner_records(stages.owner_records(step, rollouts, selection, adv))
                run.write_episodes(step, raw, rollouts)
        history, summary = (log.history, log.summary()) if log is not None else ([], "")
    return TrainResult(Path(run_dir), run.start_step + 1, last_step, history, summary)
