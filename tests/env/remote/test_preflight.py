"""preflight(): one clear message per problem; a good service passes with a test sandbox."""

import asyncio
import socket

import pytest

from osworld_jax.env.backend import PreflightError
from osworld_jax.env.remote import RemoteBackend
from osworld_jax.testing.sandbox_service import FakeFaults, FakeSandboxService

from .conftest import TOKEN, TOKEN_ENV, make_config


def _preflight(pki, faults=None, *, token=TOKEN, serve_pki=None, ca=None, **overrides):
    """Runs ``preflight()`` (blocking, in a worker thread) against a running fake service."""

    async def main():
        async with FakeSandboxService(token=token, pki=serve_pki or pki, faults=faults) as svc:
            be = RemoteBackend(make_config(svc, ca or pki.ca_path, **overrides))
            try:
                await asyncio.to_thread(be.preflight)
                err = None
            except PreflightError as e:
                err = e
            return err, svc.stats, svc.live_ids()

    return asyncio.run(main())


def test_preflight_passes_and_leaves_nothing(pki):
    err, stats, live = _preflight(pki)
    assert err is None
    assert stats.created == 1 and stats.deleted == 1 and live == []


def test_preflight_missing_token(pki, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV)
    err, stats, _ = _preflight(pki)
    assert f"API token variable {TOKEN_ENV} is not set" in str(err)
    assert stats.requests == 0


def test_preflight_unreadable_and_invalid_ca(pki, tmp_path):
    err, _, _ = _preflight(pki, ca=tmp_path / "nope.pem")
    assert "cannot be read" in str(err) and "nope.pem" in str(err)
    bad = tmp_path / "bad.pem"
    bad.write_text("hello")
    err, _, _ = _preflight(pki, ca=bad)
    assert "holds no PEM certificate" in str(err)
    err, _, _ = _preflight(pki, ca=pki.cert_path)
    assert "no CA certificate" in str(err)


def test_preflight_wrong_ca(pki, other_pki):
    err, stats, _ = _preflight(pki, serve_pki=other_pki, max_retries=0)
    assert "TLS" in str(err) and "pinned CA" in str(err)
    assert stats.requests == 0


def test_preflight_rejected_token(pki):
    err, stats, _ = _preflight(pki, token="some-other-token")
    assert "rejects the token" in str(err) and TOKEN_ENV in str(err)
    assert TOKEN not in str(err)


def test_preflight_service_down(pki):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main():
        async with FakeSandboxService(token=TOKEN, pki=pki) as svc:
            cfg = make_config(svc, pki.ca_path, max_retries=1)
        import dataclasses

        be = RemoteBackend(dataclasses.replace(cfg, base_url=f"https://127.0.0.1:{port}/v1"))
        with pytest.raises(PreflightError, match="does not answer"):
            await asyncio.to_thread(be.preflight)

    asyncio.run(main())


def test_preflight_test_sandbox_fails_to_boot(pki):
    err, _, live = _preflight(pki, FakeFaults(stuck_boots=1), boot_timeout_s=0.2)
    assert "test sandbox could not be created" in str(err) and "boot_timeout_s" in str(err)
    assert live == []  # the stuck test sandbox was deleted
