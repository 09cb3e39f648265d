"""Offline OSWorld-format tasks shipped with the package (assets beside their JSON files).

Two sets, each laid out ``<domain>/<id>.json`` with its files under ``<domain>/assets/<id>/``
(a task's ``download`` URLs are paths relative to its JSON file, resolved by
``osworld_jax.env.cache.resolve``):

- ``tasks/`` (``bundled_task_dir``): shell, text-editor and CSV tasks that any backend runs,
  the in-process ``memory`` one included (the ``bundled`` task set); scripted correct and wrong
  action sequences in ``tests/env/bundled_solutions.json``;
- ``apps/`` (``bundled_app_task_dir``): two tasks per application domain (calc, writer, impress,
  chrome, gimp, vlc, thunderbird) for the local backend with the applications installed
  (``bash scripts/setup.sh --apps``); their files are made by the real applications
  (``scripts/make_bundled_app_assets.py``); solutions in
  ``tests/env/bundled_app_solutions.json``.
"""

from __future__ import annotations

from pathlib import Path


def bundled_task_dir() -> Path:
    """The directory of the bundled tasks (``<domain>/<id>.json``)."""
    return Path(__file__).resolve().parent / "tasks"


bundled_tasks_dir = bundled_task_dir


def bundled_app_task_dir() -> Path:
    """The directory of the bundled application tasks (``<domain>/<id>.json``)."""
    return Path(__file__).resolve().parent / "apps"
