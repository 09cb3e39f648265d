"""What a weight refit may change: values only, never the architecture or a tensor's shape.

`checkpoint_signature` reads a checkpoint's ``config.json`` and its safetensors *headers* (no
tensor data), and `first_difference` names the first way a new checkpoint differs from the
served one: a config field, a tensor the served model does not have (an extra layer, silently
ignored by a loader, would change nothing it reads but means the checkpoint is not this model),
a missing tensor, or a shape. ``/update_weights_from_disk`` refuses such a checkpoint with that
message and keeps serving the old weights.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from osworld_jax.model import Qwen3MoeConfig

#: A safetensors header larger than this is refused (the format's own readers cap it at 100 MB).
MAX_HEADER_BYTES = 100 << 20


#: Largest metadata file (``*.json``, ``*.jinja``, ``*.txt``) read from a checkpoint directory.
MAX_METADATA_BYTES = 64 << 20
#: Files of a checkpoint directory that a loader reads (config, tokenizer, weights, template).
_READ_SUFFIXES = (".json", ".safetensors", ".jinja", ".txt", ".model")


class CheckpointMismatch(ValueError):
    """A checkpoint that cannot be read or is not the served model's architecture."""


def check_checkpoint_files(path: str | Path) -> None:
    """Every file a loader reads from ``path`` is a regular file of bounded size.

    Checked with ``stat`` (following symlinks) before anything is opened: a ``config.json``
    that is a symlink to ``/dev/zero``, a FIFO that would block the reader forever, a directory
    or a socket is refused; metadata files are at most `MAX_METADATA_BYTES`.

    Raises:
      CheckpointMismatch: not a directory, or the first offending file.
    """
    path = Path(path)
    try:
        names = sorted(os.listdir(path))
    except NotADirectoryError:
        raise CheckpointMismatch(f"{path}: not a checkpoint directory") from None
    except OSError as e:
        raise CheckpointMismatch(f"{path}: not a readable directory ({e.strerror})") from None
    for name in names:
        if not name.endswith(_READ_SUFFIXES):
            continue
        file = path / name
        try:
            st = os.stat(file)
        except OSError as e:
            raise CheckpointMismatch(f"{file}: unreadable ({e.strerror})") from None
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointMismatch(f"{file}: not a regular file (a device, FIFO or directory)")
        if not name.endswith(".safetensors") and st.st_size > MAX_METADATA_BYTES:
            raise CheckpointMismatch(
                f"{file}: {st.st_size} bytes, more than {MAX_METADATA_BYTES} for a metadata file"
            )


@dataclass(frozen=True, kw_only=True)
class CheckpointSignature:
    """The architecture of a checkpoint directory.

    Attributes:
      config: its parsed ``config.json``.
      shapes: every tensor name -> shape, over all its safetensors files.
    """

    config: Qwen3MoeConfig
    shapes: dict[str, tuple[int, ...]]


def _header_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    try:
        with open(file, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointMismatch(f"{file}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER_BYTES:
                raise CheckpointMismatch(f"{file}: safetensors header of {n} bytes is too large")
            header = json.loads(f.read(n))
    except OSError as e:
        raise CheckpointMismatch(f"{file}: unreadable ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointMismatch(f"{file}: invalid safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointMismatch(f"{file}: invalid safetensors header")
    shapes = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        shape = info.get("shape") if isinstance(info, dict) else None
        if not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
            raise CheckpointMismatch(f"{file}: tensor {name} has no valid shape")
        shapes[name] = tuple(shape)
    return shapes


def checkpoint_signature(path: str | Path) -> CheckpointSignature:
    """The `CheckpointSignature` of a HF checkpoint directory (headers only, no tensor data).

    Raises:
      CheckpointMismatch: no / invalid ``config.json``, no safetensors file, a bad header, a
        file that is not regular or too large (`check_checkpoint_files`).
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointMismatch(f"{path}: not a checkpoint directory")
    check_checkpoint_files(path)
    try:
        config = Qwen3MoeConfig.from_json(path / "config.json")
    except Exception as e:  # ModelConfigError and friends: one line naming the file
        raise CheckpointMismatch(str(e)) from None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointMismatch(f"{path}: no *.safetensors files")
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        for name, shape in _header_shapes(file).items():
            if name in shapes:
                raise CheckpointMismatch(f"{path}: tensor {name} appears in two files")
            shapes[name] = shape
    return CheckpointSignature(config=config, shapes=shapes)


def _natural(name: str) -> list[int | str]:
    """Sort key putting ``layers.2`` before ``layers.10``."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def first_difference(served: CheckpointSignature, new: CheckpointSignature) -> str | None:
    """The first way ``new`` differs from ``served`` (config field, tensor set, shape), or None."""
    for f in dataclasses.fields(Qwen3MoeConfig):
        a, b = getattr(served.config, f.name), getattr(new.config, f.name)
        if a != b:
            return f"config.json: {f.name} is {b!r}, the served model has {a!r}"
    for name in sorted(served.shapes.keys() | new.shapes.keys(), key=_natural):
        if name not in new.shapes:
            return f"tensor {name} is missing (the served model has {list(served.shapes[name])})"
        if name not in served.shapes:
            return f"tensor {name} {list(new.shapes[name])} is not in the served model"
        if served.shapes[name] != new.shapes[name]:
            return (
                f"tensor {name} has shape {list(new.shapes[name])}, the served model has "
                f"{list(served.shapes[name])}"
            )
    return None
