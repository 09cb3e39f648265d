"""The engine's admission budget (``--max-prefill-tokens``): a burst of prompts is prefilled
over several scheduler iterations, with decode steps of the running requests between them."""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from .conftest import ENGINE_KW


def _first_token_steps(
    path, max_prefill_tokens: int, prompts: int = 4, decode_steps: int = 1
) -> list[int]:
    """The engine's decode-step count when each of ``prompts`` 20-token requests, queued at
    once beside one running request, got its first token (from its prefill)."""  # noqa: D205, D209
    from osworld_jax.server.engine import Engine, EngineConfig

    cfg = EngineConfig(
        model_path=str(path),
        max_prefill_tokens=max_prefill_tokens,
        num_continuous_decode_steps=decode_steps,
        **ENGINE_KW,
    )
    eng = Engine(cfg).start()
    try:
        first: dict[str, int] = {}
        done: dict[str, concurrent.futures.Future] = {}

        def request(rid: str, n: int, first_id: int):
            req = eng.make_request(
                rid=rid,
                input_ids=list(range(first_id, first_id + 20)),  # distinct: no kept prefix
                sampling={"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True},
            )
            done[rid] = concurrent.futures.Future()

            def notify(r, finished):
                if r.output_ids and r.rid not in first:
                    first[r.rid] = eng.num_decode_steps
                if finished:
                    done[r.rid].set_result(r)

            req.notify = notify
            return req

        eng.submit(request("running", 40, 3))
        deadline = time.monotonic() + 60
        while "running" not in first:  # it decodes while the burst arrives
            assert time.monotonic() < deadline and not done["running"].done()
            time.sleep(0.005)
        burst = [request(f"burst-{i}", 2, 30 + 20 * i) for i in range(prompts)]
        eng.call(lambda: eng.waiting.extend(burst)).result()
        for f in done.values():
            assert f.result(timeout=120).finish["type"] == "length"
        return [first[r.rid] for r in burst]
    finally:
        eng.shutdown()


@pytest.mark.parametrize(("budget", "decode_steps"), [(16384, 1), (20, 1), (20, 3)])
def test_a_burst_of_prompts_is_admitted_within_the_prefill_budget(tiny_ckpt, budget, decode_steps):
    # With --num-continuous-decode-steps 3 the running request still takes one step between
    # two admissions while prompts wait (SGLang's rule), not a call of three.
    steps = _first_token_steps(tiny_ckpt, budget, decode_steps=decode_steps)
    if budget >= 4 * 20:  # the whole burst in one iteration, before one decode step
        assert len(set(steps)) == 1, steps
    else:  # one 20-token prompt an iteration: a decode step of the running request after each
        assert steps == sorted(steps) and len(set(steps)) == 4, steps
        assert all(b - a == 1 for a, b in zip(steps, steps[1:], strict=False)), steps


def test_an_engine_lowers_the_gil_switch_interval_and_the_flag_is_checked(tiny_ckpt, capsys):
    """The engine thread waits for the GIL after every device step: starting an engine lowers
    the process's switch interval (benchmarks/engine_gil.py) to ``--switch-interval-ms``."""  # noqa: D205, D209
    import sys

    from osworld_jax.server import serve
    from osworld_jax.server.engine import Engine, EngineConfig

    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)  # Python's default
    try:
        cfg = EngineConfig(model_path=str(tiny_ckpt), switch_interval_ms=0.2, **ENGINE_KW)
        Engine(cfg).start().shutdown()
        assert sys.getswitchinterval() == pytest.approx(0.0002)
    finally:
        sys.setswitchinterval(before)
    assert serve.engine_config(serve.parse_args(["--model-path", "x"])).switch_interval_ms == 0.2
    with pytest.raises(SystemExit):
        serve.parse_args(["--model-path", "x", "--switch-interval-ms", "50"])
    assert capsys.readouterr().err == "error: --switch-interval-ms: must be at most 5.0, got 50\n"
