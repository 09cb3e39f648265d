"""The RL loop, synchronous vs asynchronous: wall time per step and how busy each stage keeps.

Usage:
  .venv/bin/python benchmarks/rl_loop.py [--steps 6] [--staleness 0,1] [--gin_param=...]
      [--gin_file=configs/gpu_1x_h200.gin] [--keep DIR] [--tabulate]
  .venv/bin/python benchmarks/rl_loop.py --learning   # the learnable suite's reward curves

The default mode runs ``scripts/train.py`` (configs/default.gin: tiny Qwen3-VL-MoE, embedded
server, jailed local desktops with screenshots, B=2 x N=4) for ``--steps`` steps once per
``RLConfig.max_staleness`` value, each in a fresh run directory and process, and prints per
run: the mean wall time of a step (steps 2.., the first compiles; and over all steps), steps
per hour, and the share of the run's wall time each side was busy: rollout (from a rollout's
start to its result, union over the steps' rollouts) and train (the train stage). With k >= 1
both can be busy at once. Target (issue 20): k = 1 gives >= 1.4x the steps per hour of k = 0.

``--learning`` runs the learnable suite (tests/rl/learnable.py, the memory desktop, one-token
replies, the learning test's configuration) with k = 0, k = 1 and 4 minibatches and prints the
mean reward of each step, the train/rollout logprob gap and the gate's rejected fraction.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _run(run_dir: Path, steps: int, params: list[str], gin_files: list[str]) -> float:
    cmd = [sys.executable, str(REPO / "scripts" / "train.py"), f"--run_dir={run_dir}"]
    cmd += [f"--steps={steps}", *[f"--gin_file={f}" for f in gin_files]]
    cmd += [f"--gin_param={p}" for p in ["RLConfig.progress_bar = False", *params]]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    log = run_dir.parent / f"{run_dir.name}.log"
    log.write_text(proc.stdout + "\n--- stderr\n" + proc.stderr)
    if proc.returncode:
        raise SystemExit(f"run failed ({run_dir}; log {log}):\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


#: Per-step metrics averaged over steps 2.. in the second table (a GPU run reports these).
DETAIL = (
    "logprob/train_rollout_abs_diff",
    "r3/route_agreement",
    "gate/rejected_fraction",
)


def loop_table(
    steps: int,
    staleness: list[int],
    extra: list[str],
    gin_files: list[str],
    keep: str | None,
    tabulate_only: bool = False,
) -> None:
    rows, details = [], []
    with tempfile.TemporaryDirectory(prefix="rl_loop-") as tmp:
        root = Path(keep or tmp)
        root.mkdir(parents=True, exist_ok=True)
        for k in staleness:
            run_dir = root / f"k{k}"
            if tabulate_only:  # runs made before (train.py --run_dir=KEEP/k<k>)
                wall = float("nan")
            else:
                params = [f"RLConfig.max_staleness = {k}", *extra]
                wall = _run(run_dir, steps, params, gin_files)
            recs = _records(run_dir)
            later_recs = recs[1:] or recs
            keys = sorted({key for r in recs for key in r if key.startswith("time/")}) + [
                key for key in DETAIL if key in recs[0]
            ]
            details.append(
                (
                    k,
                    {
                        key: sum(r.get(key, 0.0) for r in later_recs) / len(later_recs)
                        for key in keys
                    },
                )
            )
            t_end = max(r["timeline/train_end"] for r in recs)
            t_start = min(r["timeline/rollout_start"] for r in recs)
            span = t_end - t_start
            rollout = _union(
                [(r["timeline/rollout_start"], r["timeline/rollout_end"]) for r in recs]
            )
            train = _union([(r["timeline/train_start"], r["timeline/train_end"]) for r in recs])
            # a step ends when its train (and refit/checkpoint) ends: wall time between step ends
            ends = [r["timeline/train_end"] for r in recs]
            later = [b - a for a, b in zip(ends, ends[1:], strict=False)]
            per_step = sum(later) / len(later) if later else float("nan")
            rows.append(
                dict(
                    k=k,
                    steps=len(recs),
                    process_s=wall,
                    loop_s=span,
                    step_all=span / len(recs),
                    step_later=per_step,
                    per_hour=3600 / per_step,
                    rollout_busy=rollout / span,
                    train_busy=train / span,
                    stale=max(r["staleness/max"] for r in recs),
                    reward=sum(r["reward/mean"] for r in recs) / len(recs),
                )
            )
    head = (
        "| max_staleness | steps | process s | loop s | s/step (all) | s/step (2..) "
        "| steps/hour | rollout busy | train busy | max staleness | mean reward |"
    )
    print(head)
    print("|---" * 11 + "|")
    for r in rows:
        print(
            f"| {r['k']} | {r['steps']} | {r['process_s']:.1f} | {r['loop_s']:.1f} "
            f"| {r['step_all']:.2f} | {r['step_later']:.2f} | {r['per_hour']:.0f} "
            f"| {r['rollout_busy']:.0%} | {r['train_busy']:.0%} | {r['stale']:.0f} "
            f"| {r['reward']:.3f} |"
        )
    if len(rows) > 1:
        base = rows[0]["per_hour"]
        for r in rows[1:]:
            print(f"k={r['k']}: {r['per_hour'] / base:.2f}x the steps per hour of k={rows[0]['k']}")
    print("\nmean over steps 2.. (time/* in seconds)")
    for k, d in details:
        print(f"k={k}: " + ", ".join(f"{key} {v:.4g}" for key, v in d.items()))


def learning_table(extra: list[str]) -> None:
    from osworld_jax import config
    from osworld_jax.rl import train
    from tests.rl import learnable  # registers the learnable suite's sandbox backend
    from tests.rl.test_slow import LEARN

    variants = {
        "k=0": [],
        "k=1": ["RLConfig.max_staleness = 1"],
        "4 minibatches": ["TrainerConfig.num_minibatches = 4", "RLConfig.num_prompts = 4"],
    }
    curves: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="rl_learning-") as tmp:
        tasks = learnable.write_tasks(Path(tmp) / "tasks")
        for name, params in variants.items():
            run_dir = Path(tmp) / name.replace(" ", "_").replace("=", "")
            keys = {p.split("=")[0].strip() for p in params}
            base = [p for p in LEARN if p.split("=")[0].strip() not in keys]
            task_set = f"DataConfig.task_set = '{tasks}'"
            exp = config.load_experiment(["default.gin"], [*base, *params, *extra, task_set])
            config.write_operative_config(run_dir, exp)
            t0 = time.perf_counter()
            curves[name] = train(exp, run_dir).history
            print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    steps = max(len(c) for c in curves.values())
    print("| step | " + " | ".join(f"{n}: reward / gap / rejected" for n in curves) + " |")
    print("|---" * (len(curves) + 1) + "|")
    for i in range(steps):
        cells = []
        for recs in curves.values():
            r = recs[i] if i < len(recs) else {}
            cells.append(
                f"{r.get('reward/mean', float('nan')):.3f} / "
                f"{r.get('logprob/train_rollout_abs_diff', float('nan')):.1e} / "
                f"{r.get('gate/rejected_fraction', float('nan')):.2f}"
            )
        print(f"| {i + 1} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--staleness", default="0,1")
    parser.add_argument("--learning", action="store_true")
    parser.add_argument("--gin_param", action="append", default=[])
    parser.add_argument(
        "--gin_file", action="append", default=[], help="recipes for train.py (default.gin)"
    )
    parser.add_argument("--keep", default=None, help="keep the run dirs and logs under DIR")
    parser.add_argument(
        "--tabulate", action="store_true", help="only the tables of the runs under --keep"
    )
    args = parser.parse_args()
    if args.learning:
        learning_table(args.gin_param)
    else:
        staleness = [int(k) for k in args.staleness.split(",")]
        loop_table(args.steps, staleness, args.gin_param, args.gin_file, args.keep, args.tabulate)


if __name__ == "__main__":
    main()
