#!/usr/bin/env bash
# The demo: 8 CPU processes on gloo. Extra arguments go to the entry point.
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC="${NPROC:-8}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec torchrun --standalone --nproc_per_node "$NPROC" launch/example_custom_metric.py "$@"
