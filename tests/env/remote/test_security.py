"""Pinned CA and token hygiene: a foreign certificate is refused before any request is sent,
the token never reaches logs, reprs or error messages."""

import asyncio
import email.utils
import logging
import time

import pytest

from osworld_jax.env.remote import (
    CABundleError,
    RemoteBackend,
    RemoteCreateError,
    check_ca_bundle,
    pinned_ssl_context,
)
from osworld_jax.env.remote.api import retry_after_s
from osworld_jax.testing.memory import word_task
from osworld_jax.testing.sandbox_service import FakeFaults, FakeSandboxService

from .conftest import TOKEN, make_config, service_and_backend


def _chain_text(exc: BaseException) -> str:
    parts, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        parts += [str(exc), repr(exc), *map(str, exc.args)]
        exc = exc.__cause__ or exc.__context__
    return "\n".join(parts)


def test_context_trusts_only_the_pinned_ca(pki):
    ctx = pinned_ssl_context(pki.ca_path)
    assert ctx.cert_store_stats()["x509_ca"] == 1  # no system CAs loaded
    assert ctx.check_hostname and ctx.verify_mode.name == "CERT_REQUIRED"


def test_wrong_ca_is_refused_and_token_never_sent(pki, other_pki):
    """The service presents a certificate of an unrelated CA: TLS fails, no HTTP request."""

    async def main():
        async with FakeSandboxService(token=TOKEN, pki=other_pki) as svc:
            be = RemoteBackend(make_config(svc, pki.ca_path, max_retries=3))
            try:
                with pytest.raises(RemoteCreateError) as info:
                    await be.create(word_task("x"))
            finally:
                await be.aclose()
            assert info.value.tls
            assert "pinned CA" in str(info.value) and "certificate" in str(info.value)
            assert svc.stats.requests == 0 and svc.stats.proxy_requests == 0
            assert svc.stats.connections_total == 0  # no handshake ever completed
            assert svc.live_ids() == []

    asyncio.run(main())


def test_token_absent_from_logs_reprs_and_errors(pki, caplog):
    """Throttling, server errors that echo the token, and a failed create: no token anywhere."""
    caplog.set_level(logging.DEBUG)

    async def main():
        faults = FakeFaults(throttle=2, retry_after_s=0.01, echo_auth_in_errors=True)
        async with service_and_backend(pki, faults, max_retries=2) as (svc, be):
            sb = await be.create(word_task("x"))  # after two 429s
            faults.error_rate, faults.error_status = 1.0, 500
            with pytest.raises(RemoteCreateError) as info:
                await be.fork(sb, 2)
            faults.error_rate = 0.0
            texts = [_chain_text(info.value), repr(be), repr(be._api), repr(be.config), repr(sb)]
            await sb.close()
            return texts, svc.stats.errors_injected

    texts, injected = asyncio.run(main())
    assert injected >= 1
    assert "***" in texts[0]  # the echoed token was redacted, not dropped silently
    joined = "\n".join(texts) + caplog.text
    assert "retry" in caplog.text  # the retries were logged...
    assert TOKEN not in joined  # ...without the token


def test_log_records_are_redacted_while_a_client_is_open(pki, caplog):
    caplog.set_level(logging.INFO, logger="osworld_jax.env.remote")

    async def main():
        async with service_and_backend(pki) as (_, be):
            be._client()
            logging.getLogger("osworld_jax.env.remote").warning("echo %s here", TOKEN)

    asyncio.run(main())
    assert "echo *** here" in caplog.text and TOKEN not in caplog.text


def test_plain_http_endpoint_is_refused(pki):
    async def main():
        async with service_and_backend(pki, FakeFaults(endpoint_scheme="http://")) as (svc, be):
            with pytest.raises(RemoteCreateError, match="plain http"):
                await be.create(word_task("x"))
            assert svc.stats.proxy_requests == 0 and svc.live_ids() == []

    asyncio.run(main())


def test_retry_after_parsing():
    assert retry_after_s("3") == 3.0 and retry_after_s(" 0.5 ") == 0.5
    assert retry_after_s(None) is None and retry_after_s("soon") is None
    later = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 25 <= retry_after_s(later) <= 31


def test_missing_token_is_a_clear_error(pki, monkeypatch):
    async def main():
        async with FakeSandboxService(token=TOKEN, pki=pki) as svc:
            cfg = make_config(svc, pki.ca_path, token_env="OSWORLD_JAX_NO_SUCH_TOKEN")
            be = RemoteBackend(cfg)
            with pytest.raises(RemoteCreateError, match="OSWORLD_JAX_NO_SUCH_TOKEN"):
                await be.create(word_task("x"))
            await be.aclose()
            assert svc.stats.requests == 0

    asyncio.run(main())


def test_ca_bundle_checks(tmp_path, pki):
    assert check_ca_bundle(pki.ca_path) == 1
    with pytest.raises(CABundleError, match="cannot be read"):
        check_ca_bundle(tmp_path / "missing.pem")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(CABundleError, match="no PEM certificate"):
        check_ca_bundle(junk)
    with pytest.raises(CABundleError, match="no CA certificate"):
        check_ca_bundle(pki.cert_path)  # a leaf certificate is not a CA
    broken = tmp_path / "broken.pem"
    broken.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    with pytest.raises(CABundleError, match="not valid PEM"):
        check_ca_bundle(broken)
