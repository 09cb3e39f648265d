"""Registries of OSWorld metrics and getters (names exactly as in upstream task files)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from osworld_jax.env.protocol import VMProtocol
from osworld_jax.registry import Registry


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalContext:
    """What a getter may use besides the VM.

    Attributes:
      work_dir: a per-evaluation scratch directory; file getters write the fetched files here
        (upstream's ``cache_dir``) and return their paths.
      cache_dir: the local file cache that stands in for OSWorld's remote file cache.
      task_id: the task's id.
      base_dir: the task file's directory (relative paths of bundled tasks resolve against it).
    """

    work_dir: Path
    cache_dir: str | os.PathLike[str] | None = None
    task_id: str | None = None
    base_dir: str | os.PathLike[str] | None = None


Getter = Callable[[VMProtocol, Mapping[str, Any], EvalContext], Awaitable[Any]]
Metric = Callable[..., float]

METRICS: Registry[Metric] = Registry("evaluator metric")
GETTERS: Registry[Getter] = Registry("evaluator getter")


def option_checker(metric: Metric) -> Callable[[Mapping[str, Any]], list[str]] | None:
    """The metric's ``unsupported_options(options) -> list[str]`` hook, if it defines one."""
    return getattr(metric, "unsupported_options", None)
