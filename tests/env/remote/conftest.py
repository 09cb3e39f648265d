"""Fixtures of the remote backend tests: a throw-away CA, the token variable, configs."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator

import pytest

from osworld_jax.env.remote import RemoteBackend, RemoteBackendConfig
from osworld_jax.testing.sandbox_service import FakeFaults, FakeSandboxService, make_test_pki

TOKEN_ENV = "OSWORLD_JAX_TEST_SANDBOX_TOKEN"
TOKEN = "sbx-" + secrets.token_hex(16)
TYPE = "```python\npyautogui.typewrite({!r})\n```"


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    return make_test_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def other_pki(tmp_path_factory):
    """A second, unrelated CA (and a server certificate it signed)."""
    return make_test_pki(tmp_path_factory.mktemp("other-pki"), name="unrelated CA")


@pytest.fixture(autouse=True)
def token_env(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    return TOKEN


def make_config(svc: FakeSandboxService, ca_path, **overrides) -> RemoteBackendConfig:
    """Fast timings for loopback; every field explicit where a test depends on it."""
    kw = dict(
        base_url=svc.base_url,
        ca_bundle=str(ca_path),
        token_env=TOKEN_ENV,
        poll_interval_s=0.01,
        boot_timeout_s=5.0,
        snapshot_timeout_s=5.0,
        request_timeout_s=5.0,
        rpc_timeout_s=5.0,
        step_timeout_s=5.0,
        settle_s=0.0,
        wait_action_s=0.0,
        backoff_initial_s=0.01,
        backoff_max_s=1.0,
        max_creations_per_s=1000.0,
        creation_burst=1000,
    )
    kw.update(overrides)
    return RemoteBackendConfig(**kw)


@contextlib.asynccontextmanager
async def service_and_backend(
    pki, faults: FakeFaults | None = None, **overrides
) -> AsyncIterator[tuple[FakeSandboxService, RemoteBackend]]:
    """A running fake service and a backend pointed at it; the backend is closed on exit."""
    async with FakeSandboxService(token=TOKEN, pki=pki, faults=faults) as svc:
        backend = RemoteBackend(make_config(svc, pki.ca_path, **overrides))
        try:
            yield svc, backend
        finally:
            await asyncio.shield(backend.aclose())


class Scripted:
    """An agent replying with fixed texts, then DONE."""

    def __init__(self, replies):
        self.replies = list(replies)

    async def act(self, obs):
        return self.replies.pop(0) if self.replies else "DONE"
