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
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from osworld_jax.model import Qwen3MoeConfig

#: A safetensors header larger than this is refused (the format's own readers cap it at 100 MB).
MAX_HEADER_BYTES = 100 << 20


class CheckpointMismatch(ValueError):
    """A checkpoint that cannot be read or is not the served model's architecture."""


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
      CheckpointMismatch: no / invalid ``config.json``, no safetensors file, a bad header.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointMismatch(f"{path}: not a checkpoint directory")
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
