#!/usr/bin/env bash
# Everything that needs a GPU, as one command (one device call; about 1.5 minutes on one H200
# on 2026-12-01, the time limits below add up to 8.5):
#
#   bash benchmarks/gpu_session.sh            # from the repository root; results under $OUT
#
# 1. tests/kernels/test_cuda.py: every metric's accumulate under set_sync_debug_mode("error") on the
#    torch path and on the Triton path, the two paths' results compared, calculate()'s
#    synchronisations counted;
# 2. benchmarks/gpu_check.py: sync debug, calculate() on a 1-rank NCCL group, host time
#    blocked behind queued work, peak memory, asynchronous calculate() behind a busy stream;
# 3. benchmarks/gpu_bench.py: the Triton kernels against the torch paths and the HBM read
#    ceiling (entropy, Accuracy, the GRPO / DPO / Rollout / PPO-value updates, one MoE layer);
# 4. benchmarks/gpu_tune.py: the kernels' tile widths, warps and variants swept, and where
#    each accumulate's host time goes (cProfile).
#
# Each step has its own time limit and its own output file (stdout and stderr), so one that
# fails or hangs leaves the others' results: six files under $OUT. Needs only the image's
# python3 with torch, triton and pytest.
set -u
OUT=${OUT:-runs/gpu_session}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1
  git log -1 --oneline 2>/dev/null || true
} > "$OUT/machine.txt"

step() {  # step NAME LIMIT_S COMMAND...: stdout and stderr to NAME.txt, status to steps.txt
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "$name rc=$? seconds=$((SECONDS - t0))" >> "$OUT/steps.txt"
}

step test_cuda 90 "$PY" -m pytest -q -p no:cacheprovider -p no:xdist -rs tests/kernels/test_cuda.py
step gpu_check 90 "$PY" benchmarks/gpu_check.py
step gpu_bench 150 "$PY" benchmarks/gpu_bench.py
step gpu_tune 180 "$PY" benchmarks/gpu_tune.py
cat "$OUT/steps.txt"
