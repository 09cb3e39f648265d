"""Fixtures of the evaluator tests: the fixture source that writes input files.

A test that takes ``src`` runs once per source (``sources.py``): ``library`` always, ``apps``
(files the real applications wrote in a jailed desktop) as a slow test.
"""

from __future__ import annotations

import pytest

from tests.env.evaluators.sources import APP_SOURCES, make_source, source_names


@pytest.fixture(
    params=[
        pytest.param(n, marks=pytest.mark.slow) if n in APP_SOURCES else n for n in source_names()
    ]
)
def src(request, tmp_path):
    """The fixture source of this run of the test, writing under its ``tmp_path``."""
    apps = request.getfixturevalue("real_apps") if request.param in APP_SOURCES else None
    return make_source(tmp_path, request.param, apps)
