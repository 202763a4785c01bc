#!/usr/bin/env bash
# Every benchmark, one at a time (the machine is shared), into benchmarks/results/*.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${BENCH_PY:-benchmarks/.venv/bin/python}"
[ -x "$PY" ] || bash benchmarks/setup_env.sh
"$PY" -m benchmarks.bench_calculate "$@"
"$PY" -m benchmarks.bench_accumulate
"$PY" -m benchmarks.bench_memory
"$PY" -m benchmarks.bench_scaling
"$PY" -m benchmarks.bench_sync_scaling
