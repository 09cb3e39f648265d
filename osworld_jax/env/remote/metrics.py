"""``RemoteMetrics``: the remote backend's counters (forks by fork vs by snapshot, retries...)."""

from __future__ import annotations

import dataclasses

__all__ = ["RemoteMetrics"]


@dataclasses.dataclass
class RemoteMetrics:
    """Counters of the remote backend (monotonic).

    Attributes:
      creates: sandboxes created from the image.
      forks_by_fork: forked sandboxes made by the service's ``/fork``.
      forks_by_snapshot: forked sandboxes made from a snapshot (setup's launch steps re-run).
      snapshots: snapshots taken.
      deletes: sandboxes deleted.
      boot_timeouts: sandboxes that did not boot within ``boot_timeout_s``.
      lost: sandboxes that vanished mid-episode.
      leftovers_deleted: sandboxes deleted by ``aclose`` (not closed by their owner, or
        created by a request whose reply was lost).
      retries: lifecycle requests retried, by cause (``"429"``, ``"503"``, ``"connection"``...).
      creation_wait_s: time creations spent waiting for the rate limit (summed over callers).
    """

    creates: int = 0
    forks_by_fork: int = 0
    forks_by_snapshot: int = 0
    snapshots: int = 0
    deletes: int = 0
    boot_timeouts: int = 0
    lost: int = 0
    leftovers_deleted: int = 0
    retries: dict[str, int] = dataclasses.field(default_factory=dict)
    creation_wait_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        """The counters keyed ``sandbox/<name>`` (retries as ``sandbox/retries_<cause>``)."""
        out: dict[str, float] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, dict):
                out.update({f"sandbox/retries_{k}": v for k, v in sorted(value.items())})
            else:
                out[f"sandbox/{f.name}"] = value
        return out
