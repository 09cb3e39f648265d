#!/usr/bin/env python
"""Train a computer-use agent with RL: gin configs in, `osworld_jax.rl.train` out.

    python scripts/train.py                                   # configs/default.gin, CPU, embedded
    python scripts/train.py --gin_file=configs/osworld_flash_b8n8_r3_dr_grpo.gin \
        --gin_param="RLConfig.steps = 200" --run_dir=runs/b8n8

``--gin_file`` and ``--gin_param`` repeat (later files override earlier ones; params apply
last). The same ``--run_dir`` resumes from its latest checkpoint at the next step.
"""

from __future__ import annotations

import argparse
import datetime
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
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
    try:
        from osworld_jax.rl import train  # after config parsing: a config typo fails fast
        from osworld_jax.rl.rundir import quiet_storage_tracebacks

        quiet_storage_tracebacks()  # a full disk is reported below, once, as one line
        # The run writes operative_config.gin + experiment.json once it is starting.
        result = train(experiment, run_dir, args.steps, operative_gin=config.operative_config())
    except KeyboardInterrupt:
        print(f"interrupted; the last checkpoint in {run_dir} is intact", file=sys.stderr)
        return 130
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # storage and multi-host failures: one line; anything else: traceback
        line = _known_failure(e, run_dir)
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 1
    print(result.summary)
    return 0


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
