"""The remote backend against the fake service: lifecycle, fork, snapshot fallback, zero leaks."""

import asyncio
import os
import signal
import subprocess
import sys

import aiohttp

from osworld_jax.env.actions import parse_action
from osworld_jax.env.agent_env import AgentEnv, AgentEnvConfig
from osworld_jax.env.backends import BACKENDS
from osworld_jax.env.remote import RemoteBackend, RemoteBackendConfig, pinned_ssl_context
from osworld_jax.env.tasks import load_task
from osworld_jax.testing.memory import word_task, word_task_dict
from osworld_jax.testing.sandbox_service import FakeFaults

from .conftest import TOKEN, TOKEN_ENV, TYPE, Scripted, service_and_backend


def test_registered_as_remote():
    assert BACKENDS.get("remote") is RemoteBackend


def test_create_step_evaluate_close(pki):
    async def main():
        async with service_and_backend(pki) as (svc, be):
            task = word_task("hello")
            sb = await be.create(task)
            assert be.inventory() == [sb.id] == svc.live_ids()
            # setup ran through the endpoint: the editor is open on answer.txt
            assert svc.desktop(sb.id).doc is not None
            obs = await sb.observe()
            assert obs.screenshot.startswith(b"\x89PNG") and obs.instruction == task.instruction
            obs = await sb.step(parse_action(TYPE.format("hello")))
            assert "hello" in obs.a11y_tree
            assert await sb.evaluate(parse_action("DONE")) == 1.0
            await sb.close()
            await sb.close()  # idempotent
            assert be.inventory() == [] and svc.live_ids() == []
            assert svc.stats.api_key_on_proxy == 0  # the API token only goes to the lifecycle API
            assert be.metrics.creates == 1 and be.metrics.deletes == 1

    asyncio.run(main())


def _run_groups(be, words, owners_per_group, replies_for):
    env = AgentEnv(be, AgentEnvConfig(max_turns=3, eval_retry_delay_s=0.01))

    async def group(word):
        return await env.run_group(
            word_task(word), range(owners_per_group), lambda o: Scripted(replies_for(word, o))
        )

    return env, asyncio.gather(*(group(w) for w in words))


def test_fork_via_service_fork(pki):
    async def main():
        async with service_and_backend(pki) as (svc, be):
            env, job = _run_groups(
                be, ["alpha"], 4, lambda w, o: [TYPE.format(w if o % 2 == 0 else "nope")]
            )
            (results,) = await job
            assert [r.reward for r in results] == [1.0, 0.0, 1.0, 0.0]
            assert not any(r.failed for r in results)
            assert be.metrics.forks_by_fork == 4 and be.metrics.forks_by_snapshot == 0
            assert svc.stats.forked == 4 and svc.stats.from_snapshot == 0
            assert env.metrics.forks == 4
            assert be.inventory() == [] and svc.live_ids() == []

    asyncio.run(main())


def test_snapshot_fallback_when_fork_absent(pki):
    """No /fork: snapshot + snapshotId creates; the launch step re-runs (else typing is lost)."""

    async def main():
        faults = FakeFaults(fork_supported=False)
        async with service_and_backend(pki, faults) as (svc, be):
            env, job = _run_groups(be, ["beta", "gamma"], 3, lambda w, o: [TYPE.format(w)])
            res_beta, res_gamma = await job
            assert [r.reward for r in res_beta + res_gamma] == [1.0] * 6
            m = be.metrics.as_dict()
            assert m["sandbox/forks_by_fork"] == 0 and m["sandbox/forks_by_snapshot"] == 6
            assert m["sandbox/snapshots"] == 2
            assert svc.stats.from_snapshot == 6 and svc.stats.forked == 0
            assert svc.snapshots == {}  # snapshots are deleted after the fork
            assert be.inventory() == [] and svc.live_ids() == []

    asyncio.run(main())


def test_use_fork_never_skips_fork_route(pki):
    async def main():
        async with service_and_backend(pki, use_fork="never") as (svc, be):
            _, job = _run_groups(be, ["delta"], 2, lambda w, o: [TYPE.format(w)])
            (res,) = await job
            assert [r.reward for r in res] == [1.0, 1.0]
            assert svc.stats.forked == 0 and be.metrics.forks_by_snapshot == 2

    asyncio.run(main())


def test_fork_copies_state_exactly(pki):
    """A /fork copy carries the source's files; a snapshot copy too (launch re-run on top)."""

    async def main():
        for fork_supported in (True, False):
            async with service_and_backend(pki, FakeFaults(fork_supported=fork_supported)) as (
                svc,
                be,
            ):
                d = word_task_dict("x")
                d["config"].insert(
                    0,
                    {
                        "type": "execute",
                        "parameters": {"command": ["echo", "saved"], "stdout": "out.txt"},
                    },
                )
                sb = await be.create(load_task(d))
                await sb.vm.upload("/home/user/data.txt", b"payload")
                forks = await be.fork(sb, 2)
                for f in forks:
                    assert await f.vm.file("/home/user/data.txt") == b"payload"
                    assert svc.desktop(f.id).doc is not None  # editor open in every copy
                    # the setup's saved output (host side) travels with the copy
                    assert (f.work_dir / "out.txt").read_text() == "saved\n"
                assert len(set(be.inventory())) == 3
                for s in [sb, *forks]:
                    await s.close()
                assert svc.live_ids() == []

    asyncio.run(main())


def test_fake_service_runs_standalone(tmp_path):
    """``python -m ...fake_service`` serves HTTPS; a backend in another process drives it."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "osworld_jax.testing.sandbox_service",
            "--pki-dir",
            str(tmp_path),
            "--token-env",
            TOKEN_ENV,
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, TOKEN_ENV: TOKEN},
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving https://127.0.0.1:"), line
        base_url = line.split()[1]

        async def main():
            be = RemoteBackend(
                RemoteBackendConfig(
                    base_url=base_url,
                    ca_bundle=str(tmp_path / "ca.pem"),
                    token_env=TOKEN_ENV,
                    poll_interval_s=0.01,
                    settle_s=0.0,
                )
            )
            sb = await be.create(word_task("x"))
            await sb.close()
            await be.aclose()
            ctx = pinned_ssl_context(tmp_path / "ca.pem")
            async with aiohttp.ClientSession() as s:
                async with s.get(
                    base_url + "/_fake/stats", headers={"OPEN-SANDBOX-API-KEY": TOKEN}, ssl=ctx
                ) as r:
                    return await r.json()

        stats = asyncio.run(main())
        assert stats["created"] == 1 and stats["deleted"] == 1 and stats["live"] == []
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)
