"""The RL loop: ``train(experiment, run_dir, steps)``.

Each step: B (+ e over-provisioned) tasks from grain -> their owners rolled out concurrently
(streaming train: up to B groups, the first to finish) -> segments -> the generation window
checked (every trainable token's weight version) -> group policy + advantages -> device batch,
cut into ``TrainerConfig.num_minibatches`` minibatches of whole groups -> one optimizer update
per minibatch (R3) -> export + refit every server -> metrics -> orbax checkpoint (with the
task-stream position). With one minibatch pi_old is the current policy,
whose logprobs ``train_step`` computes itself for the gate; with several, ``Trainer.logprobs``
computes pi_old of every minibatch first.

``RLConfig.max_staleness = k``: 0 runs each step's rollout when the step starts (synchronous);
k >= 1 starts the rollouts of the next k steps while this one trains (`rl.producer`), so a step
trains on tokens from weights at most k steps older than its own (at most
``RLConfig.max_buffered_rollouts`` groups running at once). A bad step (too many failed owners,
too few usable groups) is skipped (`stages.StepSkips`: refit, checkpoint and the task stream go
on; ``RLConfig.max_consecutive_skipped_steps`` in a row at most). Set-up and tear-down live in
`osworld_jax.rl.run` (`RunResources`), the stage helpers in `osworld_jax.rl.stages`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from osworld_jax.agent import pack_batch, select_groups, split_selection
from osworld_jax.rl import stages
from osworld_jax.rl.config import ExperimentConfig
from osworld_jax.rl.metrics import MetricsLogger, StageTimer, setting_up, stage_text
from osworld_jax.rl.producer import RolloutProducer
from osworld_jax.rl.run import RunResources
from osworld_jax.trainer.distributed import broadcast_host_batches


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
    minibatches = experiment.trainer.num_minibatches
    run = RunResources(experiment, Path(run_dir), operative_gin)
    skips = stages.StepSkips(rl.max_consecutive_skipped_steps)
    with contextlib.ExitStack() as stack:
        with setting_up(rl.progress_bar):  # a status line while nothing moves yet
            stack.enter_context(run)
        log = stack.enter_context(run.metrics_logger(last_step))
        producer = stack.enter_context(_producer(run, last_step))
        stages.start_compile_counts()  # each step's metrics count the programs it built
        for step in range(run.start_step + 1, last_step + 1):
            t, batches, skip = StageTimer(_say(log, step, step == run.start_step + 1)), None, None
            with t.stage("data"):  # every process draws: one checkpointed position
                producer.launch_through(step, weights_step=step - 1)
            if run.rolls_out:  # process 0 of a multi-host job; the only process otherwise
                with t.stage("rollout"):
                    launched, raw = producer.take(step)
                try:  # a bad step (too many failed owners, too few groups) is skipped
                    with t.stage("segments"):
                        rollouts = stages.collect_owners(raw, rl, step)
                        rollouts, window = stages.check_window(rollouts, rl, step)
                    with t.stage("advantages"):
                        selection = select_groups(rollouts.owners, experiment.group, rl.num_prompts)
                        adv = stages.owner_advantages(selection, rl.estimator, run.trainer.bounds)
                    with t.stage("batch"):
                        parts = split_selection(selection, adv, minibatches)
                        batches = [pack_batch(sel, a, **run.pack_kwargs) for sel, a in parts]
                except stages.BAD_STEP_ERRORS as e:
                    skip, batches = f"{type(e).__name__}: {e}", []
            else:
                launched = producer.skip(step)
            with t.stage("broadcast"):
                batches = broadcast_host_batches(batches)  # no-op for one process
            if not batches:  # every process skips the step process 0 skipped
                skipped = skips.skip(step, skip or "process 0 skipped it (its log names why)")
            else:
                with t.stage("train"):
                    run.state, updates = run.trainer.train_minibatches(run.state, batches)
                skipped = skips.trained()
            with t.stage("refit"):  # a skipped step refits the same weights as its version
                run.refit(step)  # rollouts in flight continue on the new weights
            with t.stage("checkpoint"):
                run.save(step, launched.data_state, force=step == last_step)
            if log is not None and skip is not None:
                timeline = stages.timeline_metrics(launched, t, producer)
                extra = {**raw.group_metrics(), **t.metrics(), **raw.timing(), **timeline}
                log.log(step, {**skipped, **extra})
            elif log is not None:
                tm = stages.mean_update_metrics(updates)
                m = stages.step_metrics(rollouts, selection, adv, batches, tm, rl.success_reward)
                timeline = stages.timeline_metrics(launched, t, producer)
                m.update(raw.group_metrics())  # groups/launched, stragglers, unused
                log.log(step, {**m, **window, **skipped, **t.metrics(), **raw.timing(), **timeline})
                run.write_owner_records(stages.owner_records(step, rollouts, selection, adv))
                run.write_episodes(step, raw, rollouts)
        history, summary = (log.history, log.summary()) if log is not None else ([], "")
    return TrainResult(Path(run_dir), run.start_step + 1, last_step, history, summary)


def _say(log: MetricsLogger | None, step: int, first: bool) -> Callable[[str], None] | None:
    """What the progress line says as each stage of ``step`` starts (None: no line here)."""
    if log is None:
        return None
    return lambda name: log.stage(stage_text(step, name, first=first))


def _producer(run: RunResources, last_step: int) -> RolloutProducer:
    """The run's rollout producer (closed before the run's resources: rollouts cancelled)."""
    return RolloutProducer(
        run.stream,
        run.rollout if run.rolls_out else None,
        run.runner,
        max_staleness=run.experiment.rl.max_staleness,
        last_step=last_step,
        first_step=run.start_step + 1,
        groups_per_step=run.experiment.rl.rollout_groups,
        max_buffered_groups=run.experiment.rl.max_buffered_rollouts,
    )
