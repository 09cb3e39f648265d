"""Orbax checkpointing of the train state plus the data-iterator state.

A checkpoint step directory holds the items

- ``state``: the `TrainState` (params, opt_state, step, rng, weight_version) as a standard
  orbax pytree (sharded arrays written by every host, restorable onto any mesh);
- ``data_iterator``: a grain iterator's state (grain's own checkpoint handler), or
- ``data``: a JSON dict (any other data-position state the caller keeps).

Saves are atomic (orbax writes into a temporary directory and renames it when complete), so a
process killed mid-save leaves the previous checkpoints intact and the partial one invisible.
A complete checkpoint that cannot be read back (damaged on disk) raises
`CorruptCheckpointError`, one line naming the step and the file; `set_aside_after` moves the
checkpoints after a chosen step out of orbax's sight (renamed, not deleted) so that a run can
resume from an earlier one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from osworld_jax.errors import ConfigError
from osworld_jax.trainer.config import CheckpointConfig
from osworld_jax.trainer.state import TrainerError, TrainState

STATE, DATA_ITERATOR, DATA_JSON = "state", "data_iterator", "data"
SET_ASIDE = ".set-aside"  # suffix of a checkpoint moved out of the way (not a step name)

# tensorstore's read errors: which array of which OCDBT database, or which file, and why.
_TS_READ = re.compile(r'Error reading "([^"]+)" in OCDBT database at local file "([^"]+)": (.*)')
_TS_DECODE = re.compile(r'Error decoding local file "([^"]+)": (.*)')
_TS_STATUS = ("FAILED_PRECONDITION", "OUT_OF_RANGE", "DATA_LOSS", "NOT_FOUND", "INVALID_ARGUMENT")


class CorruptCheckpointError(TrainerError):
    """A complete checkpoint could not be read back: one line naming the step and the file.

    Attributes:
      step: the checkpoint step.
      path: the damaged file (or item directory).
      reason: what reading it failed on.
    """

    def __init__(self, step: int, path: str | Path, reason: str) -> None:
        self.step, self.path, self.reason = step, str(path), reason
        super().__init__(f"checkpoint {step} is corrupt: {self.path}: {reason}")


class CheckpointPathError(TrainerError, ConfigError):
    """The checkpoint directory holds an entry that orbax would follow or delete through."""


def symlink_problem(directory: str | Path) -> str | None:
    """One line naming the first symlink among ``directory``'s entries, or None.

    Orbax deletes old and temporary step directories with ``rmtree``, which refuses a symlink
    (a later save fails) and must never delete through one: a step directory that is a link,
    wherever it points, is refused before the run starts. The directory itself may be a link
    (checkpoints on another disk).
    """
    root = Path(directory)
    try:
        entries = sorted(root.iterdir()) if root.is_dir() else []
    except OSError:
        return None  # unreadable: orbax reports it, naming the directory
    for entry in entries:
        if entry.is_symlink():
            return (
                f"checkpoint directory entry {entry} is a symlink (to {os.readlink(entry)}): "
                "checkpoints are never followed through links; move it out of the way"
            )
    return None


def set_aside(path: Path) -> Path:
    """Renames ``path`` to ``<name>.set-aside`` (``-2``, ``-3``... if taken); returns it."""
    dst, n = path.with_name(path.name + SET_ASIDE), 1
    while dst.exists():
        n += 1
        dst = path.with_name(f"{path.name}{SET_ASIDE}-{n}")
    return path.rename(dst)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def _bad_json_file(step_dir: Path) -> tuple[Path, str] | None:
    """The first JSON file of ``step_dir`` that does not parse, with why (orbax names none)."""
    for f in sorted(step_dir.rglob("*")):
        if not f.is_file() or "ocdbt" in f.parts[-3:-1] or f.parent.name == "d":
            continue  # array data (binary)
        try:
            raw = f.read_bytes()
        except OSError:
            continue
        named = f.name in ("_METADATA", "metadata")
        try:
            text = raw.decode()
        except UnicodeDecodeError as e:
            if named or raw.lstrip().startswith((b"{", b"[")):
                return f, f"not UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})"
            continue
        if not text.lstrip().startswith(("{", "[")) and not named:
            continue
        try:
            json.loads(text)
        except json.JSONDecodeError as e:
            return f, f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
    return None


def _corruption(step: int, step_dir: Path, error: BaseException) -> CorruptCheckpointError | None:
    """What ``error`` (raised by orbax restoring ``step``) says is damaged, or None (not damage)."""
    chain: list[BaseException] = []
    link: BaseException | None = error
    while link is not None and len(chain) < 20:
        chain.append(link)
        link = link.__cause__ or link.__context__
    for e in reversed(chain):  # innermost first: the read that failed
        text = str(e)
        if isinstance(e, json.JSONDecodeError):
            bad = _bad_json_file(step_dir)
            return CorruptCheckpointError(step, *(bad or (step_dir, f"invalid JSON ({e.msg})")))
        if isinstance(e, UnicodeDecodeError):  # a JSON file (e.g. _METADATA) with non-UTF-8 bytes
            bad = _bad_json_file(step_dir)
            why = f"not UTF-8 (byte 0x{e.object[e.start]:02x} at offset {e.start})"
            return CorruptCheckpointError(step, *(bad or (step_dir, why)))
        if isinstance(e, FileNotFoundError):
            return CorruptCheckpointError(step, e.filename or step_dir, "missing")
        if isinstance(e, KeyError) and "was not found in the checkpoint" in text:
            return CorruptCheckpointError(step, step_dir, _first_line(text.strip("'\"")))
        if text.startswith(_TS_STATUS):
            if m := _TS_DECODE.search(text):
                return CorruptCheckpointError(step, m.group(1), m.group(2).split("; at ")[0])
            if m := _TS_READ.search(text):
                array = m.group(1).split("/")[0]  # "params.attn.k_proj/0.0.0": a chunk of it
                path = f"{m.group(2).rstrip('/')} (array {array})"
                return CorruptCheckpointError(step, path, m.group(3).split("; at ")[0])
            return CorruptCheckpointError(step, step_dir, _first_line(text))
    return None


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
        problem = symlink_problem(self.directory)
        if problem is not None:
            raise CheckpointPathError(problem)
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
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:
            damage = _corruption(step, step_dir, e)
            if damage is None:
                raise
            raise damage from e
        state = TrainState(**restored[STATE])
        if data_iterator is not None:
            return state, restored[DATA_ITERATOR]
        return state, restored[DATA_JSON] if DATA_JSON in items else None

    def set_aside_after(self, step: int) -> list[Path]:
        """Renames every checkpoint newer than ``step`` to ``<step>.set-aside``; returns them.

        Orbax no longer sees them (not step names) and nothing is deleted.
        """
        self.wait()
        moved = []
        for s in self.all_steps():
            if s > step:
                moved.append(set_aside(self.directory / str(s)))
        self._manager.reload()
        return moved

    def wait(self) -> None:
        """Blocks until the in-flight async save (if any) is committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases the manager."""
        self._manager.wait_until_finished()
        self._manager.close()
