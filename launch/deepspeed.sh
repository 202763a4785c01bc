#!/usr/bin/env bash
# DeepSpeed pipeline demo: PP2 x DP2 = 4 processes (gloo on CPU). Extra arguments go to the
# entry point, e.g. --steps 8. DeepSpeed's launcher passes --local_rank; the entry point takes it.
# MASTER_PORT, when set, is the rendezvous port (DeepSpeed's default: 29500).
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC="${NPROC:-4}"
CONFIG="${CONFIG:-configs/deepspeed_demo.json}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec deepspeed ${MASTER_PORT:+--master_port "$MASTER_PORT"} --num_gpus "$NPROC" launch/train_deepspeed.py --config "$CONFIG" "$@"
