"""Preflight: check every external part of a run before the first step, one line per problem.

A run needs a model checkpoint, reachable rollout servers (unless the run starts them), a
sandbox backend that passes its own preflight, and a non-empty task set (R3's route shape is
derived from the model, so it cannot disagree). All problems are collected and raised together
as one `PreflightError` (``osworld_jax.errors``, the same class a backend's own preflight
raises) whose message has one line per missing part.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import aiohttp

from osworld_jax.data import DataError, load_task_refs, resolve_task_set
from osworld_jax.errors import OsworldJaxError, PreflightError
from osworld_jax.rl.config import ExperimentConfig
from osworld_jax.rl.servers import compilation_cache_problem, server_problems
from osworld_jax.trainer.checkpoint import symlink_problem


def check_model_path(path: str | Path, *, weights: bool = True) -> str | None:
    """``None`` when ``path`` is an HF checkpoint dir (``weights``: with its weights), else the
    problem."""  # noqa: D205, D209
    p = Path(path)
    if not p.is_dir():
        what = "is not a directory" if p.exists() else "does not exist"
        return f"model path {str(path)!r} {what} (ModelSourceConfig.path)"
    if not (p / "config.json").is_file():
        return f"model path {str(path)!r} has no config.json (not an HF checkpoint)"
    if weights and not any(p.glob("*.safetensors")):
        return f"model path {str(path)!r} has no *.safetensors weights"
    if not (p / "tokenizer.json").is_file():
        return f"model path {str(path)!r} has no tokenizer.json"
    return None


async def _probe(url: str, timeout_s: float) -> str | None:
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(f"{url}/health") as resp:
                if resp.status != 200:
                    return f"rollout server {url} is unhealthy: GET /health -> {resp.status}"
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        return f"rollout server {url} is unreachable: {type(e).__name__}: {e}"
    return None


def check_servers(urls: tuple[str, ...], timeout_s: float = 10.0) -> list[str]:
    """One problem per unreachable or unhealthy server URL."""

    async def probe_all() -> list[str | None]:
        return await asyncio.gather(*(_probe(u, timeout_s) for u in urls))

    return [p for p in asyncio.run(probe_all()) if p]


def check_task_set(task_set: str) -> str | None:
    """``None`` when the task set resolves to at least one task."""
    try:
        load_task_refs(resolve_task_set(task_set))
    except DataError as e:
        return f"{e} (DataConfig.task_set)"
    return None


def run_preflight(
    experiment: ExperimentConfig,
    *,
    model_path: str | Path,
    backend_preflight: Callable[[], None],
    weights_made_by_run: bool = False,
) -> None:
    """Runs every check; raises `PreflightError` listing each problem on its own line.

    Args:
      experiment: the run's config.
      model_path: the resolved starting checkpoint (the tiny model is built before preflight).
      backend_preflight: the sandbox backend's ``preflight`` (raises ``PreflightError``).
      weights_made_by_run: the checkpoint's random weights are not written yet (a tiny model
        of ``--validate_only``): only its other files are checked.
    """
    problems: list[str] = []
    model_problem = check_model_path(model_path, weights=not weights_made_by_run)
    if model_problem:
        problems.append(model_problem)
    if experiment.server.launch == "none":
        problems += check_servers(experiment.rollout.urls, experiment.rollout.connect_timeout_s)
    problems += server_problems(experiment)
    cache_problem = compilation_cache_problem(experiment)
    if cache_problem:
        problems.append(cache_problem)
    try:
        backend_preflight()
    except OsworldJaxError as e:
        problems.append(f"sandbox backend {experiment.backend!r}: {e}")
    ckpt = experiment.trainer.checkpoint.directory
    ckpt_problem = None if ckpt is None else symlink_problem(ckpt)
    if ckpt_problem:
        problems.append(ckpt_problem)
    task_problem = check_task_set(experiment.data.task_set)
    if task_problem:
        problems.append(task_problem)
    if problems:
        raise PreflightError("preflight failed:\n" + "\n".join(f"  - {p}" for p in problems))
