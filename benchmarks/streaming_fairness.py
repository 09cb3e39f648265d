"""Streaming train and slow tasks: the share of drawn groups each step trains, per duration.

Usage:
  .venv/bin/python benchmarks/streaming_fairness.py [--steps 300] [--tasks 68] [--seed 0]

A fake environment (no model, no sandbox): each task of a pool has a duration drawn once from a
heavy-tailed distribution (Pareto, shape ``--alpha``, scale 2 ms, capped at 200 ms), and each of
its episodes takes that duration times a small lognormal jitter (real ``asyncio.sleep``). Every
step draws ``B + e`` tasks uniformly from the pool and runs them through the RL loop's own
`osworld_jax.rl.rollouts.rollout_step` (streaming train: it returns once ``m`` groups finished,
trains the first B of them in launch order and cancels the rest). Tasks are split into quartiles
of their duration; the script prints, per quartile, the drawn groups, the trained ones and the
share trained, for two configurations:

- ``before``: the former B17/N16 recipe, B = 17 + e = 2 over-provisioned groups, trained once
  m = 17 have finished (the 2 slowest of each draw are thrown away);
- ``after``: the recipe now, B = 17, no over-provisioning (e = 0, m = B: every drawn group is
  trained).

The target (issue 29 item 3): no quartile's share below 90% of any other's.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

from osworld_jax.agent import AgentConfig
from osworld_jax.data import TaskRef
from osworld_jax.env import AgentEnvConfig, OwnerResult
from osworld_jax.rl.config import RLConfig
from osworld_jax.rl.rollouts import rollout_step
from osworld_jax.rollout import SamplingParams


class TimedEnv:
    """An agent_env whose group of task ``t`` takes ``durations[t]`` seconds (times a jitter)."""

    config = AgentEnvConfig()

    def __init__(self, durations: dict[str, float], rng: np.random.Generator) -> None:
        self.durations, self.rng = durations, rng

    async def run_group(self, task: str, owners: list[int], make_agent: object) -> list:
        del make_agent  # no model: the owners' results are all there is
        await asyncio.sleep(self.durations[task] * float(self.rng.lognormal(0.0, 0.1)))
        return [
            OwnerResult(owner_index=o, reward=0.0, failed=False, error=None, turns=1, actions=())
            for o in owners
        ]


def measure(rl: RLConfig, durations: dict[str, float], steps: int, seed: int) -> dict:
    """Runs ``steps`` streaming rollouts; per task: how often drawn and how often trained."""
    rng = np.random.default_rng(seed)
    env = TimedEnv(durations, np.random.default_rng(seed + 1))
    ids = sorted(durations)
    drawn = dict.fromkeys(ids, 0)
    trained = dict.fromkeys(ids, 0)
    walls = []

    async def main() -> None:
        for step in range(steps):
            tasks = [ids[i] for i in rng.integers(0, len(ids), rl.rollout_groups)]
            refs = [TaskRef(task_id=t, path=t, group_id=t) for t in tasks]
            t0 = time.perf_counter()
            raw = await rollout_step(
                env,
                None,
                None,
                AgentConfig(),
                SamplingParams(max_new_tokens=1),
                refs,
                rl=rl,
                step=step,
                load_task=lambda path: path,
            )
            walls.append(time.perf_counter() - t0)
            for t in tasks:
                drawn[t] += 1
            for ref in raw.tasks:
                trained[ref.task_id] += 1

    asyncio.run(main())
    return {"drawn": drawn, "trained": trained, "wall": float(np.mean(walls))}


def quartile_table(name: str, rl: RLConfig, result: dict, durations: dict[str, float]) -> float:
    """Prints the per-quartile shares; returns min share / max share."""
    ids = sorted(durations, key=durations.get)
    quarters = np.array_split(np.array(ids), 4)
    shares = []
    print(
        f"\n{name}: B={rl.num_prompts} e={rl.extra_rollout_groups} m={rl.min_groups} "
        f"(mean rollout wall per step {result['wall'] * 1e3:.1f} ms)"
    )
    print("| duration quartile | task durations (ms) | drawn | trained | share trained |")
    print("|---|---|---|---|---|")
    for q, part in enumerate(quarters, 1):
        d = sum(result["drawn"][t] for t in part)
        tr = sum(result["trained"][t] for t in part)
        shares.append(tr / d if d else float("nan"))
        lo, hi = durations[part[0]] * 1e3, durations[part[-1]] * 1e3
        print(f"| Q{q} | {lo:.1f}-{hi:.1f} | {d} | {tr} | {shares[-1]:.3f} |")
    ratio = min(shares) / max(shares)
    print(f"lowest share / highest share = {ratio:.3f} (target >= 0.90)")
    return ratio


def main() -> None:
    """Parses flags, runs both configurations, prints the tables."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--tasks", type=int, default=68)
    ap.add_argument("--alpha", type=float, default=1.2, help="Pareto shape (heavier tail: less)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    base = np.minimum(0.002 * (1.0 + rng.pareto(args.alpha, args.tasks)), 0.2)
    durations = {f"task{i:03d}": float(d) for i, d in enumerate(base)}
    configs = {
        "before": RLConfig(
            num_prompts=17, num_owners=1, extra_rollout_groups=2, min_groups_for_streaming_train=17
        ),
        "after": RLConfig(num_prompts=17, num_owners=1),
    }
    for name, rl in configs.items():
        quartile_table(name, rl, measure(rl, durations, args.steps, args.seed), durations)


if __name__ == "__main__":
    main()
