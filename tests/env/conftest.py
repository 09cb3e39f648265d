"""Shared fixtures of the env room tests."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def osworld_examples() -> Path:
    """The 369 upstream task files: ``<repo>/../shared/osworld_tasks/examples``."""
    root = REPO.parent / "shared" / "osworld_tasks" / "examples"
    if not root.is_dir():
        pytest.skip(f"OSWorld task files not found at {root} (the CI clone has them beside it)")
    return root
