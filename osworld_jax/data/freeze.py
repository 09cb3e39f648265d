"""The offline DAPO-band freezer: calibration pass counts -> an immutable training dataset.

``scripts/evaluate.py`` runs each task ``reps`` times and writes one calibration line per task
(``{"task_id", "reps", "passes"}``). `freeze_band` admits the tasks whose pass count lies strictly
inside the band (``osworld_jax.algorithms.dapo_band_keep``: ``low < passes < high``, default
``0 < k < reps``: neither always failed nor always solved) and publishes a dataset directory:

    tasks/<path relative to task_dir>   admitted task JSON (+ its asset directory, if any)
    train.jsonl                         num_repeats x admitted, group id rlvr-band:{task}:repeat:{k}
    SNAPSHOT.json                       inputs, filter, counts, source sha256s
    SHA256SUMS                          sha256 of every file above (``sha256sum -c`` format)

The directory is written under a temporary name and published by one atomic ``rename``; the
freeze refuses (and publishes nothing) when an input file changes while it runs, or when the
output already exists. Published files are read-only.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import stat
import uuid
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from osworld_jax.algorithms import dapo_band_keep
from osworld_jax.data.errors import FreezeError
from osworld_jax.data.tasksets import TaskRef, load_task_refs, sha256_file

SNAPSHOT_FORMAT = 1


def read_calibration(path: str | Path) -> list[dict]:
    """Parses a calibration JSONL (``task_id``, ``reps``, ``passes`` per line, unique ids)."""
    rows, seen = [], set()
    for lineno, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            row: dict[str, Any] = {
                "task_id": str(rec["task_id"]),
                "reps": int(rec["reps"]),
                "passes": int(rec["passes"]),
            }
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise FreezeError(f"{path}:{lineno}: expected {{task_id, reps, passes}}: {e}") from None
        if not 0 <= row["passes"] <= row["reps"]:
            raise FreezeError(
                f"{path}:{lineno}: passes {row['passes']} not in [0, reps={row['reps']}]"
            )
        if row["task_id"] in seen:
            raise FreezeError(f"{path}:{lineno}: duplicate task_id {row['task_id']!r}")
        seen.add(row["task_id"])
        rows.append(row)
    if not rows:
        raise FreezeError(f"{path}: no calibration lines")
    return rows


def task_asset_files(task_path: Path) -> list[Path]:
    """The local asset files of a task: what its JSON references by relative path.

    Bundled/offline tasks reference their files relative to the task JSON (e.g. a ``download``
    step's ``"url": "assets/<id>/data.txt"``); every string value of the task that names an
    existing file below the task's directory counts, plus everything under a sibling directory
    named like the task (``<id>.json`` + ``<id>/``).
    """
    base = task_path.parent.resolve()
    found: set[Path] = set()

    def walk(obj: Any) -> None:
        if isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, list):
            for v in obj:
                walk(v)
        elif isinstance(obj, str) and obj and "://" not in obj and not obj.startswith("/"):
            try:
                p = (base / obj).resolve()
            except (OSError, ValueError):
                return
            if p.is_file() and p.is_relative_to(base) and p != task_path.resolve():
                found.add(p)

    walk(json.loads(task_path.read_text()))
    sibling = task_path.with_suffix("")
    if sibling.is_dir():
        found.update(p.resolve() for p in sibling.rglob("*") if p.is_file())
    return sorted(found)


def _hash_sources(paths: list[Path]) -> dict[str, str]:
    return {str(p): sha256_file(p) for p in paths}


def _copy_file(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)


def freeze_band(
    calibration_jsonl: str | Path,
    task_dir: str | Path,
    out_dir: str | Path,
    *,
    reps: int | None = None,
    low: int = 0,
    high: int | None = None,
    num_repeats: int = 1,
) -> Path:
    """Freezes the DAPO band of ``task_dir`` into the immutable dataset ``out_dir``.

    Args:
      calibration_jsonl: one ``{"task_id", "reps", "passes"}`` line per task.
      task_dir: the task set the calibration ran on (any layout `load_task_refs` reads).
      out_dir: the dataset directory to publish; must not exist.
      reps: when given, every calibration line must report exactly this many attempts.
      low: admit iff ``passes > low``.
      high: admit iff ``passes < high`` (default: the line's ``reps``).
      num_repeats: how many times each admitted task appears in ``train.jsonl`` (each repeat is
        its own prompt group ``rlvr-band:{task}:repeat:{k}``).

    Returns:
      ``out_dir`` (published).

    Raises:
      FreezeError: bad calibration, a task missing from ``task_dir``, an empty band, an input
        that changed during the freeze, or an existing ``out_dir``.
    """
    calibration_jsonl, task_dir, out_dir = Path(calibration_jsonl), Path(task_dir), Path(out_dir)
    if num_repeats < 1:
        raise FreezeError(f"num_repeats: {num_repeats} < 1")
    if out_dir.exists():
        raise FreezeError(f"{out_dir} already exists; a frozen dataset is never overwritten")
    calib_sha = sha256_file(calibration_jsonl)
    rows = read_calibration(calibration_jsonl)
    if reps is not None:
        bad = [r["task_id"] for r in rows if r["reps"] != reps]
        if bad:
            raise FreezeError(f"{calibration_jsonl}: tasks {bad[:5]} do not have reps={reps}")
    by_id: dict[str, TaskRef] = {r.task_id: r for r in load_task_refs(task_dir)}
    missing = [r["task_id"] for r in rows if r["task_id"] not in by_id]
    if missing:
        raise FreezeError(f"{calibration_jsonl}: tasks {missing[:5]} are not in {task_dir}")

    passes = np.array([r["passes"] for r in rows], np.int32)
    reps_arr = np.array([r["reps"] for r in rows], np.int32)
    keep = np.asarray(
        dapo_band_keep(jnp.asarray(passes), jnp.asarray(reps_arr), low=low, high=high)
    )
    admitted = sorted(r["task_id"] for r, k in zip(rows, keep, strict=True) if k)
    if not admitted:
        raise FreezeError(
            f"{calibration_jsonl}: no task inside the band ({low} < passes < "
            f"{'reps' if high is None else high}); nothing to freeze"
        )

    task_root = task_dir.resolve()
    plan: list[tuple[Path, str]] = []  # (source, destination relative to out_dir)
    task_rel: dict[str, str] = {}
    for tid in admitted:
        src = Path(by_id[tid].path)
        dst = (Path("tasks") / src.relative_to(task_root)).as_posix()
        task_rel[tid] = dst
        plan.append((src, dst))
        for asset in task_asset_files(src):
            plan.append((asset, (Path("tasks") / asset.relative_to(task_root)).as_posix()))
    sources = [calibration_jsonl.resolve()] + [s for s, _ in plan]
    before = _hash_sources(sources)
    if before[str(calibration_jsonl.resolve())] != calib_sha:
        raise FreezeError(f"{calibration_jsonl} changed while it was read; refusing to freeze")

    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        for src, rel in plan:
            _copy_file(src, tmp / rel)
            if sha256_file(tmp / rel) != before[str(src)]:
                raise FreezeError(f"{src} changed while it was copied; refusing to freeze")
        lines = [
            json.dumps(
                {
                    "task_id": tid,
                    "path": task_rel[tid],
                    "group_id": f"rlvr-band:{tid}:repeat:{k}",
                    "repeat": k,
                }
            )
            for k in range(num_repeats)
            for tid in admitted
        ]
        (tmp / "train.jsonl").write_text("\n".join(lines) + "\n")
        band_passes = passes[keep]
        snapshot = {
            "format": SNAPSHOT_FORMAT,
            "created_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "inputs": {
                "calibration": {"path": str(calibration_jsonl.resolve()), "sha256": calib_sha},
                "task_dir": str(task_root),
            },
            "filter": {
                "rule": "osworld_jax.algorithms.dapo_band_keep",
                "low": low,
                "high": high,
                "reps": reps,
                "num_repeats": num_repeats,
            },
            "counts": {
                "calibrated": len(rows),
                "admitted": len(admitted),
                "rejected_low": int(np.sum(passes <= low)),
                "rejected_high": int(np.sum(~keep & (passes > low))),
                "train_rows": len(lines),
                "admitted_mean_pass_rate": float(np.mean(band_passes / reps_arr[keep])),
            },
            "admitted": admitted,
            "sources": {rel: {"path": str(src), "sha256": before[str(src)]} for src, rel in plan},
        }
        (tmp / "SNAPSHOT.json").write_text(json.dumps(snapshot, indent=2, sort_keys=True) + "\n")
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        sums = "".join(f"{sha256_file(p)}  {p.relative_to(tmp).as_posix()}\n" for p in files)
        (tmp / "SHA256SUMS").write_text(sums)

        after = _hash_sources(sources)
        changed = sorted(p for p in before if after[p] != before[p])
        if changed:
            raise FreezeError(f"inputs changed during the freeze: {changed[:3]}; refusing")
        for p in [*files, tmp / "SHA256SUMS"]:
            p.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
        if out_dir.exists():
            raise FreezeError(f"{out_dir} appeared during the freeze; refusing to overwrite")
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
