"""Multi-host JAX: one process per host, one `Mesh` over every device of every process.

``initialize_distributed(config)`` wraps ``jax.distributed.initialize`` (explicit values, the
``JAX_*`` environment variables, or SLURM auto-detection) and is idempotent. After it,
``jax.devices()`` lists the devices of all processes (process 0's first), so
``osworld_jax.model.make_mesh`` builds the global mesh unchanged and ``Trainer.train_step`` runs
SPMD: every process calls it with the **same** host batch (``jax.device_put`` of a host array onto
a global sharding keeps each process's own shards).

Roles of the processes:

- metrics: only `is_primary` (process 0) writes them;
- checkpoints: every process calls ``Trainer.save`` / ``Trainer.restore`` (orbax writes and reads
  each process's shards; the checkpoint directory must be on a filesystem all hosts share);
- data: every process draws the same task stream (one checkpointed position); process 0 uses
  the tasks;
- rollouts: process 0 drives all B x N owners (against its embedded server or any list of SGLang
  URLs), packs the batch, and `broadcast_host_batch` copies it to every process.

Process 0 also exports the refit weights (`export_hf_all_processes`: every process joins the
gather of the sharded parameters, process 0 writes).

Bounded collectives: every cross-process operation of the run is named (`barrier`, `collective`)
and first meets the other processes at a barrier of the coordination service (not of the
collectives backend) that times out after ``DistributedConfig.collective_timeout_s``, so a
process that never arrives (stuck, or on a different code path) makes the others fail with a
`CollectiveTimeout` that names the operation and where the missing process is instead of
waiting in gloo for 30 minutes. A collective that all processes reached but that does not
complete within the same time ends the process (exit code `STUCK_EXIT_CODE`) with one line
naming it and a dump of every thread's stack. Whether a process joins a collective must never
depend on its own view of the file system (the export race of issue 16 item 15): decisions
that differ between processes are taken on process 0 and published, or taken after the
collective.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import faulthandler
import functools
import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils

from osworld_jax.batch import Batch, RowImages, check_batch, from_arrays, to_arrays
from osworld_jax.errors import ConfigError
from osworld_jax.model.processor import ImageProcessor
from osworld_jax.registry import check_choice
from osworld_jax.trainer.state import TrainerError

logger = logging.getLogger(__name__)

#: Where the process values come from.
AutoMode = Literal["none", "slurm", "env"]
#: Cross-process collectives of the CPU backend.
CpuCollectives = Literal["gloo", "mpi"]

# The JAX_* variables of ``auto="env"`` (the first and last are also read by jax itself).
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "JAX_LOCAL_DEVICE_IDS"


class DistributedError(TrainerError):
    """Multi-process set-up failed or the processes disagree (the message names the field)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """How this process joins the multi-host JAX job (one process per host).

    Attributes:
      auto: where the process values come from. ``"none"``: the explicit fields below (all of
        ``coordinator_address``, ``num_processes``, ``process_id``; or none of them for a
        single-process run); ``"slurm"``: SLURM's ``SLURM_*`` variables through jax's SLURM
        cluster detector (coordinator = first node of the step, port from the job id or
        ``JAX_COORDINATOR_PORT``); ``"env"``: ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``,
        ``JAX_PROCESS_ID`` (and optional ``JAX_LOCAL_DEVICE_IDS``, comma-separated). Explicit
        fields override detected values.
      coordinator_address: ``host:port`` of process 0's coordinator service.
      num_processes: number of processes in the job.
      process_id: this process's index in ``[0, num_processes)``.
      local_device_ids: the local accelerators this process uses (``None``: all of them; with
        SLURM and several tasks per node, ``(SLURM_LOCALID,)``, one device per task, as jax
        does). Ignored by the CPU backend.
      cpu_collectives: cross-process collectives of the CPU backend (``"gloo"`` or ``"mpi"``);
        set before the backend starts. ``"gloo"`` ships with jaxlib.
      initialization_timeout_s: how long process start-up waits for the others (seconds).
      heartbeat_timeout_s: a process that sent no heartbeat for this long is declared dead and
        the job fails (instead of hanging in a collective).
      collective_timeout_s: how long a process waits for the others at a named collective
        (process 1 waits there while process 0 rolls out a step, so this bounds a step's
        rollout too) and how long a collective that every process reached may run; past it
        the run fails naming the process and the collective (see the module docstring).
      broadcast_chunk_bytes: the most bytes one collective of `broadcast_host_batch` carries
        (a step's host batch goes as a stream of chunks of this size).
    """

    auto: AutoMode = "none"
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None
    cpu_collectives: CpuCollectives = "gloo"
    initialization_timeout_s: int = 300
    heartbeat_timeout_s: int = 100
    collective_timeout_s: int = 3600
    broadcast_chunk_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        check_choice(self.auto, AutoMode, "DistributedConfig.auto")
        check_choice(self.cpu_collectives, CpuCollectives, "DistributedConfig.cpu_collectives")
        if self.num_processes is not None and self.num_processes < 1:
            raise ConfigError(f"DistributedConfig.num_processes: {self.num_processes} < 1")
        if self.process_id is not None and self.num_processes is not None:
            if not 0 <= self.process_id < self.num_processes:
                raise ConfigError(
                    f"DistributedConfig.process_id: {self.process_id} not in "
                    f"[0, {self.num_processes})"
                )
        if self.auto == "none":
            given = [
                f
                for f in ("coordinator_address", "num_processes", "process_id")
                if getattr(self, f) is not None
            ]
            if given and len(given) != 3:
                raise ConfigError(
                    f"DistributedConfig: auto='none' needs coordinator_address, num_processes "
                    f"and process_id together (got only {given})"
                )
        timeouts = (self.initialization_timeout_s, self.heartbeat_timeout_s)
        if min(*timeouts, self.collective_timeout_s) < 1:
            raise ConfigError("DistributedConfig: timeouts must be >= 1 s")
        if self.broadcast_chunk_bytes < 1:
            raise ConfigError("DistributedConfig.broadcast_chunk_bytes: must be >= 1")


@dataclasses.dataclass(frozen=True)
class ProcessValues:
    """The resolved values ``jax.distributed.initialize`` receives.

    Attributes:
      coordinator_address: ``host:port`` of the coordinator.
      num_processes: processes in the job.
      process_id: this process.
      local_device_ids: local accelerators of this process (None: all).
    """

    coordinator_address: str
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"${name}: expected an integer, got {value!r}") from None


def _env_ids(name: str) -> tuple[int, ...] | None:
    value = os.environ.get(name)
    if not value:
        return None
    try:
        return tuple(int(v) for v in value.split(","))
    except ValueError:
        raise DistributedError(
            f"${name}: expected comma-separated integers, got {value!r}"
        ) from None


def _slurm_values() -> tuple[str, int, int, tuple[int, ...] | None]:
    from jax._src.clusters.slurm_cluster import SlurmCluster

    if not SlurmCluster.is_env_present():
        raise DistributedError(
            "DistributedConfig.auto='slurm': not inside a SLURM step (need SLURM_JOB_ID, "
            "SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID; launch with srun)"
        )
    address = SlurmCluster.get_coordinator_address(
        timeout_secs=None, override_coordinator_port=os.environ.get("JAX_COORDINATOR_PORT")
    )
    count, pid = SlurmCluster.get_process_count(), SlurmCluster.get_process_id()
    nodes = _env_int("SLURM_STEP_NUM_NODES") or _env_int("SLURM_NNODES") or 1
    local_id = SlurmCluster.get_local_process_id()
    # One task per node owns all its devices; several tasks per node get one device each.
    device_ids = (local_id,) if count > nodes and local_id is not None else None
    return address, count, pid, device_ids


def resolve_process_values(config: DistributedConfig) -> ProcessValues | None:
    """The values of ``jax.distributed.initialize`` for ``config`` (None: single process).

    Raises:
      DistributedError: a detection source is absent or incomplete (names what is missing).
    """
    address, count, pid = config.coordinator_address, config.num_processes, config.process_id
    device_ids = config.local_device_ids
    if config.auto == "slurm":
        s_address, s_count, s_pid, s_ids = _slurm_values()
        address, count, pid = (
            address or s_address,
            count or s_count,
            pid if pid is not None else s_pid,
        )
        device_ids = device_ids if device_ids is not None else s_ids
    elif config.auto == "env":
        address = address or os.environ.get(ENV_COORDINATOR)
        count = count if count is not None else _env_int(ENV_NUM_PROCESSES)
        pid = pid if pid is not None else _env_int(ENV_PROCESS_ID)
        device_ids = device_ids if device_ids is not None else _env_ids(ENV_LOCAL_DEVICE_IDS)
        missing = [
            n
            for n, v in (
                (ENV_COORDINATOR, address),
                (ENV_NUM_PROCESSES, count),
                (ENV_PROCESS_ID, pid),
            )
            if v is None
        ]
        if missing:
            raise DistributedError(f"DistributedConfig.auto='env': ${', $'.join(missing)} unset")
    if address is None and count is None and pid is None:
        return None
    assert address is not None and count is not None and pid is not None
    if not 0 <= pid < count:
        raise DistributedError(f"process_id {pid} not in [0, {count})")
    return ProcessValues(address, count, pid, device_ids)


_initialized_with: ProcessValues | None = None


def initialize_distributed(config: DistributedConfig) -> ProcessValues | None:
    """Joins the multi-host job described by ``config`` (idempotent); call before any jax work.

    A second call with the same resolved values is a no-op; with different values it raises.
    A config that resolves to no process values (``auto="none"``, nothing set) is a
    single-process run and initialises nothing.

    Returns:
      The resolved `ProcessValues`, or None for a single-process run.

    Raises:
      DistributedError: values missing/inconsistent, or the job was already initialised
        differently.
    """
    global _initialized_with, _collective_timeout_s, _broadcast_chunk_bytes
    values = resolve_process_values(config)
    if values is None:
        return None
    _collective_timeout_s = config.collective_timeout_s
    _broadcast_chunk_bytes = config.broadcast_chunk_bytes
    if jax.distributed.is_initialized():
        if _initialized_with is not None and _initialized_with != values:
            raise DistributedError(
                f"initialize_distributed: already initialised as {_initialized_with}, "
                f"now asked for {values}"
            )
        if jax.process_count() != values.num_processes or jax.process_index() != values.process_id:
            raise DistributedError(
                f"initialize_distributed: jax runs as process {jax.process_index()} of "
                f"{jax.process_count()}, config says {values.process_id} of "
                f"{values.num_processes}"
            )
        return values
    jax.config.update("jax_cpu_collectives_implementation", config.cpu_collectives)
    try:
        jax.distributed.initialize(
            coordinator_address=values.coordinator_address,
            num_processes=values.num_processes,
            process_id=values.process_id,
            local_device_ids=list(values.local_device_ids) if values.local_device_ids else None,
            cluster_detection_method="deactivate",
            initialization_timeout=config.initialization_timeout_s,
            heartbeat_timeout_seconds=config.heartbeat_timeout_s,
        )
    except RuntimeError as e:  # jax ran computations already, or the coordinator is unreachable
        raise DistributedError(
            f"initialize_distributed: process {values.process_id} of {values.num_processes} "
            f"could not join {values.coordinator_address}: {e}"
        ) from e
    _initialized_with = values
    logger.info(
        "jax.distributed: process %d of %d, coordinator %s",
        values.process_id,
        values.num_processes,
        values.coordinator_address,
    )
    return values


def is_primary() -> bool:
    """Whether this is process 0: the one that writes metrics, logs and refit weights."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Blocks until every process reaches the barrier ``name`` (no-op with one process).

    A barrier of the coordination service (no device collective), bounded by
    ``collective_timeout_s``.

    Raises:
      CollectiveTimeout: a process did not arrive in time (the message says where it is).
    """
    if jax.process_count() > 1:
        _meet(name)


# ---------------------------------------------------------------------- bounded collectives

STUCK_EXIT_CODE = 124  # a collective every process reached did not complete (as `timeout`)
_KEY = "osworld_jax/collective"
_collective_timeout_s: float = DistributedConfig.collective_timeout_s
_broadcast_chunk_bytes: int = DistributedConfig.broadcast_chunk_bytes
_calls: collections.Counter[str] = collections.Counter()
_F = TypeVar("_F", bound=Callable[..., Any])


class CollectiveTimeout(DistributedError):
    """A process did not reach a named collective in time (the message names both)."""


def _client() -> Any:
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    if client is None:
        raise DistributedError("multi-process collective without jax.distributed.initialize")
    return client


def _where(client: Any, process: int) -> str:
    try:
        return str(client.key_value_try_get(f"{_KEY}/at/{process}"))
    except Exception:  # noqa: BLE001 - not published yet (or the service is gone)
        return "no named collective yet"


def _meet(name: str) -> str:
    """Waits (interruptibly) until every process reaches ``name``; returns its unique id.

    The n-th call of ``name`` on each process meets the n-th call on the others. Each process
    publishes where it is, so a timeout can say where the missing ones are.
    """
    me, count, timeout = jax.process_index(), jax.process_count(), _collective_timeout_s
    at = f"{name}#{_calls[name]}"
    _calls[name] += 1
    client = _client()
    client.key_value_set(f"{_KEY}/at/{me}", at, allow_overwrite=True)
    failure: list[BaseException] = []

    def wait() -> None:
        try:
            client.wait_at_barrier(f"{_KEY}/{at}", int(timeout * 1000))
        except Exception as e:  # noqa: BLE001 - reported by the waiting thread
            failure.append(e)

    waiter = threading.Thread(target=wait, name=f"barrier {at}", daemon=True)
    waiter.start()
    while waiter.is_alive():  # a join with a timeout lets Ctrl-C / SIGTERM through
        waiter.join(0.5)
    if failure:
        others = [p for p in range(count) if p != me]
        where = "; ".join(f"process {p} is at {_where(client, p)!r}" for p in others)
        raise CollectiveTimeout(
            f"process {me} of {count}: collective {at!r} not reached by every process within "
            f"{timeout:g} s ({where}; DistributedConfig.collective_timeout_s)"
        ) from failure[0]
    return at


def _stuck(at: str, timeout: float) -> None:
    me, count = jax.process_index(), jax.process_count()
    sys.stderr.write(
        f"process {me} of {count}: collective {at!r} did not complete within {timeout:g} s "
        f"although every process reached it; exiting with {STUCK_EXIT_CODE} (stacks follow)\n"
    )
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    os._exit(STUCK_EXIT_CODE)


@contextlib.contextmanager
def guarded(name: str) -> Iterator[None]:
    """Runs the block as the bounded collective ``name`` on every process.

    Every process must enter it within ``collective_timeout_s``, and it must finish within the
    same time once all have, or the process exits naming it. No-op with one process. The
    block must wait for its device work (see `collective`).

    Raises:
      CollectiveTimeout: a process did not arrive in time.
    """
    if jax.process_count() == 1:
        yield
        return
    at, timeout = _meet(name), _collective_timeout_s
    watchdog = threading.Timer(timeout, _stuck, (at, timeout))
    watchdog.daemon = True
    watchdog.start()
    try:
        yield
    finally:
        watchdog.cancel()


def collective(name: str) -> Callable[[_F], _F]:
    """Decorates a function that every process calls together as the bounded collective ``name``.

    The call runs under `guarded` and waits for its result (``jax.block_until_ready``: a jitted
    collective returns before it has run), so a hang is reported at the collective that hangs.
    """

    def wrap(fn: _F) -> _F:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if jax.process_count() == 1:
                return fn(*args, **kwargs)
            with guarded(name):
                return jax.block_until_ready(fn(*args, **kwargs))

        return call  # type: ignore[return-value]

    return wrap


# ---------------------------------------------------------------------- host batches


def _processor_json(images: RowImages) -> np.ndarray:
    """The stored images' processor as its HF JSON (the other processes rebuild it)."""
    if not isinstance(images.processor, ImageProcessor):
        raise DistributedError("broadcast_host_batch: the images' processor is no ImageProcessor")
    return np.frombuffer(json.dumps(images.processor.to_dict()).encode(), np.uint8)


def _broadcast_arrays(arrays: list[np.ndarray], chunk_bytes: int) -> None:
    """Process 0's bytes of ``arrays`` into every process's ``arrays`` (in place).

    The arrays are one byte stream cut into collectives of ``chunk_bytes`` (the last one
    shorter): every broadcast is bounded, and all but the last have one shape (one compile).
    Bytes, not values, travel (a sum with zeros in uint8: bit for bit, -0.0 and NaNs too).
    """
    views = [a.reshape(-1).view(np.uint8) for a in arrays]
    total = sum(v.size for v in views)
    for start in range(0, total, chunk_bytes):
        chunk = np.zeros((min(chunk_bytes, total - start),), np.uint8)
        at = 0
        for v in views:  # copy process 0's bytes in [start, start + chunk) out of the stream
            lo, hi = max(start - at, 0), min(start + chunk.size - at, v.size)
            if lo < hi and is_primary():
                chunk[at + lo - start : at + hi - start] = v[lo:hi]
            at += v.size
        chunk = np.asarray(multihost_utils.broadcast_one_to_all(chunk))
        at = 0
        for v in views if not is_primary() else ():  # process 0 holds them already
            lo, hi = max(start - at, 0), min(start + chunk.size - at, v.size)
            if lo < hi:
                v[lo:hi] = chunk[at + lo - start : at + hi - start]
            at += v.size


@collective("broadcast_host_batch")
def broadcast_host_batch(batch: Batch | None, *, chunk_bytes: int | None = None) -> Batch:
    """Process 0's host batch on every process, in bounded collectives.

    Process 0 passes its packed batch, the others None; all must call it. It broadcasts the
    layout (names, dtypes, shapes: one small collective), then every array's bytes in chunks of
    ``chunk_bytes`` (default ``DistributedConfig.broadcast_chunk_bytes``). Returns numpy arrays
    equal to process 0's bit for bit; stored images (`RowImages`) travel as their encoded
    bytes, index and processor JSON and are rebuilt equal. With one process it returns
    ``batch``.
    """
    if is_primary() and batch is None:
        raise DistributedError("broadcast_host_batch: process 0 passed no batch")
    if jax.process_count() == 1:
        assert batch is not None
        return batch
    arrays: dict[str, np.ndarray] = {}
    spec = b""
    if is_primary():
        assert batch is not None
        check_batch(batch)
        arrays = to_arrays(batch)
        if batch.images is not None:
            arrays["images.processor"] = _processor_json(batch.images)
        spec = json.dumps([[k, a.dtype.str, a.shape] for k, a in arrays.items()]).encode()
    size = np.asarray(multihost_utils.broadcast_one_to_all(np.asarray([len(spec)], np.int64)))
    layout = np.frombuffer(spec, np.uint8).copy() if spec else np.zeros(int(size[0]), np.uint8)
    chunk = chunk_bytes or _broadcast_chunk_bytes
    _broadcast_arrays([layout], chunk)
    if is_primary():
        _broadcast_arrays([np.ascontiguousarray(a) for a in arrays.values()], chunk)
        assert batch is not None
        return batch
    out = {k: np.zeros(s, np.dtype(t)) for k, t, s in json.loads(layout.tobytes())}
    _broadcast_arrays(list(out.values()), chunk)
    text = out.pop("images.processor", None)
    processor = None if text is None else ImageProcessor.from_dict(json.loads(text.tobytes()))
    return from_arrays(out, processor)


def broadcast_host_batches(batches: list[Batch] | None) -> list[Batch]:
    """Process 0's minibatches on every process (`broadcast_host_batch` of each).

    Process 0 passes its list, the others None; their count is broadcast first.
    """
    if is_primary() and batches is None:
        raise DistributedError("broadcast_host_batches: process 0 passed no batches")
    if jax.process_count() == 1:
        assert batches is not None
        return batches
    count = np.asarray([len(batches) if batches is not None else 0], np.int64)
    n = int(np.asarray(multihost_utils.broadcast_one_to_all(count))[0])
    return [broadcast_host_batch(batches[i] if batches is not None else None) for i in range(n)]


# ---------------------------------------------------------------------- parameters, export


@collective("params_to_host")
def params_to_host(tree: Any) -> Any:
    """A pytree of (possibly non-fully-addressable) arrays as full numpy arrays on every host.

    Every process must call it (an all-gather of each sharded leaf).
    """
    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, jax.device_get(tree))
    return multihost_utils.process_allgather(tree, tiled=True)


def export_hf_all_processes(
    trainer: Any, state: Any, path: str | Path, *, copy_files_from: str | Path | None = None
) -> Path:
    """Writes the refit checkpoint of ``state`` from process 0; every process must call it.

    The sharded parameters are gathered to every host (`params_to_host`), process 0 writes the
    HF checkpoint through ``trainer.export_hf`` (atomic rename; skipped when ``path`` already
    holds one, e.g. on resume), and a barrier makes the files visible to all processes before
    anyone asks a server to load them. No process skips the gather or the barrier because of
    what it sees on disk: process 0 may have written ``path`` already (a fully replicated
    gather does not synchronise), and a process that skipped would meet the others in a
    different collective.
    """
    path = Path(path)
    host_params = params_to_host(state.params)  # every process joins, whatever is on disk
    if is_primary() and not path.exists():  # only process 0 looks at the disk
        trainer.export_hf(state.replace(params=host_params), path, copy_files_from=copy_files_from)
    barrier(f"export_hf:{path.name}")
    return path
