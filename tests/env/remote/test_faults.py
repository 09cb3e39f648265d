"""Faults through AgentEnv: each masks only its owners, siblings continue, nothing leaks."""

import asyncio
import time

import pytest

from osworld_jax.env.agent_env import AgentEnv, AgentEnvConfig
from osworld_jax.env.backend import SandboxTimeout
from osworld_jax.env.remote.api import RateLimiter, RemoteServiceError
from osworld_jax.testing.memory import word_task
from osworld_jax.testing.sandbox_service import FakeFaults

from .conftest import TYPE, Scripted, service_and_backend


def _env(be, **cfg):
    return AgentEnv(be, AgentEnvConfig(max_turns=2, eval_retry_delay_s=0.01, **cfg))


async def _groups(env, words, n, replies_for):
    return await asyncio.gather(
        *(
            env.run_group(word_task(w), range(n), lambda o, w=w: Scripted(replies_for(w, o)))
            for w in words
        )
    )


def test_429_burst_backs_off_honouring_retry_after(pki):
    async def main():
        faults = FakeFaults(throttle=3, retry_after_s=0.2)
        async with service_and_backend(pki, faults) as (svc, be):
            t0 = time.monotonic()
            sb = await be.create(word_task("x"))
            elapsed = time.monotonic() - t0
            await sb.close()
            assert svc.stats.throttled == 3 and be.metrics.retries["429"] == 3
            # three Retry-After: 0.2 waits (the jittered backoff alone would be ~0.01-0.04 s)
            assert elapsed >= 0.6 - 0.02
            assert svc.live_ids() == []

    asyncio.run(main())


def test_5xx_503_rate_is_absorbed_by_retries(pki):
    async def main():
        faults = FakeFaults(error_rate=0.3, error_status=503, seed=7)
        async with service_and_backend(pki, faults) as (svc, be):
            env = _env(be)
            results = await _groups(env, ["one", "two", "three"], 3, lambda w, o: [TYPE.format(w)])
            assert all(r.reward == 1.0 for g in results for r in g)
            assert svc.stats.errors_injected > 0
            assert be.metrics.retries["503"] == svc.stats.errors_injected
        assert svc.live_ids() == []

    asyncio.run(main())


def test_create_500_masks_its_group_and_the_lost_reply_is_swept(pki):
    """The service made the sandbox but its reply was a 500 (never retried: a POST)."""

    async def main():
        faults = FakeFaults(lost_create_replies=1)
        async with service_and_backend(pki, faults) as (svc, be):
            env = _env(be)
            g1, g2 = await _groups(env, ["left", "right"], 2, lambda w, o: [TYPE.format(w)])
            failed = [g for g in (g1, g2) if all(r.failed for r in g)]
            ok = [g for g in (g1, g2) if not any(r.failed for r in g)]
            assert len(failed) == 1 and len(ok) == 1
            assert "create failed" in failed[0][0].error and "HTTP 500" in failed[0][0].error
            assert [r.reward for r in ok[0]] == [1.0, 1.0]
            assert be.inventory() == []
            assert len(svc.live_ids()) == 1  # unknown to the client until aclose sweeps
        assert svc.live_ids() == []
        assert be.metrics.leftovers_deleted == 1

    asyncio.run(main())


def test_boot_timeout_masks_its_group(pki):
    async def main():
        faults = FakeFaults(stuck_boots=1)
        async with service_and_backend(pki, faults, boot_timeout_s=0.3) as (svc, be):
            env = _env(be)
            g1, g2 = await _groups(env, ["up", "down"], 2, lambda w, o: [TYPE.format(w)])
            failed = [g for g in (g1, g2) if all(r.failed for r in g)]
            assert len(failed) == 1 and "SandboxTimeout" in failed[0][0].error
            assert "boot_timeout_s" in failed[0][0].error
            ok = g2 if failed[0] is g1 else g1
            assert [r.reward for r in ok] == [1.0, 1.0]
            assert be.metrics.boot_timeouts == 1
            assert be.inventory() == [] and svc.live_ids() == []

    asyncio.run(main())


def test_boot_timeout_raises_sandbox_timeout(pki):
    async def main():
        async with service_and_backend(pki, FakeFaults(stuck_boots=1), boot_timeout_s=0.2) as (
            svc,
            be,
        ):
            with pytest.raises(SandboxTimeout, match="not running within"):
                await be.create(word_task("x"))
            assert be.inventory() == [] and svc.live_ids() == []

    asyncio.run(main())


def test_lost_sandbox_masks_one_owner_siblings_continue(pki):
    async def main():
        async with service_and_backend(pki) as (svc, be):
            env = _env(be)

            def replies(w, o):
                return [TYPE.format("LOSE-THIS-SANDBOX" if o == 1 else w)]

            (res,) = await _groups(env, ["kept"], 3, replies)
            assert [r.failed for r in res] == [False, True, False]
            assert "was lost" in res[1].error and res[1].reward is None
            assert [res[0].reward, res[2].reward] == [1.0, 1.0]
            assert be.metrics.lost == 1 and svc.stats.lost == 1
            assert be.inventory() == [] and svc.live_ids() == []

    asyncio.run(main())


def test_cancellation_mid_episode_and_mid_boot_leaks_nothing(pki):
    class Slow:
        async def act(self, obs):
            await asyncio.sleep(30)
            return "DONE"

    async def main():
        async with service_and_backend(pki, FakeFaults(boot_delay_s=0.0)) as (svc, be):
            env = _env(be)
            jobs = [
                asyncio.ensure_future(env.run_group(word_task(w), range(3), lambda o: Slow()))
                for w in ("a", "b")
            ]
            deadline = time.monotonic() + 10
            while env.metrics.forks < 6 and time.monotonic() < deadline:  # owners are acting
                await asyncio.sleep(0.01)
            assert env.metrics.forks == 6
            for job in jobs:
                job.cancel()
            for job in jobs:  # (a plain gather would return at the first cancelled group)
                with pytest.raises(asyncio.CancelledError):
                    await job
            assert be.inventory() == [] and svc.live_ids() == []

            svc.faults.boot_delay_s = 10.0  # now cancel while a create is booting
            boot = asyncio.ensure_future(be.create(word_task("c")))
            deadline = time.monotonic() + 10
            while not svc.live_ids() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert len(be.inventory()) == 1
            boot.cancel()
            with pytest.raises(asyncio.CancelledError):
                await boot
            assert be.inventory() == [] and svc.live_ids() == []

    asyncio.run(main())


def test_rate_limiter_bounds_creations():
    async def main():
        lim = RateLimiter(rate=50.0, burst=5)
        t0 = time.monotonic()
        await asyncio.gather(*(lim.acquire() for _ in range(15)))
        return time.monotonic() - t0

    # 5 at once, then 10 more at 50/s: >= 0.2 s
    assert asyncio.run(main()) >= 0.2 - 0.01


def test_fork_creations_are_rate_limited(pki):
    async def main():
        async with service_and_backend(pki, max_creations_per_s=20.0, creation_burst=1) as (
            svc,
            be,
        ):
            sb = await be.create(word_task("x"))
            t0 = time.monotonic()
            forks = await be.fork(sb, 4)  # 4 creation tokens at 20/s
            elapsed = time.monotonic() - t0
            for s in [sb, *forks]:
                await s.close()
            assert elapsed >= 4 / 20 - 0.06
            assert be.metrics.creation_wait_s > 0

    asyncio.run(main())


def test_failed_delete_stays_in_inventory_until_aclose(pki):
    async def main():
        faults = FakeFaults()
        async with service_and_backend(pki, faults, max_retries=1) as (svc, be):
            sb = await be.create(word_task("x"))
            faults.error_rate, faults.error_methods, faults.error_status = 1.0, ("DELETE",), 500
            with pytest.raises(RemoteServiceError, match="HTTP 500 after 2 attempts"):
                await sb.close()
            assert be.inventory() == [sb.id] == svc.live_ids()  # not forgotten
            faults.error_rate = 0.0
            sb2 = await be.create(word_task("y"))
            faults.error_rate = 1.0
            with pytest.raises(RemoteServiceError):
                await sb2.close()
            faults.error_rate = 0.0
            await sb2.close()  # a later close retries the delete
            assert be.inventory() == [sb.id]
            await be.aclose()
            assert be.inventory() == [] and svc.live_ids() == []
            assert be.metrics.leftovers_deleted == 1

    asyncio.run(main())
