#!/usr/bin/env bash
# The README's test command: set up (system packages, the OSWorld tasks' desktop applications,
# .venv with dev extras), lint, type-check, then run the whole test suite including the slow
# (end-to-end, learning) tests. The application tests fail, not skip, when an app is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev --apps
export OSWORLD_JAX_REQUIRE_APPS=1
.venv/bin/ruff check osworld_jax tests scripts benchmarks
.venv/bin/ruff format --check osworld_jax tests scripts benchmarks
.venv/bin/mypy osworld_jax
# Two workers (pytest-xdist), a test file each at a time: XLA compiles on one thread and many
# slow tests wait on the processes they start, so one worker leaves a core idle most of the time.
# Files are handed out in collection order (tests/conftest.py puts the longest first), not
# xdist's most-tests-first (which left the few-test end-to-end files to the end).
# OSWORLD_JAX_TEST_WORKERS=0 runs everything in this process.
exec .venv/bin/python -m pytest -q --runslow -p no:cacheprovider \
  -n "${OSWORLD_JAX_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
