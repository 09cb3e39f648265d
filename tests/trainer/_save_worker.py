"""Subprocess for the kill -9 test: saves checkpoint 1, then starts checkpoint 2 and reports.

Usage: python _save_worker.py DIR. Prints SAVED 1 once checkpoint 1 is committed, then MIDSAVE
as soon as checkpoint 2's temporary directory exists (its arrays are being written), and
sleeps until killed.
"""

import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from osworld_jax.trainer import CheckpointConfig, Checkpointer, TrainState


def make_state(step: int) -> TrainState:
    rng = np.random.default_rng(step)
    big = rng.random((32, 1024, 1024), np.float32)  # 128 MiB: writing it takes a while
    return TrainState(
        params={"w": jnp.asarray(big), "b": jnp.full((3,), float(step))},
        opt_state=(),
        step=jnp.int32(step),
        weight_version=jnp.int32(step),
    )


def main(directory: str) -> None:
    ck = Checkpointer(CheckpointConfig(directory=directory, keep=3, async_save=True))
    ck.save(make_state(1), 1, {"next_index": 1})
    ck.wait()
    print("SAVED 1", flush=True)
    ck.save(make_state(2), 2, {"next_index": 2})
    root = Path(directory)
    while not any("tmp" in p.name and p.name.startswith("2") for p in root.iterdir()):
        time.sleep(0.001)
    print("MIDSAVE", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main(sys.argv[1])
