"""Two real jax processes (gloo on loopback) running one worker script, for the tests/scale tests.

The test side: `spawn_pair` starts ``worker`` twice (process ids 0 and 1, one coordinator
address; each worker sets its own device count in ``XLA_FLAGS``) and `kill_pair` ends what runs.
The worker side: `init_pair` joins the two-process job.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def spawn_pair(worker: Path, args: Callable[[str, int], Sequence[str]]) -> list[subprocess.Popen]:
    """Starts ``worker`` as processes 0 and 1; ``args(coordinator, pid)`` are its arguments."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        coordinator = f"127.0.0.1:{s.getsockname()[1]}"
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # XLA_FLAGS: worker
    return [
        subprocess.Popen(
            [sys.executable, str(worker), *args(coordinator, pid)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid in range(2)
    ]


def kill_pair(procs: list[subprocess.Popen]) -> None:
    """Kills and reaps the processes of ``procs`` that still run."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def init_pair(coordinator: str, pid: int, **config: Any) -> None:
    """Joins the two-process job as ``pid`` (``config``: more `DistributedConfig` fields)."""
    from osworld_jax.trainer.distributed import DistributedConfig, initialize_distributed

    initialize_distributed(
        DistributedConfig(
            coordinator_address=coordinator,
            num_processes=2,
            process_id=pid,
            initialization_timeout_s=60,
            **config,
        )
    )
