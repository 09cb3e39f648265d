"""Attacks on the remote backend (issue 16 items 12-14), each written before its fix.

12. A service echoes the API token in its error text, at every offset around the client's
    truncation point, in lifecycle errors, malformed replies and sandbox endpoint errors: no part
    of the token reaches an exception, a log record or an owner's error.
13. A service presents an expired certificate, a certificate for another host, a certificate of
    an unknown CA, or speaks only TLS 1.0: the error names that cause, nothing is retried and no
    request (hence no token) is sent.
14. An OSWorld VM server answers HTTP 500 to ``/execute`` of a missing program (upstream's
    ``subprocess.run`` raises, the handler answers ``{"status": "error", "message"}``): that is
    permanent, so neither the client, the getters nor AgentEnv retry it, and the getter answers
    None as upstream's does (the task is scored, not masked).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import ssl
import threading
from collections.abc import AsyncIterator, Callable

import pytest
from aiohttp import web

from osworld_jax.env.actions import parse_action
from osworld_jax.env.agent_env import AgentEnv, AgentEnvConfig
from osworld_jax.env.backend import PreflightError, SandboxError, SandboxStepError
from osworld_jax.env.protocol import is_transient
from osworld_jax.env.remote import RemoteBackend, RemoteCreateError
from osworld_jax.env.remote.api import Secret
from osworld_jax.env.tasks import load_task
from osworld_jax.env.vm_client import VMClient
from osworld_jax.testing.memory import word_task, word_task_dict
from osworld_jax.testing.sandbox_service import FakeFaults, FakeSandboxService, make_test_pki

from .conftest import TOKEN_ENV, Scripted, make_config

# A token of its own, with no run of 5 characters that the rest of an error message could hold.
SECRET = "Zk" + secrets.token_urlsafe(33)


def _leaks(text: str, token: str = SECRET, n: int = 5) -> list[str]:
    """The substrings of ``token`` of length ``n`` found in ``text`` (whole or partial leaks)."""
    return sorted({token[i : i + n] for i in range(len(token) - n + 1) if token[i : i + n] in text})


def _chain_text(exc: BaseException | None) -> str:
    parts, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        parts += [str(exc), repr(exc), *map(str, exc.args)]
        exc = exc.__cause__ or exc.__context__
    return "\n".join(parts)


@pytest.fixture
def secret_env(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, SECRET)
    return SECRET


@contextlib.asynccontextmanager
async def _https_app(
    pki, handler: Callable[[web.Request], web.StreamResponse]
) -> AsyncIterator[str]:
    """A one-handler HTTPS service on loopback (every route); yields its ``/v1`` base URL."""
    app = web.Application()

    async def any_route(request: web.Request) -> web.StreamResponse:
        return handler(request)

    app.router.add_route("*", "/{tail:.*}", any_route)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=pki.server_context())
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"https://127.0.0.1:{port}/v1"
    finally:
        await runner.cleanup()


# ------------------------------------------------------------------ 12: token redaction


def test_token_echoed_across_the_truncation_point_leaks_no_part(pki, secret_env, caplog):
    """Lifecycle errors: the token is put at every offset around the 300-character cut."""
    caplog.set_level(logging.DEBUG)
    faults = FakeFaults(error_rate=1.0, error_status=400, echo_auth_in_errors=True)

    async def main() -> list[str]:
        texts = []
        async with FakeSandboxService(token=SECRET, pki=pki, faults=faults) as svc:
            be = RemoteBackend(make_config(svc, pki.ca_path, max_retries=0))
            api = be._client()
            try:
                for pad in range(150, 300, 2):
                    faults.echo_pad = pad
                    with pytest.raises(RemoteCreateError) as info:
                        await api.create(metadata={})
                    texts.append(_chain_text(info.value))
            finally:
                await be.aclose()
        return texts

    texts = asyncio.run(main())
    assert len(texts) == 75
    assert sum("***" in t for t in texts) >= 30  # echoes before the cut are visibly redacted
    for text in texts:
        assert _leaks(text) == [], text
    assert _leaks(caplog.text) == []


def test_token_in_a_malformed_reply_is_redacted(pki, secret_env):
    """A 200 reply without a sandbox id (or endpoint) that carries the token."""

    def echo(request: web.Request) -> web.StreamResponse:
        if request.path.endswith("/sb-dead"):  # a sandbox whose failure message has the token
            status = {"state": "Failed", "message": "." * 150 + f" boom {SECRET}"}
            return web.json_response({"id": "sb-dead", "status": status})
        return web.json_response({"note": "." * 150, "echo": SECRET, "why": f"bad {SECRET}"})

    async def main() -> list[str]:
        texts = []
        async with _https_app(pki, echo) as url:
            be = RemoteBackend(make_config_for(url, pki))
            api = be._client()
            try:
                for call in (
                    api.create(metadata={}),
                    api.endpoint("sb-1", 5000),
                    api.fork("sb-1", 2),
                    api.snapshot("sb-1"),
                    be._wait_running("sb-dead", deadline=asyncio.get_running_loop().time() + 5),
                ):
                    with pytest.raises(RemoteCreateError) as info:
                        await call
                    texts.append(_chain_text(info.value))
            finally:
                await be.aclose()
        return texts

    for text in asyncio.run(main()):
        assert _leaks(text) == [], text


def make_config_for(url: str, pki, **overrides):
    """``make_config`` for a service that is not a ``FakeSandboxService``."""

    class _Svc:
        base_url = url

    return make_config(_Svc(), pki.ca_path, **{"max_retries": 0, **overrides})


def test_token_echoed_by_a_sandbox_endpoint_is_redacted(pki, secret_env):
    """The in-VM endpoint's error replies echo the API token (the service knows it)."""
    faults = FakeFaults(echo_auth_in_errors=True, error_status=400, vm_error_marker="ECHO-ME")

    async def main() -> list[str]:
        texts = []
        async with FakeSandboxService(token=SECRET, pki=pki, faults=faults) as svc:
            be = RemoteBackend(make_config(svc, pki.ca_path))
            try:
                sb = await be.create(word_task("x"))
                action = parse_action("```python\nprint('ECHO-ME')\n```", "pyautogui")
                for pad in range(180, 300, 3):
                    faults.echo_pad = pad
                    with pytest.raises(SandboxError) as info:
                        await sb.step(action)
                    texts.append(_chain_text(info.value))
                await sb.close()
            finally:
                await be.aclose()
        return texts

    texts = asyncio.run(main())
    assert len(texts) == 40
    for text in texts:
        assert "HTTP 400" in text
        assert _leaks(text) == [], text


def test_secret_redaction_unit():
    token = "Zk" + "A1b2C3d4E5f6G7h8I9j0" * 2
    s = Secret(token)
    assert s.redact(f"x {token} y") == "x *** y"
    # as JSON or a URL would carry it
    assert token not in s.redact(f'{{"t": "{token}"}}')
    assert s.redact("a" + token[:10] + "b") == "a***b"  # a run of >= 8 of its characters
    assert s.redact("a" + token[:7] + "b") == "a" + token[:7] + "b"  # shorter runs are noise
    # truncating after masking never cuts the secret: nothing of it before the cut survives
    for cut in range(1, 60):
        text = "." * 20 + token + "." * 20
        out = s.snippet(text, limit=cut)
        assert _leaks(out, token) == [], (cut, out)


# ------------------------------------------------------------------ 13: TLS failures


@pytest.fixture(scope="module")
def bad_pkis(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-pki")
    return {
        "expired": make_test_pki(root / "expired", expired=True),
        "wrong_host": make_test_pki(root / "host", hosts=("sandbox.example.org",)),
    }


@contextlib.contextmanager
def _alerting_tls10_server(pki):
    """A TLS 1.0-only server that answers a modern ClientHello with a protocol_version alert
    (as OpenSSL-based servers do); yields its ``/v1`` base URL.
    """  # noqa: D205
    ctx = pki.server_context(only_version=ssl.TLSVersion.TLSv1)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with contextlib.suppress(OSError), ctx.wrap_socket(conn, server_side=True) as tls:
                tls.recv(1)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{port}/v1"
    finally:
        stop.set()
        thread.join(5)
        listener.close()


TLS_CASES = {
    "expired": "certificate has expired",
    "wrong_host": "is not valid for 127.0.0.1",
    "unknown_ca": "not signed by the pinned CA",
    "tls10": "speaks only TLSv1",
}


@pytest.mark.parametrize("case", list(TLS_CASES))
def test_tls_failure_says_what_failed_and_is_not_retried(case, pki, other_pki, bad_pkis):
    """Each broken service: the error names the cause; no retry; no request, so no token."""

    async def main() -> tuple[RemoteCreateError, dict, int]:
        if case == "tls10":
            svc = FakeSandboxService(token="t", pki=pki, tls_version=ssl.TLSVersion.TLSv1)
            pinned = pki.ca_path
        elif case == "unknown_ca":
            svc, pinned = FakeSandboxService(token="t", pki=other_pki), pki.ca_path
        else:
            served = bad_pkis[case]
            svc, pinned = FakeSandboxService(token="t", pki=served), served.ca_path
        async with svc:
            be = RemoteBackend(make_config(svc, pinned, max_retries=3))
            try:
                with pytest.raises(RemoteCreateError) as info:
                    await be.create(word_task("x"))
            finally:
                await be.aclose()
            return info.value, dict(be.metrics.retries), svc.stats.requests

    err, retries, requests = asyncio.run(main())
    text = str(err)
    assert err.tls, text
    assert TLS_CASES[case] in text, text
    if case != "unknown_ca":
        assert "not signed by the pinned CA" not in text, text  # the old catch-all claim
    assert retries == {}, retries
    assert requests == 0  # the handshake failed: no HTTP request, the token was never sent


def test_tls_version_alert_is_named_and_not_retried(pki):
    """A TLS 1.0-only server that sends the protocol_version alert (not a reset)."""

    async def main() -> tuple[RemoteCreateError, dict]:
        with _alerting_tls10_server(pki) as url:
            be = RemoteBackend(make_config_for(url, pki, max_retries=3))
            try:
                with pytest.raises(RemoteCreateError) as info:
                    await be.create(word_task("x"))
            finally:
                await be.aclose()
            return info.value, dict(be.metrics.retries)

    err, retries = asyncio.run(main())
    assert err.tls and "speaks only TLSv1" in str(err) and "TLS 1.2" in str(err), str(err)
    assert retries == {}


@pytest.mark.parametrize("case", ["expired", "wrong_host"])
def test_preflight_names_the_tls_cause(case, bad_pkis):
    async def main() -> str:
        served = bad_pkis[case]
        async with FakeSandboxService(token="t", pki=served) as svc:
            be = RemoteBackend(make_config(svc, served.ca_path, max_retries=3))
            with pytest.raises(PreflightError) as info:
                await asyncio.to_thread(be.preflight)
            return str(info.value)

    text = asyncio.run(main())
    assert "TLS" in text and TLS_CASES[case] in text, text


def test_sandbox_endpoint_tls_failure_is_named_and_permanent(pki, bad_pkis):
    """The in-VM endpoint presents an expired certificate: not a transient connection error."""
    served = bad_pkis["expired"]

    async def main() -> SandboxError:
        def ok(request: web.Request) -> web.StreamResponse:
            return web.json_response({"width": 1, "height": 1})

        async with _https_app(served, ok) as url:
            from osworld_jax.env.tls import pinned_ssl_context

            vm = VMClient(url, ssl=pinned_ssl_context(served.ca_path), timeout=5.0)
            try:
                with pytest.raises(SandboxError) as info:
                    await vm.screen_size()
            finally:
                await vm.aclose()
            return info.value

    err = asyncio.run(main())
    assert "certificate has expired" in str(err) and not is_transient(err), str(err)


# ------------------------------------------------------------------ 14: 500 of a missing program


UPSTREAM_500 = {"status": "error", "message": "[Errno 2] No such file or directory: 'nope'"}


def test_vm_client_classifies_an_upstream_execute_500_as_permanent():
    """Upstream's /execute answers 500 + {"status": "error"} when the program cannot run."""
    calls: list[str] = []

    async def execute(request: web.Request) -> web.Response:
        calls.append("execute")
        return web.json_response(UPSTREAM_500, status=500)

    async def screenshot(request: web.Request) -> web.Response:
        calls.append("screenshot")
        return web.Response(status=500, text="<html>Internal Server Error</html>")

    async def terminal(request: web.Request) -> web.Response:
        calls.append("terminal")
        return web.Response(status=503, text="busy")

    async def main() -> list[BaseException]:
        app = web.Application()
        app.router.add_post("/execute", execute)
        app.router.add_get("/screenshot", screenshot)
        app.router.add_get("/terminal", terminal)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        vm = VMClient(f"http://127.0.0.1:{runner.addresses[0][1]}", timeout=5.0)
        errors = []
        try:
            for call in (vm.execute(["nope"]), vm.screenshot(), vm.terminal()):
                with pytest.raises(SandboxStepError) as info:
                    await call
                errors.append(info.value)
        finally:
            await vm.aclose()
            await runner.cleanup()
        return errors

    missing, crashed, busy = asyncio.run(main())
    assert not is_transient(missing) and missing.status == 500
    assert "No such file or directory: 'nope'" in str(missing)
    assert is_transient(crashed) and is_transient(busy)  # a crash or 503 may pass on retry
    assert calls == ["execute", "screenshot", "terminal"]


def _missing_program_task() -> dict:
    task = word_task_dict("x", task_id="missing-program")
    task["evaluator"] = {
        "func": "exact_match",
        "result": {"type": "vm_command_line", "command": ["no-such-program", "--version"]},
        "expected": {"type": "rule", "rules": {"expected": "1.0"}},
    }
    return task


def test_getter_of_a_missing_program_scores_without_retrying(pki, secret_env):
    """Through AgentEnv: one /execute of the missing program, a reward (0), not a masked owner."""

    async def main():
        async with FakeSandboxService(token=SECRET, pki=pki) as svc:
            be = RemoteBackend(make_config(svc, pki.ca_path))
            env = AgentEnv(be, AgentEnvConfig(max_turns=2, eval_retry_delay_s=0))
            try:
                results = await env.run_group(
                    load_task(_missing_program_task()), [0], lambda i: Scripted(["DONE"])
                )
            finally:
                await be.aclose()
            runs = [c for c in svc.stats.executes if "no-such-program" in str(c)]
            return results, runs, env.metrics.eval_retries

    (result,), runs, eval_retries = asyncio.run(main())
    assert not result.failed and result.reward == 0.0, result
    assert len(runs) == 1 and eval_retries == 0
