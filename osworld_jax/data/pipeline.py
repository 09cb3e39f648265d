"""The training task stream: a grain pipeline over task references.

``MapDataset.source(refs)`` -> shard by process -> shuffle(seed) -> repeat -> batches of B task
references. The iterator state (a small JSON-able dict) is checkpointed with the train state, so
a resumed run draws exactly the tasks the interrupted run would have drawn next.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grain
import jax

from osworld_jax.data.errors import DataError, TaskSetEmptyError
from osworld_jax.data.tasksets import FROZEN_INDEX, TaskRef, load_task_refs, verify_sha256sums
from osworld_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the training tasks come from and in which order.

    Attributes:
      task_set: a task-set path (see `osworld_jax.data.tasksets`), or ``"bundled"`` for the
        tasks shipped with the env room (``osworld_jax.env.bundled_tasks_dir()``).
      seed: shuffle seed (each epoch is reshuffled from it).
      shuffle: shuffle the task order (off: task-set order, epoch after epoch).
      num_epochs: passes over the task set; ``None`` repeats forever.
      shard_by_process: give each JAX process a disjoint slice ``[process_index::process_count]``
        of the task set (multi-host); off: every process sees every task. (The RL loop rolls
        out on process 0 only, so it draws the whole set on every process, in lockstep.)
      verify_checksums: for a frozen dataset directory, check its ``SHA256SUMS`` at start-up.
      only_runnable: drop the tasks the sandbox backend cannot run here (the RL loop checks
        ``osworld_jax.env.capabilities`` per task and writes the reasons to
        ``<run_dir>/skipped_tasks.json``); off: every task is drawn.
    """

    task_set: str = "bundled"
    seed: int = 0
    shuffle: bool = True
    num_epochs: int | None = None
    shard_by_process: bool = True
    verify_checksums: bool = True
    only_runnable: bool = True

    def __post_init__(self) -> None:
        if not self.task_set:
            raise ConfigError("DataConfig.task_set: empty; name a task-set path or 'bundled'")
        if self.num_epochs is not None and self.num_epochs < 1:
            raise ConfigError(f"DataConfig.num_epochs: {self.num_epochs} < 1")


def _as_list(refs: Sequence[TaskRef]) -> list[TaskRef]:
    return list(refs)


class TaskStream:
    """Batches of task references with a checkpointable position.

    Args:
      refs: the task set (before sharding).
      batch_size: task references per batch (B prompts of this process).
      seed: shuffle seed.
      shuffle: shuffle (per epoch) or keep the order.
      num_epochs: ``None`` repeats forever.
      shard_index: this process's shard.
      shard_count: number of shards.
    """

    def __init__(
        self,
        refs: Sequence[TaskRef],
        *,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        num_epochs: int | None = None,
        shard_index: int = 0,
        shard_count: int = 1,
    ) -> None:
        if batch_size < 1:
            raise ConfigError(f"batch_size: {batch_size} < 1")
        if not 0 <= shard_index < shard_count:
            raise ConfigError(f"shard_index {shard_index} not in [0, {shard_count})")
        ds = grain.MapDataset.source(list(refs))
        if shard_count > 1:
            ds = ds[shard_index::shard_count]
        if len(ds) == 0:
            raise DataError(f"shard {shard_index}/{shard_count} of a {len(refs)}-task set is empty")
        if shuffle:
            ds = ds.shuffle(seed=seed)
        ds = ds.repeat(num_epochs)
        self.num_tasks = len(refs)
        self._iter = ds.to_iter_dataset().batch(batch_size, batch_fn=_as_list).__iter__()

    def __iter__(self) -> TaskStream:
        return self

    def __next__(self) -> list[TaskRef]:
        """The next batch of task references (``StopIteration`` after the last epoch)."""
        return next(self._iter)

    def get_state(self) -> dict[str, Any]:
        """The position in the stream (JSON-able); `set_state` continues from it exactly."""
        return dict(self._iter.get_state())

    def set_state(self, state: dict[str, Any]) -> None:
        """Moves the stream to a position saved by `get_state`."""
        self._iter.set_state(dict(state))


def resolve_task_set(task_set: str) -> str:
    """``"bundled"`` -> the env room's bundled task directory; any other value unchanged."""
    if task_set == "bundled":
        from osworld_jax.env import bundled_tasks_dir

        return str(bundled_tasks_dir())
    return task_set


def make_task_stream(
    config: DataConfig,
    batch_size: int,
    *,
    process_index: int | None = None,
    process_count: int | None = None,
    keep: Callable[[TaskRef], bool] | None = None,
) -> TaskStream:
    """The task stream of ``config`` for this process (sharded by ``jax.process_index``).

    ``batch_size`` is the global number of prompts B; each of the ``process_count`` processes
    draws ``B / process_count`` of them (B must divide). ``keep`` filters the task set first
    (before sharding, so every process filters alike); nothing kept raises `TaskSetEmptyError`.
    """
    path = resolve_task_set(config.task_set)
    if config.verify_checksums and (Path(path) / FROZEN_INDEX).is_file():
        verify_sha256sums(path)
    refs = load_task_refs(path)
    if keep is not None:
        refs = [r for r in refs if keep(r)]
        if not refs:
            raise TaskSetEmptyError(f"task set {path!r}: no task passes the filter (0 runnable)")
    if process_index is None or process_count is None:
        process_index, process_count = jax.process_index(), jax.process_count()
    if not config.shard_by_process:
        process_index, process_count = 0, 1
    if batch_size % process_count:
        raise ConfigError(
            f"RLConfig.num_prompts ({batch_size}) must divide by the process count "
            f"({process_count})"
        )
    return TaskStream(
        refs,
        batch_size=batch_size // process_count,
        seed=config.seed,
        shuffle=config.shuffle,
        num_epochs=config.num_epochs,
        shard_index=process_index,
        shard_count=process_count,
    )
