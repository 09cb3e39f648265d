"""Every docstring example of the package runs and gives what it shows (``doctest``).

The examples are documentation a reader copies (`algorithms/advantages.py`'s formulas and exact
zeros, the server's bucket and cache rules): a stale one misleads, so each runs here.
"""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "osworld_jax"
MODULES = sorted(
    ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts)
    for p in PACKAGE.rglob("*.py")
    if ">>> " in p.read_text(encoding="utf-8")
)


def test_the_package_has_examples():
    assert "osworld_jax.algorithms.advantages" in MODULES and len(MODULES) >= 10


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name}: no example ran"
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"
