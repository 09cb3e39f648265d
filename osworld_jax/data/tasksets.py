"""Task sets: resolve a directory (or index file) of OSWorld task JSON into task references.

A task set is one of
- a frozen DAPO-band dataset directory (has ``train.jsonl``; written by `freeze_band`): one
  reference per line, repeats included, with their group ids;
- an OSWorld ``evaluation_examples`` directory with a ``test_all.json`` style index
  (``{domain: [task_id, ...]}``) and the task files at ``examples/{domain}/{task_id}.json``;
- any directory: every ``*.json`` file below it that holds an object with ``id`` and
  ``instruction`` (sorted by path, so the order is reproducible);
- a ``.jsonl`` file of ``{"task_id", "path"[, "group_id"]}`` lines (paths relative to the file).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from osworld_jax.data.errors import DataError, TaskSetEmptyError

#: The index files of an OSWorld ``evaluation_examples`` directory, in order of preference.
INDEX_NAMES = ("test_all.json", "test_small.json")
#: The reference list of a frozen dataset directory.
FROZEN_INDEX = "train.jsonl"


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskRef:
    """One task draw of the training stream (cheap to pickle; the task JSON is read later).

    Attributes:
      task_id: the task's ``id``.
      path: absolute path of the task JSON file.
      group_id: name of the prompt group this draw forms (``task_id`` by default; a frozen band
        uses ``rlvr-band:{task}:repeat:{k}``).
    """

    task_id: str
    path: str
    group_id: str


def load_task_refs(task_set: str | Path) -> list[TaskRef]:
    """Resolves ``task_set`` (see the module docstring) into its task references.

    Raises:
      DataError: the path does not exist or an index line is malformed (names the file/line).
      TaskSetEmptyError: the task set holds no task.
    """
    root = Path(task_set).expanduser().resolve()
    if not root.exists():
        raise DataError(f"task set {str(task_set)!r} does not exist")
    if root.is_file():
        refs = _from_jsonl(root)
    elif (root / FROZEN_INDEX).is_file():
        refs = _from_jsonl(root / FROZEN_INDEX)
    elif any((root / n).is_file() for n in INDEX_NAMES):
        refs = _from_osworld_index(root)
    else:
        refs = _from_tree(root)
    if not refs:
        raise TaskSetEmptyError(f"task set {str(root)!r} is empty: no task JSON found")
    return refs


def _from_jsonl(path: Path) -> list[TaskRef]:
    refs = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            task_id, rel = str(rec["task_id"]), str(rec["path"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise DataError(f"{path}:{lineno}: expected {{task_id, path}} JSON: {e}") from None
        task_path = (path.parent / rel).resolve()
        if not task_path.is_file():
            raise DataError(f"{path}:{lineno}: task file {rel!r} does not exist")
        refs.append(
            TaskRef(
                task_id=task_id, path=str(task_path), group_id=str(rec.get("group_id", task_id))
            )
        )
    return refs


def _from_osworld_index(root: Path) -> list[TaskRef]:
    index = next(root / n for n in INDEX_NAMES if (root / n).is_file())
    try:
        domains = json.loads(index.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{index}: not JSON: {e}") from None
    refs = []
    for domain, ids in sorted(domains.items()):
        for task_id in ids:
            p = root / "examples" / domain / f"{task_id}.json"
            if not p.is_file():
                raise DataError(f"{index}: task {domain}/{task_id} has no file {p}")
            refs.append(TaskRef(task_id=str(task_id), path=str(p), group_id=str(task_id)))
    return refs


def _from_tree(root: Path) -> list[TaskRef]:
    refs = []
    for p in sorted(root.rglob("*.json")):
        try:
            obj = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue  # not a task file (an asset); task files are validated by env.load_task
        if isinstance(obj, dict) and "id" in obj and "instruction" in obj:
            refs.append(TaskRef(task_id=str(obj["id"]), path=str(p), group_id=str(obj["id"])))
    ids = [r.task_id for r in refs]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise DataError(f"task set {str(root)!r} has duplicate task ids: {dup[:5]}")
    return refs


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes (streamed)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_sha256sums(dataset_dir: str | Path) -> None:
    """Checks every line of ``dataset_dir/SHA256SUMS``; raises `DataError` naming a bad file."""
    root = Path(dataset_dir)
    sums = root / "SHA256SUMS"
    if not sums.is_file():
        raise DataError(f"{root}: no SHA256SUMS (not a frozen dataset)")
    for lineno, line in enumerate(sums.read_text().splitlines(), start=1):
        digest, _, rel = line.partition("  ")
        if not rel:
            raise DataError(f"{sums}:{lineno}: malformed line {line!r}")
        target = root / rel
        if not target.is_file():
            raise DataError(f"{sums}:{lineno}: {rel} is missing")
        if sha256_file(target) != digest:
            raise DataError(f"{sums}:{lineno}: {rel} changed since the freeze (sha256 mismatch)")
