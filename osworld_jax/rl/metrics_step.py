"""The records of one RL step: its scalar metrics, rollouts.jsonl lines and episode files.

Pure functions of what the step produced (`StepRollouts`, the `GroupSelection`, advantages,
batches, the train step's metrics); `osworld_jax.rl.run` writes them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from osworld_jax.agent import GroupSelection
from osworld_jax.batch import Batch
from osworld_jax.rl.rollouts import RawRollouts, StepRollouts


def mean_update_metrics(updates: Sequence[dict[str, float]]) -> dict[str, float]:
    """One step's train metrics over its optimizer updates (the update's own for one).

    The mean of each metric, except ``*_max`` metrics (e.g. ``is_weight_max``): their maximum.
    """
    if len(updates) == 1:
        return dict(updates[0])
    keys = [k for k in updates[0] if all(k in u for u in updates)]
    reduce = {k: np.max if k.endswith("_max") else np.mean for k in keys}
    out = {k: float(reduce[k]([float(u[k]) for u in updates])) for k in keys}
    out["updates"] = float(len(updates))
    return out


def timeline_metrics(launched: Any, timer: Any, producer: Any) -> dict[str, float]:
    """When the step's rollout and train ran (seconds since the loop started) and how far ahead.

    ``timeline/rollout_start`` / ``_end`` (from the rollout's launch to its result),
    ``timeline/train_start`` / ``_end``; ``rollout/wall`` (the rollout's own duration, which
    may overlap earlier steps' training: ``time/rollout`` is only the wait for it) and
    ``rollout/in_flight`` (later steps' rollouts running when this one trained).
    """
    t0, out = producer.started_at, {}
    if launched.launched_at is not None and launched.finished_at is not None:
        out["timeline/rollout_start"] = launched.launched_at - t0
        out["timeline/rollout_end"] = launched.finished_at - t0
        out["rollout/wall"] = launched.finished_at - launched.launched_at
    if "train" in timer.spans:
        start, end = timer.spans["train"]
        out["timeline/train_start"], out["timeline/train_end"] = start - t0, end - t0
    out["rollout/in_flight"] = float(producer.in_flight)
    out.update(device_memory_metrics())
    out.update(compile_metrics())
    return out


class CompileCounts:
    """This process's XLA programs, counted from ``jax.monitoring`` events (thread-safe).

    Every program jit builds is compiled or loaded from the persistent compilation cache
    (``/jax/core/compile/backend_compile_duration``, both), a load is also a cache hit; tracing
    and lowering come before either (no cache saves them). A colocated server's programs are
    this process's too. `take` gives the counts since the previous `take`.
    """

    EVENTS = {
        "/jax/core/compile/backend_compile_duration": "seconds",
        "/jax/core/compile/jaxpr_trace_duration": "trace_lower_seconds",
        "/jax/core/compile/jaxpr_to_mlir_module_duration": "trace_lower_seconds",
    }

    def __init__(self) -> None:
        import threading

        import jax

        self._lock = threading.Lock()
        self._totals: dict[str, float] = {}
        self._taken: dict[str, float] = {}
        jax.monitoring.register_event_duration_secs_listener(self._duration)
        jax.monitoring.register_event_listener(self._event)

    def _add(self, key: str, value: float) -> None:
        with self._lock:
            self._totals[key] = self._totals.get(key, 0.0) + value

    def _duration(self, event: str, duration_secs: float, **_: str | int) -> None:
        key = self.EVENTS.get(event)
        if key is not None:
            self._add(key, duration_secs)
        if key == "seconds":
            self._add("programs", 1.0)

    def _event(self, event: str, **_: str | int) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            self._add("cache_hits", 1.0)

    def take(self) -> dict[str, float]:
        """``compile/programs`` (compiled or loaded), ``compile/cache_hits``, ``compile/seconds``
        (compiling and loading) and ``compile/trace_lower_seconds`` since the last take."""  # noqa: D205, D209
        with self._lock:
            totals = dict(self._totals)
            since = {k: totals.get(k, 0.0) - self._taken.get(k, 0.0) for k in _COMPILE_KEYS}
            self._taken = totals
        return {f"compile/{k}": v for k, v in since.items()}


_COMPILE_KEYS = ("programs", "cache_hits", "seconds", "trace_lower_seconds")
_COMPILES: list[CompileCounts] = []  # one per process: jax's listeners cannot all be removed


def start_compile_counts() -> None:
    """Counts this process's programs from now on (`compile_metrics` gives them per step)."""
    if not _COMPILES:
        _COMPILES.append(CompileCounts())
    _COMPILES[0].take()


def compile_metrics() -> dict[str, float]:
    """The programs since the last call (`CompileCounts.take`); {} before `start_compile_counts`."""
    return _COMPILES[0].take() if _COMPILES else {}


def device_memory_metrics() -> dict[str, float]:
    """``memory/peak_gib`` and ``memory/in_use_gib`` of this process's first device (the
    allocator's own figures: the measured side of the memory plan); none on the CPU."""  # noqa: D205, D209
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" not in stats:
        return {}
    return {
        "memory/peak_gib": stats["peak_bytes_in_use"] / 2**30,
        "memory/in_use_gib": stats.get("bytes_in_use", 0) / 2**30,
    }


def step_metrics(
    rollouts: StepRollouts,
    selection: GroupSelection,
    adv: np.ndarray,
    batches: Batch | Sequence[Batch],
    train_metrics: dict[str, float],
    success_reward: float,
) -> dict[str, float]:
    """The scalars logged for one step (rewards, gate, KL, R3 agreement, tokens, failures).

    ``batches``: the step's device batch, or its minibatches (token and row counts are summed,
    ``batch/length`` is the longest). ``batch/rows`` counts every row of the padded batch;
    ``rows/valid`` only rows that carry an owner's tokens with weight (not padding rows, not a
    failed owner's masked row) and ``tokens/valid`` their real tokens. ``actions/parse_errors``:
    the step's replies that did not parse (``UNPARSED`` turns); ``actions/parse_error_rate``
    per turn. ``is_weight/mean`` and ``is_weight/max``: the applied (gated, truncated) per-token
    importance weights over loss tokens.
    """
    parts = [batches] if isinstance(batches, Batch) else list(batches)
    healthy = [o for o in rollouts.owners if not o.failed]
    rewards = np.array([o.reward for o in healthy], np.float64)
    seg_counts = [len(o.segments) for o in healthy]
    real_tokens = sum(float((np.asarray(b.segment_ids) > 0).sum()) for b in parts)
    grids = [np.asarray(b.image_grid_thw) for b in parts if b.image_grid_thw is not None]
    valid_rows = [
        (np.asarray(b.row_weight) > 0) & (np.asarray(b.segment_ids) > 0).any(axis=-1) for b in parts
    ]
    valid_tokens = sum(
        float(((np.asarray(b.segment_ids) > 0) & rows[:, None]).sum())
        for b, rows in zip(parts, valid_rows, strict=True)
    )
    unparsed, turns = sum(rollouts.parse_errors), sum(rollouts.turns)
    m: dict[str, float] = {
        "reward/mean": float(rewards.mean()) if rewards.size else float("nan"),
        "reward/std": float(rewards.std()) if rewards.size else float("nan"),
        "reward/pass_rate": float((rewards >= success_reward).mean())
        if rewards.size
        else float("nan"),
        "owners/total": len(rollouts.owners),
        "owners/failed": len(rollouts.owners) - len(healthy),
        "owners/trained": len(selection.owners),
        "groups/dropped": len(selection.dropped_group_ids),
        "segments/per_owner": float(np.mean(seg_counts)) if seg_counts else 0.0,
        "turns/mean": float(np.mean(rollouts.turns)),
        "tokens/trainable": float(sum(np.asarray(b.loss_mask).sum() for b in parts)),
        "tokens/total": real_tokens,
        "batch/rows": float(sum(b.tokens.shape[0] for b in parts)),
        "rows/valid": float(sum(int(r.sum()) for r in valid_rows)),
        "tokens/valid": valid_tokens,
        "actions/parse_errors": float(unparsed),
        "actions/parse_error_rate": unparsed / turns if turns else 0.0,
        "batch/length": float(max(b.tokens.shape[1] for b in parts)),
        "advantage/mean": float(adv.mean()) if adv.size else 0.0,
        "advantage/abs_mean": float(np.abs(adv).mean()) if adv.size else 0.0,
    }
    m["batch/images"] = float(sum((g[..., 0] > 0).sum() for g in grids))
    if grids:
        m["batch/image_patches"] = float(
            sum(np.prod(g.astype(np.int64), axis=-1).sum() for g in grids)
        )
    renames = {
        "gate_rejected_fraction": "gate/rejected_fraction",
        "binary_kl_mean": "gate/binary_kl_mean",
        "logprob_abs_diff": "logprob/train_rollout_abs_diff",
        "route_agreement": "r3/route_agreement",
        "is_weight_mean": "is_weight/mean",
        "is_weight_max": "is_weight/max",
    }
    for k, v in train_metrics.items():
        if k != "step":
            m[renames.get(k, f"train/{k}")] = float(v)
    return m


def episode_files(
    step: int, raw: RawRollouts, rollouts: StepRollouts, owners: int
) -> dict[str, bytes]:
    """The episodes of the step's first ``owners`` owners, as files relative to ``episodes/``.

    ``step_{step:08d}_owner_{o}.json`` holds the task, reward and, per model call, the
    screenshots its prompt showed (``images/<sha256>.png``, each PNG written once), the reply
    text, the finish reason and ``parse_error`` (why the reply did not parse: an ``UNPARSED``
    turn that ran nothing; null when it parsed); ``parse_errors`` counts them. Declared
    compactions are listed with the call they precede.
    """
    files: dict[str, bytes] = {}
    for o in rollouts.owners[:owners]:
        agent = raw.agents.get(o.owner_id)
        if agent is None:
            continue
        calls = []
        result = getattr(agent, "result", None)
        errors = tuple(getattr(result, "parse_errors", ()))
        if len(errors) != len(agent.history.calls):  # one call per turn; else not aligned
            errors = (None,) * len(agent.history.calls)
        for i, call in enumerate(agent.history.calls):
            names = []
            for png in call.images:
                name = f"images/{hashlib.sha256(png).hexdigest()[:20]}.png"
                files.setdefault(name, png)
                names.append(name)
            calls.append(
                {
                    "call": i,
                    "images": names,
                    "reply": call.text,
                    "finish_reason": call.finish_reason.get("type"),
                    "prompt_tokens": int(call.prompt_ids.size),
                    "output_tokens": int(call.output_ids.size),
                    "parse_error": errors[i],
                }
            )
        record = {
            "step": step,
            "owner": o.owner_id,
            "task_id": rollouts.tasks[o.group_id].task_id,
            "reward": o.reward,
            "failed": o.failed,
            "error": o.error,
            "parse_errors": sum(e is not None for e in getattr(result, "parse_errors", ())),
            "calls": calls,
            "compactions": [dataclasses.asdict(c) for c in agent.history.compactions],
        }
        name = f"step_{step:08d}_owner_{o.owner_id}.json"
        files[name] = json.dumps(record, indent=1).encode()
    return files


def owner_records(
    step: int, rollouts: StepRollouts, selection: GroupSelection, adv: np.ndarray
) -> list[dict[str, Any]]:
    """One ``rollouts.jsonl`` record per owner of the step (reward, advantage, failure, ...)."""
    adv_of = {o.owner_id: float(a) for o, a in zip(selection.owners, adv, strict=True)}
    n = len(rollouts.owners) // max(len(rollouts.tasks), 1)
    out = []
    unparsed = rollouts.parse_errors or (0,) * len(rollouts.owners)
    for o, turns, parse_errors in zip(rollouts.owners, rollouts.turns, unparsed, strict=True):
        ref = rollouts.tasks[o.owner_id // n]
        out.append(
            {
                "step": step,
                "task_id": ref.task_id,
                "group_id": ref.group_id,
                "owner": o.owner_id,
                "reward": o.reward,
                "failed": o.failed,
                "error": o.error,
                "advantage": adv_of.get(o.owner_id),
                "turns": turns,
                "parse_errors": parse_errors,
                "segments": len(o.segments),
                "trainable_tokens": o.num_trainable,
            }
        )
    return out
