"""Prefix reuse across requests: a free KV-cache slot keeps the KV of the last sequence it held.

When a request finishes (or is retracted), its slot's cache rows ``[0, n)`` still hold the KV of
its first ``n`` tokens (prompt + output but the last sampled token, which was never fed). A new
request whose tokens start with the same ``m`` tokens is admitted into that slot and prefills
only tokens ``[m, len)``, attending to the kept rows (SGLang's radix cache, reduced to one
sequence per slot: exactly the multi-turn agent's case, where turn t + 1's prompt extends turn
t's prompt + reply).

Keys: a token's key is its id, except that an image token's key is derived from its image's
bytes (sha256), so two prompts that share their text but not an image diverge at that image's
first token and never share its KV (nor the KV of anything after it). Images are never split:
a match ending inside an image's tokens is cut back to the image's start.

Everything here is host-side numpy; the engine thread owns the one `PrefixCache`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from osworld_jax.server.images import RequestImages


def prefix_key(
    ids: Sequence[int], images: RequestImages | None, image_token_id: int | None
) -> np.ndarray:
    """i64[len(ids)]: token ids, with image k's tokens keyed by a hash of its bytes (< 0).

    Image keys are ``-1 - h_k`` with ``h_k`` the first 62 bits of the image's sha256, so they
    never equal a token id and two different images (almost surely) never share one.
    """
    key = np.asarray(ids, np.int64)
    if images is None or image_token_id is None:
        return key
    pads = np.flatnonzero(key == image_token_id)
    values = np.repeat(
        [-1 - (int.from_bytes(d[:8], "little") >> 2) for d in images.digests],
        images.num_tokens,
    )
    if len(values) != len(pads):  # the caller validated the expansion; be loud if not
        raise ValueError(f"prefix_key: {len(pads)} image tokens, images give {len(values)}")
    key[pads] = values
    return key


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two key arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def whole_images(key: np.ndarray, m: int) -> int:
    """``m`` cut back so that it does not end inside an image's run of tokens."""
    while 0 < m < len(key) and key[m] < 0 and key[m - 1] == key[m]:
        m -= 1
    return m


@dataclass(kw_only=True)
class Entry:
    """What a free slot's cache rows hold.

    Attributes:
      key: i64[n] keys of the tokens whose KV is in rows ``[0, n)``.
      routes: i32[n, L, K] the routes of those tokens (served again to a request reusing them).
      last_used: monotonic time of the last store or hit (eviction order).
    """

    key: np.ndarray
    routes: np.ndarray
    last_used: float = field(default_factory=time.monotonic)


class PrefixCache:
    """The kept sequence of each free slot, and the choice of a slot for a new request.

    Args:
      num_slots: KV-cache slots of the engine.
      enabled: False keeps nothing (every request gets an empty slot; SGLang's
        ``--disable-radix-cache``).

    Attributes:
      hits, hit_tokens: requests (and tokens) served from kept rows, for ``/v1/loads``.
    """

    def __init__(self, num_slots: int, enabled: bool = True) -> None:
        self.entries: list[Entry | None] = [None] * num_slots
        self.enabled = enabled
        self.hits = 0
        self.hit_tokens = 0

    def store(self, slot: int, key: np.ndarray, routes: np.ndarray) -> None:
        """Records that ``slot``'s rows ``[0, len(key))`` hold ``key``'s KV (now free)."""
        n = min(len(key), len(routes))
        if self.enabled and n > 0:
            self.entries[slot] = Entry(key=key[:n].copy(), routes=routes[:n])

    def drop(self, slot: int) -> None:
        """Forgets ``slot``'s rows (it is about to be overwritten)."""
        self.entries[slot] = None

    def clear(self) -> None:
        """Forgets every slot (new weights, a flush, an engine error)."""
        self.entries = [None] * len(self.entries)

    def choose(
        self,
        free: Sequence[int],
        key: np.ndarray,
        limit: int,
        worth: Callable[[int], bool] = lambda m: m > 0,
    ) -> tuple[int, int, np.ndarray | None]:
        """The slot for a request with ``key``; (slot, reused tokens m, their routes or None).

        The slot with the longest reusable prefix wins (at most ``limit`` tokens, whole images
        only) when ``worth(m)``; otherwise an empty slot, else the least recently used kept
        sequence.
        """
        best, best_m = None, 0
        if self.enabled and limit > 0:
            for s in free:
                e = self.entries[s]
                if e is not None:
                    m = whole_images(key, min(common_prefix(e.key, key), limit))
                    if m > best_m:
                        best, best_m = s, m
        if best is not None and worth(best_m):
            entry = self.entries[best]
            assert entry is not None
            self.hits += 1
            self.hit_tokens += best_m
            return best, best_m, entry.routes[:best_m]
        empty = [s for s in free if self.entries[s] is None]
        if empty:
            return empty[0], 0, None
        oldest = min(free, key=lambda s: self.entries[s].last_used)  # type: ignore[union-attr]
        return oldest, 0, None
