"""The real subprocess: ``python -m osworld_jax.server.serve`` via `launch_embedded`."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request

import pytest

from osworld_jax.rollout import (
    EngineError,
    RolloutConfig,
    SamplingParams,
    SGLangClient,
    launch_embedded,
)


def test_importing_the_server_leaves_logging_to_serve():
    """``serve.main`` configures logging (``logging.basicConfig``: the server.log lines); a
    module that configured it on import (orbax, through absl, once came in with the trainer
    room) would make that call a no-op and leave server.log empty."""
    code = (
        "import logging\n"
        "import osworld_jax.server.serve, osworld_jax.server.app, osworld_jax.server.runner\n"
        "print(len(logging.root.handlers))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "0", out.stderr[-2000:]


@pytest.mark.slow
def test_launch_generate_and_stop(tiny_ckpt, tmp_path):
    log = tmp_path / "server.log"
    srv = launch_embedded(
        tiny_ckpt,
        max_running_requests=4,
        weight_version="w7",
        dtype="float32",
        extra_args=["--context-length", "128", "--min-bucket", "64", "--min-decode-batch", "4"],
        log_path=log,
        startup_timeout_s=300,
    )
    with srv:
        with urllib.request.urlopen(srv.url + "/server_info") as r:
            info = json.loads(r.read())
        assert info["weight_version"] == "w7" and info["max_running_requests"] == 4
        with urllib.request.urlopen(srv.url + "/health_generate") as r:
            assert r.status == 200
        cfg = RolloutConfig(
            urls=(srv.url,), return_routed_experts=True, num_layers=3, num_experts_per_tok=2
        )

        async def main():
            async with SGLangClient(None, cfg) as client:
                sp = SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)
                return await asyncio.gather(
                    *(client.generate([11, 12, 13 + i], sp, rid=f"s{i}") for i in range(6))
                )

        gens = asyncio.run(main())
        assert all(g.completion_tokens == 5 and g.weight_version == "w7" for g in gens)
        assert all(g.routed_experts.shape == (3 + 5 - 1, 3, 2) for g in gens)
        proc = srv.process
    assert srv.process is None and proc.returncode == 0  # SIGTERM -> clean exit
    assert "shutting down" in log.read_text()


def test_launch_failure_reports_the_log(tmp_path):
    with pytest.raises(EngineError, match="no such config file|failed to start|exited"):
        launch_embedded(tmp_path / "missing", startup_timeout_s=120).start()
