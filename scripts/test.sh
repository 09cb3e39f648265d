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
# each at a time (42 min for the whole command on 2 cores instead of about an hour), but there
# the end-to-end tests, the real applications and the 1 s /health bounds share two cores with a
# second suite, and a /health bound failed under that load.
exec .venv/bin/python -m pytest -q --runslow -p no:cacheprovider \
  -n "${OSWORLD_JAX_TEST_WORKERS:-0}" --dist loadfile "$@"
