#!/usr/bin/env bash
# Build the benchmark's own environment from scratch: benchmarks/.venv with the
# peers we compare against (ModelScope Twinkle's twinkle.metric, TorchMetrics)
# next to this repo. Kept apart from the project's .venv so that twinkle-kit's
# dependencies (transformers, modelscope, datasets, ...) never leak into it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-python3}"
VENV="${BENCH_VENV:-benchmarks/.venv}"
# CPU build of torch, pinned first so nothing pulls a multi-GB CUDA build.
TORCH="${TORCH:-torch==2.13.0}"
TWINKLE="${TWINKLE:-twinkle-kit==0.5.1}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "$TORCH"
# Keep the torch we just installed: a dependency must not swap it for another build.
# pytest: `make test-twinkle` runs tests/integrations/test_twinkle_compat.py here, against the real twinkle-kit.
"$VENV/bin/python" -m pip install -q "$TWINKLE" torchmetrics psutil pytest "$TORCH"
"$VENV/bin/python" -m pip install -q --no-deps -e .
"$VENV/bin/python" - <<'PY'
import torch, torchmetrics, twinkle.metric, twinkle_metrics
from importlib.metadata import version
print("bench env ok: torch", torch.__version__, "| torchmetrics", torchmetrics.__version__,
      "| twinkle-kit", version("twinkle-kit"), "| twinkle-metrics", twinkle_metrics.__version__)
PY
