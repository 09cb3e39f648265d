#!/usr/bin/env bash
# The README's test command: set up (system packages, the OSWorld tasks' desktop applications,
# .venv with dev extras), lint, type-check, then run the whole test suite including the slow
# (end-to-end, learning) tests. The application tests fail, not skip, when an app is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
# Python writes each module's bytecode on its first import (set-up installs with --no-compile).
# With PYTHONDONTWRITEBYTECODE set (this machine's default) every one of the suite's hundreds of
# processes (train.py, servers, workers) compiled torch, jax and transformers from source again:
# ~5 s of each train.py's start.
unset PYTHONDONTWRITEBYTECODE
bash scripts/setup.sh --dev --apps
export OSWORLD_JAX_REQUIRE_APPS=1
.venv/bin/ruff check osworld_jax tests scripts benchmarks
.venv/bin/ruff format --check osworld_jax tests scripts benchmarks
# Two pytest-xdist workers (a test file each at a time), then the tests marked `serial` (1 s
# latency bounds, real GUI apps typed into on a clock) alone on the machine: on 2 cores a second
# worker's compile beside them made them fail. Three workers kept the cores busier (21m45s once)
# but the next run's third worker ran the 24 GiB machine out of memory (a worker at 11 GiB was
# killed). OSWORLD_JAX_TEST_WORKERS=0 runs everything in one process, in one pass. Extra
# arguments go to both passes (a pass that selects nothing is fine).
workers="${OSWORLD_JAX_TEST_WORKERS:-2}"
pytest=(.venv/bin/python -m pytest -q --runslow -p no:cacheprovider)
if [ "$workers" = 0 ]; then
  .venv/bin/mypy osworld_jax
  exec "${pytest[@]}" "$@"
fi
# mypy (~30 s of one core) runs beside the workers' start (collection, imports: a third of the
# CPU idle), not before it; its verdict counts like a test pass's.
mypy_log=$(mktemp)
.venv/bin/mypy osworld_jax > "$mypy_log" 2>&1 &
mypy_pid=$!
status=0
"${pytest[@]}" -n "$workers" --dist loadfile -m "not serial" "$@" || status=$?
[ "$status" = 5 ] && status=0  # nothing selected
echo "--- mypy osworld_jax"
mypy_status=0
wait "$mypy_pid" || mypy_status=$?
cat "$mypy_log"
rm -f "$mypy_log"
[ "$mypy_status" != 0 ] && [ "$status" = 0 ] && status=$mypy_status
echo "--- the tests marked serial, alone"
serial=0
"${pytest[@]}" -m serial "$@" || serial=$?
[ "$serial" = 5 ] && serial=0
[ "$status" != 0 ] && exit "$status"
exit "$serial"
