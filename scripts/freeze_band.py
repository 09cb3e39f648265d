#!/usr/bin/env python
"""Freeze the offline DAPO band of a task set into an immutable training dataset.

    python scripts/freeze_band.py --calibration calib.jsonl --task_dir TASKS --out_dir BAND \\
        [--reps 8] [--low 0] [--high 8] [--num_repeats 4]

The calibration file comes from ``scripts/evaluate.py``. Train on the result with
``--gin_param="DataConfig.task_set = 'BAND'"``.
"""

from __future__ import annotations

import argparse
import json
import sys

from osworld_jax import cliargs
from osworld_jax.data import freeze_band
from osworld_jax.errors import OsworldJaxError


def main(argv: list[str] | None = None) -> int:
    p = cliargs.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--calibration",
        type=cliargs.existing_file,
        required=True,
        help="JSONL of {task_id, reps, passes}",
    )
    p.add_argument(
        "--task_dir",
        type=cliargs.existing_dir,
        required=True,
        help="the task set the calibration ran on",
    )
    p.add_argument(
        "--out_dir", type=cliargs.new_dir, required=True, help="dataset directory to publish"
    )
    p.add_argument(
        "--reps", type=cliargs.positive_int, default=None, help="require this many attempts"
    )
    p.add_argument("--low", type=cliargs.non_negative_int, default=0, help="admit iff passes > low")
    p.add_argument(
        "--high",
        type=cliargs.positive_int,
        default=None,
        help="admit iff passes < high (default reps)",
    )
    p.add_argument(
        "--num_repeats",
        type=cliargs.positive_int,
        default=1,
        help="repeats of each task in train.jsonl",
    )
    a = p.parse_args(argv)
    if a.high is not None and a.high <= a.low:
        p.error(f"--high {a.high} must be above --low {a.low} (admit iff low < passes < high)")
    try:
        out = freeze_band(
            a.calibration,
            a.task_dir,
            a.out_dir,
            reps=a.reps,
            low=a.low,
            high=a.high,
            num_repeats=a.num_repeats,
        )
    except OsworldJaxError as e:
        print(f"freeze_band: {e}", file=sys.stderr)
        return 1
    counts = json.loads((out / "SNAPSHOT.json").read_text())["counts"]
    print(
        f"froze {counts['admitted']}/{counts['calibrated']} tasks "
        f"({counts['train_rows']} train rows) into {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
