"""Loaders for analysing a run directory (used by ``notebooks/analysis.py``).

A run directory holds ``metrics.jsonl`` (one record per step, see `osworld_jax.rl.metrics`) and
``rollouts.jsonl`` (one record per logical owner per step: task, group, reward, failure,
advantage, turns, segments, tokens). These helpers turn them into numpy columns; plotting stays
in the notebook.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from osworld_jax.rl.metrics import STAGES, read_metrics

ROLLOUTS_FILE = "rollouts.jsonl"
EPISODES_DIR = "episodes"


RUN_DIR_ENV = "OSWORLD_RUN_DIR"
_CLONE = Path(__file__).resolve().parents[2]  # where scripts/train.py is run: runs/ beside it


def _is_run(path: Path) -> bool:
    return (path / "experiment.json").is_file() or (path / "metrics.jsonl").is_file()


def find_run_dir(environ: Mapping[str, str] | None = None, cwd: Path | None = None) -> Path:
    """The run a notebook reads, from any working directory.

    ``$OSWORLD_RUN_DIR`` if set (relative: to the working directory or one above it, else to
    the clone's root); else ``runs/latest`` (``scripts/train.py`` points it at its newest run),
    else the newest run under ``runs/``, looking for ``runs/`` in the working directory, then
    each directory above it, then the clone's root (``notebooks/`` is one level down).

    Raises:
      FileNotFoundError: no run directory (naming where it looked).
    """
    environ = os.environ if environ is None else environ
    cwd = Path.cwd() if cwd is None else cwd
    roots = list(dict.fromkeys([cwd, *cwd.parents, _CLONE]))
    given = environ.get(RUN_DIR_ENV)
    if given:
        path = Path(given).expanduser()
        for base in [Path("/")] if path.is_absolute() else roots:
            if _is_run(base / path):
                return (base / path).resolve()
        raise FileNotFoundError(f"{RUN_DIR_ENV}={given}: not a run directory (no experiment.json)")
    for root in roots:
        runs = root / "runs"
        if _is_run(runs / "latest"):
            return runs / "latest"
        found = sorted((p for p in runs.glob("*") if _is_run(p)), key=lambda p: p.stat().st_mtime)
        if found:
            return found[-1]
    raise FileNotFoundError(
        f"no run under runs/ in {cwd}, its parents or {_CLONE}: train one (scripts/train.py), "
        f"or set {RUN_DIR_ENV}"
    )


def metrics_dir(run_dir: str | Path) -> Path:
    """The directory holding ``metrics.jsonl`` (the run dir or its ``metrics_dir``)."""
    run_dir = Path(run_dir)
    resolved = run_dir / "experiment.json"
    if resolved.is_file():
        sub = json.loads(resolved.read_text()).get("rl", {}).get("metrics_dir", ".")
        return (run_dir / sub).resolve()
    return run_dir


def load_metrics(run_dir: str | Path) -> dict[str, np.ndarray]:
    """Step metrics as float columns keyed by metric name (NaN where a step lacks one)."""
    records = read_metrics(metrics_dir(run_dir))
    keys = sorted({k for r in records for k in r if _is_number(r[k])})
    return {
        k: np.array([float(r[k]) if _is_number(r.get(k)) else np.nan for r in records])
        for k in keys
    }


def load_rollouts(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every per-owner record of ``rollouts.jsonl`` (empty if the run wrote none)."""
    p = metrics_dir(run_dir) / ROLLOUTS_FILE
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def load_episodes(run_dir: str | Path) -> list[dict[str, Any]]:
    """The recorded episodes (``episodes/step_*_owner_*.json``), ordered by step and owner.

    Each has ``step``, ``owner``, ``task_id``, ``reward``, ``failed``, ``compactions`` and
    ``calls``: per model call the screenshots its prompt showed (paths relative to the episodes
    directory, see `episode_image`), the reply text and the finish reason.
    """
    root = metrics_dir(run_dir) / EPISODES_DIR
    records = [json.loads(p.read_text()) for p in root.glob("step_*_owner_*.json")]
    return sorted(records, key=lambda r: (r["step"], r["owner"]))


def episode_image(run_dir: str | Path, name: str) -> np.ndarray:
    """A screenshot of an episode as uint8 [H, W, 3] (``name`` as listed in its call)."""
    from PIL import Image

    with Image.open(metrics_dir(run_dir) / EPISODES_DIR / name) as im:
        return np.asarray(im.convert("RGB"))


def per_task_pass_rate(
    rollouts: list[dict[str, Any]], *, success: float = 1.0
) -> dict[str, tuple[int, int]]:
    """``task_id -> (passes, healthy attempts)``; a pass is a reward >= ``success``."""
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for r in rollouts:
        if r.get("failed") or r.get("reward") is None:
            continue
        out[r["task_id"]][0] += int(r["reward"] >= success)
        out[r["task_id"]][1] += 1
    return {k: (v[0], v[1]) for k, v in sorted(out.items())}


def advantages_by_step(rollouts: list[dict[str, Any]]) -> dict[int, np.ndarray]:
    """``step -> f32[owners]`` advantages of the healthy owners trained at that step."""
    out: dict[int, list[float]] = defaultdict(list)
    for r in rollouts:
        if not r.get("failed") and r.get("advantage") is not None:
            out[int(r["step"])].append(float(r["advantage"]))
    return {s: np.asarray(v, np.float32) for s, v in sorted(out.items())}


def stage_times(metrics: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``stage -> seconds per step`` for the stages a run timed (`STAGES` order)."""
    return {s: metrics[f"time/{s}"] for s in STAGES if f"time/{s}" in metrics}


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)
