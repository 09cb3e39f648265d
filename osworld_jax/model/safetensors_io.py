"""Minimal numpy safetensors reader/writer (bfloat16 via ml_dtypes; no torch, no jax).

Format: u64 little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the
raw little-endian tensor bytes. Reads are memory-mapped, so a tensor is only paged in when used.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from osworld_jax.model.errors import CheckpointError

_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class SafetensorsFile:
    """A memory-mapped safetensors file: ``names()`` and ``get(name) -> np.ndarray``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
        except (OSError, struct.error, json.JSONDecodeError) as e:
            raise CheckpointError(f"{self.path}: not a readable safetensors file ({e})") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self._header = header
        self._data_start = 8 + n
        self._mmap: np.memmap | None = None

    def names(self) -> list[str]:
        """Tensor names in this file."""
        return list(self._header)

    def get(self, name: str) -> np.ndarray:
        """The tensor ``name`` as a read-only numpy view of the mapped file."""
        info = self._header[name]
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"{self.path}: tensor {name}: unsupported dtype {info['dtype']}")
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        begin, end = info["data_offsets"]
        raw = self._mmap[self._data_start + begin : self._data_start + end]
        return raw.view(dtype).reshape(info["shape"])


def write_safetensors(
    path: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None
) -> None:
    """Writes ``tensors`` (C-contiguous little-endian copies) to ``path``."""
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    arrays = []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype not in _NAMES:
            raise CheckpointError(f"{path}: tensor {name}: unsupported dtype {arr.dtype}")
        header[name] = {
            "dtype": _NAMES[arr.dtype],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # 8-byte alignment of the data section
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())
