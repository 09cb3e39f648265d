"""One process of a 2-process job whose collectives cannot complete (test_collectives.py).

``python tests/scale/collective_worker.py SCENARIO COORDINATOR PROCESS_ID TIMEOUT_S`` joins a
2-process job (1 CPU device each, gloo) with ``collective_timeout_s = TIMEOUT_S`` and then:

- ``absent``: process 0 gathers the parameters (`params_to_host`, the collective of the refit
  export) while process 1 never joins it: it waits at a different collective (``checkpoint``).
  Each prints ``CollectiveTimeout: <message>`` and exits 3.
- ``stuck``: both processes enter the collective ``stuck``, whose body never finishes (a
  deadlock inside the collectives backend, simulated); the watchdog must end the process.

Each process prints ``elapsed <seconds>`` (from the collective's start) before it ends.
"""

import os
import sys
import time
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.xla_env import use_host_devices  # noqa: E402

use_host_devices(1)


def main() -> None:
    scenario, coordinator, pid, timeout = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    from osworld_jax.trainer.distributed import (
        CollectiveTimeout,
        barrier,
        guarded,
        params_to_host,
    )
    from tests.scale.pair import init_pair

    init_pair(coordinator, pid, collective_timeout_s=int(timeout))
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()), ("data",))
    params = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, PartitionSpec()))
    barrier("ready")  # both joined: what follows is the scenario
    t0 = time.monotonic()
    try:
        if scenario == "absent":
            if pid == 0:
                params_to_host({"w": params})
            else:
                barrier("checkpoint")
        elif scenario == "stuck":
            with guarded("stuck"):
                time.sleep(3600)
        print("completed (unexpected)", flush=True)
    except CollectiveTimeout as e:
        print(f"elapsed {time.monotonic() - t0:.1f}", flush=True)
        print(f"CollectiveTimeout: {e}", flush=True)
        sys.exit(3)  # jax's shutdown barrier at exit lets the other process report too


if __name__ == "__main__":
    main()
