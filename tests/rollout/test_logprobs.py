"""Which distribution the embedded server's logprobs refer to, against an HF forward (float32).

The rule (SGLang 0.5.23 ``Sampler.forward``; docs/INTERFACES.md, rollout): an output logprob is
``log_softmax(logits / T_lp)[token]`` over the whole vocabulary, before top-k / top-p / min-p,
with ``T_lp = logprob_temperature(T, return_original_logprob=...)``; prompt logprobs are at 1.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from osworld_jax.rollout import SamplingParams, logprob_temperature

from .conftest import ENGINE_KW, hf_logits_and_routes, hf_model, log_softmax, serving
from .test_server import post

PROMPT = [7, 42, 300, 511, 12, 99, 250]
NEW = 10
# (temperature, extra sampling params): three temperatures, greedy, and filters at T = 1.3.
CASES = [(0.6, {}), (1.0, {}), (1.3, {}), (0.0, {}), (1.3, {"top_k": 5, "top_p": 0.8})]


def test_logprob_temperature_rule():
    assert [logprob_temperature(t) for t in (0.6, 1.0, 1.3)] == [0.6, 1.0, 1.3]
    assert logprob_temperature(0.0) == logprob_temperature(5e-7) == 1.0  # greedy (< 1e-6)
    assert logprob_temperature(1.3, return_original_logprob=True) == 1.0
    sp = SamplingParams(temperature=0.6)
    assert sp.logprob_temperature() == 0.6
    assert sp.logprob_temperature(return_original_logprob=True) == 1.0


def _generate_all(engine) -> list[dict]:
    """Every case in one concurrent batch (mixed temperatures share decode steps)."""
    bodies = [
        {
            "input_ids": PROMPT,
            "sampling_params": {
                "temperature": t,
                "max_new_tokens": NEW,
                "ignore_eos": True,
                "sampling_seed": 5,
                **extra,
            },
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        for t, extra in CASES
    ]

    async def main():
        async with serving(engine) as url:
            return await asyncio.gather(*(post(url, "/generate", b) for b in bodies))

    out = asyncio.run(main())
    assert all(status == 200 for status, _ in out), out
    return [r for _, r in out]


def _check(replies, model, *, original: bool) -> float:
    worst = 0.0
    for (t, _), reply in zip(CASES, replies, strict=True):
        out = reply["output_ids"]
        entries = reply["meta_info"]["output_token_logprobs"]
        assert [tok for _, tok, _ in entries] == out and len(out) == NEW
        logits, _ = hf_logits_and_routes(model, PROMPT + out)
        rows = np.arange(len(PROMPT) - 1, len(PROMPT) + NEW - 1)  # logits[j] predicts j + 1
        t_lp = logprob_temperature(t, return_original_logprob=original)
        want = log_softmax(logits[rows] / t_lp)[np.arange(NEW), out]
        got = np.array([lp for lp, _, _ in entries])
        worst = max(worst, float(np.abs(got - want).max()))
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=f"T={t}")
        if t_lp != 1.0:  # the test tells the temperatures apart
            other = log_softmax(logits[rows])[np.arange(NEW), out]
            assert np.abs(other - want).max() > 1e-2
        if t == 0.0:  # greedy: the argmax of the model, logprobs at temperature 1
            assert out == list(logits[rows].argmax(-1))
        # prompt logprobs are at temperature 1 whatever the request's temperature
        inp = reply["meta_info"]["input_token_logprobs"]
        want_in = log_softmax(logits[: len(PROMPT) - 1])[np.arange(len(PROMPT) - 1), PROMPT[1:]]
        np.testing.assert_allclose([lp for lp, _, _ in inp[1:]], want_in, atol=1e-5, rtol=0)
    return worst


def test_output_logprobs_are_at_the_sampling_temperature(engine, tiny_ckpt):
    """T in {0.6, 1.0, 1.3}: log_softmax(logits / T); greedy: T = 1; filters: not renormalised."""
    replies = _generate_all(engine)
    worst = _check(replies, hf_model(tiny_ckpt), original=False)
    print(f"server vs HF log_softmax(logits / T): max abs {worst:.2e}")


@pytest.fixture(scope="module")
def original_engine(tiny_ckpt):
    from osworld_jax.server.engine import Engine, EngineConfig

    cfg = EngineConfig(model_path=str(tiny_ckpt), return_original_logprob=True, **ENGINE_KW)
    eng = Engine(cfg).start()
    yield eng
    eng.shutdown()


def test_original_logprobs_are_at_temperature_one(original_engine, tiny_ckpt):
    """``--return-original-logprob`` (SGLANG_RETURN_ORIGINAL_LOGPROB=1): log_softmax(logits)."""
    replies = _generate_all(original_engine)
    worst = _check(replies, hf_model(tiny_ckpt), original=True)
    print(f"server (original) vs HF log_softmax(logits): max abs {worst:.2e}")


def test_serve_flag_follows_sglang_env(monkeypatch):
    from osworld_jax.server.serve import parse_args

    for value, want in (("1", True), ("True", True), ("0", False), ("yes", False)):
        monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", value)
        assert parse_args(["--model-path", "x"]).return_original_logprob is want
    monkeypatch.delenv("SGLANG_RETURN_ORIGINAL_LOGPROB")
    assert parse_args(["--model-path", "x"]).return_original_logprob is False
    assert parse_args(["--model-path", "x", "--return-original-logprob"]).return_original_logprob
