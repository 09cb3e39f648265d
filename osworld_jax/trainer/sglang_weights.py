"""The trainer's side of real SGLang's in-memory refit (`SGLangRefitConfig.path`).

The policy's HF tensors (`osworld_jax.model.hf_io.hf_tensors` with ``on_device=True``: the names,
layouts and values of the disk export, made on the device) are cut into buckets of at most
``bucket_bytes`` (consecutive tensors of one dtype) and sent one request a bucket, as a
`StreamedWeights` the client pulls lazily (one bucket per server alive at a time):

- ``tensor``: ``POST /update_weights_from_tensor`` with SGLang's body. A bucket is copied
  device to device into one torch-allocated flat buffer (torch's CUDA IPC shares only storage
  from its caching allocator; a ``torch.from_dlpack`` view of a jax array is XLA's memory) and
  serialized as SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)`` does:
  ``base64(ForkingPickler.dumps(obj))``, so a CUDA tensor travels as an IPC handle to the
  buffer, never as bytes. ``obj`` is ``[(name, view into the buffer), ...]`` (``load_format``
  None: one handle per bucket, as every view shares the buffer's storage) or SGLang's
  flattened bucket ``{"flattened_tensor": buffer, "metadata": [FlattenedTensorMetadata]}``.
  Every tensor-parallel rank gets the same payload (it reads the trainer's GPU over peer
  access). With ``sglang`` importable here its own serializer is used (it records device UUIDs,
  so the trainer and the server may number GPUs differently); without it the handle carries
  the trainer's device index, so both must see the same ``CUDA_VISIBLE_DEVICES``. CPU tensors
  (tests) are shared through torch.multiprocessing's ``file_system`` strategy: a named
  shared-memory file any number of readers can open.
- ``distributed``: on its first refit a server gets ``POST /init_weights_update_group`` while
  the trainer joins the same group as rank 0 (`init_custom_process_group`, one group per
  server: ``world_size = 1 + tp_size``, ``rank_offset = 1``); then per bucket ``POST
  /update_weights_from_distributed {names, dtypes, shapes, group_name, ...}`` while the
  trainer broadcasts the bucket's tensors in that order (zero-copy ``torch.from_dlpack`` views
  of the jax arrays; ``flattened_bucket``: one concatenated tensor). Broadcasts to different
  servers' groups are serialized (one communicator busy at a time).

torch is imported inside the functions: only these paths need it.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import datetime
import functools
import inspect
import io
import socket
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from osworld_jax.contract.refit import (
    SESSION_BEGIN,
    SESSION_END,
    StreamedWeights,
    UpdateStep,
)
from osworld_jax.model.hf_io import hf_tensors
from osworld_jax.model.policy import Policy
from osworld_jax.rollout.config import SGLangRefitConfig

#: A bucket: consecutive ``(HF name, jax array)`` pairs of one dtype.
Bucket = list[tuple[str, Any]]


def buckets(named: Iterable[tuple[str, Any]], bucket_bytes: int) -> Iterator[tuple[Bucket, bool]]:
    """Cuts ``named`` into buckets of one dtype and at most ``bucket_bytes`` each (a larger
    tensor is a bucket of its own), in order; yields ``(bucket, is_last)``.

    One tensor is read ahead to know which bucket is the last (it carries the weight version).

    >>> import numpy as np
    >>> a, b = np.zeros(4, np.float32), np.zeros(2, np.int8)
    >>> [([n for n, _ in bk], last) for bk, last in buckets([("x", a), ("y", a), ("z", b)], 20)]
    [(['x'], False), (['y'], False), (['z'], True)]
    """  # noqa: D205, D209
    it = iter(named)
    bucket: Bucket = []
    size = 0
    nxt = next(it, None)
    while nxt is not None:
        name, arr = nxt
        nxt = next(it, None)
        if bucket and (arr.dtype != bucket[0][1].dtype or size + arr.nbytes > bucket_bytes):
            yield bucket, False
            bucket, size = [], 0
        bucket.append((name, arr))
        size += arr.nbytes
        if nxt is None:
            yield bucket, True


def _torch_views(bucket: Bucket) -> list[tuple[str, Any]]:
    """Zero-copy torch views of the bucket's jax arrays (same device)."""
    import torch

    return [(name, torch.from_dlpack(arr)) for name, arr in bucket]


def _flat_copy(views: list[tuple[str, Any]]) -> tuple[Any, list[tuple[str, Any]]]:
    """One torch-allocated flat buffer holding the views (device to device), and a view of it
    per tensor, each shaped as its source."""  # noqa: D205, D209
    import torch

    first = views[0][1]
    flat = torch.empty(sum(v.numel() for _, v in views), dtype=first.dtype, device=first.device)
    out, off = [], 0
    for name, v in views:
        n = v.numel()
        flat[off : off + n].copy_(v.reshape(-1))
        out.append((name, flat[off : off + n].view(v.shape)))
        off += n
    if flat.device.type == "cuda":
        torch.cuda.current_stream(flat.device).synchronize()
    return flat, out


def _flattened_metadata_class() -> Any:
    """SGLang's ``FlattenedTensorMetadata`` (its unpickler resolves the class by name, so the
    payload must name SGLang's own)."""  # noqa: D205, D209
    try:
        from sglang.srt.weight_sync.tensor_bucket import (  # type: ignore[import-not-found]
            FlattenedTensorMetadata,
        )
    except ImportError as e:
        raise RuntimeError(
            "SGLangRefitConfig.load_format = 'flattened_bucket' with path = 'tensor' needs sglang "
            "importable in the trainer (its FlattenedTensorMetadata); use load_format None"
        ) from e
    return FlattenedTensorMetadata


def flattened_bucket(flat: Any, views: list[tuple[str, Any]]) -> dict[str, Any]:
    """SGLang's ``flattened_bucket`` object: the flat buffer and each tensor's slice of it."""
    meta_cls = _flattened_metadata_class()
    metadata, off = [], 0
    for name, v in views:
        n = v.numel()
        metadata.append(
            meta_cls(
                name=name, shape=v.shape, dtype=v.dtype, start_idx=off, end_idx=off + n, numel=n
            )
        )
        off += n
    return {"flattened_tensor": flat, "metadata": metadata}


def serialize(obj: Any) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)`` (its own when
    importable): base64 of ``ForkingPickler`` bytes; tensors travel by handle."""  # noqa: D205, D209
    try:
        from sglang.srt.utils import MultiprocessingSerializer  # type: ignore[import-not-found]
    except ImportError:
        MultiprocessingSerializer = None  # noqa: N806
    if MultiprocessingSerializer is not None:
        return str(MultiprocessingSerializer.serialize(obj, output_str=True))
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as tmp  # registers torch's reductions with ForkingPickler

    before = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")  # CPU storage: a named file many readers open
    try:
        buf = io.BytesIO()
        ForkingPickler(buf).dump(obj)
    finally:
        tmp.set_sharing_strategy(before)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _dtype_name(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


def _session(cfg: SGLangRefitConfig, end: bool) -> Iterator[UpdateStep]:
    if cfg.weight_update_session:
        yield UpdateStep(
            endpoint=SESSION_END if end else SESSION_BEGIN, body={}, expect_success=False
        )


def tensor_steps(
    policy: Policy, cfg: SGLangRefitConfig, tp_size: int, weight_version: str
) -> Iterator[UpdateStep]:
    """The ``tensor`` path's requests for one server, one bucket made per request."""
    yield from _session(cfg, end=False)
    named = hf_tensors(policy.params(), policy.config, on_device=True)
    for bucket, last in buckets(named, cfg.bucket_bytes):
        flat, views = _flat_copy(_torch_views(bucket))
        obj = views if cfg.load_format is None else flattened_bucket(flat, views)
        body: dict[str, Any] = {
            "serialized_named_tensors": [serialize(obj)] * tp_size,
            "load_format": cfg.load_format,
            "flush_cache": last,
            "abort_all_requests": False,
        }
        if last:
            body["weight_version"] = weight_version
        yield UpdateStep(endpoint="/update_weights_from_tensor", body=body)
        del flat, views, obj  # the server has loaded it: the buffer may go
    yield from _session(cfg, end=True)


def init_custom_process_group(
    *,
    backend: str,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float,
) -> Any:
    """A torch process group outside the default one, as SGLang's ``init_custom_process_group``
    makes it (a TCP rendezvous, the store prefixed by ``group_name``), so the trainer (rank 0)
    and an SGLang server's ranks (``rank_offset + tp_rank``) meet in it."""  # noqa: D205, D209
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = datetime.timedelta(seconds=timeout_s)
    url = f"tcp://{master_address}:{master_port}"
    store, rank, world_size = next(rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    # torch renamed pg_options to backend_options (2.6); take whichever this torch has.
    params = inspect.signature(_new_process_group_helper).parameters
    options = "backend_options" if "backend_options" in params else "pg_options"
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        store,
        group_name=group_name,  # type: ignore[arg-type]  # a GroupName is a str
        timeout=timeout,
        **{options: None},
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass
class DistributedSender:
    """The trainer's end (rank 0) of one process group per SGLang server, kept across refits.

    Attributes:
      cfg: the refit settings (address, ports, backend, timeouts, bucket size, format).
      tp_size: each server's tensor-parallel ranks (the group is ``1 + tp_size`` wide).
    """

    cfg: SGLangRefitConfig
    tp_size: int = 1
    _groups: dict[str, tuple[str, Any]] = dataclasses.field(default_factory=dict)
    _joins: int = 0
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def steps(self, policy: Policy, url: str, weight_version: str) -> Iterator[UpdateStep]:
        """The ``distributed`` path's requests for the server at ``url``."""
        cfg = self.cfg
        if url not in self._groups:
            yield self._join_step(url)
        group_name, _ = self._groups[url]
        yield from _session(cfg, end=False)
        named = hf_tensors(policy.params(), policy.config, on_device=True)
        for bucket, last in buckets(named, cfg.bucket_bytes):
            views = _torch_views(bucket)
            body: dict[str, Any] = {
                "names": [n for n, _ in views],
                "dtypes": [_dtype_name(v) for _, v in views],
                "shapes": [list(v.shape) for _, v in views],
                "group_name": group_name,
                "flush_cache": last,
                "abort_all_requests": False,
            }
            if cfg.load_format is not None:
                body["load_format"] = cfg.load_format
            if last:
                body["weight_version"] = weight_version
            yield UpdateStep(
                endpoint="/update_weights_from_distributed",
                body=body,
                during=functools.partial(self._broadcast, url, views),
            )
        yield from _session(cfg, end=True)

    def _join_step(self, url: str) -> UpdateStep:
        cfg = self.cfg
        index, self._joins = self._joins, self._joins + 1
        port = cfg.master_port + index if cfg.master_port else _free_port(cfg.master_address)
        group_name = f"osworld_jax_refit_{index}"
        world = 1 + self.tp_size

        def join() -> None:
            try:
                pg = init_custom_process_group(
                    backend=cfg.backend,
                    master_address=cfg.master_address,
                    master_port=port,
                    world_size=world,
                    rank=0,
                    group_name=group_name,
                    timeout_s=cfg.group_timeout_s,
                )
            except BaseException:
                self._groups.pop(url, None)  # the next refit tries to join again
                raise
            self._groups[url] = (group_name, pg)

        self._groups[url] = (group_name, None)  # named now: the bodies that follow need it
        body = {
            "master_address": cfg.master_address,
            "master_port": port,
            "rank_offset": 1,
            "world_size": world,
            "group_name": group_name,
            "backend": cfg.backend,
        }
        return UpdateStep(endpoint="/init_weights_update_group", body=body, during=join)

    def _broadcast(self, url: str, views: list[tuple[str, Any]]) -> None:
        """Rank 0 sends ``views`` to the server's ranks, in the body's order."""
        import torch.distributed as dist

        _, pg = self._groups[url]
        if pg is None:
            raise RuntimeError(f"{url}: the weight-update group was never joined")
        with self._lock:
            if self.cfg.load_format == "flattened_bucket":
                flat, _ = _flat_copy(views)
                dist.broadcast(flat, src=0, group=pg)
            else:
                for _, v in views:
                    dist.broadcast(v.contiguous(), src=0, group=pg)

    def forget(self, url: str) -> None:
        """Drops the group of ``url`` (a restarted server joins a new one on its next refit)."""
        entry = self._groups.pop(url, None)
        if entry is not None and entry[1] is not None:
            import torch.distributed as dist

            with contextlib.suppress(Exception):
                dist.destroy_process_group(entry[1])

    def close(self) -> None:
        """Destroys every group."""
        for url in list(self._groups):
            self.forget(url)


def sglang_weights(
    policy: Policy,
    cfg: SGLangRefitConfig,
    *,
    tp_size: int = 1,
    sender: DistributedSender | None = None,
    expected_digest: str | None = None,
) -> StreamedWeights:
    """What `SGLangClient.refit` sends real SGLang servers for ``cfg.path`` ``tensor`` or
    ``distributed`` (``disk`` writes a checkpoint: `osworld_jax.contract.refit.DiskWeights`).

    Args:
      policy: the weights to serve (the `Policy` ``Trainer.export_hf`` would write).
      cfg: the refit settings.
      tp_size: each server's tensor-parallel size (``tensor``: one payload per rank).
      sender: ``distributed``: the trainer's groups, kept across refits (required).
      expected_digest: the digest of the trainer's cast, checked where a reply carries one.
    """  # noqa: D205, D209
    if cfg.path == "tensor":
        return StreamedWeights(
            steps=lambda url, version: tensor_steps(policy, cfg, tp_size, version),
            expected_digest=expected_digest,
            label=f"tensors by handle in buckets of <= {cfg.bucket_bytes} bytes",
        )
    if cfg.path == "distributed":
        if sender is None:
            raise ValueError("SGLangRefitConfig.path = 'distributed' needs a DistributedSender")
        return StreamedWeights(
            steps=lambda url, version: sender.steps(policy, url, version),
            expected_digest=expected_digest,
            label=f"{cfg.backend} broadcast in buckets of <= {cfg.bucket_bytes} bytes",
        )
    raise ValueError(
        f"SGLangRefitConfig.path = {cfg.path!r} moves no tensors in memory (write a checkpoint "
        "and refit with DiskWeights)"
    )
