#!/usr/bin/env python
"""Train a computer-use agent with RL: gin configs in, `osworld_jax.rl.train` out.

Examples:

  python scripts/train.py                       # configs/default.gin, CPU, embedded server
  python scripts/train.py --validate_only       # config, preflight, memory estimate; no run
  python scripts/train.py --gin_file=configs/osworld_flash_b8n8_r3_dr_grpo.gin \\
      --gin_param="RLConfig.steps = 200" --run_dir=runs/b8n8

``--gin_file`` and ``--gin_param`` repeat (later files override earlier ones; params apply
last). The same ``--run_dir`` resumes from its latest checkpoint at the next step, with the
run's own config: a change to the model, the data or the algorithm is refused unless
``--allow_config_change`` is given (the steps, logging and checkpoint cadence may change).
The run prints its directory when it starts and ends; ``runs/latest`` points at the newest.
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import signal
import sys
import warnings
from pathlib import Path

from osworld_jax import config
from osworld_jax.errors import ConfigError

# Sandboxes and the embedded server are started with subprocess (fork + exec: the child runs no
# Python), which JAX's at-fork hook reports on every spawn.
warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)

DEFAULT_GIN = "default.gin"
CONFIG_CHANGES_LOG = "config_changes.log"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--gin_file",
        action="append",
        default=[],
        help=f"gin file (repeatable; default configs/{DEFAULT_GIN})",
    )
    p.add_argument(
        "--gin_param",
        action="append",
        default=[],
        help="gin binding 'Class.field = value' (repeatable, applied after files)",
    )
    p.add_argument("--run_dir", default=None, help="run directory (default runs/<UTC timestamp>)")
    p.add_argument(
        "--steps", type=int, default=None, help="the last step to run (overrides RLConfig.steps)"
    )
    p.add_argument(
        "--validate_only",
        action="store_true",
        help="check the config, the preflight and the memory estimate; run nothing, write nothing",
    )
    p.add_argument(
        "--allow_config_change",
        action="store_true",
        help="resume even though the model/data/algorithm bindings differ (the diff is logged)",
    )
    return p.parse_args(argv)


def _stop_on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (a scheduler stopping the job) shuts down like Ctrl-C: sandboxes and servers are
    # closed and the last checkpoint stays intact.
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    run_dir = Path(args.run_dir or f"runs/{datetime.datetime.now(datetime.UTC):%Y%m%d-%H%M%S}")
    try:
        experiment = config.load_experiment(args.gin_file or [DEFAULT_GIN], args.gin_param)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.validate_only:
        return _validate(experiment)
    last_step = args.steps if args.steps is not None else experiment.rl.steps
    try:
        resume = _check_resume(run_dir, experiment, last_step, args.allow_config_change)
    except ConfigError as e:  # the run's own experiment.json is unreadable
        print(f"error: {e}", file=sys.stderr)
        return 2
    if resume is not None:
        return resume
    created = _first_missing(run_dir)  # removed again by a start that fails
    print(f"run directory: {run_dir}", flush=True)
    try:
        from osworld_jax.rl import train  # after config parsing: a config typo fails fast
        from osworld_jax.rl.rundir import quiet_storage_tracebacks

        quiet_storage_tracebacks()  # a full disk is reported below, once, as one line
        # The run writes operative_config.gin + experiment.json once it is starting.
        result = train(experiment, run_dir, args.steps, operative_gin=config.operative_config())
    except KeyboardInterrupt:
        if _forget_failed_start(run_dir, created):
            print(f"interrupted before the first checkpoint; removed {run_dir}", file=sys.stderr)
            return 130
        print(f"interrupted; the last checkpoint in {run_dir} is intact", file=sys.stderr)
        print(_where_results_are(run_dir, experiment.rl.metrics_dir), file=sys.stderr)
        return 130
    except ConfigError as e:
        _forget_failed_start(run_dir, created)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # storage and multi-host failures: one line; anything else: traceback
        _forget_failed_start(run_dir, created)
        line = _known_failure(e, run_dir)
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 1
    print(result.summary)
    print(_where_results_are(run_dir, experiment.rl.metrics_dir))
    return 0


def _validate(experiment: config.ExperimentConfig) -> int:
    """``--validate_only``: preflight and memory estimate, nothing written, nothing compiled."""
    from osworld_jax.errors import OsworldJaxError
    from osworld_jax.rl.run import validate

    print("config: ok")
    try:
        lines = validate(experiment)
    except OsworldJaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    print("valid: nothing was run or written (drop --validate_only to train)")
    return 0


def _check_resume(
    run_dir: Path, experiment: config.ExperimentConfig, last_step: int, allow_change: bool
) -> int | None:
    """Before a resume: a finished run, a changed config; None to go on (exit code otherwise)."""
    from osworld_jax.rl.rundir import complete_checkpoints, config_changes

    steps = complete_checkpoints(run_dir)
    if not steps:
        return None
    restore = experiment.trainer.checkpoint.restore_step
    if restore is None and steps[-1] >= last_step:
        print(
            f"{run_dir} is finished: its checkpoint {steps[-1]} is at or past the last step "
            f"({last_step}); pass --steps=N with N > {steps[-1]} to train further"
        )
        print(_where_results_are(run_dir, experiment.rl.metrics_dir))
        return 0
    changes = config_changes(run_dir, experiment)
    if changes and not allow_change:
        print(
            f"error: {run_dir} was trained with another config; changed: {'; '.join(changes)} "
            "(pass --allow_config_change to resume anyway, or use a new --run_dir)",
            file=sys.stderr,
        )
        return 2
    if changes:
        note = f"{datetime.datetime.now(datetime.UTC):%Y-%m-%dT%H:%M:%SZ} resumed at checkpoint "
        note += f"{restore or steps[-1]} with --allow_config_change: {'; '.join(changes)}\n"
        with open(run_dir / CONFIG_CHANGES_LOG, "a") as f:
            f.write(note)
        print(f"config changed (logged in {run_dir / CONFIG_CHANGES_LOG}): {'; '.join(changes)}")
    print(f"resuming from checkpoint {restore if restore is not None else steps[-1]}", flush=True)
    return None


def _first_missing(path: Path) -> Path | None:
    """The outermost directory of ``path`` that does not exist yet (None: ``path`` exists)."""
    missing = None
    for p in (path, *path.parents):
        if p.exists():
            break
        missing = p
    return missing


def _forget_failed_start(run_dir: Path, created: Path | None) -> bool:
    """Removes what this command created (``created``: the run dir or an ancestor) when the run
    never checkpointed: a failed start leaves no directory behind that did not exist before."""
    from osworld_jax.rl.rundir import complete_checkpoints

    if created is None or not created.is_dir() or complete_checkpoints(run_dir):
        return False
    shutil.rmtree(created, ignore_errors=True)
    return True


def _where_results_are(run_dir: Path, metrics_dir: str) -> str:
    """The run directory with the commands that show it (TensorBoard, the analysis notebook)."""
    from osworld_jax.rl.rundir import point_latest_at

    latest = point_latest_at(run_dir)
    also = f" ({latest} points here)" if latest is not None else ""
    board = run_dir / metrics_dir / "tensorboard"
    return (
        f"results in {run_dir}{also}\n"
        f"  TensorBoard: .venv/bin/tensorboard --logdir {board.as_posix()}\n"
        f"  notebook:    .venv/bin/python scripts/analyze.py {run_dir}"
    )


def _known_failure(e: Exception, run_dir: Path) -> str | None:
    """One line for a failure that is not a bug: the run dir's storage, a damaged checkpoint,
    or a lost process."""
    from osworld_jax.rl.rundir import complete_checkpoints, storage_error
    from osworld_jax.trainer.checkpoint import CorruptCheckpointError
    from osworld_jax.trainer.distributed import DistributedError

    if isinstance(e, (DistributedError, CorruptCheckpointError)):
        return f"error: {e}"
    err = storage_error(e)
    if err is None:
        return None
    steps = complete_checkpoints(run_dir)
    kept = f"checkpoint {steps[-1]} is the last complete one" if steps else "no checkpoint yet"
    return f"error: {err} ({kept}; fix the storage and rerun the same command to resume)"


if __name__ == "__main__":
    sys.exit(main())
