"""What the client knows about each server it talks to (`SGLangClient.servers`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class ServerState:
    """What the client knows about one server.

    Attributes:
      url: base URL.
      outstanding: requests in flight to it from this client.
      healthy: its last ``/health`` probe (or request) succeeded.
      in_rotation: False after a failed refit (it may hold old weights) until a refit succeeds.
      weight_version: its last reported weight version (None before the first probe).
      last_error: the last failure seen, for diagnostics.
      dispatched: ``/generate`` attempts sent to it (retries included), for load metrics.
      failed: attempts to it that failed with a connection error, timeout or 5xx.
    """

    url: str
    outstanding: int = 0
    dispatched: int = 0
    failed: int = 0
    healthy: bool = True
    in_rotation: bool = True
    weight_version: str | None = None
    last_error: str | None = None

    @property
    def usable(self) -> bool:
        """Healthy and in rotation."""
        return self.healthy and self.in_rotation
