#!/usr/bin/env bash
# The demo: a megatron-core GPT on TP2 x PP2 x DP2 = 8 CPU processes (gloo), a few dozen steps,
# metrics printed as it goes; JSONL, TensorBoard events and a PNG land in runs/<timestamp>
# (the path is printed at the end). Rank 6 makes its gradients NaN at step 5 (NAN_AT=STEP:RANK;
# NAN_AT= for none): every rank's StepGuard skips that update and names rank 6. Extra arguments
# go to the entry point, e.g. --steps 8.
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC="${NPROC:-8}"
CONFIG="${CONFIG:-configs/megatron_demo.json}"
NAN_AT="${NAN_AT-5:6}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec torchrun --standalone --nproc_per_node "$NPROC" launch/train_megatron.py --config "$CONFIG" \
  --set "train.nan_at=${NAN_AT}" "$@"
