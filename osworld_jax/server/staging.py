"""Weights staged in this process for the server, by handle (the colocated refit's payload).

The trainer casts its new parameters on the device and puts them here (`Staging.put`); the
refit's ``/update_weights_from_tensor`` request names the handle (``load_format =
osworld_jax.contract.refit.STAGED_FORMAT``) and the server takes the arrays (`Staging.take`):
a hand-over of device arrays, no copy and no file. Only a server in the trainer's process
(`osworld_jax.server.colocated`) has a staging area; any other refuses the format.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any


class Staging:
    """Handle -> staged parameter tree (thread-safe: the trainer puts, the server takes)."""

    #: Staged trees kept at most (a refit that never came would otherwise hold device memory).
    MAX_STAGED = 2

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[str, Any] = {}

    def put(self, params: Any) -> str:
        """Stages ``params``; returns its handle. The oldest staged tree beyond `MAX_STAGED`
        is dropped (its refit can no longer be asked for)."""  # noqa: D205, D209
        handle = f"staged-{uuid.uuid4().hex}"
        with self._lock:
            self._items[handle] = params
            while len(self._items) > self.MAX_STAGED:
                self._items.pop(next(iter(self._items)))
        return handle

    def take(self, handle: str) -> Any | None:
        """The tree staged as ``handle`` (removed from here), or None."""
        with self._lock:
            return self._items.pop(handle, None)

    def discard(self, handle: str) -> None:
        """Forgets ``handle`` (a refit that failed before the server took it)."""
        self.take(handle)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
