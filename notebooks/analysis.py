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
# rates, the per-stage time breakdown, and for one owner the screenshots the model saw next to
# the actions it took (`episodes/`, written for the first `RLConfig.episode_owners` owners).
#
# Run it with `python scripts/analyze.py RUN_DIR` (writes `RUN_DIR/analysis.ipynb`), or from
# any directory with `jupyter execute notebooks/analysis.ipynb` or in a notebook, with
# `OSWORLD_RUN_DIR` set. Without it the notebook reads `runs/latest` (which `scripts/train.py`
# points at its newest run), else the newest run under `runs/`, wherever it is started
# (`analysis.find_run_dir`). The loaders live in `osworld_jax.rl.analysis`.

# %%
import json
import textwrap

import matplotlib.pyplot as plt
import numpy as np

from osworld_jax.env.actions import parse_action
from osworld_jax.rl import analysis

RUN_DIR = analysis.find_run_dir()
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

# %% [markdown]
# ## Asynchronous RL: staleness and the timeline
#
# With `RLConfig.max_staleness = k >= 1` a step's rollout starts up to k steps before the step
# trains. Left: how stale the trained tokens were (per step, the tokens `d` optimizer steps
# older than the weights being trained; "beyond" were masked or refused). Right: when each
# step's rollout (from its start to its result) and train ran; overlapping bars are the
# overlap the asynchronous loop buys.

# %%
fig, axes = plt.subplots(1, 2, figsize=(13, 3.5))
hist_keys = sorted(k for k in metrics if k.startswith("staleness/tokens_"))
bottom = np.zeros(len(steps))
for key in hist_keys:
    counts = np.nan_to_num(metrics[key])
    axes[0].bar(steps, counts, bottom=bottom, label=key.removeprefix("staleness/tokens_"))
    bottom = bottom + counts
axes[0].set_xlabel("step")
axes[0].set_ylabel("trainable tokens")
axes[0].set_title("staleness (steps behind)")
if hist_keys:
    axes[0].legend(fontsize="small")
for row, (name, color) in enumerate([("rollout", "tab:blue"), ("train", "tab:orange")]):
    start, end = metrics.get(f"timeline/{name}_start"), metrics.get(f"timeline/{name}_end")
    if start is None or end is None:
        continue
    for s, a, b in zip(steps, start, end, strict=True):
        if np.isfinite(a) and np.isfinite(b):
            axes[1].barh(s + 0.2 * row, b - a, left=a, height=0.35, color=color)
    axes[1].barh([], [], color=color, label=name)
axes[1].set_xlabel("seconds since the loop started")
axes[1].set_ylabel("step")
axes[1].legend(fontsize="small")
plt.show()

# %% [markdown]
# ## What one owner saw and did
#
# The last recorded episode: at each model call, the screenshots its prompt showed (oldest to
# newest; the prompt keeps the last `AgentConfig.max_screenshots`, older ones became a text
# placeholder) next to the reply and the action the environment parsed from it.

# %%
episodes = analysis.load_episodes(RUN_DIR)
experiment = json.loads((RUN_DIR / "experiment.json").read_text())
space = experiment["env"]["action_space"]
print(f"{len(episodes)} recorded episodes")
if episodes:
    ep = episodes[-1]
    calls = ep["calls"]
    width = max([len(c["images"]) for c in calls] + [0]) + 1
    fig, axes = plt.subplots(
        len(calls), width, figsize=(4 * width, 2.6 * len(calls)), squeeze=False
    )
    fig.suptitle(f"step {ep['step']}, owner {ep['owner']}, {ep['task_id']}: reward {ep['reward']}")
    for row, call in zip(axes, calls, strict=True):
        for ax in row:
            ax.axis("off")
        for ax, name in zip(row, call["images"], strict=False):
            ax.imshow(analysis.episode_image(RUN_DIR, name))
        row[0].set_title(f"call {call['call']}: {len(call['images'])} screenshot(s)", fontsize=9)
        action = parse_action(call["reply"], space)
        text = f"action: {action.kind.value}\n\nreply ({call['finish_reason']}):\n"
        text += textwrap.fill(repr(call["reply"])[:400], 48)
        row[-1].text(0, 1, text, va="top", family="monospace", fontsize=7)
    plt.tight_layout()
    plt.show()
