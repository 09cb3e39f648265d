"""Host memory of the embedded server's images (numpy only, no jax).

The decoded-pixel budget of in-flight requests (`ImageBudget`, ``--max-server-image-pixels``)
and the processed-image cache by content hash (`ProcessedImageCache`, ``--vlm-cache-size-mb``).
"""

from __future__ import annotations

import collections
import threading
from typing import Protocol

import numpy as np

from osworld_jax.server.images import ImageRequestError


class Processed(Protocol):
    """What the cache keeps of a processed image (`osworld_jax.server.images.DecodedImage`)."""

    @property
    def levels(self) -> np.ndarray:
        """The image's uint8 patch levels."""
        ...

    @property
    def digest(self) -> bytes:
        """sha256 of its encoded bytes."""
        ...


class ImageBudget:
    """Decoded image pixels held across the whole server (thread-safe).

    A body's images reserve their pixels (`reserve`) before any is decoded and keep them until
    every request of the body has been prefilled or finished (its levels are dropped then);
    a body that would take the server past ``max_pixels`` gets a 400 naming the limit.
    """

    def __init__(self, max_pixels: int) -> None:
        self.max_pixels = max_pixels
        self.in_use = 0
        self._lock = threading.Lock()

    def reserve(self, pixels: int, where: str) -> ImageHold:
        """Takes ``pixels`` from the budget, or raises `ImageRequestError` naming the limit."""
        with self._lock:
            if self.in_use + pixels > self.max_pixels:
                raise ImageRequestError(
                    f"{where}: its images decode to {pixels} pixels and the server holds "
                    f"{self.in_use} of --max-server-image-pixels ({self.max_pixels}); retry later"
                )
            self.in_use += pixels
        return ImageHold(self, pixels)

    def _give_back(self, pixels: int) -> None:
        with self._lock:
            self.in_use -= pixels


class ImageHold:
    """Pixels reserved in an `ImageBudget` for ``refs`` holders; the last `release` frees them."""

    def __init__(self, budget: ImageBudget, pixels: int) -> None:
        self._budget, self.pixels, self.refs = budget, pixels, 1
        self._lock = threading.Lock()

    def release(self, n: int = 1) -> None:
        """Drops ``n`` holders; the pixels return to the budget when none is left."""
        with self._lock:
            if self.refs <= 0:
                return
            self.refs = max(0, self.refs - n)
            done = self.refs == 0
        if done:
            self._budget._give_back(self.pixels)


class ProcessedImageCache:
    """Processed images by the sha256 of their encoded bytes; the least recently used go first.

    An agent's screenshot reaches the server again at each later turn that keeps it in context,
    and the owners forked from one task send the same first screenshot: each is decoded and
    patchified once while it stays within ``max_bytes`` of uint8 patch levels (6.0 MiB for a
    1920x1080 screenshot at Qwen3-VL's budget, whose PNG decode and patchify take ~0.1 s of a
    core). Thread-safe: a body's images are processed in threads. SGLang's analogue is
    ``SGLANG_VLM_CACHE_SIZE_MB`` (it holds the tower's outputs; this holds its inputs, whose
    tower pass the prefix cache already skips for the images a kept prefix holds).

    >>> from osworld_jax.server.images import DecodedImage
    >>> cache = ProcessedImageCache(max_bytes=100)
    >>> img = lambda key, n: DecodedImage(levels=np.zeros(n, np.uint8), grid=np.zeros((1, 3)),
    ...                                   num_tokens=1, digest=key, raw=b"")
    >>> cache.put(img(b"a", 60)); cache.put(img(b"b", 30))
    >>> cache.get(b"a") is not None  # a is now the most recently used
    True
    >>> cache.put(img(b"c", 30))  # 120 > 100: b, the least recently used, goes
    >>> [cache.get(k) is not None for k in (b"a", b"b", b"c")], cache.hits, cache.misses
    ([True, False, True], 3, 1)
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max(0, int(max_bytes))
        self._items: collections.OrderedDict[bytes, Processed] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, digest: bytes) -> Processed | None:
        """The processed image of these bytes' digest, or None (counted as a miss)."""
        with self._lock:
            hit = self._items.get(digest)
            if hit is None:
                self.misses += 1
                return None
            self._items.move_to_end(digest)
            self.hits += 1
            return hit

    def put(self, image: Processed) -> None:
        """Keeps ``image`` (its levels made read-only), evicting the least recently used."""
        size = image.levels.nbytes
        if size > self.max_bytes:
            return
        image.levels.flags.writeable = False  # shared by every request that sends these bytes
        with self._lock:
            if image.digest in self._items:
                return
            while self._bytes + size > self.max_bytes:
                _, old = self._items.popitem(last=False)
                self._bytes -= old.levels.nbytes
            self._items[image.digest] = image
            self._bytes += size

    @property
    def nbytes(self) -> int:
        """Bytes of levels held."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)
