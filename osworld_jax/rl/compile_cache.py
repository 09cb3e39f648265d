"""jax's persistent compilation cache directory: checked once at start, damaged entries removed.

jax (0.10 and 0.11) stores each compiled executable as one file ``<key>-cache`` (zstd- or
zlib-compressed: a big-endian compile time, then the serialized executable) with a ``<key>-atime``
beside it, and writes it in place. A process killed mid-write leaves a truncated entry; jax then
fails to read it on every later run (a warning, a recompile) and never replaces it (``put``
keeps an existing file). `repair` decompresses each entry not yet known good (a stream, nothing
kept in memory) and removes the unreadable ones, so the next compile writes them again; the
entries it verified are recorded in `VERIFIED` (name, size, mtime) and not read again, so a
start reads each entry once in its life. Standard library only: nothing here imports jax.
"""

from __future__ import annotations

import json
import logging
import os
import time
import zlib
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ENTRY_SUFFIX, ATIME_SUFFIX = "-cache", "-atime"
VERIFIED = ".osworld_jax-verified.json"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_TIME_BYTES = 4  # jax's compile-time prefix of the decompressed entry
_CHUNK = 1 << 20


def dir_problem(path: str | os.PathLike[str], field: str) -> str | None:
    """One line when ``path`` cannot be (or become) a writable directory, else None.

    Nothing is created: the nearest existing ancestor must be a writable directory.
    """
    p = Path(path)
    probe = p
    while not os.path.lexists(probe) and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        what = "is not a directory" if probe == p else f"cannot be created: {probe} is a file"
        return f"{field} = {str(path)!r} {what}"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{field} = {str(path)!r}: {probe} is not writable by this user"
    return None


def _zstd_stream() -> Any | None:
    """A streaming zstd decompressor (Python 3.14's, else the zstandard package's), or None."""
    try:
        from compression import zstd  # type: ignore[import-not-found]

        return zstd.ZstdDecompressor()
    except ImportError:
        pass
    try:
        import zstandard  # type: ignore[import-not-found]

        return zstandard.ZstdDecompressor().decompressobj()
    except ImportError:
        return None


def entry_problem(path: Path) -> str | None:
    """Why the cache entry ``path`` cannot be read back, or None (readable, or not checkable:
    zstd without a zstd module here, or a format this code does not know).
    """  # noqa: D205
    with open(path, "rb") as f:
        head = f.read(_CHUNK)
        if not head:
            return "empty"
        if head.startswith(_ZSTD_MAGIC):
            stream = _zstd_stream()
            if stream is None:
                return None
        elif head[0] == 0x78 and int.from_bytes(head[:2], "big") % 31 == 0:  # a zlib header
            stream = zlib.decompressobj()
        else:
            return None if len(head) > _TIME_BYTES else "too short"
        size, chunk = 0, head
        try:
            while chunk:
                size += len(stream.decompress(chunk))
                if stream.eof:
                    break
                chunk = f.read(_CHUNK)
        except Exception as e:  # zlib.error, zstd errors: the data is damaged
            return f"damaged ({type(e).__name__}: {str(e)[:120]})"
    if not stream.eof:
        return "truncated"
    if size <= _TIME_BYTES:
        return "holds no executable"
    return None


def _load_verified(root: Path) -> dict[str, list[int]]:
    try:
        data = json.loads((root / VERIFIED).read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def repair(root: str | os.PathLike[str], *, settle_s: float = 60.0) -> list[str]:
    """Removes the unreadable entries of the cache directory ``root``; returns their names.

    Args:
      root: the compilation cache directory (top-level files only).
      settle_s: entries modified more recently than this are left for the next start (another
        process sharing the cache may still be writing them).
    """
    root = Path(root)
    verified, now, removed = _load_verified(root), time.time(), []
    seen: dict[str, list[int]] = {}
    for entry in sorted(root.glob(f"*{ENTRY_SUFFIX}")):
        try:
            st = entry.lstat()
        except OSError:
            continue
        if not entry.is_file() or entry.is_symlink():
            continue
        stamp = [st.st_size, st.st_mtime_ns]
        if verified.get(entry.name) == stamp:
            seen[entry.name] = stamp
            continue
        if now - st.st_mtime < settle_s:
            continue
        try:
            problem = entry_problem(entry)
        except OSError as e:
            log.warning("compilation cache entry %s: unreadable (%s)", entry, e)
            continue
        if problem is None:
            seen[entry.name] = stamp
            continue
        key = entry.name.removesuffix(ENTRY_SUFFIX)
        for path in (entry, root / f"{key}{ATIME_SUFFIX}"):
            path.unlink(missing_ok=True)
        removed.append(f"{entry.name} ({problem})")
    if removed:
        log.warning(
            "compilation cache %s: removed %d unreadable entries (the next compile writes them "
            "again): %s",
            root,
            len(removed),
            ", ".join(removed),
        )
    if seen != verified:
        tmp = root / f"{VERIFIED}.{os.getpid()}"
        try:
            tmp.write_text(json.dumps(seen))
            tmp.replace(root / VERIFIED)
        except OSError:
            tmp.unlink(missing_ok=True)  # read-only or full: verified again next start
    return removed
