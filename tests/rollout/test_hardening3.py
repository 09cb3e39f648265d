"""Issue 43 (hardening round 3), the server's items: each test replays an attack first.

1. every sampling / logprob value is checked at the edge (400 naming the field and the bound it
   violates, or SGLang's clamp: ``top_k`` beyond the vocabulary is every token); another client's
   generation never notices; a request's own failure inside the engine ends only that request;
2. ``serve``'s numeric flags are checked while parsing: one line ``error: --flag: ...``, exit 2;
12. range messages name the violated bound; a chat of more messages than the context is refused
   before it is copied, its template loaded and rendered off the event loop; a streaming client
   that vanishes while no event comes is noticed (its slot freed) without waiting for one.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from types import SimpleNamespace

import pytest

from osworld_jax.model.chat_template import ChatTemplate
from osworld_jax.server import openai_api, serve
from osworld_jax.server.openai_protocol import chat_messages
from osworld_jax.server.params import BadRequest, check_sampling
from osworld_jax.server.protocol import ServerLimits

from .conftest import serving
from .test_server import post

PROMPT = [7, 42, 300, 511, 12, 99, 250]
VOCAB = 1024  # the tiny model's
FAKE = SimpleNamespace(vocab_size=VOCAB, tokenizer=object(), eos_ids=[0])


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize(
    ("sp", "message"),
    [
        ({"top_k": 0}, "sampling_params.top_k must be -1 (disable) or at least 1, got 0"),
        ({"top_k": -2}, "sampling_params.top_k must be at least -1, got -2"),
        ({"top_k": 1e40}, "sampling_params.top_k must be at most 9223372036854775807, got 1e+40"),
        ({"top_k": 2.5}, "sampling_params.top_k must be an integer, got 2.5"),
        ({"stop_token_ids": [2**40]}, "stop_token_ids holds ids outside the vocabulary"),
        ({"stop_token_ids": [-1]}, "stop_token_ids holds ids outside the vocabulary [0, 1024)"),
        ({"stop_token_ids": [VOCAB]}, "stop_token_ids holds ids outside the vocabulary"),
        ({"stop_token_ids": [1.0]}, "stop_token_ids must be a list of integers"),
        # 2^64 + 1 is read as a float: the bound it violates is the int64 one, not "at least 0"
        ({"max_new_tokens": 2**64 + 1.0}, "max_new_tokens must be at most 9223372036854775807"),
        ({"max_new_tokens": -1}, "sampling_params.max_new_tokens must be at least 0, got -1"),
        ({"min_new_tokens": 5, "max_new_tokens": 2}, "must be at most sampling_params.max_new"),
        ({"temperature": 1e39}, "temperature must be at most 3.4028234663852886e+38"),
        ({"temperature": -0.5}, "sampling_params.temperature must be at least 0.0, got -0.5"),
        ({"top_p": 0}, "sampling_params.top_p must be greater than 0.0, got 0"),
        ({"top_p": 1.5}, "sampling_params.top_p must be at most 1.0, got 1.5"),
        ({"min_p": -0.1}, "sampling_params.min_p must be at least 0.0, got -0.1"),
        ({"sampling_seed": 2**63}, "sampling_seed must be at most 9223372036854775807"),
        ({"sampling_seed": -(2**63) - 1}, "sampling_seed must be at least -9223372036854775808"),
        ({"stream_interval": 0}, "sampling_params.stream_interval must be at least 1, got 0"),
        ({"n": 2}, "sampling_params.n=2 is not supported"),
        ({"frequency_penalty": 0.5}, "sampling_params.frequency_penalty=0.5 is not supported"),
        ({"logit_bias": {"99999999999": 1}}, "sampling_params.logit_bias="),
        ({"spaces_between_special_tokens": 1}, "spaces_between_special_tokens must be a bool"),
        ({"custom_params": [1]}, "sampling_params.custom_params must be an object"),
    ],
)
def test_each_sampling_field_is_refused_naming_the_field_and_its_bound(sp, message):
    """Items 1 and 12: a 400 naming the field and the violated bound, before any engine."""
    with pytest.raises(BadRequest) as e:
        check_sampling(sp, FAKE, ServerLimits())  # type: ignore[arg-type]
    assert message in str(e.value), str(e.value)


def test_sglang_clamps_and_the_openai_names():
    """top_k at or beyond the vocabulary is every token (SGLang), so 2^31 fits the int32 arrays;
    the OpenAI routes' messages use their own field names."""
    ok = check_sampling({"top_k": 2**31, "max_new_tokens": 2**62}, FAKE, ServerLimits())  # type: ignore[arg-type]
    assert ok["top_k"] == -1 and ok["max_new_tokens"] == 2**62  # cut to the context later
    assert check_sampling({"top_k": VOCAB - 1}, FAKE, ServerLimits())["top_k"] == VOCAB - 1  # type: ignore[arg-type]
    names = {"min_new_tokens": "min_tokens", "max_new_tokens": "max_tokens"}
    with pytest.raises(BadRequest, match=r"^min_tokens must be at most max_tokens \(2\), got 9$"):
        check_sampling({"min_new_tokens": 9, "max_new_tokens": 2}, FAKE, ServerLimits(), "", names)  # type: ignore[arg-type]


def test_bad_values_are_refused_while_another_clients_generation_runs(engine):
    """Item 1, end to end: while one client's generation is mid-way (held by an in-place pause,
    so the attacks surely meet it), another client's top_k = 2^31 requests are clamped and
    admitted beside it, and its ids beyond int32 / the vocabulary, 2^64 + 1 lengths and a
    logprob start past the prompt are refused at the edge; the first client's generation then
    runs to its length (before: the engine step raised OverflowError and aborted it)."""
    long_body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
    hi = [{"role": "user", "content": "hi"}]
    clamped = [
        ("/generate", {"input_ids": PROMPT, "sampling_params": {"top_k": 2**31}}),
        ("/v1/chat/completions", {"messages": hi, "max_tokens": 2, "top_k": 2**31}),
    ]
    refused = [
        ("/generate", {"input_ids": PROMPT, "sampling_params": {"stop_token_ids": [2**40]}}),
        ("/v1/chat/completions", {"messages": hi, "stop_token_ids": [VOCAB], "min_tokens": 1}),
        ("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2**64 + 1}}),
        ("/v1/chat/completions", {"messages": hi, "max_tokens": 2**64 + 1}),
        ("/generate", {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 99}),
    ]

    async def main():
        async with serving(engine) as url:
            first = asyncio.create_task(post(url, "/generate", long_body))
            while not any(r is not None and r.output_ids for r in engine.slots):
                await asyncio.sleep(0.005)  # it is decoding
            await post(url, "/pause_generation", {"mode": "in_place"})
            try:
                queued = [asyncio.create_task(post(url, p, b)) for p, b in clamped]
                while len(engine.waiting) < len(clamped):
                    await asyncio.sleep(0.005)
                bad = [await post(url, p, b) for p, b in refused]
                mid_way = not first.done()
            finally:
                await post(url, "/continue_generation", {})
            return await asyncio.gather(*queued), bad, mid_way, await first

    ok, bad, mid_way, (status, reply) = run(main())
    assert mid_way
    assert [s for s, _ in ok] == [200, 200], ok
    assert ok[0][1]["meta_info"]["finish_reason"]["type"] == "length"
    assert ok[1][1]["choices"][0]["finish_reason"] == "length"
    assert [s for s, _ in bad] == [400] * len(refused), bad
    assert [r.get("error", {}).get("message") or r.get("message") for _, r in bad] == [
        "sampling_params.stop_token_ids holds ids outside the vocabulary [0, 1024): "
        "[1099511627776]",
        "stop_token_ids holds ids outside the vocabulary [0, 1024): [1024]",
        "sampling_params.max_new_tokens must be at most 9223372036854775807, got "
        "1.8446744073709552e+19",
        "max_tokens must be at most 9223372036854775807, got 1.8446744073709552e+19",
        "logprob_start_len (the prompt has 7 tokens) must be at most 7, got 99",
    ]
    assert status == 200 and reply["meta_info"]["finish_reason"] == {"type": "length", "length": 40}


def test_a_request_failing_inside_the_engine_ends_only_itself(engine):
    """Defence in depth (item 1): a request whose values slipped past the edge (here set after
    validation: top_k beyond int32, a stop id beyond int32 while min_new_tokens bans it) fails
    alone; the request admitted with it in the same step runs to its length."""
    from concurrent.futures import Future

    def request(rid: str, **fields):
        req = engine.make_request(
            rid=rid, input_ids=PROMPT, sampling={"max_new_tokens": 6, "ignore_eos": True}
        )
        for k, v in fields.items():
            setattr(req, k, v)
        done: Future = Future()
        req.notify = lambda r, finished: finished and done.set_result(r.finish)
        return req, done

    good, good_done = request("good")
    bad_k, bad_k_done = request("bad-top-k", top_k=2**31)
    bad_stop, bad_stop_done = request("bad-stop", stop_token_ids={2**40}, min_new_tokens=3)

    def submit_together():  # one engine command: all three are admitted in one step
        engine.waiting.extend([bad_k, good, bad_stop])

    engine.call(submit_together).result()
    assert good_done.result(timeout=60) == {"type": "length", "length": 6}
    for done in (bad_k_done, bad_stop_done):
        finish = done.result(timeout=60)
        assert finish["type"] == "abort" and "OverflowError" in finish["message"], finish


# Every numeric flag of serve: a malformed, a non-finite / fractional and an out-of-range value.
NUMERIC_FLAGS = {
    "--port": "70000",
    "--max-running-requests": "0",
    "--context-length": "-5",
    "--max-total-tokens": "0",
    "--random-seed": "-1",
    "--min-bucket": "0",
    "--min-decode-batch": "0",
    "--max-prefill-batch": "0",
    "--max-request-bytes": "0",
    "--max-json-depth": "2000",
    "--max-json-values": "0",
    "--max-stop-strings": "0",
    "--max-stop-length": "0",
    "--max-image-pixels": "0",
    "--max-images-per-request": "0",
    "--max-request-image-pixels": "0",
    "--max-server-image-pixels": "0",
    "--chat-template-timeout-s": "-5",
    "--refit-read-timeout-s": "0",
    "--stall-timeout-s": "-5",
    "--num-continuous-decode-steps": "0",
    "--extra-length-buckets": "0",
}


@pytest.mark.parametrize("flag", sorted(NUMERIC_FLAGS))
def test_every_numeric_flag_is_checked_in_one_line(flag, capsys):
    """Item 2: out of range, non-finite, malformed: one line ``error: --flag: ...``, exit 2."""
    timeout = flag.endswith("-s")
    for value, says in [
        (NUMERIC_FLAGS[flag], "must be "),
        ("nan" if timeout else "1.5", "must be a finite number" if timeout else "invalid int"),
        ("abc", "invalid float value" if timeout else "invalid int value: 'abc'"),
    ]:
        with pytest.raises(SystemExit) as e:
            serve.main(["--model-path", "/nonexistent", flag, value])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1, err
        assert err.startswith(f"error: {flag}: ") and says in err, err
    assert serve.parse_args(["--model-path", "x"]).port == 30000  # defaults pass their checks


def test_flag_messages_name_the_bound_and_a_taken_port_is_one_line(capsys):
    for argv, line in [
        (["--port", "70000"], "error: --port: must be at most 65535, got 70000"),
        (["--stall-timeout-s", "-5"], "error: --stall-timeout-s: must be greater than 0.0, got -5"),
        (
            ["--max-running-requests", "0"],
            "error: --max-running-requests: must be at least 1, got 0",
        ),
        (
            ["--log-level", "loud"],
            "error: --log-level: invalid choice: 'loud' (choose from "
            "'debug', 'info', 'warning', 'error', 'critical')",
        ),  # fmt: skip
    ]:
        with pytest.raises(SystemExit):
            serve.parse_args(["--model-path", "x", *argv])
        assert capsys.readouterr().err == line + "\n"
    with pytest.raises(ValueError, match="chat_template_timeout_s must be finite and above 0"):
        ServerLimits(chat_template_timeout_s=float("nan"))
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        args = serve.parse_args(["--model-path", "x", "--port", str(port)])
        with pytest.raises(serve.ListenError, match=f"^--port {port}: cannot listen on 127"):
            run(serve.serve(args))  # before anything loads
    finally:
        taken.close()


def test_a_chat_beyond_the_context_is_refused_before_copying_and_templates_load_off_the_loop(
    engine, monkeypatch
):
    """Item 12: 900,000 one-line messages cannot fit a 128-token context: refused before any is
    copied or rendered; the template is loaded and rendered in a worker thread, never on the
    event loop's."""
    with pytest.raises(BadRequest, match=r"^messages: 900000 messages cannot fit .* \(128 tok"):
        chat_messages({"messages": [{"role": "user"}] * 900_000}, "string", 128)
    threads: list[str] = []
    real = ChatTemplate.from_model_dir

    class Recording(ChatTemplate):
        def render(self, *a, **kw):
            threads.append(f"render:{threading.current_thread().name}")
            return super().render(*a, **kw)

    def load(path):
        threads.append(f"load:{threading.current_thread().name}")
        t = real(path)
        return Recording(t.source, name=t.name, special_tokens=t.special_tokens)

    monkeypatch.setattr(openai_api.ChatTemplate, "from_model_dir", load)

    async def main():
        loop_thread = threading.current_thread().name
        async with serving(engine) as url:
            many = {"messages": [{"role": "user"}] * 200, "max_tokens": 2}
            refused = await post(url, "/v1/chat/completions", many)
            ok = await post(url, "/v1/chat/completions", {**many, "messages": many["messages"][:2]})
        return loop_thread, refused, ok

    loop_thread, (status, reply), (ok_status, _) = run(main())
    assert status == 400 and reply["message"].startswith("messages: 200 messages cannot fit")
    assert ok_status == 200
    assert [t.split(":")[0] for t in threads] == ["load", "render"], threads
    assert all(t.split(":")[1] != loop_thread for t in threads), (threads, loop_thread)


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_a_vanished_streaming_client_frees_its_slot_without_an_event(engine, path):
    """Item 12: a streaming client that goes away while its request is held (paused in place:
    no token, no event, nothing written) is noticed by the handler's poll and its slot freed; a
    request sharing its rid prefix runs on."""
    rid = f"stream-gone-{path.strip('/').replace('/', '-')}"

    async def main():
        async with serving(engine) as url:
            port = int(url.rsplit(":", 1)[1])
            await post(url, "/pause_generation", {"mode": "in_place"})
            try:
                if path == "/generate":
                    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 60}}
                else:
                    body = {"prompt": PROMPT, "max_tokens": 60}
                raw = json.dumps({**body, "rid": rid, "stream": True}).encode()
                body_kept = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}}
                sock = socket.create_connection(("127.0.0.1", port))
                sock.sendall(
                    f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(raw)}\r\n\r\n".encode()
                    + raw
                )
                kept = asyncio.create_task(
                    post(url, "/generate", {**body_kept, "rid": rid + "-kept"})
                )

                def where(r_id: str) -> str | None:
                    if any(r is not None and r.rid == r_id for r in engine.slots):
                        return "slot"
                    return "waiting" if any(r.rid == r_id for r in engine.waiting) else None

                while not (where(rid) and where(rid + "-kept")):
                    await asyncio.sleep(0.01)
                await asyncio.wrap_future(engine.call(engine._admit))  # prefilled, held
                assert where(rid) == "slot"
                sock.close()  # gone, while no event will come until /continue_generation
                t = time.perf_counter()
                while where(rid) is not None and time.perf_counter() - t < 10:
                    await asyncio.sleep(0.02)
                print(f"{path}: slot freed {time.perf_counter() - t:.2f} s after the disconnect")
                assert where(rid) is None
                assert where(rid + "-kept") == "slot"
            finally:
                await post(url, "/continue_generation", {})
            status, reply = await kept
            assert status == 200 and reply["meta_info"]["finish_reason"]["type"] != "abort"

    run(main())
