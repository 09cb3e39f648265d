"""The weight-refit protocol: how new weights reach a server, as both sides speak it.

A refit moves every server to the trainer's new weights under a version string. Per server the
client runs SGLang's canonical order (../shared/SGLANG_API.md): ``/pause_generation`` (abort:
in-flight requests come back aborted and are resubmitted on the new weights) ->
``/flush_cache`` (polled: 400 while busy) -> the update below -> ``/continue_generation`` ->
``/model_info`` must report the new ``weight_version``. What differs between paths is the update:

- `DiskWeights`: ``POST /update_weights_from_disk {model_path, weight_version, ...}``, an HF
  checkpoint directory (any server; the fallback, chosen explicitly).
- `TensorWeights`: ``POST /update_weights_from_tensor`` per bucket, SGLang's body
  ``{serialized_named_tensors: [one payload per tensor-parallel rank], load_format,
  flush_cache, abort_all_requests, weight_version}``; ``load_format`` says what a payload is:
  `STAGED_FORMAT` (the embedded server in the trainer's process: a handle to arrays the trainer
  staged on the device, no copy and no file) or SGLang's own formats for real SGLang servers
  (`TENSOR_FORMATS`: serialized tensors shared by handle between processes on one host).

Exactness: a server that can report a digest of what it now serves (the embedded server
returns `DIGEST_KEY` in the update's reply: `osworld_jax.model.digest.params_digest` of its
parameters) is checked against the digest of the trainer's cast (``expected_digest``): a refit
that does not serve the trainer's bf16 values bit for bit takes the server out of rotation.
No jax here: the digests are computed by the model room on either side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

#: ``load_format`` of an in-process hand-over (the embedded server in the trainer's process).
STAGED_FORMAT = "osworld_jax_staged"
#: Real SGLang's ``load_format`` values for ``/update_weights_from_tensor`` payloads: None (a
#: list of ``(name, tensor)`` serialized by ``MultiprocessingSerializer``) and
#: ``"flattened_bucket"`` (one flat tensor per dtype plus metadata).
TENSOR_FORMATS: tuple[str | None, ...] = (None, "flattened_bucket")
#: The key of the update's reply that carries the served weights' digest (embedded server).
DIGEST_KEY = "weights_digest"

#: How the RL loop moves weights (``ServerConfig.refit``): ``auto`` picks ``memory`` where the
#: server can take it (the colocated embedded server), else ``disk``.
RefitPath = Literal["auto", "memory", "disk"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiskWeights:
    """An HF checkpoint directory written by the trainer (``/update_weights_from_disk``).

    Attributes:
      path: the directory (absolute).
      expected_digest: the digest of the trainer's cast (None: not checked).
    """

    path: str
    expected_digest: str | None = None

    def requests(self, weight_version: str) -> list[tuple[str, dict[str, Any]]]:
        """The update's ``(endpoint, body)`` list (one request)."""
        body = {"model_path": self.path, "weight_version": weight_version, "flush_cache": True}
        return [("/update_weights_from_disk", body)]

    def describe(self) -> str:
        """One line for logs and errors."""
        return self.path


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorWeights:
    """Weights handed over in memory (``/update_weights_from_tensor``, one request a bucket).

    Attributes:
      buckets: per request, its ``serialized_named_tensors`` (one payload per tensor-parallel
        rank; one handle for `STAGED_FORMAT`).
      load_format: `STAGED_FORMAT` or one of `TENSOR_FORMATS`.
      expected_digest: the digest of the trainer's cast (None: not checked).
      label: what the payload is, for logs (e.g. ``"staged 1.9e9 parameters"``).
    """

    buckets: tuple[tuple[str, ...], ...]
    load_format: str | None
    expected_digest: str | None = None
    label: str = "tensors"

    def __post_init__(self) -> None:
        if not self.buckets or any(not b for b in self.buckets):
            raise ValueError("TensorWeights needs at least one bucket, each with a payload")
        if self.load_format != STAGED_FORMAT and self.load_format not in TENSOR_FORMATS:
            raise ValueError(f"TensorWeights.load_format {self.load_format!r} is not known")

    def requests(self, weight_version: str) -> list[tuple[str, dict[str, Any]]]:
        """The update's ``(endpoint, body)`` list: one request a bucket; only the last one
        flushes the cache and sets ``weight_version`` (SGLang applies each bucket as it
        arrives; the version names the whole set)."""  # noqa: D205, D209
        out = []
        last = len(self.buckets) - 1
        for i, payloads in enumerate(self.buckets):
            body: dict[str, Any] = {
                "serialized_named_tensors": list(payloads),
                "load_format": self.load_format,
                "flush_cache": i == last,
                "abort_all_requests": False,
            }
            if i == last:
                body["weight_version"] = weight_version
            out.append(("/update_weights_from_tensor", body))
        return out

    def describe(self) -> str:
        """One line for logs and errors."""
        return f"{self.label} in {len(self.buckets)} bucket(s), load_format={self.load_format}"


#: What a refit moves a server to.
Weights = DiskWeights | TensorWeights


def check_digest(reply: dict[str, Any], expected: str | None) -> str | None:
    """None when the update's reply agrees with ``expected`` (or either has no digest), else
    the mismatch in one line."""  # noqa: D205, D209
    got = reply.get(DIGEST_KEY)
    if expected is None or got is None:
        return None
    if got == expected:
        return None
    theirs = dict(p.split("=", 1) for p in str(got).partition(":")[2].split(",") if "=" in p)
    ours = dict(p.split("=", 1) for p in expected.partition(":")[2].split(",") if "=" in p)
    differ = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
    where = f" (first: {differ[0]})" if differ else ""
    return (
        f"the served weights differ from the trainer's bf16 cast in {len(differ)} tensor(s)"
        f"{where}: not bit-exact"
    )


def join_digests(parts: Sequence[tuple[str, int]]) -> str:
    """One digest string from ``(leaf path, uint32 digest)`` pairs, in the given order.

    >>> join_digests([("a", 1), ("b", 255)])
    '2:a=00000001,b=000000ff'
    """
    body = ",".join(f"{name}={value & 0xFFFFFFFF:08x}" for name, value in parts)
    return f"{len(parts)}:{body}"


# --- Real SGLang's in-memory endpoints: weights made bucket by bucket while the refit runs ---

#: How weights reach a real SGLang server (`osworld_jax.rollout.config.SGLangRefitConfig`):
#: ``disk`` (`DiskWeights`, the fallback), ``tensor`` (``/update_weights_from_tensor``: CUDA
#: tensors shared by IPC handle, servers on the trainer's host) or ``distributed``
#: (``/init_weights_update_group`` once, then ``/update_weights_from_distributed`` per bucket
#: while the trainer, rank 0 of a process group with the server's ranks, broadcasts).
SGLangRefitPath = Literal["disk", "tensor", "distributed"]

#: SGLang's weight-update session (builds from mid-2026 on, ../shared/SGLANG_API.md): an
#: in-memory update is wrapped in these two requests (bodies ``{}``).
SESSION_BEGIN = "/begin_weight_update"
SESSION_END = "/end_weight_update"


@dataclasses.dataclass(frozen=True, kw_only=True)
class UpdateStep:
    """One request of a `StreamedWeights` update.

    Attributes:
      endpoint: the route, e.g. ``/update_weights_from_tensor``.
      body: its JSON body.
      during: the trainer's side of the request, run on a worker thread while the request is
        in flight (the rank-0 half of a collective the server joins: joining the group,
        broadcasting a bucket); None when the body carries everything.
      expect_success: the reply must be JSON with a true ``success`` (SGLang's update replies);
        False: any 200 will do (the session requests, whose reply shape is not pinned).
    """

    endpoint: str
    body: dict[str, Any]
    during: Callable[[], None] | None = None
    expect_success: bool = True


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamedWeights:
    """Weights made one bucket at a time while the refit runs (real SGLang servers).

    ``steps(url, weight_version)`` yields the server's `UpdateStep` list lazily: the client asks
    for the next step only after the previous request answered, so the producer holds one bucket
    per server at a time (the bucket size bounds the extra device memory) and may free it once
    its request returned. Made by `osworld_jax.trainer.sglang_weights`.

    Attributes:
      steps: ``(server url, weight_version) -> iterator of UpdateStep``.
      expected_digest: the digest of the trainer's cast (None: not checked).
      label: what is moved, for logs and errors.
    """

    steps: Callable[[str, str], Iterator[UpdateStep]]
    expected_digest: str | None = None
    label: str = "streamed tensors"

    def describe(self) -> str:
        """One line for logs and errors."""
        return self.label


def update_problem(
    step: UpdateStep, status: int, text: str, expected_digest: str | None
) -> str | None:
    """None when an update request's reply (``status``, body ``text``) says it worked and its
    weights digest (if any) agrees with ``expected_digest``; else the problem in one line."""  # noqa: D205, D209
    reply: Any = None
    with contextlib.suppress(ValueError):
        reply = json.loads(text)
    ok = status == 200 and (
        not step.expect_success or (isinstance(reply, dict) and bool(reply.get("success")))
    )
    if not ok:
        return f"{step.endpoint} answered {status}: {text[:300]}"
    problem = check_digest(reply, expected_digest) if isinstance(reply, dict) else None
    return None if problem is None else f"{step.endpoint}: {problem}"
