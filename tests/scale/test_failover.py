"""Three embedded servers behind one `SGLangClient`; one is SIGKILLed in the middle of a step.

A step's worth of concurrent generations (24) is spread by outstanding requests over the three
real ``python -m osworld_jax.server.serve`` subprocesses; one server is killed while it holds
requests; every request still completes (retried on the live servers), the dead server is
drained, and the refit that follows reaches the two live servers and takes the dead one out of
rotation, with the weight version checked on every reply.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import pytest

from osworld_jax.rollout import RolloutConfig, SamplingParams, SGLangClient, launch_embedded

REQUESTS = 24  # a step: e.g. B=3 prompts x N=8 owners, one turn each
SLOTS = 8  # KV slots per server: 3 x 8 = 24, every request is admitted at once
NEW_TOKENS = 48
SERVER_ARGS = [
    "--context-length",
    "64",
    "--min-bucket",
    "64",
    "--min-decode-batch",
    str(SLOTS),
    "--max-prefill-batch",
    "1",
]


def _ckpt(path, seed: int):
    from osworld_jax.model.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(path, seed=seed, initializer_range=0.1)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    base = tmp_path_factory.mktemp("failover")
    ckpt = _ckpt(base / "w0", seed=0)
    srvs = [
        launch_embedded(
            ckpt,
            max_running_requests=SLOTS,
            weight_version="v0",
            dtype="float32",
            extra_args=SERVER_ARGS,
            log_path=base / f"server{i}.log",
            startup_timeout_s=300,
            stop_timeout_s=10,
        )
        for i in range(3)
    ]
    try:
        with ThreadPoolExecutor(3) as pool:  # start (and compile) the three concurrently
            list(pool.map(lambda s: s.start(), srvs))
        yield ckpt, base, srvs
    finally:
        for s in srvs:
            s.stop()


def _config(ckpt, urls) -> RolloutConfig:
    model = json.loads((ckpt / "config.json").read_text())
    return RolloutConfig(
        urls=tuple(urls),
        return_routed_experts=True,
        num_layers=model["num_hidden_layers"],
        num_experts_per_tok=model["num_experts_per_tok"],
        request_timeout_s=120,
        max_retries=4,
        backoff_initial_s=0.2,
        backoff_max_s=1.0,
        health_check_interval_s=0.5,
        unavailable_wait_s=30,
    )


@pytest.mark.slow
@pytest.mark.serial  # a kill timed against requests in flight on three servers
def test_server_killed_mid_step_then_refit_skips_it(servers):
    ckpt, base, srvs = servers
    new_weights = _ckpt(base / "w1", seed=1)
    victim = srvs[1]
    live = [s.url for s in srvs if s is not victim]
    sp = SamplingParams(temperature=0.7, max_new_tokens=NEW_TOKENS, ignore_eos=True)

    async def main():
        async with SGLangClient(None, _config(ckpt, [s.url for s in srvs])) as client:
            by_url = {s.url: s for s in client.servers}
            peak: dict[str, int] = dict.fromkeys(by_url, 0)
            stop = asyncio.Event()

            async def sample():  # the client's own view of the load while the step runs
                while not stop.is_set():
                    for url, s in by_url.items():
                        peak[url] = max(peak[url], s.outstanding)
                    await asyncio.sleep(0.005)

            async with aiohttp.ClientSession() as http:

                async def post(url: str, route: str, body: dict) -> None:
                    async with http.post(url + route, json=body) as resp:
                        assert resp.status == 200, await resp.text()

                async def wait_for(what: str, cond) -> None:  # a deadline, never a hang
                    deadline = time.monotonic() + 60
                    while not cond():
                        assert time.monotonic() < deadline, f"timed out waiting for {what}"
                        await asyncio.sleep(0.01)

                # Every server holds its requests (queued, in place) until all 24 are dispatched:
                # the spread is then exactly the client's balancing, whatever the machine's speed
                # (on a slow one a server finished its first requests before the last were sent).
                for url in by_url:
                    await post(url, "/pause_generation", {"mode": "in_place"})
                sampler = asyncio.create_task(sample())
                tasks = [
                    asyncio.create_task(
                        client.generate([3 + i % 40, 9, 27, 40 + i], sp, rid=f"step-{i}")
                    )
                    for i in range(REQUESTS)
                ]
                await wait_for(
                    "every request dispatched",
                    lambda: all(s.outstanding == SLOTS for s in by_url.values()),
                )
                # The victim starts prefilling / decoding, and is held again where it is (its
                # 8 x 48 tokens were once all done within a 0.1 s wait): the kill is mid-request.
                await post(victim.url, "/continue_generation", {})
                await asyncio.sleep(0.02)
                await post(victim.url, "/pause_generation", {"mode": "in_place"})
                in_flight_at_kill = by_url[victim.url].outstanding
                dispatched_before = {u: s.dispatched for u, s in by_url.items()}
                # The spread is the load up to the kill: afterwards the victim's requests are
                # retried on the live servers while their own run (seen: 10 outstanding on each).
                stop.set()
                await sampler
                victim.process.kill()  # SIGKILL: no goodbye, sockets reset mid-request
                for url in live:
                    await post(url, "/continue_generation", {})
            t0 = time.monotonic()
            gens = await asyncio.gather(*tasks)
            recovery_s = time.monotonic() - t0
            drained = {u: (s.healthy, s.dispatched, s.failed) for u, s in by_url.items()}

            report = await client.refit(str(new_weights), "v1")
            after = await asyncio.gather(
                *(client.generate([5, 6, 7 + i], sp, rid=f"next-{i}") for i in range(6))
            )
            rotation = {u: (s.in_rotation, s.weight_version) for u, s in by_url.items()}
            return dict(
                gens=gens,
                after=after,
                peak=peak,
                in_flight_at_kill=in_flight_at_kill,
                dispatched_before=dispatched_before,
                drained=drained,
                report=report,
                rotation=rotation,
                active=client.active_urls,
                dispatched_after={u: s.dispatched for u, s in by_url.items()},
                recovery_s=recovery_s,
            )

    r = asyncio.run(main())
    print(
        f"peak outstanding {r['peak']}, in flight on the victim at SIGKILL "
        f"{r['in_flight_at_kill']}, step finished {r['recovery_s']:.1f} s after the kill, "
        f"dispatched/failed {r['drained']}"
    )

    # Load was spread by outstanding requests: 24 at once over 3 equal servers -> 8 each
    # (dispatched, and at most outstanding on each, up to the kill).
    assert r["dispatched_before"] == dict.fromkeys(r["peak"], SLOTS)
    assert set(r["peak"].values()) == {SLOTS}
    # The kill happened mid-step, with requests of this step on the victim.
    assert r["in_flight_at_kill"] > 0

    # Every request completed, fully, validated, from the old weights.
    assert len(r["gens"]) == REQUESTS
    for i, g in enumerate(r["gens"]):
        assert g.rid == f"step-{i}"
        assert g.completion_tokens == NEW_TOKENS and g.finish_reason["type"] == "length"
        assert len(g.output_logprobs) == NEW_TOKENS
        assert g.routed_experts is not None and g.routed_experts.shape[0] == 4 + NEW_TOKENS - 1
        assert g.weight_version == "v0"

    # The dead server is drained: its failed requests were retried on the live ones.
    healthy, _, failed = r["drained"][victim.url]
    assert not healthy and failed >= r["in_flight_at_kill"]
    retried = sum(r["drained"][u][1] - r["dispatched_before"][u] for u in live)
    assert retried >= r["in_flight_at_kill"]
    assert all(r["drained"][u][0] and r["drained"][u][2] == 0 for u in live)

    # The refit reached the two live servers and took the dead one out of rotation.
    assert r["report"][live[0]] is None and r["report"][live[1]] is None
    assert r["report"][victim.url] is not None and "refit to 'v1'" in r["report"][victim.url]
    assert r["rotation"][victim.url][0] is False
    assert all(r["rotation"][u] == (True, "v1") for u in live)
    assert sorted(r["active"]) == sorted(live)
    # After the refit every reply carries the new version and none went to the dead server.
    assert all(g.weight_version == "v1" and g.completion_tokens == NEW_TOKENS for g in r["after"])
    assert r["dispatched_after"][victim.url] == r["drained"][victim.url][1]
