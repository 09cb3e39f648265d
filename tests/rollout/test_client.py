"""SGLangClient against a scriptable fake server: validation, retries, aborts, balancing, refit."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

from osworld_jax.errors import ConfigError, InfraError
from osworld_jax.rollout import (
    AbortBudgetExceeded,
    Generation,
    RefitError,
    Reply,
    ReplyValidationError,
    RequestRejected,
    RolloutConfig,
    SamplingParams,
    ServerUnavailable,
    SGLangClient,
    stitch,
)
from osworld_jax.testing.sglang_server import FakeServer, K, L, logprob_at, routes_for, token_at

PROMPT = list(range(100, 110))  # 10 tokens
SAMPLING = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=6, stop=("\n",))


def cfg(**kw: Any) -> RolloutConfig:
    base = dict(
        urls=("http://unused",),
        return_routed_experts=True,
        num_layers=L,
        num_experts_per_tok=K,
        request_timeout_s=1.0,
        backoff_initial_s=0.01,
        backoff_max_s=0.05,
        max_retries=3,
        health_check_interval_s=0.2,
        unavailable_wait_s=1.0,
        flush_poll_interval_s=0.01,
        sampling=SAMPLING,
    )
    base.update(kw)
    return RolloutConfig(**base)


def with_servers(n: int, body: Callable[..., Awaitable[None]], **client_kw: Any) -> None:
    async def main() -> None:
        servers = [await FakeServer().start() for _ in range(n)]
        client = SGLangClient([s.url for s in servers], cfg(**client_kw))
        try:
            await body(client, *servers)
        finally:
            await client.aclose()
            for s in servers:
                await s.stop()

    asyncio.run(main())


def expected_generation(p: int, n: int, start: int = 0) -> tuple[list[int], list[float], Any]:
    ids = [token_at(p + i) for i in range(n)]
    lps = [logprob_at(p + i) for i in range(n)]
    return ids, lps, routes_for(range(start, p + n - 1))


def test_generate_sends_every_key_and_validates():
    async def body(client: SGLangClient, s: FakeServer) -> None:
        g = await client.generate(PROMPT, rid="owner0-call0", routed_experts_start_len=3)
        ids, lps, routes = expected_generation(len(PROMPT), 6, start=3)
        assert g.output_ids == ids and g.output_logprobs == pytest.approx(lps)
        assert g.routed_experts is not None
        assert g.routed_experts.shape == (len(PROMPT) + 6 - 1 - 3, L, K)
        np.testing.assert_array_equal(g.routed_experts, routes)
        assert g.finish_reason == {"type": "length", "length": 6}
        assert (g.prompt_tokens, g.completion_tokens, g.rid) == (10, 6, "owner0-call0")
        assert g.weight_version == "v0" and client.weight_version == "v0"
        sent = s.requests[0]
        assert set(sent["sampling_params"]) == {f.name for f in dataclasses.fields(SamplingParams)}
        assert sent["sampling_params"]["temperature"] == 0.7
        assert sent["sampling_params"]["stop"] == ["\n"]
        assert sent["return_logprob"] is True and sent["return_routed_experts"] is True
        assert sent["routed_experts_start_len"] == 3 and sent["rid"] == "owner0-call0"

    with_servers(1, body)


@pytest.mark.parametrize(
    "action,match",
    [
        ("short_routes", "routed_experts has 14 rows"),
        ("bad_logprob_ids", r"output_token_logprobs\[5\] is for token"),
        ("few_logprobs", "output_token_logprobs has 5 entries"),
        ("stale", "weight_version 'old'"),
    ],
)
def test_invalid_replies_raise_with_rid(action: str, match: str):
    async def body(client: SGLangClient, s: FakeServer) -> None:
        s.script = [action]
        with pytest.raises(ReplyValidationError, match=match) as e:
            await client.generate(PROMPT, rid="r-bad")
        assert e.value.rid == "r-bad" and isinstance(e.value, InfraError)
        assert len(s.requests) == 1  # a broken reply is not silently retried

    with_servers(1, body)


def test_5xx_is_retried_with_backoff_then_succeeds():
    async def body(client: SGLangClient, s: FakeServer) -> None:
        s.script = ["500", "500", "ok"]
        g = await client.generate(PROMPT, rid="r5")
        assert g.completion_tokens == 6
        assert [r["rid"] for r in s.requests] == ["r5", "r5.retry1", "r5.retry2"]

    with_servers(1, body)


def test_5xx_beyond_retry_budget_is_server_unavailable():
    async def body(client: SGLangClient, s: FakeServer) -> None:
        s.script = ["500"] * 10
        with pytest.raises(ServerUnavailable, match="4 attempts failed"):
            await client.generate(PROMPT, rid="r5x")
        assert len(s.requests) == 4  # 1 + max_retries

    with_servers(1, body)


def test_timeout_is_retried_and_the_stuck_request_aborted():
    async def body(client: SGLangClient, s: FakeServer) -> None:
        s.script = ["hang", "ok"]
        g = await client.generate(PROMPT, rid="rt")
        assert g.completion_tokens == 6
        await asyncio.sleep(0.05)
        assert "abort_request:rt" in s.calls

    with_servers(1, body, request_timeout_s=0.3)


def test_4xx_is_rejected_without_retry():
    async def body(client: SGLangClient, s: FakeServer) -> None:
        s.script = ["400"]
        with pytest.raises(RequestRejected, match="HTTP 400"):
            await client.generate(PROMPT, rid="r4")
        assert len(s.requests) == 1

    with_servers(1, body)


def test_abort_is_resubmitted_and_stitched_exactly():
    async def body(client: SGLangClient, s: FakeServer) -> None:
        s.script = ["abort:2", "abort:0", "abort:1", "ok"]
        g = await client.generate(PROMPT, rid="ra", routed_experts_start_len=4)
        ids, lps, routes = expected_generation(len(PROMPT), 6, start=4)
        # Identical to an uninterrupted request: ids, logprobs and every route row.
        assert g.output_ids == ids and g.output_logprobs == pytest.approx(lps)
        np.testing.assert_array_equal(g.routed_experts, routes)
        assert g.routed_experts.shape[0] == len(PROMPT) + 6 - 1 - 4
        assert g.finish_reason["type"] == "length" and g.num_resubmits == 3
        sent = s.requests
        assert [len(r["input_ids"]) for r in sent] == [10, 12, 12, 13]
        assert sent[1]["input_ids"] == PROMPT + ids[:2]
        assert [r["sampling_params"]["max_new_tokens"] for r in sent] == [6, 4, 4, 3]
        assert [r["routed_experts_start_len"] for r in sent] == [4, 11, 11, 12]
        assert [r["rid"] for r in sent] == ["ra", "ra.resubmit1", "ra.resubmit2", "ra.resubmit3"]

    with_servers(1, body)


def test_an_abort_after_a_generated_media_token_ends_the_turn_there():
    """Resubmitting ``prompt + partial output`` would put the generated placeholder into a
    prompt, where a server reads it as an image without its image (SGLang's processor and the
    embedded server refuse it): the turn ends with the part, as a stop on that token."""

    async def body(client: SGLangClient, s: FakeServer) -> None:
        s.script = ["abort:3", "ok"]
        ids, lps, routes = expected_generation(len(PROMPT), 6, start=4)
        g = await client.generate(
            PROMPT, rid="rm", routed_experts_start_len=4, media_token_ids={ids[1], 7}
        )
        assert g.output_ids == ids[:3] and g.output_logprobs == pytest.approx(lps[:3])
        np.testing.assert_array_equal(g.routed_experts, routes[: len(PROMPT) + 3 - 1 - 4])
        assert g.finish_reason["type"] == "stop" and g.finish_reason["matched"] == ids[1]
        assert len(s.requests) == 1 and g.num_resubmits == 0
        # without media ids among the output, the same abort is resubmitted as usual
        s.script = ["abort:3", "ok"]
        g = await client.generate(PROMPT, rid="rn", media_token_ids={7})
        assert g.output_ids == ids and g.num_resubmits == 1

    with_servers(1, body)


def test_abort_beyond_budget_fails_the_owner():
    async def body(client: SGLangClient, s: FakeServer) -> None:
        s.script = ["abort:1"] * 10
        with pytest.raises(AbortBudgetExceeded, match="budget is 2") as e:
            await client.generate(PROMPT, rid="rb")
        assert e.value.rid == "rb" and isinstance(e.value, InfraError)
        assert len(s.requests) == 3

    with_servers(1, body, max_abort_resubmits=2)


def test_dead_server_is_drained_and_load_is_balanced():
    async def body(client: SGLangClient, a: FakeServer, b: FakeServer) -> None:
        await client.health()
        await asyncio.gather(*(client.generate(PROMPT, rid=f"x{i}") for i in range(20)))
        assert len(a.requests) > 0 and len(b.requests) > 0
        assert len(a.requests) + len(b.requests) == 20
        await b.stop()  # connection refused from now on
        n_a = len(a.requests)
        gens = await asyncio.gather(*(client.generate(PROMPT, rid=f"y{i}") for i in range(10)))
        assert all(g.completion_tokens == 6 for g in gens)
        assert len(a.requests) - n_a == 10
        assert client.active_urls == [a.url]
        b.port = 0

    async def main() -> None:
        a, b = await FakeServer().start(), await FakeServer().start()
        client = SGLangClient([a.url, b.url], cfg())
        try:
            await body(client, a, b)
        finally:
            await client.aclose()
            await a.stop()

    asyncio.run(main())


def test_no_server_reachable_is_server_unavailable():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()

    async def main() -> None:
        async with SGLangClient([url], cfg(unavailable_wait_s=0.3)) as client:
            with pytest.raises(ServerUnavailable, match="no healthy server"):
                await client.generate(PROMPT, rid="rz")

    asyncio.run(main())


def test_refit_runs_the_canonical_sequence_and_checks_versions():
    async def body(client: SGLangClient, a: FakeServer, b: FakeServer) -> None:
        a.flush_busy = 3
        report = await client.refit("/ckpt/step1", "v1")
        assert report == {a.url: None, b.url: None}
        seq = [c for c in a.calls if c not in ("health", "model_info")]
        # each busy flush (400) is followed by another abort: what reached the server after
        # the pause waits in its queue until aborted
        assert seq == ["pause", *["flush", "pause"] * 3, "flush", "update", "continue"]
        assert a.calls[-1] == "model_info"
        assert client.weight_version == "v1"
        g = await client.generate(PROMPT, rid="after")
        assert g.weight_version == "v1"

    with_servers(2, body)


def test_refit_failure_takes_the_server_out_of_rotation():
    async def body(client: SGLangClient, a: FakeServer, b: FakeServer) -> None:
        b.fail_update = True
        report = await client.refit("/ckpt/step1", "v1")
        assert report[a.url] is None and "update_weights_from_disk" in report[b.url]
        assert "continue" not in b.calls  # left paused: never serves the old weights
        assert client.active_urls == [a.url]
        await asyncio.gather(*(client.generate(PROMPT, rid=f"z{i}") for i in range(8)))
        assert len(b.requests) == 0
        await asyncio.sleep(0.5)  # health probes keep it out (old version)
        assert client.active_urls == [a.url]
        a.fail_update = True
        with pytest.raises(RefitError, match="failed on every server"):
            await client.refit("/ckpt/step2", "v2")

    with_servers(2, body)


def test_refit_aborts_in_flight_requests_which_resume_on_new_weights():
    async def body(client: SGLangClient, s: FakeServer) -> None:
        s.script = ["wait"]
        task = asyncio.create_task(client.generate(PROMPT, rid="inflight"))
        while not s.requests:
            await asyncio.sleep(0.01)
        await client.refit("/ckpt/step1", "v1")
        g = await task
        ids, lps, routes = expected_generation(len(PROMPT), 6)
        assert g.output_ids == ids and g.output_logprobs == pytest.approx(lps)
        np.testing.assert_array_equal(g.routed_experts, routes)
        assert g.weight_versions == ("v0", "v1") and g.weight_version == "v1"
        # The 'wait' part returned 2 tokens before the pause; the resubmission made the other 4.
        assert g.part_lengths == (2, 4)
        assert g.token_weight_versions() == ("v0",) * 2 + ("v1",) * 4

    with_servers(1, body)


def test_config_validation():
    with pytest.raises(ConfigError, match="num_layers"):
        RolloutConfig(return_routed_experts=True)
    with pytest.raises(ConfigError, match="load_balancer"):
        RolloutConfig(load_balancer="random")
    with pytest.raises(ConfigError, match="top_p"):
        SamplingParams(top_p=0.0)
    assert RolloutConfig(urls="http://h:1/").urls == ("http://h:1",)


def test_client_reopens_in_a_new_event_loop():
    async def serve_and(client: SGLangClient) -> int:
        s = await FakeServer().start()
        client.servers[0].url = s.url
        client.config = dataclasses.replace(client.config, urls=(s.url,))
        try:
            g = await client.generate(PROMPT, rid="loop")
            return g.completion_tokens
        finally:
            await client.aclose()
            await s.stop()

    client = SGLangClient(["http://127.0.0.1:1"], cfg())
    assert asyncio.run(serve_and(client)) == 6
    assert asyncio.run(serve_and(client)) == 6  # a second loop: fresh session and primitives


def test_abort_before_any_token_is_resubmitted_whole():
    async def body(client: SGLangClient, s: FakeServer) -> None:
        s.script = ["abort:0", "abort:2", "abort:0", "ok"]
        g = await client.generate(PROMPT, rid="re", routed_experts_start_len=1)
        ids, lps, routes = expected_generation(len(PROMPT), 6, start=1)
        assert g.output_ids == ids and g.output_logprobs == pytest.approx(lps)
        np.testing.assert_array_equal(g.routed_experts, routes)
        assert g.num_resubmits == 3 and len(g.weight_versions) == 2
        assert g.part_lengths == (2, 4)  # the empty aborts are not parts
        assert [len(r["input_ids"]) for r in s.requests] == [10, 10, 12, 12]
        assert [r["routed_experts_start_len"] for r in s.requests] == [1, 1, 11, 11]

    with_servers(1, body)


def test_an_empty_abort_with_nothing_left_to_generate_is_resubmitted():
    # max_new_tokens 0: an abort before any token used to index the (empty) list of parts.
    async def body(client: SGLangClient, s: FakeServer) -> None:
        s.script = ["abort:0", "ok"]
        g = await client.generate(PROMPT, SAMPLING.replace(max_new_tokens=0), rid="r0")
        assert g.output_ids == [] and g.finish_reason == {"type": "length", "length": 0}
        assert g.num_resubmits == 1 and g.part_lengths == (0,)
        assert [r["rid"] for r in s.requests] == ["r0", "r0.resubmit1"]

    with_servers(1, body)


def test_stitch_records_every_tokens_version():
    def part(n: int, p: int, version: str, finish: str) -> Reply:
        ids, lps, _ = expected_generation(p, n)
        reason = {"type": "abort", "message": "paused"} if finish == "abort" else {"type": finish}
        return Reply(
            output_ids=ids,
            output_logprobs=lps,
            routed_experts=None,
            finish_reason=reason,
            prompt_tokens=p,
            completion_tokens=n,
            weight_version=version,
            text="",
        )

    # 3 tokens on "4", an abort and a retry on "4" again (2 tokens), then 1 token on "5".
    parts = [part(3, 10, "4", "abort"), part(2, 13, "4", "abort"), part(1, 15, "5", "length")]
    g = stitch(parts, rid="s", prompt_tokens=10, routed_experts_start_len=0)
    assert g.weight_versions == ("4", "4", "5") and g.part_lengths == (3, 2, 1)
    assert g.token_weight_versions() == ("4", "4", "4", "4", "4", "5")
    assert g.weight_version == "5" and g.completion_tokens == 6


def test_stitch_sums_the_parts_cached_tokens():
    def part(p: int, cached: Any) -> Reply:
        meta = {} if cached is None else {"cached_tokens": cached}
        return Reply(
            output_ids=[1],
            output_logprobs=[0.0],
            routed_experts=None,
            finish_reason={"type": "abort"},
            prompt_tokens=p,
            completion_tokens=1,
            weight_version="0",
            text="",
            meta_info=meta,
        )

    # 6 of 10 cached, then 11 of 11 (the resubmission extends the kept prompt), a server that
    # does not say (0), a bad value (0) and one above its prompt (clipped to it).
    parts = [part(10, 6), part(11, 11), part(12, None), part(13, "7"), part(14, 99)]
    g = stitch(parts, rid="c", prompt_tokens=10, routed_experts_start_len=0)
    assert (g.cached_tokens, g.served_tokens) == (6 + 11 + 0 + 0 + 14, 10 + 11 + 12 + 13 + 14)


def test_generation_part_bookkeeping_is_checked():
    base = dict(
        rid="g1",
        output_ids=[1, 2, 3],
        output_logprobs=[-0.1] * 3,
        routed_experts=None,
        finish_reason={"type": "length"},
        prompt_tokens=4,
        completion_tokens=3,
        weight_version="7",
    )
    g = Generation(**base)  # one part by default: every token on weight_version
    assert (g.weight_versions, g.part_lengths) == (("7",), (3,))
    assert g.token_weight_versions() == ("7", "7", "7")
    for bad, match in [
        (dict(weight_versions=("6", "7")), "2 part versions but 0 part lengths"),
        (dict(weight_versions=("6", "7"), part_lengths=(1, 1)), "sum to 2, not the 3"),
        (dict(weight_versions=("6", "7"), part_lengths=(4, -1)), "non-negative"),
        (dict(weight_versions=("7", "6"), part_lengths=(1, 2)), "last part's version '6'"),
    ]:
        with pytest.raises(ValueError, match=f"Generation 'g1': .*{match}"):
            Generation(**base, **bad)
