"""Every registered metric, getter and setup step is exercised by a test of this package.

Capability reporting counts a metric/getter as supported iff it is registered, so registering
one without a test would let the report call untested tasks runnable: this test forbids that.
"""

import re
from pathlib import Path

from osworld_jax.env.evaluators import GETTERS, METRICS
from osworld_jax.env.setup import SETUP_STEPS

HERE = Path(__file__).parent
TEST_FILES = [*HERE.glob("test_*.py"), HERE.parent / "test_evaluate.py"]


def _quoted_names() -> set[str]:
    names: set[str] = set()
    for p in TEST_FILES:
        names.update(re.findall(r"[\"']([A-Za-z_][A-Za-z0-9_]*)[\"']", p.read_text()))
    return names


def test_every_metric_getter_and_step_is_named_by_a_test():
    quoted = _quoted_names()
    missing = {
        "metric": sorted(set(METRICS.names()) - quoted),
        "getter": sorted(set(GETTERS.names()) - quoted),
        "setup step": sorted(set(SETUP_STEPS.names()) - quoted),
    }
    assert missing == {"metric": [], "getter": [], "setup step": []}
