"""``--num-continuous-decode-steps``: n decode steps per device call give the tokens, logprobs,
routes and finish reasons of n calls of one step, and leave the kept prefixes intact."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

from .conftest import ENGINE_KW


def _run(engine, specs: list[tuple[list[int], dict]]) -> list:
    """Submits every ``(input_ids, sampling)`` at once; their finished `GenRequest` s."""
    futures = []
    for k, (ids, sampling) in enumerate(specs):
        req = engine.make_request(rid=f"r{k}", input_ids=ids, sampling=sampling)
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def notify(r, finished, fut=fut):
            if finished:
                fut.set_result(r)

        req.notify = notify
        engine.submit(req)
        futures.append(fut)
    return [f.result(timeout=120) for f in futures]


def _outcome(req) -> tuple:
    routes = np.concatenate(req.routes, axis=0) if req.routes else np.zeros((0,))
    return req.output_ids, np.asarray(req.output_logprobs), routes, req.finish


@pytest.fixture(scope="module")
def engines(tiny_ckpt):
    from osworld_jax.server.engine import Engine, EngineConfig

    out = {}
    for n in (1, 3):
        cfg = EngineConfig(model_path=str(tiny_ckpt), num_continuous_decode_steps=n, **ENGINE_KW)
        out[n] = Engine(cfg).start()
    yield out
    for e in out.values():
        e.shutdown()


def test_n_steps_a_call_equal_n_calls_of_one_step(engines):
    greedy = {"temperature": 0.0, "ignore_eos": True}
    probe = _run(engines[1], [([5, 6, 7, 8], {**greedy, "max_new_tokens": 12})])[0]
    out = probe.output_ids
    k = next(k for k in range(2, len(out)) if out[k] not in out[:k])  # met first at index k
    third = out[k]  # a stop id greedy decoding meets mid-call at n = 3 (k = 2: the 1st call's)
    specs = [
        ([5, 6, 7, 8], {**greedy, "max_new_tokens": 13}),  # 13: not a multiple of 3
        ([9, 10, 11], {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 10,
                        "sampling_seed": 4}),
        ([5, 6, 7, 8], {**greedy, "max_new_tokens": 12, "stop_token_ids": [third]}),
        # banned until 5 tokens: across the first call (3 steps) into the second
        ([5, 6, 7, 8], {**greedy, "max_new_tokens": 8, "stop_token_ids": [third],
                        "min_new_tokens": 5}),
        ([40, 41], {"temperature": 1.0, "max_new_tokens": 7, "sampling_seed": 11}),
    ]  # fmt: skip
    one, many = (_run(engines[n], specs) for n in (1, 3))
    for a, b in zip(one, many, strict=True):
        ids_a, lps_a, routes_a, fin_a = _outcome(a)
        ids_b, lps_b, routes_b, fin_b = _outcome(b)
        assert ids_a == ids_b and fin_a == fin_b
        np.testing.assert_allclose(lps_a, lps_b, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(routes_a, routes_b)
    stopped, banned = one[2], one[3]
    assert stopped.finish == {"type": "stop", "matched": third}
    assert len(stopped.output_ids) == k + 1
    assert third not in banned.output_ids[:5] and len(banned.output_ids) >= 5
    assert engines[3].num_decode_steps % 3 == 0  # every call ran its 3 steps


def test_a_prefix_kept_after_a_call_that_ran_past_its_request(engines):
    # The request ends at its 3rd token, inside a 3-step call whose last step writes a row
    # past its sequence; a request extending the sequence reuses the kept rows (it is long
    # enough that reuse saves a prefill bucket: 64 tokens).
    greedy = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 6}
    prompt = list(range(200, 262))  # 62 tokens
    outs = {}
    for n, engine in engines.items():
        assert engine.flush_cache().result(timeout=60)
        first = _run(engine, [(prompt, {**greedy, "max_new_tokens": 3})])[0]
        (second,) = _run(engine, [([*prompt, *first.output_ids, 30, 31], greedy)])
        assert second.cached_tokens == 64  # the prompt and the two output tokens fed back
        outs[n] = (first.output_ids, second.output_ids, second.output_logprobs)
    assert outs[1][:2] == outs[3][:2]
    np.testing.assert_allclose(outs[1][2], outs[3][2], rtol=1e-5, atol=1e-6)


def test_decode_buckets_compiled_at_start(tiny_ckpt):
    # As SGLang captures its decode CUDA graphs at start: a request met later (any batch,
    # any context length) compiles no decode program.
    from osworld_jax.server.engine import Engine, EngineConfig
    from osworld_jax.server.runner import _decode

    kw = {**ENGINE_KW, "num_continuous_decode_steps": 2}  # batch 8, windows 64 and 128
    kw["max_prefill_tokens"] = 20  # the burst below waits over a few one-step calls
    cfg = EngineConfig(model_path=str(tiny_ckpt), warmup_decode_buckets=True, **kw)
    before = _decode._cache_size()
    engine = Engine(cfg).start()
    try:
        buckets = engine.runner.buckets
        # 2 steps a call (new here) and 1 while prompts wait for admission (other engines of
        # this process may have compiled some of those already): every bucket of both
        assert _decode._cache_size() - before >= len(buckets.batches) * len(buckets.lengths)
        started = _decode._cache_size()
        greedy = {"temperature": 0.0, "ignore_eos": True}
        specs = [(list(range(5, 5 + 70)), {**greedy, "max_new_tokens": 40})]  # window 128
        specs += [([k, k + 1], {**greedy, "max_new_tokens": 3}) for k in range(7)]  # batch 8
        # (a burst of 8: some decode calls run while prompts wait, at one step)
        assert all(r.finish["type"] == "length" for r in _run(engine, specs))
        assert _decode._cache_size() == started
    finally:
        engine.shutdown()


def test_a_dense_decode_samples_what_the_grouped_one_does(tiny_ckpt, engines):
    # --decode-expert-backend dense: every expert on every slot's token, combined by the gate
    # weights; the routes, tokens and logprobs are the default backend's (float32, CPU:
    # ragged_dot).
    from osworld_jax.server.engine import Engine, EngineConfig

    cfg = EngineConfig(
        model_path=str(tiny_ckpt),
        num_continuous_decode_steps=3,
        decode_expert_backend="dense",
        **ENGINE_KW,
    )
    dense = Engine(cfg).start()
    try:
        assert dense.runner.decode_runtime.expert_backend == "dense"
        specs = [
            ([5, 6, 7, 8], {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 11}),
            ([9, 10, 11], {"temperature": 0.9, "max_new_tokens": 9, "sampling_seed": 2}),
        ]
        for a, b in zip(_run(engines[3], specs), _run(dense, specs), strict=True):
            ids_a, lps_a, routes_a, fin_a = _outcome(a)
            ids_b, lps_b, routes_b, fin_b = _outcome(b)
            assert ids_a == ids_b and fin_a == fin_b
            np.testing.assert_allclose(lps_a, lps_b, rtol=1e-4, atol=1e-5)
            np.testing.assert_array_equal(routes_a, routes_b)
    finally:
        dense.shutdown()
