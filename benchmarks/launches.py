"""Device kernels each ``accumulate`` launches: the torch path against the one-kernel path.

    TRITON_INTERPRET=1 .venv/bin/python -m benchmarks.launches     # CPU, ~20 s

On a GPU an RL ``accumulate`` on [64, 4096] tokens is launch-bound: the bytes it reads
take well under 0.3 ms of HBM time, each kernel launch costs the host microseconds. So
the number of kernels per call is the figure that decides its cost there, and it can be
counted on the CPU: every aten op that computes (views and allocations are not kernels)
is one launch on CUDA, and each Triton kernel is one more. The Triton kernels run
under the interpreter with the CPU taken for a Triton device; the interpreter's own
tensor traffic is not counted.

Counted for GRPOMetric (old log-probs, per-sequence advantages, reference log-probs; with
and without ``top_k_kl=8``), DPOMetric (with references) and RolloutMismatchMetric (dense
rollout log-probs), at 1 and 4 microbatches.
Printed as JSON and saved to ``benchmarks/results/launches.json``.
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import sys

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("benchmarks.launches: set TRITON_INTERPRET=1 (the Triton kernels run interpreted on the CPU)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks.common import moe_layer_call  # noqa: E402
from twinkle_metrics import (  # noqa: E402
    Accuracy,
    DPOMetric,
    GRPOMetric,
    PPOValueMetric,
    RolloutMismatchMetric,
)
from twinkle_metrics.kernels import (  # noqa: E402
    argmax_triton,
    backend,
    dpo_triton,
    entropy_triton,
    moe_triton,
    ppo_triton,
    rl_triton,
    rollout_triton,
    triton_common,
)

_ALLOCATIONS = {"empty", "empty_strided", "new_empty", "new_empty_strided"}


class KernelCounter(TorchDispatchMode):
    """Counts the aten ops that compute (one device kernel each on CUDA), by name."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        # no kernel: views, allocations, and ops that neither return a tensor nor write
        # one (dtype promotion); in-place ops (the folds' _foreach_add_) are kernels
        tensor = isinstance(out, torch.Tensor) or (isinstance(out, (tuple, list)) and out
                                                   and isinstance(out[0], torch.Tensor))
        kernel = (tensor or func._schema.is_mutable) and not func.is_view and name not in _ALLOCATIONS
        if not self.paused and kernel:
            self.ops[name] += 1
        return out


@contextlib.contextmanager
def counted_triton(counter: KernelCounter):
    """Each Triton kernel launch counts once; the interpreter's tensor work inside it does not."""
    saved = {}
    for module, name in ((rl_triton, "_rl_kernel"), (dpo_triton, "_row_sums_kernel"), (dpo_triton, "_pair_kernel"),
                         (moe_triton, "_tokens_kernel"), (moe_triton, "_rows_kernel"),
                         (ppo_triton, "_tokens_kernel"), (ppo_triton, "_finish_kernel"),
                         (triton_common, "_totals_kernel"), (rollout_triton, "_rollout_kernel"),
                         (rollout_triton, "_sequence_kernel"), (argmax_triton, "_argmax_kernel"),
                         (entropy_triton, "_partials_lean_kernel"), (entropy_triton, "_partials_kernel")):
        real = getattr(module, name)
        saved[module, name] = real

        class Launch:
            def __getitem__(self, grid, real=real, name=name):
                def run(*args, **kwargs):
                    counter.ops[f"triton:{name}"] += 1
                    counter.paused = True
                    try:
                        return real[grid](*args, **kwargs)
                    finally:
                        counter.paused = False
                return run
        setattr(module, name, Launch())
    try:
        yield
    finally:
        for (module, name), real in saved.items():
            setattr(module, name, real)


def batch(n_mb: int, b: int = 64, s: int = 256):
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 1000, (b, s), generator=g)
    labels[:, : s // 8] = -100
    lp = -torch.rand(b, s, generator=g)
    old = lp + 0.01 * torch.randn(b, s, generator=g)
    ref = lp + 0.01 * torch.randn(b, s, generator=g)
    adv = torch.randn(b, generator=g)
    if n_mb == 1:
        return {"labels": labels}, {"logps": lp}, old, ref, adv
    split = [x.chunk(n_mb) for x in (labels, lp, old, ref, adv)]
    return ([{"labels": x} for x in split[0]], [{"logps": x} for x in split[1]], list(split[2]),
            list(split[3]), list(split[4]))


def cases(n_mb: int):
    """{name: (metric factory, accumulate(metric))}: a metric is built once, as in training."""
    inputs, outputs, old, ref, adv = batch(n_mb)
    refs = [{"logps": r} for r in ref] if isinstance(ref, list) else {"logps": ref}

    def grpo(m):
        return m.accumulate(inputs, outputs, old_logps=old, advantages=adv, ref_logps=ref)

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 64, 512, generator=g)  # Accuracy: fewer tokens (the interpreter reads them all)
    tokens = torch.randint(0, 512, (16, 64), generator=g)
    tokens[:, :8] = -100
    token_lp = -torch.rand(16, 64, generator=g)
    if n_mb == 1:
        acc_in, acc_out = {"labels": tokens}, {"logits": logits}
        ent_out = {"logps": token_lp, "logits": logits}
    else:
        acc_in = [{"labels": x} for x in tokens.chunk(n_mb)]
        acc_out = [{"logits": x} for x in logits.chunk(n_mb)]
        ent_out = [{"logps": a, "logits": b} for a, b in zip(token_lp.chunk(n_mb), logits.chunk(n_mb))]
    return {
        "Accuracy": (Accuracy, lambda m: m.accumulate(acc_in, acc_out)),
        "GRPOMetric(entropy_from_logits=True), log-probs and logits only": (
            lambda: GRPOMetric(entropy_from_logits=True), lambda m: m.accumulate(acc_in, ent_out)),
        "GRPOMetric": (GRPOMetric, grpo),
        "GRPOMetric(top_k_kl=8)": (lambda: GRPOMetric(top_k_kl=8), grpo),
        "DPOMetric": (DPOMetric, lambda m: m.accumulate(inputs, outputs, ref_outputs=refs)),
        "RolloutMismatchMetric": (RolloutMismatchMetric, lambda m: m.accumulate(inputs, outputs, rollout_logps=old)),
        # no Triton path: the torch path's count, for the record
        "PPOValueMetric": (PPOValueMetric, lambda m: m.accumulate(
            inputs, _values(outputs), old_values=old, returns=ref, advantages=adv)),
    }


def _values(outputs):
    """The log-prob outputs renamed as a value head's (same shapes)."""
    if isinstance(outputs, list):
        return [{"values": o["logps"]} for o in outputs]
    return {"values": outputs["logps"]}


def count(make, step, fused: bool) -> dict:
    with backend("triton" if fused else "torch"):
        metric = make()
        step(metric)  # warm: first-call work (state allocation) is not per step
        counter = KernelCounter()
        with counter, counted_triton(counter):
            step(metric)
    return {"kernels": sum(counter.ops.values()), "by_op": dict(counter.ops.most_common())}


def main():
    out = {}
    for n_mb in (1, 4):
        for name, (make, step) in cases(n_mb).items():
            torch_path, fused = count(make, step, False), count(make, step, True)
            out[f"{name}, {n_mb} microbatch{'es' if n_mb > 1 else ''}"] = {
                "torch_path": torch_path["kernels"], "one_kernel_path": fused["kernels"],
                "one_kernel_path_ops": fused["by_op"]}
    make, step = moe_layer_call()
    torch_path, fused = count(make, step, False), count(make, step, True)
    out["MoERoutingMetric.observe, one layer"] = {"torch_path": torch_path["kernels"],
                                                  "two_kernel_path": fused["kernels"],
                                                  "two_kernel_path_ops": fused["by_op"]}
    from benchmarks.common import save
    saved = save("launches", {"launches_per_accumulate": out},
                 "TRITON_INTERPRET=1 .venv/bin/python -m benchmarks.launches")
    print(json.dumps({"launches_per_accumulate": out, "saved": saved}, indent=1))


if __name__ == "__main__":
    main()
