"""Ctrl-C (SIGINT) mid-run: the process's sandboxes are all deleted before it exits."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from .conftest import TOKEN, TOKEN_ENV

REPO = Path(__file__).resolve().parents[3]

SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys
    from osworld_jax.env.agent_env import AgentEnv, AgentEnvConfig
    from osworld_jax.env.remote import RemoteBackend, RemoteBackendConfig
    from osworld_jax.testing.sandbox_service import FakeSandboxService, make_test_pki
    from osworld_jax.testing.memory import word_task

    class Slow:
        async def act(self, obs):
            await asyncio.sleep(60)
            return "DONE"

    async def main(pki_dir):
        pki = make_test_pki(pki_dir)
        async with FakeSandboxService(token=sys.argv[2], pki=pki) as svc:
            cfg = RemoteBackendConfig(base_url=svc.base_url, ca_bundle=str(pki.ca_path),
                                      token_env=sys.argv[3], poll_interval_s=0.01, settle_s=0.0,
                                      max_creations_per_s=1000.0)
            be = RemoteBackend(cfg)
            env = AgentEnv(be, AgentEnvConfig(max_turns=2))
            try:
                jobs = [asyncio.ensure_future(env.run_group(word_task(w), range(4),
                                                            lambda o: Slow())) for w in "xyz"]
                while env.metrics.forks < 12:
                    await asyncio.sleep(0.01)
                print("RUNNING", len(svc.live_ids()), flush=True)
                await asyncio.gather(*jobs, return_exceptions=True)
            finally:
                await be.aclose()
                print("LEFT", json.dumps(svc.live_ids()), json.dumps(be.inventory()), flush=True)

    asyncio.run(main(sys.argv[1]))
    """
)


def test_sigint_deletes_every_sandbox(tmp_path):
    env = {**os.environ, TOKEN_ENV: TOKEN, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(tmp_path), TOKEN, TOKEN_ENV],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("RUNNING"), line
        assert int(line.split()[1]) >= 12  # 12 forks (+ bases not yet deleted)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    left = [ln for ln in out.splitlines() if ln.startswith("LEFT")]
    assert left, out + err
    _, live, inventory = left[0].split(" ", 2)
    assert json.loads(live) == [] and json.loads(inventory.strip()) == []
    assert "KeyboardInterrupt" in err  # the interrupt still propagates
    assert TOKEN not in out + err
