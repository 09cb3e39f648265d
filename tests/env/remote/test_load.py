"""Issue 10 load test: 272 concurrent owners (17 groups x 16) through AgentEnv against the fake
service on loopback; the client's connection cap holds, nothing leaks."""

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

from osworld_jax.testing.sandbox_service import FakeFaults

_PATH = Path(__file__).resolve().parents[3] / "benchmarks" / "sandbox_load.py"
_spec = importlib.util.spec_from_file_location("sandbox_load", _PATH)
sandbox_load = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("sandbox_load", sandbox_load)  # dataclasses look their module up
_spec.loader.exec_module(sandbox_load)


@pytest.mark.slow
@pytest.mark.parametrize("fork_supported", [True, False], ids=["fork", "snapshot"])
def test_272_concurrent_owners(fork_supported, tmp_path):
    faults = FakeFaults(fork_supported=fork_supported, throttle=40, retry_after_s=0.05)
    report = asyncio.run(
        sandbox_load.run_load(
            groups=17,
            owners=16,
            turns=3,
            max_connections=48,
            creations_per_s=300.0,
            creation_burst=32,
            faults=faults,
            pki_dir=str(tmp_path),
        )
    )
    print("\n" + report.table())
    assert report.owners == 272
    assert report.succeeded == 272 and report.correct == 272
    assert 1 <= report.peak_connections <= 48  # the client-side cap, seen by the server
    assert report.leaked == 0 and report.backend_inventory_after == 0
    assert report.sandboxes_created == 17 + 272
    key = "sandbox/forks_by_fork" if fork_supported else "sandbox/forks_by_snapshot"
    assert report.metrics[key] == 272
    assert report.metrics["sandbox/retries_429"] == 40  # the 429 burst was absorbed
    assert report.wall_s < 90
