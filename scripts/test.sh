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
# One process by default. OSWORLD_JAX_TEST_WORKERS=2 runs two pytest-xdist workers, a test file
# each at a time, the longest files first (tests/conftest.py; --no-loadscope-reorder keeps that
# order): 42 min for the whole command on a 2-core machine, but there the end-to-end tests, the
# real applications and the /health latency bounds share two cores with a second suite, and a
# LibreOffice task (calc-sum-column) and a 1 s /health bound failed in two rehearsals of two.
exec .venv/bin/python -m pytest -q --runslow -p no:cacheprovider \
  -n "${OSWORLD_JAX_TEST_WORKERS:-0}" --dist loadfile --no-loadscope-reorder "$@"
