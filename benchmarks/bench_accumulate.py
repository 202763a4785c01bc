"""Benchmarks 2 and 5: accumulate() cost per microbatch, and device waits per accumulate.

    benchmarks/.venv/bin/python -m benchmarks.bench_accumulate

Single process on CPU, one intra-op thread (the machine is shared; one thread keeps
the two peers' timings comparable). Ours and Twinkle run on the same tensors,
interleaved in blocks (ours x k, Twinkle x k, alternating which goes first); each
block gives one ratio, and we report the median ratio and per-call medians.

Workloads (what the brief fixes):
  GRPOMetric  16 x 2048 tokens: logps, old logps, advantages, entropies (fp32)
  Accuracy    logits 4 x 1024 x 32000 (fp32); ours with vocab_parallel=True (TP1 here)
  DPOMetric   16 x 2048 (8 interleaved chosen/rejected pairs) with reference logps
  PPOValueMetric  16 x 2048 tokens: values, old values, returns, advantages (fp32)

Twinkle takes advantages only as a per-sequence list of floats, so it gets that;
old logps go to both as a tensor shaped like the logps (Twinkle's fast path).
``GRPOMetric:ragged`` gives both Twinkle's native rollout form instead: old logps
as one 1-D tensor of completion tokens per sequence, advantages as a list.

Device waits: every metric's accumulate runs once under ``waits.count_device_waits``
on the suite's standard microbatch (plus the workloads above).

Metrics Twinkle does not have (``--cases baseline``; needs neither twinkle-kit nor
torchmetrics) are timed the same way against the plain torch work they cannot avoid,
on the same tensors in the same command (``baselines.py``): RolloutMismatchMetric,
ModelNormMetric, MoERoutingMetric.

    python -m benchmarks.bench_accumulate --cases baseline     # only those (~30 s)
    python -m benchmarks.bench_accumulate --cases twinkle      # only the Twinkle pairs
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from benchmarks import baselines, common, suite
from benchmarks.waits import count_device_waits


def workloads(seed=0):
    g = torch.Generator().manual_seed(seed)
    b, s = 16, 2048
    prompt = torch.randint(128, 1024, (b, 1), generator=g)
    length = torch.randint(256, s, (b, 1), generator=g)
    pos = torch.arange(s).unsqueeze(0)
    completion = (pos >= prompt) & (pos < prompt + length)
    labels = torch.where(completion, torch.randint(0, 32000, (b, s), generator=g), torch.full((b, s), -100))
    logps = -torch.rand(b, s, generator=g) * 4
    grpo = dict(inputs={"labels": labels},
                outputs={"logps": logps, "entropies": torch.rand(b, s, generator=g) * 3},
                kwargs=dict(old_logps=logps + 0.2 * torch.randn(b, s, generator=g),
                            advantages=torch.randn(b, generator=g)))
    acc_labels = torch.randint(0, 32000, (4, 1024), generator=g)
    acc_labels[:, :200] = -100
    accuracy = dict(inputs={"labels": acc_labels},
                    outputs={"logits": torch.randn(4, 1024, 32000, generator=g)}, kwargs={})
    dpo = dict(inputs={"labels": labels}, outputs={"logps": logps},
               kwargs=dict(ref_outputs={"logps": logps + 0.1 * torch.randn(b, s, generator=g)}))
    # Twinkle's native rollout form: per sequence, old logps of its completion tokens only,
    # and one advantage per sequence, as Python lists (both metrics accept it).
    old = grpo["kwargs"]["old_logps"]
    ragged = dict(grpo, kwargs=dict(old_logps=[old[i][completion[i]] for i in range(b)],
                                    advantages=grpo["kwargs"]["advantages"].tolist()))
    values = torch.randn(b, s, generator=g)
    ppo_value = dict(inputs={"labels": labels}, outputs={"values": values},
                     kwargs=dict(old_values=values + 0.2 * torch.randn(b, s, generator=g),
                                 returns=values + torch.randn(b, s, generator=g),
                                 advantages=torch.randn(b, s, generator=g)))
    return {"GRPOMetric": grpo, "GRPOMetric:ragged": ragged, "Accuracy": accuracy, "DPOMetric": dpo,
            "PPOValueMetric": ppo_value}


def make_ours(name):
    name = name.split(":")[0]
    cls = suite.ours_classes([name])[name]
    if name == "Accuracy":
        return cls(vocab_parallel=True)
    return cls()


def make_twinkle(name):
    import twinkle.metric as tm

    name = name.split(":")[0]
    return getattr(tm, name)(None, None)


def twinkle_kwargs(name, kw):
    if name.endswith("POMetric") and name != "DPOMetric" and "advantages" in kw:
        kw = dict(kw, advantages=kw["advantages"].tolist())
    return kw


def time_pair(name, w, blocks, per_block):
    ours, tw = make_ours(name), make_twinkle(name)
    tw_kw = twinkle_kwargs(name, w["kwargs"])
    fns = {"ours": lambda: ours.accumulate(w["inputs"], w["outputs"], **w["kwargs"]),
           "twinkle": lambda: tw.accumulate(w["inputs"], w["outputs"], **tw_kw)}
    for fn in fns.values():  # warm-up
        fn()
    def after_block(blk):
        if blk % 4 == 3:  # keep Python-number accumulators of the peer bounded
            tw.reset()
            ours.reset()

    timed = common.time_rotating(fns, blocks, per_block, after_block)
    per_call = {k: [t[k] for t in timed] for k in fns}
    ratios = {k: [t["twinkle"] / t[k] for t in timed] for k in fns if k != "twinkle"}
    out = {"ours_ms": 1e3 * common.median(per_call["ours"]),
           "twinkle_ms": 1e3 * common.median(per_call["twinkle"]),
           "twinkle_over_ours": common.median(ratios["ours"]),
           "ratio_p10": common.quantile(ratios["ours"], 0.1), "ratio_p90": common.quantile(ratios["ours"], 0.9),
           "blocks": blocks, "calls_per_block": per_block}
    return out


def count_waits(names):
    out = {}
    b = suite.make_batch(1)
    big = workloads(1)
    for name in names:
        row = {}
        for impl in ("ours", "twinkle"):
            if impl == "ours":
                m = make_ours(name)

                def call(n=name, m=m, bb=b):
                    suite._accumulate_ours(n, m, bb)
            else:
                m = make_twinkle(name)

                def call(n=name, m=m, bb=b):
                    suite._accumulate_twinkle(n, m, bb)
            call()  # warm-up (lazy imports)
            with count_device_waits() as c:
                call()
            row[impl] = {"total": c.total, "by_call": dict(c.counts), "host_reads": c.host_reads}
            for key in (name, name + ":ragged"):
                if key not in big:
                    continue
                w = big[key]
                m.reset()
                kw = w["kwargs"] if impl == "ours" else twinkle_kwargs(key, w["kwargs"])
                with count_device_waits() as c:
                    m.accumulate(w["inputs"], w["outputs"], **kw)
                row[impl + "_" + ("ragged_workload" if key != name else "benchmark_workload")] = {
                    "total": c.total, "by_call": dict(c.counts), "host_reads": c.host_reads}
        out[name] = row
    return out


TWINKLE_PLAN = {"GRPOMetric": (16, 10), "GRPOMetric:ragged": (12, 10), "DPOMetric": (16, 20), "Accuracy": (8, 2),
                "PPOValueMetric": (8, 5)}  # (blocks, calls per block)
ALIASES = {"twinkle": list(TWINKLE_PLAN), "baseline": list(baselines.CASES)}


def select(spec):
    """``--cases``: comma-separated case names or the aliases 'twinkle' / 'baseline'."""
    if not spec:
        return list(TWINKLE_PLAN) + list(baselines.CASES)
    out = []
    for part in spec.split(","):
        names = ALIASES.get(part.strip(), [part.strip()])
        for name in names:
            if name not in TWINKLE_PLAN and name not in baselines.CASES:
                raise SystemExit(f"bench_accumulate: unknown case {name!r}; choose from "
                                 f"{sorted(ALIASES) + list(TWINKLE_PLAN) + list(baselines.CASES)}")
            if name not in out:
                out.append(name)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--scale", type=float, default=1.0, help="multiply the number of timed blocks")
    p.add_argument("--cases", default="", help="comma-separated cases, or 'twinkle' (the pairs with Twinkle, "
                   "and Twinkle's device waits) or 'baseline' (metrics timed against plain torch ops); "
                   "default: all")
    p.add_argument("--out", default=None, help="results/<out>.json; default 'accumulate', "
                   "'accumulate_<cases>' for a selection")
    args = p.parse_args(argv)
    chosen = select(args.cases)
    out_name = args.out or ("accumulate" if not args.cases else
                            "accumulate_" + args.cases.replace(",", "_").replace(":", "-"))
    torch.set_num_threads(args.threads)
    t_start = time.time()
    payload = {"threads": args.threads, "cases": chosen}
    twinkle_cases = [n for n in chosen if n in TWINKLE_PLAN]
    if twinkle_cases:
        w = workloads()
        timing = {}
        for name in twinkle_cases:
            blocks, per_block = TWINKLE_PLAN[name]
            timing[name] = time_pair(name, w[name], max(2, int(blocks * args.scale)), per_block)
            r = timing[name]
            print(f"{name:18s} ours {r['ours_ms']:8.2f} ms  twinkle {r['twinkle_ms']:8.2f} ms  "
                  f"twinkle/ours {r['twinkle_over_ours']:.2f}x (p10 {r['ratio_p10']:.2f}, p90 {r['ratio_p90']:.2f})")
            sys.stdout.flush()
        waits = count_waits(suite.ALL)
        for name, row in waits.items():
            extra = ""
            for kind in ("benchmark_workload", "ragged_workload"):
                if "ours_" + kind in row:
                    extra += (f" | {kind.replace('_', ' ')}: ours {row['ours_' + kind]['total']}, "
                              f"twinkle {row['twinkle_' + kind]['total']}")
            print(f"device waits per accumulate  {name:24s} ours {row['ours']['total']:3d}  "
                  f"twinkle {row['twinkle']['total']:3d}{extra}")
        payload.update(ours_implementation=suite.implementation(suite.ALL), accumulate=timing, device_waits=waits)
    base = {}
    for name in (n for n in chosen if n in baselines.CASES):
        base[name] = r = baselines.run_case(name, args.scale)
        print(f"{name}: {r['workload']}")
        print(f"  {'ours':44s} {r['ours_ms']:8.2f} ms  device waits {r['ours']['device_waits']}  "
              f"aten ops {r['ours']['aten_ops']}")
        for k, b in r["baselines"].items():
            print(f"  {k:44s} {b['ms']:8.2f} ms  device waits {b['device_waits']}  aten ops {b['aten_ops']}  "
                  f"ours/this {b['ours_over']:.2f}x (p10 {b['p10']:.2f}, p90 {b['p90']:.2f})")
        for k, v in r["notes"].items():
            print(f"  note {k}: {v}")
        sys.stdout.flush()
    if base:
        payload["baseline_cases"] = base
        payload["baseline_implementation"] = {  # "Class:variant" cases name their class first
            n: suite.ours_classes([n.split(":")[0]])[n.split(":")[0]].__module__ for n in base}
    python = os.path.relpath(sys.executable, common.ROOT) if sys.executable.startswith(common.ROOT + os.sep) \
        else sys.executable
    command = f"{python} -m benchmarks.bench_accumulate " + " ".join(argv if argv is not None else sys.argv[1:])
    payload["wall_s"] = round(time.time() - t_start, 1)
    path = common.save(out_name, payload, command.strip())
    print("wrote", path)


if __name__ == "__main__":
    main()
