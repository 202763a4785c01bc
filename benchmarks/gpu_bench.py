"""Triton vs torch paths of the logits-reading metrics on one CUDA GPU (< 3 minutes).

    python benchmarks/gpu_bench.py            # from the repository root; prints one JSON

Times, interleaved iteration by iteration with CUDA events, on [4, 4096, 152064]
bf16 logits (fewer tokens if memory is short):

- the read ceiling ``logits.amax(-1)`` (one read of the logits, nothing else);
- ``GRPOMetric(entropy_from_logits=True).accumulate`` on the torch path and on the
  Triton path, also for a transposed Megatron ``[s, b, V]`` view;
- ``Accuracy().accumulate`` on both paths, and TorchMetrics' ``MulticlassAccuracy.update``
  where torchmetrics is installed;
- each accumulate into one live metric, call after call (the training loop's case), and
  for the Triton path also into a new metric per call (``*_new_metric``: its states are
  created and moved to the GPU within the timed call);
- the two kernels alone at several vocab tile widths (for tuning the default);
- ``GRPOMetric.accumulate`` (old log-probs, advantages, reference log-probs,
  ``top_k_kl=8``), ``DPOMetric.accumulate`` (with references) and
  ``RolloutMismatchMetric.accumulate`` at [64, 4096]
  float32 log-probs, torch path vs the one-kernel path, beside one elementwise pass
  over the log-probs (``(logps - old).sum()``) as the floor;

and reports each median as a ratio to the ceiling, plus the largest difference
between the paths' results. Without CUDA it says so and exits 0.

``GPU_BENCH_DRY=1`` (with ``TRITON_INTERPRET=1``) runs the whole script on the CPU at
tiny shapes, the kernels interpreted and the CPU taken for a Triton device, and saves
nothing: a test runs it so that the one GPU call finds a script that works.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

DRY = os.environ.get("GPU_BENCH_DRY") == "1"
DEVICE = "cpu" if DRY else "cuda"
SHAPE = (2, 24, 300) if DRY else (4, 4096, 152064)
RL_SHAPE = (4, 40) if DRY else (64, 4096)
ITERS = 2 if DRY else int(os.environ.get("GPU_BENCH_ITERS", "15"))


def synchronize():
    if not DRY:
        torch.cuda.synchronize()


class _HostEvent:
    """``torch.cuda.Event``'s timing interface on the host clock (dry runs)."""

    def record(self):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


def _event():
    return _HostEvent() if DRY else torch.cuda.Event(enable_timing=True)


@contextlib.contextmanager
def torch_path():
    """Route the metrics to the torch implementations (as on a machine without triton)."""
    from twinkle_metrics.kernels import backend
    with backend("torch"):
        yield


def on_torch(fn):
    """``fn`` run on the torch paths (``torch_path``)."""
    def run():
        with torch_path():
            return fn()
    return run


def live(fn, make, *args):
    """``fn(*args, m=metric)`` into one metric from ``make()``, call after call, as in a
    training loop (``fn`` makes a new metric per call when given none)."""
    m = make()
    return lambda: fn(*args, m=m)


def allocate(shape):
    b, s, v = shape
    while s >= min(256, SHAPE[1]):
        try:
            return torch.randn(b, s, v, device=DEVICE, dtype=torch.bfloat16).mul_(3.0)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            s //= 2
    raise RuntimeError("not enough GPU memory for [4, 256, 152064] bf16 logits")


def time_interleaved(fns, iters):
    """Median milliseconds of each fn, run in turn within every iteration."""
    times = {k: [] for k in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            start, end = _event(), _event()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def torchmetrics_accuracy(num_classes):
    """TorchMetrics' ``MulticlassAccuracy`` (micro) on the device, or None where it is not installed."""
    try:
        from torchmetrics.classification import MulticlassAccuracy
    except ImportError:
        return None
    return MulticlassAccuracy(num_classes=num_classes, average="micro", validate_args=False).to(DEVICE)


def _max_rel_diff(got, want):
    keys = [k for k, w in want.items() if isinstance(w, float)]
    return max((abs(got[k] - want[k]) / max(abs(want[k]), 1e-300) for k in keys), default=0.0)


def rl_batch():
    """The RL updates' inputs at ``RL_SHAPE``: labels (1/8 masked), log-probs, old and
    reference log-probs, per-sequence advantages (seeded)."""
    g = torch.Generator(device=DEVICE).manual_seed(1)
    b, s = RL_SHAPE
    labels = torch.randint(0, 1000, (b, s), device=DEVICE, generator=g)
    labels[:, :s // 8] = -100
    lp = -torch.rand(b, s, device=DEVICE, generator=g)
    old = lp + 0.01 * torch.randn(b, s, device=DEVICE, generator=g)
    ref = lp + 0.01 * torch.randn(b, s, device=DEVICE, generator=g)
    adv = torch.randn(b, device=DEVICE, generator=g)
    return labels, lp, old, ref, adv


def moe_layer_batch(tokens=256 if DRY else 16384, experts=64, k=8):
    """One MoE layer's router outputs as ``register_router_hooks`` passes them: a top-``k``
    boolean routing map, float32 router logits, 0-d aux and z losses (seeded)."""
    g = torch.Generator(device=DEVICE).manual_seed(2)
    logits = torch.randn(tokens, experts, device=DEVICE, generator=g)
    routing = torch.zeros(tokens, experts, dtype=torch.bool, device=DEVICE)
    routing.scatter_(1, logits.topk(k, dim=1).indices, True)
    return dict(routing_map=routing, router_logits=logits, aux_loss=torch.tensor(0.01, device=DEVICE),
                z_loss=torch.tensor(0.001, device=DEVICE))


def rl_updates(triton_ok):
    """The RL updates at [64, 4096] (GRPO with top-k records, DPO, Rollout, PPO value) and one
    MoE layer's observe: torch path vs kernel path (ms, ratios)."""
    from twinkle_metrics import DPOMetric, GRPOMetric, MoERoutingMetric, PPOValueMetric, RolloutMismatchMetric
    from twinkle_metrics.kernels import dispatch as _triton
    labels, lp, old, ref, adv = rl_batch()
    router = moe_layer_batch()

    def grpo(m=None):
        return (m or GRPOMetric(top_k_kl=8)).accumulate({"labels": labels}, {"logps": lp}, old_logps=old,
                                                        advantages=adv, ref_logps=ref)

    def dpo(m=None):
        return (m or DPOMetric()).accumulate({"labels": labels}, {"logps": lp}, ref_outputs={"logps": ref})

    def rollout(m=None):
        return (m or RolloutMismatchMetric()).accumulate({"labels": labels}, {"logps": lp}, rollout_logps=old)

    def ppo(m=None):
        return (m or PPOValueMetric()).accumulate({"labels": labels}, {"values": lp}, old_values=old, returns=ref,
                                                  advantages=adv)

    def moe():
        return MoERoutingMetric(num_layers=48, num_experts=router["router_logits"].shape[1])

    def moe_layer(m=None):
        return (m or moe()).observe(7, **router)

    fns = {"one_pass_floor": lambda: (lp - old).sum(),
           "grpo_torch": on_torch(live(grpo, lambda: GRPOMetric(top_k_kl=8))),
           "dpo_torch": on_torch(live(dpo, DPOMetric)),
           "rollout_torch": on_torch(live(rollout, RolloutMismatchMetric)),
           "ppo_torch": on_torch(live(ppo, PPOValueMetric)),
           "moe_layer_torch": on_torch(live(moe_layer, moe))}
    if triton_ok:
        fns.update({"grpo_triton": live(grpo, lambda: GRPOMetric(top_k_kl=8)), "dpo_triton": live(dpo, DPOMetric),
                    "rollout_triton": live(rollout, RolloutMismatchMetric), "ppo_triton": live(ppo, PPOValueMetric),
                    "moe_layer_triton": live(moe_layer, moe),
                    # a new metric per call (the 2026-12-01 run's only form): states created and moved too
                    "grpo_triton_new_metric": grpo, "dpo_triton_new_metric": dpo})
    for fn in fns.values():
        fn()
    synchronize()
    ms = time_interleaved(fns, ITERS if DRY else max(ITERS, 30))
    out = {"rl_shape": list(RL_SHAPE), "rl_median_ms": ms}
    if triton_ok:
        out["rl_triton_speedup"] = {k: ms[f"{k}_torch"] / ms[f"{k}_triton"]
                                    for k in ("grpo", "dpo", "rollout", "ppo", "moe_layer")}
        paths = {"grpo": grpo, "dpo": dpo, "rollout": rollout, "ppo": ppo}
        with torch_path():
            want = {k: fn().calculate() for k, fn in paths.items()}
            want_moe = moe_layer().calculate()
        got = {k: fn().calculate() for k, fn in paths.items()}
        out["rl_max_rel_diff"] = {k: _max_rel_diff(got[k], want[k]) for k in want}
        # the router entropy is float32 arithmetic on both paths, summed in another order
        out["moe_max_rel_diff"] = _max_rel_diff(moe_layer().calculate(), want_moe)
        out["triton_failed"] = _triton.failed  # None: no kernel fell back to torch
    return out


def main():
    if not DRY and not torch.cuda.is_available():
        print("gpu_bench: CUDA is not available on this machine; nothing was measured "
              "(run it on a machine with a CUDA GPU)", file=sys.stderr)
        return 0
    from twinkle_metrics import Accuracy, GRPOMetric
    from twinkle_metrics.kernels import dispatch as _triton

    t0 = time.time()
    torch.manual_seed(0)
    logits = allocate(SHAPE)
    b, s, v = logits.shape
    labels = torch.randint(0, v, (b, s), device=DEVICE)
    logps = torch.randn(b, s, device=DEVICE, dtype=torch.float32)
    sbv = logits.transpose(0, 1).contiguous().transpose(0, 1)  # Megatron [s, b, V] seen as [b, s, V]
    triton_ok = _triton.available()
    # whatever TWINKLE_METRICS_TRITON says, both paths are measured; in a dry run the CPU
    # stands in for the GPU, kernels interpreted
    if triton_ok:
        from twinkle_metrics.kernels import backend
        backend("triton" if DRY else "auto")

    def entropy_metric():
        return GRPOMetric(entropy_from_logits=True)

    def grpo(z, m=None):
        m = m or entropy_metric()
        m.accumulate({"labels": labels}, {"logps": logps, "logits": z})
        return m

    def acc(m=None):
        return (m or Accuracy()).accumulate({"labels": labels}, {"logits": logits})

    fns = {"read_ceiling_amax": lambda: logits.amax(-1),
           "grpo_entropy_torch": on_torch(live(grpo, entropy_metric, logits)),
           "grpo_entropy_torch_sbv": on_torch(live(grpo, entropy_metric, sbv)),
           "accuracy_torch": on_torch(live(acc, Accuracy))}
    if triton_ok:
        fns.update({"grpo_entropy_triton": live(grpo, entropy_metric, logits),
                    "grpo_entropy_triton_sbv": live(grpo, entropy_metric, sbv),
                    "accuracy_triton": live(acc, Accuracy),
                    "grpo_entropy_triton_new_metric": lambda: grpo(logits),
                    "accuracy_triton_new_metric": acc})
    peer = torchmetrics_accuracy(v)
    if peer is not None:  # the peer a user would otherwise reach for, its checks off (its fastest)
        fns["accuracy_torchmetrics"] = lambda: peer.update(logits.reshape(-1, v), labels.reshape(-1))
    for fn in fns.values():  # warm up: kernel compilation, allocator
        fn()
    synchronize()
    ms = time_interleaved(fns, ITERS)
    ceiling = ms["read_ceiling_amax"]
    out = {"shape": [b, s, v], "dtype": "bfloat16", "iters": ITERS, "triton": triton_ok,
           "gpu": "cpu (dry run)" if DRY else torch.cuda.get_device_name(), "median_ms": ms,
           "ratio_to_read_ceiling": {k: t / ceiling for k, t in ms.items()},
           "read_gbps": logits.numel() * logits.element_size() / ceiling / 1e6}
    if triton_ok:
        from twinkle_metrics.kernels.argmax_triton import triton_argmax
        from twinkle_metrics.kernels.entropy_triton import triton_token_partials
        with torch_path():
            want_h = grpo(logits).calculate()
            want_acc = acc().calculate()
        got_h, got_acc = grpo(logits).calculate(), acc().calculate()
        out["entropy_rel_diff"] = abs(got_h["train/entropy"] - want_h["train/entropy"]) / abs(want_h["train/entropy"])
        out["accuracy_equal"] = got_acc == want_acc
        rows = logits.reshape(-1, v)
        sweep = {}
        for blk in (1024, 2048, 4096, 8192):
            sweep[f"partials_block{blk}"] = (lambda k: lambda: triton_token_partials(rows, 1.0, block=k))(blk)
            sweep[f"argmax_block{blk}"] = (lambda k: lambda: triton_argmax(rows, block=k))(blk)
        for fn in sweep.values():
            fn()
        sweep_ms = time_interleaved(sweep, max(ITERS // 2, 3))
        out["kernel_block_sweep_ratio"] = {k: t / ceiling for k, t in sweep_ms.items()}
    out.update(rl_updates(triton_ok))
    out["wall_s"] = round(time.time() - t0, 1)
    from benchmarks.common import save
    out["saved"] = None if DRY else save("gpu_bench", out, "python benchmarks/gpu_bench.py")
    print(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
