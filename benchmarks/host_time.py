"""Host time of one accumulate on the kernel paths, measured on the CPU (~20 s).

    .venv/bin/python -m benchmarks.host_time

On a GPU the RL updates are bound by the host: the Python around their few launches, not
the launches' bytes (benchmarks/README.md, "GPU run, 2026-12-01"). This measures that
Python on the CPU: the metrics take their kernel paths (the CPU counted as a Triton
device) with every Triton launch replaced by a no-op, on tiny inputs (64 sequences of 16
tokens) so that the few torch ops left cost next to nothing. What remains is the host work
a GPU call pays before and around its launches, minus the launches' own dispatch cost.

Each case accumulates into one live metric (the training loop's case) and into a new
metric per call; medians of 400 calls, interleaved case by case, reported in microseconds.
"""
from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.common import moe_layer_call  # noqa: E402
from twinkle_metrics import DPOMetric, GRPOMetric, PPOValueMetric, RolloutMismatchMetric  # noqa: E402
from twinkle_metrics.kernels import (  # noqa: E402
    backend,
    dpo_triton,
    moe_triton,
    ppo_triton,
    rl_triton,
    rollout_triton,
    triton_common,
)

CALLS = int(os.environ.get("HOST_TIME_CALLS", "400"))
#: every kernel the cases launch, as (module that launches it, name)
KERNELS = ((rl_triton, "_rl_kernel"), (dpo_triton, "_row_sums_kernel"), (dpo_triton, "_pair_kernel"),
           (rollout_triton, "_rollout_kernel"), (moe_triton, "_tokens_kernel"), (moe_triton, "_rows_kernel"),
           (ppo_triton, "_tokens_kernel"), (ppo_triton, "_finish_kernel"), (triton_common, "_totals_kernel"),
           (rollout_triton, "_sequence_kernel"))


class _NoLaunch:
    """A Triton kernel whose launches do nothing (the host-side call around it still runs)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def cases():
    g = torch.Generator().manual_seed(0)
    b, s = 64, 16
    labels = torch.randint(0, 1000, (b, s), generator=g)
    labels[:, :2] = -100
    lp = -torch.rand(b, s, generator=g)
    old = lp + 0.01 * torch.randn(b, s, generator=g)
    ref = lp + 0.01 * torch.randn(b, s, generator=g)
    adv = torch.randn(b, generator=g)
    side = dict(old_logps=old, advantages=adv, ref_logps=ref)
    return {
        "GRPOMetric(top_k_kl=8)": (lambda: GRPOMetric(top_k_kl=8),
                                   lambda m: m.accumulate({"labels": labels}, {"logps": lp}, **side)),
        "GRPOMetric": (GRPOMetric, lambda m: m.accumulate({"labels": labels}, {"logps": lp}, **side)),
        "DPOMetric": (DPOMetric, lambda m: m.accumulate({"labels": labels}, {"logps": lp},
                                                        ref_outputs={"logps": ref})),
        "RolloutMismatchMetric": (RolloutMismatchMetric,
                                  lambda m: m.accumulate({"labels": labels}, {"logps": lp}, rollout_logps=old)),
        "PPOValueMetric": (PPOValueMetric, lambda m: m.accumulate({"labels": labels}, {"values": lp}, old_values=old,
                                                                  returns=ref, advantages=adv)),
        "MoERoutingMetric.observe (one layer)": moe_layer_call(),
    }


def main():
    saved = {(m, name): getattr(m, name) for m, name in KERNELS}
    for module, name in KERNELS:
        setattr(module, name, _NoLaunch())
    try:
        with backend("triton"):  # CPU tensors take the kernel paths, up to the (replaced) launches
            fns = {}
            for name, (make, step) in cases().items():
                live = make()
                fns[f"{name}, live metric"] = (lambda m=live, step=step: step(m))
                fns[f"{name}, new metric"] = (lambda make=make, step=step: step(make()))
            for fn in fns.values():
                for _ in range(20):
                    fn()
            times = {k: [] for k in fns}
            for _ in range(CALLS):
                for name, fn in fns.items():
                    t = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t)
    finally:
        for (module, name), kernel in saved.items():
            setattr(module, name, kernel)
    us = {k: round(sorted(v)[len(v) // 2] * 1e6, 1) for k, v in times.items()}
    from benchmarks.common import save
    path = save("host_time", {"host_us_per_accumulate": us}, ".venv/bin/python -m benchmarks.host_time")
    print(json.dumps({"host_us_per_accumulate": us, "saved": path}, indent=1))


if __name__ == "__main__":
    main()
