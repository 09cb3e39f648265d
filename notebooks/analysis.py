# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Run analysis
#
# Reads one run directory written by `scripts/train.py` (`metrics.jsonl`, `rollouts.jsonl`)
# and plots: reward and pass rate over steps, the FlashREINFORCE gate (rejected fraction, mean
# binary KL, |train - rollout| logprob, R3 route agreement), advantage histograms, per-task pass
# rates and the per-stage time breakdown. Set `OSWORLD_RUN_DIR` (or edit `RUN_DIR`) to choose
# the run; the loaders live in `osworld_jax.rl.analysis`.

# %%
import os
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from osworld_jax.rl import analysis

RUN_DIR = Path(os.environ.get("OSWORLD_RUN_DIR", "runs/latest"))
metrics = analysis.load_metrics(RUN_DIR)
rollouts = analysis.load_rollouts(RUN_DIR)
steps = metrics["step"]
print(f"{RUN_DIR}: {len(steps)} steps, {len(rollouts)} owner records")

# %% [markdown]
# ## Reward and pass rate

# %%
fig, ax = plt.subplots(figsize=(7, 3.5))
ax.plot(steps, metrics["reward/mean"], marker="o", label="reward mean")
ax.fill_between(
    steps,
    metrics["reward/mean"] - metrics["reward/std"],
    metrics["reward/mean"] + metrics["reward/std"],
    alpha=0.2,
)
ax.plot(steps, metrics["reward/pass_rate"], marker="s", label="pass rate")
ax.set_xlabel("step")
ax.set_ylim(-0.05, 1.05)
ax.legend()
plt.show()

# %% [markdown]
# ## Off-policy gate, KL and router replay

# %%
fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
gate_keys = ["gate/rejected_fraction", "gate/binary_kl_mean", "logprob/train_rollout_abs_diff"]
for ax, key in zip(axes[:2], gate_keys[:2], strict=True):
    ax.plot(steps, metrics.get(key, np.full_like(steps, np.nan)), marker="o")
    ax.set_title(key)
    ax.set_xlabel("step")
axes[2].plot(
    steps,
    metrics.get(gate_keys[2], np.full_like(steps, np.nan)),
    marker="o",
    label="|train - rollout| logprob",
)
axes[2].plot(
    steps,
    metrics.get("r3/route_agreement", np.full_like(steps, np.nan)),
    marker="s",
    label="R3 route agreement",
)
axes[2].set_xlabel("step")
axes[2].legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Advantage histograms (one advantage per logical owner)

# %%
by_step = analysis.advantages_by_step(rollouts)
fig, ax = plt.subplots(figsize=(7, 3.5))
shown = list(by_step.items())[-6:]
for step, adv in shown:
    ax.hist(adv, bins=21, alpha=0.4, label=f"step {step}")
ax.set_xlabel("advantage")
if shown:
    ax.legend()
plt.show()

# %% [markdown]
# ## Per-task pass rates

# %%
per_task = analysis.per_task_pass_rate(rollouts)
names = list(per_task)
rates = [p / n if n else np.nan for p, n in per_task.values()]
fig, ax = plt.subplots(figsize=(7, 0.3 * len(names) + 1.5))
ax.barh(names, rates)
ax.set_xlim(0, 1)
ax.set_xlabel("pass rate (all steps)")
plt.show()

# %% [markdown]
# ## Time per stage

# %%
stages = analysis.stage_times(metrics)
fig, ax = plt.subplots(figsize=(7, 3.5))
bottom = np.zeros_like(steps)
for name, seconds in stages.items():
    seconds = np.nan_to_num(seconds)
    ax.bar(steps, seconds, bottom=bottom, label=name)
    bottom = bottom + seconds
ax.set_xlabel("step")
ax.set_ylabel("seconds")
ax.legend(fontsize="small")
plt.show()
