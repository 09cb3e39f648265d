"""DistributedConfig resolution (explicit / env / SLURM) and the host-batch helpers (fast)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from osworld_jax.batch import Batch
from osworld_jax.errors import ConfigError
from osworld_jax.trainer.distributed import (
    DistributedConfig,
    DistributedError,
    ProcessValues,
    broadcast_host_batch,
    initialize_distributed,
    resolve_process_values,
)

SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_NODELIST": "gpu[003-006],login1",
    "SLURM_NTASKS": "4",
    "SLURM_PROCID": "2",
    "SLURM_LOCALID": "0",
    "SLURM_STEP_NUM_NODES": "4",
}


@pytest.fixture
def clean_env(monkeypatch):
    for k in (*SLURM, "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(k, raising=False)
    for k in ("JAX_LOCAL_DEVICE_IDS", "JAX_COORDINATOR_PORT", "SLURM_NNODES"):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def test_config_validation():
    with pytest.raises(ConfigError, match="auto"):
        DistributedConfig(auto="mpi")
    with pytest.raises(ConfigError, match="process_id"):
        DistributedConfig(coordinator_address="h:1", num_processes=2, process_id=2)
    with pytest.raises(ConfigError, match="together"):
        DistributedConfig(num_processes=2)


def test_single_process_resolves_to_nothing(clean_env):
    assert resolve_process_values(DistributedConfig()) is None
    assert initialize_distributed(DistributedConfig()) is None  # no job to join: a no-op


def test_explicit_values(clean_env):
    cfg = DistributedConfig(coordinator_address="10.0.0.1:99", num_processes=4, process_id=3)
    assert resolve_process_values(cfg) == ProcessValues("10.0.0.1:99", 4, 3, None)


def test_env_values(clean_env):
    with pytest.raises(DistributedError, match="JAX_NUM_PROCESSES, \\$JAX_PROCESS_ID"):
        resolve_process_values(DistributedConfig(auto="env"))
    clean_env.setenv("JAX_COORDINATOR_ADDRESS", "host0:1234")
    clean_env.setenv("JAX_NUM_PROCESSES", "8")
    clean_env.setenv("JAX_PROCESS_ID", "5")
    clean_env.setenv("JAX_LOCAL_DEVICE_IDS", "0,1")
    assert resolve_process_values(DistributedConfig(auto="env")) == ProcessValues(
        "host0:1234", 8, 5, (0, 1)
    )
    clean_env.setenv("JAX_PROCESS_ID", "x")
    with pytest.raises(DistributedError, match="JAX_PROCESS_ID"):
        resolve_process_values(DistributedConfig(auto="env"))


def test_slurm_values(clean_env):
    with pytest.raises(DistributedError, match="not inside a SLURM step"):
        resolve_process_values(DistributedConfig(auto="slurm"))
    for k, v in SLURM.items():
        clean_env.setenv(k, v)
    # jax's SLURM detector: first node of the step list, port 4242 % 4096 + 61440.
    port = 4242 % 4096 + 65535 - 4096 + 1
    one_per_node = resolve_process_values(DistributedConfig(auto="slurm"))
    assert one_per_node == ProcessValues(f"gpu003:{port}", 4, 2, None)  # all local GPUs
    clean_env.setenv("SLURM_STEP_NUM_NODES", "2")  # 2 tasks per node: one GPU per task
    clean_env.setenv("SLURM_LOCALID", "1")
    clean_env.setenv("JAX_COORDINATOR_PORT", "7777")
    assert resolve_process_values(DistributedConfig(auto="slurm")) == ProcessValues(
        "gpu003:7777", 4, 2, (1,)
    )
    explicit = DistributedConfig(auto="slurm", local_device_ids=(0, 1, 2, 3))
    assert resolve_process_values(explicit).local_device_ids == (0, 1, 2, 3)


def _batch(rows: int, length: int, seed: int, owners, groups, layers=2, k=2) -> Batch:
    rng = np.random.default_rng(seed)
    lens = rng.integers(2, length + 1, rows)
    real = np.arange(length)[None, :] < lens[:, None]
    f = lambda x: np.where(real, x, 0).astype(np.float32)
    return Batch(
        tokens=np.where(real, rng.integers(1, 50, (rows, length)), 0).astype(np.int32),
        loss_mask=f(rng.integers(0, 2, (rows, length))),
        behavior_logprobs=f(-rng.random((rows, length))),
        advantages=f(rng.normal(size=(rows, length))),
        positions=np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length)).copy(),
        segment_ids=real.astype(np.int32),
        owner_ids=np.asarray(owners, np.int32),
        group_ids=np.asarray(groups, np.int32),
        row_weight=np.ones(rows, np.float32),
        routed_experts=np.where(
            real[..., None, None], rng.integers(0, 4, (rows, length, layers, k)), -1
        ).astype(np.int32),
    )


def test_broadcast_in_one_process_is_identity():
    a = _batch(2, 6, 1, [0, 1], [0, 0])
    out = broadcast_host_batch(a)
    assert all(x is y for x, y in zip(out, a, strict=True))
    with pytest.raises(DistributedError, match="no batch"):
        broadcast_host_batch(None)


def test_joining_after_jax_started_is_a_clear_error(tmp_path):
    # A fresh interpreter (this one may not join a job): jax computes first, then tries to join.
    script = tmp_path / "late.py"
    script.write_text(
        "import jax.numpy as jnp\n"
        "from osworld_jax.trainer.distributed import (DistributedConfig, DistributedError,\n"
        "    initialize_distributed)\n"
        "jnp.ones(3).block_until_ready()\n"
        "cfg = DistributedConfig(coordinator_address='127.0.0.1:1', num_processes=2,\n"
        "    process_id=1, initialization_timeout_s=5)\n"
        "try:\n"
        "    initialize_distributed(cfg)\n"
        "except DistributedError as e:\n"
        "    print('DistributedError:', e)\n"
    )
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[2],
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "DistributedError: initialize_distributed: process 1 of 2 could not join" in out.stdout
    assert "before any JAX" in out.stdout
