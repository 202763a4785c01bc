"""Benchmark 4: calculate() latency from 2 to 16 ranks, and against the number of metrics.

    benchmarks/.venv/bin/python -m benchmarks.bench_scaling

On each world size every rank holds our MetricCollection with 1, 3, 7 and 9
metrics (the first k of LossMetric, Accuracy, TrainMetric, EmbeddingMetric,
CompletionRewardMetric, DPOMetric, GRPOMetric, GSPOMetric, CISPOMetric), plus the
floor (one bare all_reduce of as many bytes as the 9-metric packed state) and one
bare all_gather of that buffer. Same timing method as bench_calculate: untimed
accumulate, barrier, timed calculate, slowest rank, rotating order, median.
``--with-twinkle`` adds Twinkle's 7 core metrics (slower to start: 4 s import per rank).
"""
from __future__ import annotations

import argparse
import sys
import time

from benchmarks import common, suite

COUNTS = (1, 3, 7, 9)


def rank_fn(world, counts, iters, warmup, with_twinkle):
    import torch.distributed as dist

    from parallel import DeviceMesh

    rank = dist.get_rank()
    mesh = DeviceMesh.from_sizes(dp_size=world)
    suites = {f"ours_{k}": suite.OursSuite(suite.ALL[:k], mesh=mesh) for k in counts}
    nbytes = suites[f"ours_{max(counts)}"].packed_bytes()
    suites["floor"] = suite.Floor(nbytes)
    suites["floor_gather"] = suite.GatherFloor(nbytes)
    if with_twinkle:
        suites["twinkle_7"] = suite.TwinkleSuite(suite.CORE, world=world)
    batch = suite.make_batch(rank)
    times = {k: [] for k in suites}
    for it in range(warmup + iters):
        order = list(suites)
        order = order[it % len(order):] + order[:it % len(order)]
        for name in order:
            suites[name].accumulate(batch)
            dist.barrier()
            t0 = time.perf_counter()
            suites[name].calculate()
            if it >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {"times": times, "nbytes": {k: s.packed_bytes() for k, s in suites.items() if hasattr(s, "packed_bytes")}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--with-twinkle", action="store_true")
    p.add_argument("--out", default="scaling")
    args = p.parse_args(argv)
    t_start = time.time()
    results = {}
    for world in args.ranks:
        per_rank = common.run_ranks(world, rank_fn, world, COUNTS, args.iters, args.warmup, args.with_twinkle)
        impls = list(per_rank[0]["times"])
        n = len(per_rank[0]["times"][impls[0]])
        lat = {k: [max(r["times"][k][i] for r in per_rank) for i in range(n)] for k in impls}
        res = {"latency_ms": {k: 1e3 * common.median(v) for k, v in lat.items()},
               "over_floor": {k: common.median([a / b for a, b in zip(lat[k], lat["floor"])]) for k in impls},
               "over_floor_gather": {k: common.median([a / b for a, b in zip(lat[k], lat["floor_gather"])])
                                     for k in impls},
               "packed_bytes": per_rank[0]["nbytes"], "iterations": n}
        results[str(world)] = res
        print(f"ranks={world:2d}: " + "  ".join(f"{k} {v:.1f}" for k, v in res["latency_ms"].items()) + "  (ms)")
        sys.stdout.flush()
    command = "benchmarks/.venv/bin/python -m benchmarks.bench_scaling " + " ".join(argv or sys.argv[1:])
    path = common.save(args.out, {"metric_counts": list(COUNTS), "metrics": list(suite.ALL),
                                  "ours_implementation": suite.implementation(suite.ALL),
                                  "results_by_ranks": results, "wall_s": round(time.time() - t_start, 1)},
                       command.strip())
    print("wrote", path)


if __name__ == "__main__":
    main()
