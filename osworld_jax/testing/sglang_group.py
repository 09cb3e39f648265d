"""The fake SGLang server's scheduler for the distributed refit, in a child process.

A child process (its own torch world, as SGLang's scheduler is) joins the trainer's weight-update
group and receives the broadcasts as SGLang's ``ModelRunner`` does (``init_weights_update_group``:
a rendezvous at ``tcp://master_address:master_port``, the store prefixed by ``group_name``, rank
``rank_offset + tp_rank``; ``update_weights_from_distributed``: ``torch.empty`` per name in the
body's order and one broadcast from rank 0 each, or one flat tensor for ``flattened_bucket``).

Its own rendezvous code, not the trainer's: the test proves the two sides meet. torch only.
"""

from __future__ import annotations

import datetime
import inspect
import multiprocessing
from multiprocessing.connection import Connection
from typing import Any


def _join(body: dict[str, Any], tp_rank: int = 0) -> Any:
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=120)
    url = f"tcp://{body['master_address']}:{body['master_port']}"
    rank = int(body["rank_offset"]) + tp_rank
    store, rank, world = next(c10d.rendezvous(url, rank, int(body["world_size"]), timeout=timeout))
    store = c10d.PrefixStore(body["group_name"], store)
    params = inspect.signature(c10d._new_process_group_helper).parameters
    options = "backend_options" if "backend_options" in params else "pg_options"
    pg, _ = c10d._new_process_group_helper(
        world,
        rank,
        [],
        c10d.Backend(body.get("backend", "nccl")),
        store,
        group_name=body["group_name"],
        timeout=timeout,
        **{options: None},
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world)}
    return pg


def _receive(pg: Any, body: dict[str, Any]) -> list[tuple[str, Any]]:
    import torch
    import torch.distributed as dist

    empties = [
        (name, torch.empty(shape, dtype=getattr(torch, dtype)))
        for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"], strict=True)
    ]
    if body.get("load_format") == "flattened_bucket":
        flat = torch.cat([t.flatten() for _, t in empties])
        dist.broadcast(flat, src=0, group=pg)
        out, off = [], 0
        for name, t in empties:
            out.append((name, flat[off : off + t.numel()].reshape(t.shape)))
            off += t.numel()
        return out
    handles = [dist.broadcast(t, src=0, group=pg, async_op=True) for _, t in empties]
    for h in handles:
        h.wait()
    return empties


def serve(conn: Connection) -> None:
    """The child's loop over ``(op, body)`` messages: ``init`` joins a group, ``update``
    receives one bucket (answered with the ``(name, tensor)`` list), ``stop`` ends it."""  # noqa: D205, D209
    groups: dict[str, Any] = {}
    while True:
        op, body = conn.recv()
        try:
            if op == "stop":
                conn.send(("ok", None))
                return
            if op == "init":
                groups[body["group_name"]] = _join(body)
                conn.send(("ok", None))
            elif op == "update":
                pg = groups[body["group_name"]]
                conn.send(("ok", _receive(pg, body)))  # CPU tensors, by shared memory
            else:
                conn.send(("error", f"unknown op {op!r}"))
        except Exception as e:  # the fake server's reply carries it
            conn.send(("error", f"{type(e).__name__}: {e}"))


class GroupWorker:
    """The parent's handle on the child (spawned on first use; ``ask`` blocks: call it from a
    worker thread)."""  # noqa: D205, D209

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=serve, args=(child,), daemon=True)
        self._proc.start()
        child.close()

    def ask(self, op: str, body: dict[str, Any] | None = None) -> Any:
        """Sends ``(op, body)``; returns the answer or raises RuntimeError with its message."""
        self._conn.send((op, body))
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def stop(self) -> None:
        """Ends the child (politely, then by its pid)."""
        if self._proc.is_alive():
            try:
                self.ask("stop")
            except (OSError, EOFError, RuntimeError):
                pass
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.kill()
        self._conn.close()
