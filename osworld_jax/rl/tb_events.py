"""TensorBoard event files of scalars, written directly (no tensorboardX, so no torch import).

An event file is TensorBoard's TFRecord stream of ``Event`` protocol buffers:

    record = uint64 length | uint32 masked_crc32c(length) | bytes | uint32 masked_crc32c(bytes)
    masked_crc32c(x) = rotate_right(crc32c(x), 15) + 0xa282ead8   (mod 2**32, little endian)

The first event holds ``file_version = "brain.Event:2"``; each scalar is an event with
``wall_time`` (field 1, double), ``step`` (2, int64) and ``summary`` (5) holding one
``Summary.Value`` with ``tag`` (1, string) and ``simple_value`` (2, float): what tensorboardX's
``scalar()`` writes and TensorBoard's scalar dashboard reads. Importing tensorboardX imports
torch (~1.2 s of every trainer's start); these few fields need neither.

>>> encode_scalar_event("loss", 0.5, step=3, wall_time=1.0).hex()
'09000000000000f03f10032a0d0a0b0a046c6f7373150000003f'
>>> hex(masked_crc32c(b"123456789"))  # CRC-32C("123456789") = 0xe3069283
'0xc78ab0e5'
"""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path

FILE_VERSION = "brain.Event:2"


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # Castagnoli, reflected
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of ``data``."""
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC of ``data``."""
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 as protobuf encodes it (two's complement)
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def encode_event(wall_time: float, step: int = 0, *, file_version: str | None = None,
                 summary: bytes | None = None) -> bytes:  # fmt: skip
    """One ``Event`` message: wall_time, step, and a file version or a ``Summary``."""
    out = b"\x09" + struct.pack("<d", wall_time)  # field 1, fixed64
    if step:
        out += b"\x10" + _varint(step)  # field 2, varint
    if file_version is not None:
        out += _field(3, file_version.encode())
    if summary is not None:
        out += _field(5, summary)
    return out


def encode_scalar_event(tag: str, value: float, *, step: int, wall_time: float) -> bytes:
    """An ``Event`` with a ``Summary`` of one ``simple_value`` named ``tag``."""
    v = _field(1, tag.encode()) + b"\x15" + struct.pack("<f", value)  # field 2, fixed32
    return encode_event(wall_time, step, summary=_field(1, v))


def record(data: bytes) -> bytes:
    """``data`` framed as one TFRecord."""
    n = struct.pack("<Q", len(data))
    return n + struct.pack("<I", masked_crc32c(n)) + data + struct.pack("<I", masked_crc32c(data))


class EventFile:
    """An ``events.out.tfevents.<time>.<host>`` file under ``directory``, appended to.

    Writes go straight to the file (`flush` flushes it): a full disk fails the write that
    meets it, in the caller's thread.
    """

    def __init__(self, directory: str | Path) -> None:
        now = time.time()
        name = f"events.out.tfevents.{int(now):010d}.{socket.gethostname()}"
        self.path = Path(directory) / name
        self._f = open(self.path, "ab")  # noqa: SIM115
        self._f.write(record(encode_event(now, file_version=FILE_VERSION)))

    def scalar(self, tag: str, value: float, step: int) -> None:
        """Appends scalar ``tag`` = ``value`` at ``step``."""
        self._f.write(record(encode_scalar_event(tag, value, step=step, wall_time=time.time())))

    def flush(self) -> None:
        """Flushes the appended events to the file."""
        self._f.flush()

    def close(self) -> None:
        """Closes the file."""
        self._f.close()
