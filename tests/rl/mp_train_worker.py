"""One process of the 2-process RL run (spawned by tests/rl/test_slow.py).

``python tests/rl/mp_train_worker.py RUN_DIR TASKS STEPS COORDINATOR PROCESS_ID`` trains the
learnable suite with ``DistributedConfig`` (2 processes x 1 CPU device, mesh ``data=2``):
process 0 runs the embedded server and the sandboxes and broadcasts each step's batch; both
processes train on their half of the rows, checkpoint and export.

Process 1 reaches every refit export late, after process 0 has written it (as a slow or
descheduled process does): the race that hung this run once in three CI rehearsals (issue 16
item 15) is exercised on every run instead of by chance.
"""

import inspect
import json
import os
import sys
import time
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.xla_env import use_host_devices  # noqa: E402

use_host_devices(1)


def _reach_exports_late() -> None:
    """Process 1 enters each ``export_and_refit`` only once process 0's export exists (<= 10 s)."""
    from osworld_jax.rl import stages

    export = stages.export_and_refit
    signature = inspect.signature(export)

    def late(*args, **kwargs):
        bound = signature.bind(*args, **kwargs).arguments
        path = Path(bound["weights_dir"]) / f"step_{bound['step']:08d}"
        deadline = time.monotonic() + 10
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return export(*args, **kwargs)

    stages.export_and_refit = late


def main() -> None:
    import faulthandler

    # A hang dumps every thread's stack and exits, instead of waiting for the test's timeout.
    faulthandler.dump_traceback_later(420, exit=True)
    run_dir, tasks, steps, coordinator, pid = sys.argv[1:6]
    from osworld_jax import config
    from osworld_jax.rl import train
    from tests.rl import learnable
    from tests.rl.test_slow import LEARN

    params = [
        *LEARN,
        f"DataConfig.task_set = '{tasks}'",
        "MeshConfig.data = 2",
        f"DistributedConfig.coordinator_address = '{coordinator}'",
        "DistributedConfig.num_processes = 2",
        f"DistributedConfig.process_id = {pid}",
        "DistributedConfig.initialization_timeout_s = 120",
        "DistributedConfig.collective_timeout_s = 240",
    ]
    if pid == "1":
        _reach_exports_late()
    assert learnable.BACKEND
    exp = config.load_experiment(["default.gin"], params)
    result = train(exp, run_dir, steps=int(steps))
    import jax

    out = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "steps": [h["step"] for h in result.history],
        "rewards": [h["reward/mean"] for h in result.history],
    }
    Path(run_dir, f"worker_{pid}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
