"""One process of the multi-process equality run (spawned by tests/scale/test_multiprocess.py).

``python tests/scale/mp_worker.py --out DIR --devices D [--num-processes P --process-id I
--coordinator HOST:PORT]`` runs, on a mesh ``fsdp=2 x expert=2 x tensor=2`` over all 8 devices
of the job (``fsdp`` spans the processes in the 2 x 4 layout, so parameters, optimizer moments
and gradient reductions cross process boundaries), with the real ``Trainer``:

1. step 1 on a batch built by process 0 only and broadcast (``broadcast_host_batch``);
2. step 2 on another broadcast batch of another padded length (a second compiled bucket), whose
   owner ids leave some of the bounds unused;
3. an orbax save by every process, then a restore;
4. an HF export (process 0 writes, after an all-gather of the sharded parameters).

Every process writes ``metrics_<id>.json``; process 0 also writes ``params.npz`` (initial, after
step 1, after step 2, restored) and ``hf/``. The single-process reference runs the same script
with ``--devices 8`` and no coordinator.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--num-processes", type=int, default=None)
    p.add_argument("--process-id", type=int, default=None)
    p.add_argument("--coordinator", default=None)
    return p.parse_args()


def _flat(tree, prefix: str) -> dict:
    import jax

    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out[prefix + "/" + jax.tree_util.keystr(path)] = leaf
    return out


def main() -> None:
    args = _args()
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root
    from tests.xla_env import use_host_devices

    use_host_devices(args.devices)
    t0 = time.perf_counter()

    def _tick(what: str) -> None:
        print(f"[{args.process_id}] {what}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    from osworld_jax.trainer.distributed import (
        DistributedConfig,
        DistributedError,
        broadcast_host_batch,
        export_hf_all_processes,
        initialize_distributed,
        is_primary,
        params_to_host,
    )

    config = DistributedConfig(
        coordinator_address=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
        cpu_collectives="gloo",
        initialization_timeout_s=60,
        heartbeat_timeout_s=30,
    )
    initialize_distributed(config)
    initialize_distributed(config)  # idempotent
    refused_other_values = False
    if args.num_processes:
        try:  # joining again as another process must fail loudly
            initialize_distributed(
                dataclasses.replace(config, process_id=args.num_processes - 1 - args.process_id)
            )
        except DistributedError:
            refused_other_values = True

    import jax
    import numpy as np

    from osworld_jax.model import make_mesh
    from osworld_jax.trainer import CheckpointConfig, Trainer
    from tests.trainer._tiny import BOUNDS, make_batch, make_policy, trainer_config

    out = Path(args.out)
    pid, nproc = jax.process_index(), jax.process_count()
    assert len(jax.devices()) == 8, jax.devices()
    assert len(jax.local_devices()) == args.devices
    mesh = make_mesh(fsdp=2, expert=2, tensor=2)
    policy = make_policy(seed=0)
    cfg = trainer_config(
        checkpoint=CheckpointConfig(directory=str(out / "ckpt"), async_save=False, keep=1)
    )
    trainer = Trainer(cfg, policy, bounds=BOUNDS, mesh=mesh)
    state = trainer.init_state()
    _tick("init")
    snapshots = {"init": params_to_host(state.params)}
    metrics = []

    # Model outputs behind step 2's rows, computed up front on every process (eager op compiles
    # overlap instead of stalling the collectives of step 2).
    full = make_batch(policy, seed=2)

    # Step 1: process 0 rolls out (here: builds the batch); the others receive it.
    produced = []

    def rollout(make):
        if not is_primary():
            return broadcast_host_batch(None)
        produced.append(pid)
        return broadcast_host_batch(make())

    batch = rollout(lambda: make_batch(policy, seed=1))
    state, m = trainer.train_step(state, batch)
    metrics.append(m)
    _tick("step 1")
    snapshots["step1"] = params_to_host(state.params)

    # Step 2: the rows of ``full`` cut to length 12 (a second padded shape), regrouped: owners
    # 0 0 1 2 in group 0, owners 3 4 4 + a masked row in group 1.
    def step2_batch():
        rows = type(full)._make(x if x is None or x.ndim == 1 else x[:, :12] for x in full)
        return rows._replace(
            owner_ids=np.array([0, 0, 1, 2, 3, 4, 4, 0], np.int32),
            group_ids=np.array([0, 0, 0, 0, 1, 1, 1, 1], np.int32),
            row_weight=np.array([1, 1, 1, 1, 1, 1, 1, 0], np.float32),
        )

    batch = rollout(step2_batch)
    state, m = trainer.train_step(state, batch)
    metrics.append(m)
    _tick("step 2")
    snapshots["step2"] = params_to_host(state.params)
    digest = {
        "batch_sum": float(
            sum(np.abs(np.asarray(x, np.float64)).sum() for x in batch if x is not None)
        )
    }

    # Every process takes part in the orbax save and the restore.
    assert trainer.save(state, force=True)
    trainer.checkpointer.wait()
    _tick("save")
    restored, _ = trainer.restore()
    _tick("restore")
    snapshots["restored"] = params_to_host(restored.params)
    snapshots["restored_opt"] = params_to_host(restored.opt_state)
    snapshots["step2_opt"] = params_to_host(state.opt_state)
    export_hf_all_processes(trainer, state, out / "hf")
    trainer.close()
    _tick("export")

    record = {
        "process_index": pid,
        "process_count": nproc,
        "metrics": metrics,
        "digest": digest,
        "produced_step1": bool(produced),
        "refused_other_values": refused_other_values,
        "restored_step": int(np.asarray(params_to_host(restored.step))),
        "seconds": time.perf_counter() - t0,
    }
    (out / f"metrics_{pid}.json").write_text(json.dumps(record, indent=1))
    if is_primary():
        flat = {}
        for name, tree in snapshots.items():
            flat |= _flat(tree, name)
        np.savez(out / "params.npz", **{k: np.asarray(v) for k, v in flat.items()})


if __name__ == "__main__":
    main()
