"""The host batch reaches every process equal, stored screenshots included, in bounded chunks.

Two real processes (gloo on loopback) run tests/scale/broadcast_worker.py (issue 30, section 1:
each screenshot travels once, as its encoded bytes; every collective carries at most
``DistributedConfig.broadcast_chunk_bytes``).
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

from osworld_jax.batch import with_pixel_values
from tests.scale.pair import kill_pair, spawn_pair

WORKER = Path(__file__).with_name("broadcast_worker.py")
CHUNK = 1000  # bytes: the batch (~3.5 KB of arrays, ~25 KB of PNGs) takes dozens of chunks


def _run() -> list[str]:
    procs = spawn_pair(WORKER, lambda coordinator, pid: [coordinator, str(pid), str(CHUNK)])
    try:
        out = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        kill_pair(procs)
    for p, text in zip(procs, out, strict=True):
        assert p.returncode == 0, text
    return out


def _field(text: str, key: str) -> list[str]:
    return next(x for x in text.splitlines() if x.startswith(key + " ")).split()[1:]


@pytest.mark.slow
def test_every_process_gets_the_batch_with_its_images_in_bounded_chunks():
    sys.path.insert(0, str(WORKER.parent))
    import broadcast_worker as w

    want = w.batch()
    pixels = hashlib.sha256(with_pixel_values(want).pixel_values.tobytes()).hexdigest()
    p0, p1 = _run()
    assert _field(p0, "digest") == _field(p1, "digest") == [w.digest(want)]
    assert _field(p0, "pixels") == _field(p1, "pixels") == [pixels]
    n, _, largest = _field(p1, "collectives")
    # The layout's size, then its bytes and the arrays' bytes, each collective <= CHUNK.
    assert int(largest) <= CHUNK and int(n) > 10
