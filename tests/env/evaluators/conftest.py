"""Fixtures of the evaluator tests: the fixture source that writes input files."""

from __future__ import annotations

import pytest

from tests.env.evaluators.sources import make_source


@pytest.fixture
def src(tmp_path):
    """The active fixture source, writing under this test's ``tmp_path``."""
    return make_source(tmp_path)
