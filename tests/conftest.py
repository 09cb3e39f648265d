"""Test set-up: 8 CPU devices for sharding tests, one XLA compilation cache, the --runslow switch.

The compilation cache is set through the environment, so every process a test starts
(``scripts/train.py``, the embedded server, the multi-process workers) shares it with pytest and
with its xdist workers: the suite compiles the same tiny models in hundreds of tests and dozens of
subprocesses, and each distinct program is compiled once per checkout (``.cache/jax`` under the
clone, ignored by git; a later run of the suite starts warm). XLA's cache key covers the program,
the flags, the devices and the jax/jaxlib versions. ``OSWORLD_JAX_TEST_COMPILE_CACHE=off``
switches it off.
"""

import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The environment of the last green CI (reverted at the end of the 2026-12-03 stop): with the
# cache in ~/.cache, no size bound and LLVM -O0, a full run made
# tests/env/local/test_bundled_apps.py[calc-sum-column] score its correct solution 0 after the
# evaluator app tests (the same selection passes in this environment); cause not found yet.
if os.environ.get("OSWORLD_JAX_TEST_COMPILE_CACHE", "on") != "off":
    os.environ.setdefault(
        "JAX_COMPILATION_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "jax")
    )
    # Cache every program, however quick to compile: the tiny models' programs each take
    # 0.1-3 s, below jax's default one-second threshold, and there are thousands of them.
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))  # LRU beyond 4 GiB
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import pytest  # noqa: E402


def pytest_addoption(parser):
    parser.addoption(
        "--runslow", action="store_true", default=False, help="also run tests marked slow"
    )


# The longest test files (seconds of their slowest tests in a 2-worker run of 2026-12-03),
# longest first.
LONGEST_FILES = (
    "rl/test_slow.py",  # 817
    "trainer/test_route_agreement.py",  # 326
    "scale/test_multiprocess.py",  # 270
    "agent/test_end_to_end.py",  # 256
    "env/evaluators/test_table.py",  # 252
    "rl/test_image_replay.py",  # 225
    "trainer/test_minibatches.py",  # 201
    "trainer/test_trainer.py",  # 170
    "model/test_vl_parity.py",  # 167
    "trainer/test_images.py",  # 153
    "trainer/test_step_bounds.py",  # 148
    "rl/test_async.py",  # 133
)


def _file_rank(item, slow_files: set) -> int:
    try:
        rel = item.path.relative_to(Path(__file__).parent).as_posix()
    except ValueError:  # a file outside tests/
        rel = ""
    if rel in LONGEST_FILES:
        return LONGEST_FILES.index(rel)
    return len(LONGEST_FILES) + (item.path not in slow_files)


def pytest_collection_modifyitems(config, items):
    # The longest files first, then files with slow tests, then the rest (each file's own order
    # kept): xdist's --dist loadfile --no-loadscope-reorder (scripts/test.sh) hands files out in
    # this order (its default reorders by number of tests), so the long end-to-end files
    # start early and the many quick files fill in beside them, instead of one long file running
    # alone at the end while the other worker idles.
    # One process (no xdist worker): the files' plain order.
    if hasattr(config, "workerinput"):
        slow_files = {item.path for item in items if "slow" in item.keywords}
        items.sort(key=lambda item: _file_rank(item, slow_files))
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow (.ci/run does)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def _apps_missing(names: tuple[str, ...]) -> list[str]:
    from osworld_jax.env.local import apps

    return [a.name for a in apps.APPS if a.name in names and not apps.installed(a)]


@pytest.fixture(scope="module")
def real_apps():
    """One jailed desktop whose real applications make test files (``RealApps``), per module.

    Not per session: with its headless LibreOffice still running, a later test's jailed Calc
    (tests/env/local/test_bundled_apps.py, calc-sum-column) scored its correct solution 0
    (reproduced in one process: test_table's apps tests, then that test; the cause is not
    known yet: a possible cross-jail LibreOffice interaction, see the stop's closing note).

    Skips without LibreOffice, Chromium, GIMP, VLC and Thunderbird (``bash scripts/setup.sh
    --apps``); with ``OSWORLD_JAX_REQUIRE_APPS=1`` (CI's ``scripts/test.sh``) that is a failure.
    """
    missing = _apps_missing(("libreoffice", "chrome", "gimp", "vlc", "thunderbird"))
    if missing:
        why = f"not installed: {', '.join(missing)} (bash scripts/setup.sh --apps)"
        if os.environ.get("OSWORLD_JAX_REQUIRE_APPS") == "1":
            pytest.fail(why)
        pytest.skip(why)
    from osworld_jax.testing.apps import RealApps

    apps = RealApps()
    yield apps
    apps.close()
