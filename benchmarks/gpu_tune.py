"""Where the GPU time of the hot paths goes, for choosing kernel defaults (one device call,
under 2 minutes on one H200):

    python benchmarks/gpu_tune.py             # from the repository root; prints one JSON

1. the entropy-partials kernels ("lean", the default, and "selects", the first one) and
   the argmax kernel, alone, at several tile widths and warp counts, each as a
   ratio to the read ceiling ``logits.amax(-1)`` timed in the same loop;
2. per accumulate, the host's time (perf_counter, no sync) and the GPU time (CUDA events)
   of GRPO (top_k_kl=8 and 0), DPO and Accuracy on a live metric (the training loop's
   case) and on a fresh one per call;
3. a cProfile of the host side of each (top functions by own time).

Without CUDA it says so and exits 0; ``GPU_BENCH_DRY=1 TRITON_INTERPRET=1`` runs it on the
CPU at tiny shapes, as ``gpu_bench.py`` does.
"""
from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.gpu_bench import (  # noqa: E402
    DEVICE,
    DRY,
    SHAPE,
    allocate,
    moe_layer_batch,
    rl_batch,
    synchronize,
    time_interleaved,
)

ITERS = 2 if DRY else int(os.environ.get("GPU_TUNE_ITERS", "8"))
WARM = 1 if DRY else 5


def kernel_sweep(logits, labels):
    from twinkle_metrics.kernels.argmax_triton import triton_argmax
    from twinkle_metrics.kernels.entropy_triton import triton_token_partials
    rows = logits.reshape(-1, logits.shape[-1])
    lab = labels.reshape(-1)
    fns = {"read_ceiling_amax": lambda: rows.amax(-1)}
    for blk in (256, 512, 1024, 2048)[:1 if DRY else 4]:
        for warps in (2, 4, 8)[:1 if DRY else 3]:
            for variant in ("lean", "selects"):
                fns[f"entropy_{variant}_b{blk}_w{warps}"] = (
                    lambda b, w, v: lambda: triton_token_partials(rows, 1.0, block=b, num_warps=w, variant=v)
                )(blk, warps, variant)
            fns[f"argmax_hits_b{blk}_w{warps}"] = (
                lambda b, w: lambda: triton_argmax(rows, lab, block=b, num_warps=w))(blk, warps)
    for fn in fns.values():
        fn()
    synchronize()
    ms = time_interleaved(fns, ITERS)
    ceiling = ms["read_ceiling_amax"]
    ratios = {k: round(t / ceiling, 3) for k, t in ms.items()}
    best = {kind: min((k for k in ratios if k.startswith(kind)), key=ratios.get)
            for kind in ("entropy_lean", "entropy_selects", "argmax_hits")}
    return {"ceiling_ms": ceiling, "ratio_to_read_ceiling": ratios,
            "best": {k: (v, ratios[v]) for k, v in best.items()}}


def host_and_gpu(calls, n=2 if DRY else 40):
    """Per call: median host ms (no sync; the GPU may still run) and GPU-inclusive ms (events)."""
    out = {}
    for name, fn in calls.items():
        for _ in range(WARM):
            fn()
        synchronize()
        host = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            host.append((time.perf_counter() - t) * 1e3)
        synchronize()
        out[name] = {"host_ms": round(sorted(host)[n // 2], 4)}
    ev = time_interleaved(calls, n)
    for name, t in ev.items():
        out[name]["gpu_event_ms"] = round(t, 4)
    return out


def profile(fn, n=2 if DRY else 60, top=25):
    for _ in range(WARM):
        fn()
    synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def main():
    if not DRY and not torch.cuda.is_available():
        print("gpu_tune: CUDA is not available on this machine; nothing was measured", file=sys.stderr)
        return 0
    from twinkle_metrics import Accuracy, DPOMetric, GRPOMetric, MoERoutingMetric, PPOValueMetric, RolloutMismatchMetric
    from twinkle_metrics.kernels import backend
    from twinkle_metrics.kernels import dispatch as _triton
    backend("triton" if DRY else "auto")  # DRY (GPU_BENCH_DRY=1 TRITON_INTERPRET=1): the CPU stands in, interpreted
    t0 = time.time()
    torch.manual_seed(0)
    logits = allocate(SHAPE)
    b, s, v = logits.shape
    labels = torch.randint(0, v, (b, s), device=DEVICE)
    labels[:, :64] = -100
    out = {"gpu": "cpu (dry run)" if DRY else torch.cuda.get_device_name(), "torch": torch.__version__,
           "shape": [b, s, v], "kernels": kernel_sweep(logits, labels.clamp_min(0))}

    rl_labels, lp, old, ref, adv = rl_batch()
    logps = torch.randn(b, s, device=DEVICE)
    router = moe_layer_batch()
    live = {"grpo_topk8": GRPOMetric(top_k_kl=8), "grpo": GRPOMetric(), "dpo": DPOMetric(), "accuracy": Accuracy(),
            "grpo_entropy": GRPOMetric(entropy_from_logits=True), "rollout": RolloutMismatchMetric(),
            "ppo": PPOValueMetric(), "moe": MoERoutingMetric(num_layers=48, num_experts=router["routing_map"].shape[1])}
    kw = dict(old_logps=old, advantages=adv, ref_logps=ref)
    calls = {
        "grpo_topk8_live": lambda: live["grpo_topk8"].accumulate({"labels": rl_labels}, {"logps": lp}, **kw),
        "grpo_topk8_fresh": lambda: GRPOMetric(top_k_kl=8).accumulate({"labels": rl_labels}, {"logps": lp}, **kw),
        "grpo_live": lambda: live["grpo"].accumulate({"labels": rl_labels}, {"logps": lp}, **kw),
        "dpo_live": lambda: live["dpo"].accumulate({"labels": rl_labels}, {"logps": lp}, ref_outputs={"logps": ref}),
        "dpo_fresh": lambda: DPOMetric().accumulate({"labels": rl_labels}, {"logps": lp}, ref_outputs={"logps": ref}),
        "accuracy_live": lambda: live["accuracy"].accumulate({"labels": labels}, {"logits": logits}),
        "grpo_entropy_live": lambda: live["grpo_entropy"].accumulate({"labels": labels},
                                                                      {"logps": logps, "logits": logits}),
        "rollout_live": lambda: live["rollout"].accumulate({"labels": rl_labels}, {"logps": lp}, rollout_logps=old),
        "ppo_live": lambda: live["ppo"].accumulate({"labels": rl_labels}, {"values": lp}, old_values=old, returns=ref,
                                                   advantages=adv),
        "moe_layer_live": lambda: live["moe"].observe(7, **router),
        "floor_one_pass": lambda: (lp - old).sum(),
    }
    out["accumulate"] = host_and_gpu(calls)
    out["profiles"] = {k: profile(calls[k]) for k in ("grpo_topk8_live", "dpo_live", "accuracy_live",
                                                       "grpo_entropy_live")}
    out["triton_failed"] = _triton.failed
    out["wall_s"] = round(time.time() - t0, 1)
    profiles = out.pop("profiles")
    print(json.dumps(out, indent=1, default=str))
    for k, text in profiles.items():
        print(f"\n===== cProfile {k} =====\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
