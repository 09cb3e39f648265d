"""Test set-up: 8 CPU devices for sharding tests, one XLA compilation cache, the --runslow switch.

The compilation cache is set through the environment, so every process a test starts
(``scripts/train.py``, the embedded server, the multi-process workers) shares it with pytest and
with its xdist workers: the suite compiles the same tiny models in hundreds of tests and dozens of
subprocesses, and each distinct program is compiled once per checkout (``.cache/jax`` under the
clone, ignored by git; a later run of the suite starts warm; a whole run writes ~90 MB). jax's own
size bound is not set: with it every write scans the whole directory under one file lock shared
by every process of the run (thousands of entries); instead the oldest entries are removed once
at the start of a run when the directory is over 2 GiB (`_prune_compile_cache`). XLA's cache key
covers the program, the flags, the devices and the jax/jaxlib versions, so a hit runs exactly
the executable a fresh compile would have produced, and an unreadable entry is compiled
again. ``OSWORLD_JAX_TEST_COMPILE_CACHE=off`` switches it off; ``=<dir>`` puts it elsewhere.
"""

import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_cache = os.environ.get("OSWORLD_JAX_TEST_COMPILE_CACHE", "on")
if _cache != "off":
    _clone = Path(__file__).resolve().parents[1]
    _dir = _clone / ".cache" / "jax" if _cache == "on" else Path(_cache)
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_dir))
    # Cache every program, however quick to compile: the tiny models' programs each take
    # 0.1-3 s, below jax's default one-second threshold, and there are thousands of them.
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# 8 CPU devices; LLVM at -O0 without its expensive passes: the tiny models' programs compile
# 25-35% faster (most of the suite's time is compiling them; they run slower, which tiny models
# do not notice). Numbers move by float32 rounding only (a tiny policy's loss and gradients
# against the default flags: max abs difference 1.5e-7); every comparison of the suite is
# between programs compiled with the same flags, or against a reference within a tolerance.
# ``OSWORLD_JAX_TEST_XLA_OPT=on`` keeps XLA's default optimisation.
_flags = ["--xla_force_host_platform_device_count=8"]
if os.environ.get("OSWORLD_JAX_TEST_XLA_OPT", "off") != "on":
    _flags += ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]
for _flag in _flags:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import signal  # noqa: E402

import pytest  # noqa: E402

# Ctrl-C as a user sends it. A suite started in the background by a script (``cmd &`` in a
# non-interactive shell, nohup) begins with SIGINT ignored, and an ignored signal stays ignored
# across exec: every train.py, server and service a test starts would ignore the SIGINT the
# Ctrl-C tests send (they ran on to the end). A handled signal is reset to the default at exec,
# so the processes the tests start get Python's KeyboardInterrupt again.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _prune_compile_cache(limit: int = 2 << 30, keep: int = 1 << 30) -> None:
    """Removes the oldest-written compilation cache entries when the directory is over ``limit``
    bytes, down to ``keep`` (once per run, before any test compiles)."""
    directory = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if not directory or not os.path.isdir(directory):
        return
    entries = []
    for e in os.scandir(directory):
        if e.is_file(follow_symlinks=False):
            st = e.stat(follow_symlinks=False)
            entries.append((st.st_mtime, st.st_size, e.path))
    total = sum(size for _, size, _ in entries)
    if total <= limit:
        return
    for _, size, path in sorted(entries):
        if total <= keep:
            break
        try:
            os.unlink(path)
            total -= size
        except OSError:
            pass


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controller, not each xdist worker
        _prune_compile_cache()


def pytest_addoption(parser):
    parser.addoption(
        "--runslow", action="store_true", default=False, help="also run tests marked slow"
    )


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        _slow_files_first(items)
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow (.ci/run does)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


#: The longest files of the CI run, longest first (seconds on 2 cores, 2026-12-07:
#: benchmarks/NOTES.md). Started first, the short files fill in around them.
LONGEST_FILES = (
    "tests/rl/test_slow.py",  # 160: the learning run, the two-process run
    "tests/rl/test_slow_screenshots.py",  # 160: the default run with screenshots
    "tests/rl/test_slow_resume.py",  # 90
    "tests/trainer/test_images.py",  # 85
    "tests/rl/test_image_replay.py",  # 84
    "tests/rl/test_async.py",  # 77
    "tests/scale/test_multiprocess.py",  # 74
    "tests/model/test_vl_sharding.py",  # 52
)


def _slow_files_first(items: list) -> None:
    """Puts `LONGEST_FILES`, then the other files holding a test marked ``slow``, first, in
    place (a stable sort).

    ``scripts/test.sh`` hands whole files to the xdist workers in collection order: the long
    end-to-end files, started last, ran alone at the end while the other workers idled
    (minutes of the CI run).
    """  # noqa: D205
    slow = {item.nodeid.split("::")[0] for item in items if "slow" in item.keywords}
    rank = {f: i for i, f in enumerate(LONGEST_FILES)}

    def key(item: pytest.Item) -> tuple[int, bool]:
        f = item.nodeid.split("::")[0]
        return (rank.get(f, len(rank)), f not in slow)

    items.sort(key=key)


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
