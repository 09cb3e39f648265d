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
The run prints its directory when it starts and ends; ``runs/latest`` points at the newest run
that ran. A start refused by its checks leaves nothing; a run that fails later keeps its
directory (logs, metrics, ``server.log``) and its error in ``error.txt``
(`osworld_jax.rl.lifecycle`: what a run decides about its directory lives there).
"""

from __future__ import annotations

import argparse
import datetime
import signal
import sys
import warnings
from pathlib import Path

from osworld_jax import cliargs, config
from osworld_jax.errors import ConfigError

# Sandboxes and the embedded server are started with subprocess (fork + exec: the child runs no
# Python), which JAX's at-fork hook reports on every spawn.
warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)

DEFAULT_GIN = "default.gin"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = cliargs.ArgumentParser(
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
    p.add_argument(
        "--run_dir",
        type=cliargs.run_dir,
        default=None,
        help="run directory (default runs/<UTC timestamp>)",
    )
    p.add_argument(
        "--steps",
        type=cliargs.positive_int,
        default=None,
        help="the last step to run (overrides RLConfig.steps)",
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
    # after config parsing: a typo fails fast
    from osworld_jax.rl.lifecycle import RunRequest, launch, validate_only

    if args.validate_only:
        return validate_only(experiment)

    return launch(
        RunRequest(
            experiment=experiment,
            run_dir=run_dir,
            steps=args.steps,
            operative_gin=config.operative_config(),
            allow_config_change=args.allow_config_change,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
