#!/usr/bin/env python
"""pass@N of a checkpoint (served embedded) or of running servers on a task set.

    python scripts/evaluate.py --model_path=runs/x/weights/step_00000100 --task_set=TASKS \\
        --reps=8 --out=calib.jsonl
    python scripts/evaluate.py --gin_file=configs/osworld_flash_b8n8_r3_dr_grpo.gin \\
        --server_url=http://sglang-0:30000 --reps=8 --out=calib.jsonl

Writes one calibration line per task ({task_id, reps, passes, failed, mean_reward}) for
``scripts/freeze_band.py``. Configs work as in ``scripts/train.py`` (default: configs/default.gin).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import warnings
from pathlib import Path

from osworld_jax import cliargs, config
from osworld_jax.errors import ConfigError

# Sandboxes and the embedded server are started with subprocess (fork + exec: the child runs no
# Python), which JAX's at-fork hook reports on every spawn.
warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)


def main(argv: list[str] | None = None) -> int:
    p = cliargs.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--gin_file", action="append", default=[], help="gin file (repeatable)")
    p.add_argument("--gin_param", action="append", default=[], help="gin binding (repeatable)")
    p.add_argument(
        "--model_path",
        type=cliargs.model_dir,
        default=None,
        help="HF checkpoint (served embedded unless --server_url)",
    )
    p.add_argument(
        "--server_url",
        action="append",
        type=cliargs.http_url,
        default=[],
        help="evaluate these running servers instead (repeatable)",
    )
    p.add_argument("--task_set", default=None, help="task set (default: the config's)")
    p.add_argument(
        "--reps", type=cliargs.positive_int, required=True, help="attempts per task (N of pass@N)"
    )
    p.add_argument("--out", type=cliargs.output_file, required=True, help="calibration JSONL")
    p.add_argument(
        "--run_dir", type=cliargs.run_dir, default=None, help="default runs/eval-<timestamp>"
    )
    a = p.parse_args(argv)
    params = list(a.gin_param)
    if a.model_path:
        params.append(f"ModelSourceConfig.path = {a.model_path!r}")
    if a.server_url:
        params += ["ServerConfig.launch = 'none'", f"RolloutConfig.urls = {tuple(a.server_url)!r}"]
    if a.task_set:
        params.append(f"DataConfig.task_set = {a.task_set!r}")
    run_dir = Path(a.run_dir or f"runs/eval-{datetime.datetime.now(datetime.UTC):%Y%m%d-%H%M%S}")
    try:
        experiment = config.load_experiment(a.gin_file or ["default.gin"], params)
        from osworld_jax.rl.evaluate import evaluate

        result = evaluate(experiment, run_dir, a.out, reps=a.reps)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"{len(result.lines)} tasks x {a.reps}: pass@{a.reps} = {result.pass_at_n:.3f}, "
        f"mean pass rate {result.mean_pass_rate:.3f} -> {a.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
