"""Typed errors both sides of the trainer–server contract raise (client, servers, refit)."""

from __future__ import annotations

from osworld_jax.errors import InfraError, OsworldJaxError


class RolloutError(OsworldJaxError):
    """Base of every error the rollout room raises on purpose."""


class ServerUnavailable(RolloutError, InfraError):
    """No healthy server answered within the retry budget (connection errors, timeouts, 5xx)."""


class ReplyValidationError(RolloutError, InfraError):
    """A server reply broke the wire contract (logprob count/ids, routed-expert rows, version).

    Attributes:
      rid: the request id of the offending reply.
    """

    def __init__(self, rid: str, message: str) -> None:
        super().__init__(f"request {rid!r}: {message}")
        self.rid = rid


class AbortBudgetExceeded(RolloutError, InfraError):
    """A request kept finishing with ``abort`` beyond the resubmission budget: the owner failed.

    Attributes:
      rid: the request id.
    """

    def __init__(self, rid: str, message: str) -> None:
        super().__init__(f"request {rid!r}: {message}")
        self.rid = rid


class RequestRejected(RolloutError):
    """A server rejected a request with a 4xx status: the request itself is wrong (not retried).

    Attributes:
      rid: the request id.
      status: the HTTP status.
    """

    def __init__(self, rid: str, status: int, message: str) -> None:
        super().__init__(f"request {rid!r}: HTTP {status}: {message}")
        self.rid = rid
        self.status = status


class RefitError(RolloutError):
    """A weight refit left no server on the new weights (every server failed a refit step)."""


class EngineError(RolloutError):
    """The embedded engine cannot serve a request (bad model directory, unsupported config)."""
