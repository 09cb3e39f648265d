#!/usr/bin/env python
"""The learning demo: the whole RL pipeline on a toy reward that a random tiny model can learn.

Examples:

  python scripts/demo_learning.py                      # 18 steps, a few minutes on 2 CPU cores
  python scripts/demo_learning.py --run_dir=runs/demo --gin_param="RLConfig.steps = 30"

The default run (``scripts/train.py``) shows the machinery end to end on real desktop tasks,
where a random tiny model scores 0. Here everything stays real (tasks, the memory desktop,
the agent, the embedded server, GRPO, the train step with router replay, the weight refit)
and only the reward is a toy: **1 iff the model's one-token reply starts with a lowercase
vowel**, else 0 (``osworld_jax/demo/learnable.py``). The reward starts near 0.2 (the share of
such tokens) and rises towards 1; the curve is printed at the end.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
import warnings
from pathlib import Path

from osworld_jax import cliargs, config
from osworld_jax.demo import learnable
from osworld_jax.errors import ConfigError

warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = cliargs.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--run_dir", type=cliargs.run_dir, default=None, help="default runs/demo-<UTC time>"
    )
    p.add_argument(
        "--gin_param", action="append", default=[], help="extra binding (after the demo's)"
    )
    return p.parse_args(argv)


def curve(rewards: list[float], width: int = 40) -> str:
    """One line per step: ``step  reward  bar``."""
    return "\n".join(
        f"  {i:>3}  {r:.2f}  {'#' * round(r * width)}" for i, r in enumerate(rewards, start=1)
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run_dir = Path(args.run_dir or f"runs/demo-{datetime.datetime.now(datetime.UTC):%Y%m%d-%H%M%S}")
    tasks = learnable.write_tasks(run_dir / "tasks")
    params = [*learnable.BINDINGS, f"DataConfig.task_set = '{tasks}'", *args.gin_param]
    try:
        experiment = config.load_experiment(["default.gin"], params)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(f"learning demo in {run_dir}: reward = 1 iff the reply starts with a lowercase vowel")
    from osworld_jax.rl import train
    from osworld_jax.rl.rundir import point_latest_at

    t0 = time.monotonic()
    result = train(experiment, run_dir, operative_gin=config.operative_config())
    rewards = [h["reward/mean"] for h in result.history]
    print(f"reward per step ({time.monotonic() - t0:.0f} s):\n{curve(rewards)}")
    if len(rewards) >= 6:
        first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
        print(f"reward: first 3 steps {first:.2f} -> last 3 steps {last:.2f}")
    latest = point_latest_at(run_dir)
    also = f" ({latest} points here)" if latest is not None else ""
    print(f"results in {run_dir}{also}")
    print(f"  TensorBoard: .venv/bin/tensorboard --logdir {run_dir / 'tensorboard'}")
    print(f"  notebook:    .venv/bin/python scripts/analyze.py {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
