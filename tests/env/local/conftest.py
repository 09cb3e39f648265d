"""Fixtures for the jailed local backend: one event loop and one backend per test module."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from osworld_jax.env.local import LocalBackend, LocalBackendConfig


@pytest.fixture(scope="module")
def runner() -> Iterator[asyncio.Runner]:
    """A module-wide event loop (sandbox clients are bound to the loop that opened them)."""
    with asyncio.Runner() as r:
        yield r


@pytest.fixture(scope="module")
def backend(runner: asyncio.Runner) -> Iterator[LocalBackend]:
    """A preflighted local backend; at module end it must hold zero sandboxes.

    Its root is a fresh directory under /tmp (pytest's own tmp dirs are 0700, which the jail's
    unprivileged host uid cannot traverse).
    """
    b = LocalBackend(LocalBackendConfig(observe_a11y=True))
    b.preflight()
    yield b
    leaked = b.inventory()
    runner.run(b.aclose())
    assert leaked == [], f"sandboxes left open by the tests: {leaked}"
