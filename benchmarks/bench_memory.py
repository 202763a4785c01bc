"""Benchmark 3: peak extra memory of Accuracy and entropy-from-logits on (vocab-parallel) logits.

    benchmarks/.venv/bin/python -m benchmarks.bench_memory

Method (CPU, no allocator hooks): every case runs in fresh processes (one per TP
rank, gloo). A rank builds the metric, warms it up on a tiny batch (lazy
allocations out of the way), allocates its logits shard in place
(``torch.empty(...).normal_()``: no temporary), reads its resident set size
(RSS), runs the call once, and reads the process's peak RSS
(``resource.getrusage(...).ru_maxrss``, the kernel's high-water mark of resident
pages). Extra memory = peak RSS during the call - RSS before it, i.e. everything
the call allocated and touched beyond the logits. Tensors above glibc's mmap
threshold (32 MiB at most) are returned to the kernel when freed, so the peak is
the true simultaneous footprint. glibc would keep freed temporaries below its
(dynamic) mmap threshold resident in the heap, overstating the extra of chunked
code, so the ranks run with MALLOC_MMAP_THRESHOLD_=65536: every buffer of 64 KiB
or more is its own mapping and leaves the RSS when freed. Each rank reports its own extra against its own
logits shard; the table shows the worst rank.

``ours`` is the real ``GRPOMetric(entropy_from_logits=True)`` (chunks sized in
bytes: two working buffers of 1/64 of the logits each), the design this benchmark
led to; ``--chunks`` adds runs with an ``entropy_chunk_size`` token cap.

Naive baselines (what users write):
  accuracy  TP1: logits.argmax(-1) (Twinkle); TP2: all_gather the vocab shards, argmax
  entropy   TP1: -(softmax(z) * log_softmax(z)).sum(-1); TP2: all_gather, then the same
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time

from benchmarks import common, suite

VOCAB = 152064


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rank_fn(case, impl, tp, batch, seq, vocab, chunk):
    import torch
    import torch.distributed as dist

    from parallel import DeviceMesh

    torch.manual_seed(dist.get_rank())
    mesh = DeviceMesh.from_sizes(tp_size=tp) if tp > 1 else DeviceMesh.single()
    v_local = vocab // tp
    labels = torch.randint(0, vocab, (batch, seq))
    logps = -torch.rand(batch, seq)

    def naive_full(z):
        if tp == 1:
            return z
        parts = [torch.empty_like(z) for _ in range(tp)]
        dist.all_gather(parts, z.contiguous(), group=mesh.tp_group)
        return torch.cat(parts, -1)

    if impl == "ours":
        cls = suite.ours_classes([case == "accuracy" and "Accuracy" or "GRPOMetric"])
        if case == "accuracy":
            metric = cls["Accuracy"](mesh, vocab_parallel=True)

            def call(z, lab=labels):
                metric.accumulate({"labels": lab[:, :z.shape[1]]}, {"logits": z})
        else:
            kw = {"entropy_chunk_size": chunk} if chunk else {}
            metric = cls["GRPOMetric"](mesh, entropy_from_logits=True, vocab_parallel=tp > 1, **kw)

            def call(z, lab=labels, lp=logps):
                metric.accumulate({"labels": lab[:, :z.shape[1]]}, {"logps": lp[:, :z.shape[1]], "logits": z})
    else:
        if case == "accuracy":
            def call(z):
                return naive_full(z).argmax(-1)
        else:
            def call(z):
                full = naive_full(z)
                return -(torch.softmax(full, -1) * torch.log_softmax(full, -1)).sum(-1)

    call(torch.randn(batch, 4, v_local))  # warm-up: lazy imports, groups, kernels
    logits = torch.empty(batch, seq, v_local).normal_()
    dist.barrier()
    before, peak_before = _rss_bytes(), _peak_bytes()
    t0 = time.perf_counter()
    call(logits)
    dt = time.perf_counter() - t0
    peak = _peak_bytes()
    logits_bytes = logits.numel() * logits.element_size()
    return {"logits_bytes": logits_bytes, "rss_before": before, "peak_before_call": peak_before,
            "peak": peak, "extra_bytes": peak - max(before, peak_before),
            "extra_over_logits": (peak - max(before, peak_before)) / logits_bytes, "seconds": dt}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--vocab", type=int, default=VOCAB)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--chunks", type=int, nargs="+", default=[0],
                   help="entropy_chunk_size values for ours (0: the metric's default)")
    p.add_argument("--out", default="memory")
    args = p.parse_args(argv)
    t_start = time.time()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by glibc in each (spawned) rank at start
    rows = []
    for case in ("accuracy", "entropy"):
        for tp in args.tp:
            impls = [("naive", 0)] + ([("ours", c) for c in args.chunks]
                                      if case == "entropy" else [("ours", 0)])
            for impl, chunk in impls:
                per_rank = common.run_ranks(tp, rank_fn, case, impl, tp, args.batch, args.seq, args.vocab, chunk)
                worst = max(per_rank, key=lambda r: r["extra_over_logits"])
                row = {"case": case, "tp": tp, "impl": impl, "entropy_chunk_size": chunk or None,
                       "logits_mib_per_rank": worst["logits_bytes"] / 2**20,
                       "extra_mib": worst["extra_bytes"] / 2**20,
                       "extra_over_logits": worst["extra_over_logits"],
                       "seconds": max(r["seconds"] for r in per_rank), "per_rank": per_rank}
                rows.append(row)
                label = impl + (f" (chunk {chunk})" if chunk else "")
                print(f"{case:8s} TP{tp} {label:18s} logits {row['logits_mib_per_rank']:7.1f} MiB/rank  "
                      f"extra {row['extra_mib']:8.1f} MiB = {100 * row['extra_over_logits']:6.1f}% of logits  "
                      f"({row['seconds']:.2f} s)")
                sys.stdout.flush()
    command = "benchmarks/.venv/bin/python -m benchmarks.bench_memory " + " ".join(argv or sys.argv[1:])
    names = ["Accuracy", "GRPOMetric"]
    path = common.save(args.out, {"shape": [args.batch, args.seq, args.vocab], "dtype": "float32",
                                  "ours_implementation": suite.implementation(names), "rows": rows,
                                  "wall_s": round(time.time() - t_start, 1)}, command.strip())
    print("wrote", path)


if __name__ == "__main__":
    main()
