"""Orbax checkpointing of the train state plus the data-iterator state.

A checkpoint step directory holds the items

- ``state``: the `TrainState` (params, opt_state, step, rng, weight_version) as a standard
  orbax pytree (sharded arrays written by every host, restorable onto any mesh);
- ``data_iterator``: a grain iterator's state (grain's own checkpoint handler), or
- ``data``: a JSON dict (any other data-position state the caller keeps).

Saves are atomic (orbax writes into a temporary directory and renames it when complete), so a
process killed mid-save leaves the previous checkpoints intact and the partial one invisible.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from osworld_jax.trainer.config import CheckpointConfig
from osworld_jax.trainer.state import TrainerError, TrainState

STATE, DATA_ITERATOR, DATA_JSON = "state", "data_iterator", "data"


def _is_grain_iterator(obj: Any) -> bool:
    return callable(getattr(obj, "get_state", None)) and callable(getattr(obj, "set_state", None))


def _as_tree(state: TrainState) -> dict[str, Any]:
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}


class Checkpointer:
    """A thin owner of one ``ocp.CheckpointManager`` (save every k, keep n, async).

    Attributes:
      config: the checkpoint config.
      directory: the absolute checkpoint root.
    """

    def __init__(self, config: CheckpointConfig):
        if config.directory is None:
            raise TrainerError("CheckpointConfig.directory: None, checkpointing is disabled")
        self.config = config
        self.directory = Path(config.directory).absolute()
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=1,  # the cadence is decided in `save` (orbax saves any first step)
            max_to_keep=config.keep,
            enable_async_checkpointing=config.async_save,
            create=True,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def save(
        self, state: TrainState, step: int, data_state: Any = None, *, force: bool = False
    ) -> bool:
        """Saves ``state`` (and ``data_state``) as checkpoint ``step`` if the cadence says so.

        Args:
          state: the train state (device arrays; written asynchronously when configured).
          step: the checkpoint step number (normally ``int(state.step)``).
          data_state: a grain iterator (saved with grain's handler), a JSON-able dict, or None.
          force: save even off the ``save_every`` cadence.

        Returns:
          Whether a save was started.
        """
        if not force and step % self.config.save_every:
            return False
        items: dict[str, Any] = {STATE: ocp.args.StandardSave(_as_tree(state))}
        if data_state is not None:
            if _is_grain_iterator(data_state):
                import grain

                items[DATA_ITERATOR] = grain.checkpoint.CheckpointSave(data_state)
            elif isinstance(data_state, dict):
                items[DATA_JSON] = ocp.args.JsonSave(data_state)
            else:
                raise TrainerError(
                    f"Checkpointer.save: data_state must be a grain iterator or a dict, got "
                    f"{type(data_state).__name__}"
                )
        return bool(self._manager.save(step, args=ocp.args.Composite(**items), force=force))

    def latest_step(self) -> int | None:
        """The newest complete checkpoint step, or None."""
        self._manager.reload()
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Every complete checkpoint step, oldest first."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def restore(
        self,
        abstract_state: TrainState,
        *,
        step: int | None = None,
        data_iterator: Any = None,
    ) -> tuple[TrainState, Any]:
        """Restores checkpoint ``step`` (default: the latest) onto ``abstract_state``'s shardings.

        Args:
          abstract_state: a `TrainState` of ``jax.ShapeDtypeStruct`` leaves carrying the target
            shardings (any mesh: arrays are resharded on read).
          step: which checkpoint; None = the latest complete one.
          data_iterator: a grain iterator to restore in place from the ``data_iterator`` item.

        Returns:
          ``(state, data_state)``: data_state is the restored iterator, the JSON dict, or None.
        """
        self.wait()
        if step is None:
            step = self.latest_step()
        if step is None:
            raise TrainerError(f"{self.directory}: no complete checkpoint to restore")
        items: dict[str, Any] = {STATE: ocp.args.StandardRestore(_as_tree(abstract_state))}
        step_dir = self.directory / str(step)
        if data_iterator is not None:
            if not (step_dir / DATA_ITERATOR).exists():
                raise TrainerError(f"{step_dir}: no {DATA_ITERATOR!r} item to restore into")
            import grain

            items[DATA_ITERATOR] = grain.checkpoint.CheckpointRestore(data_iterator)
        elif (step_dir / DATA_JSON).exists():
            items[DATA_JSON] = ocp.args.JsonRestore()
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        state = TrainState(**restored[STATE])
        if data_iterator is not None:
            return state, restored[DATA_ITERATOR]
        return state, restored[DATA_JSON] if DATA_JSON in items else None

    def wait(self) -> None:
        """Blocks until the in-flight async save (if any) is committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases the manager."""
        self._manager.wait_until_finished()
        self._manager.close()
