"""Test set-up: 8 CPU devices for sharding tests, one XLA compilation cache, the --runslow switch.

The compilation cache is set through the environment, so every process a test starts
(``scripts/train.py``, the embedded server, the multi-process workers) shares it with pytest and
with its xdist workers: the suite compiles the same tiny models in hundreds of tests and dozens of
subprocesses, and each distinct program is compiled once per checkout (``.cache/jax`` under the
clone, ignored by git; a later run of the suite starts warm). XLA's cache key covers the program,
the flags, the devices and the jax/jaxlib versions, so a hit runs exactly the executable a fresh
compile would have produced. ``OSWORLD_JAX_TEST_COMPILE_CACHE=off`` switches it off.
"""

import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Keep to this environment (the compile cache in the clone, bounded; XLA's default flags): with
# LLVM -O0 and an unbounded cache in ~/.cache, test_bundled_apps[calc-sum-column] scored its
# correct solution 0 after the evaluator app tests (benchmarks/NOTES.md, the test command's time).
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


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow (.ci/run does)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def _apps_missing(names: tuple[str, ...]) -> list[str]:
    from osworld_jax.env.local import apps

    return [a.name for a in apps.APPS if a.name in names and not apps.installed(a)]


@pytest.fixture(scope="session")
def real_apps():
    """One jailed desktop whose real applications make test files (``RealApps``), per session.

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
