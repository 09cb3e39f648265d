"""Offline OSWorld-format tasks shipped with the package (assets beside their JSON files).

Layout: ``tasks/<domain>/<id>.json``; a task's ``download`` URLs are paths relative to its JSON
file (``assets/...``), resolved by ``osworld_jax.env.cache.resolve``. Scripted correct and wrong
action sequences for every task live in ``tests/env/bundled_solutions.json``.
"""

from __future__ import annotations

from pathlib import Path


def bundled_task_dir() -> Path:
    """The directory of the bundled tasks (``<domain>/<id>.json``)."""
    return Path(__file__).resolve().parent / "tasks"


bundled_tasks_dir = bundled_task_dir
