"""Benchmark 1: calculate() latency of the full metric suite on N gloo ranks (CPU).

    benchmarks/.venv/bin/python -m benchmarks.bench_calculate            # 2, 4, 8 ranks

Each rank builds every suite (ours as one MetricCollection, Twinkle, TorchMetrics,
the floor), and in every iteration, for each suite in a rotating order:
accumulates two microbatches (untimed), enters a barrier, and times calculate().
An iteration's latency is the slowest rank's. Ratios are taken per iteration
(same noise for all suites) and summarised by their median. Collectives are
counted by wrapping torch.distributed (``common.CollectiveCounter``): in the first
calculate() (``collectives_first_calculate``: ours agrees on its plan there, a
one-time handshake per metric set) and in the steady state (``collectives_calculate``).
"""
from __future__ import annotations

import argparse
import sys
import time

from benchmarks import common, suite

IMPLS = ("ours", "ours_default", "twinkle", "torchmetrics", "floor", "floor_gather", "floor_python")


def rank_fn(world, names, impls, iters, warmup):
    import torch.distributed as dist

    rank = dist.get_rank()
    suites, nbytes = suite.build(list(impls), names, world)
    batches = [suite.make_batch(100 * rank + i, step=i + 1) for i in range(2)]
    times = {k: [] for k in suites}
    wire_calc, api_calc, wire_acc, wire_first = {}, {}, {}, {}
    for it in range(warmup + iters):
        order = list(suites)
        order = order[it % len(order):] + order[:it % len(order)]
        for name in order:
            s = suites[name]
            # iteration 0 counts the first calculate() (ours agrees on its plan there: a
            # one-time handshake), iteration 1 the steady state; both are untimed warm-up
            counter = common.CollectiveCounter() if it < 2 else None
            if counter:
                with counter:
                    s.accumulate(batches[0])
                if it == 0:
                    wire_acc[name] = counter.total
                counter.reset()
            else:
                s.accumulate(batches[0])
            s.accumulate(batches[1])
            dist.barrier()
            if counter:
                with counter:
                    s.calculate()
                if it == 0:
                    wire_first[name] = counter.total
                else:
                    wire_calc[name], api_calc[name] = dict(counter.wire), dict(counter.api)
                continue
            t0 = time.perf_counter()
            s.calculate()
            dt = time.perf_counter() - t0
            if it >= warmup:
                times[name].append(dt)
    return {"times": times, "wire": wire_calc, "api": api_calc, "acc_wire": wire_acc, "first": wire_first,
            "nbytes": nbytes}


def summarise(per_rank, impls):
    iters = len(per_rank[0]["times"][impls[0]])
    lat = {k: [max(r["times"][k][i] for r in per_rank) for i in range(iters)] for k in impls}
    out = {"latency_ms": {k: {"median": 1e3 * common.median(v), "p10": 1e3 * common.quantile(v, 0.1),
                              "p90": 1e3 * common.quantile(v, 0.9)} for k, v in lat.items()},
           "collectives_calculate": {k: sum(per_rank[0]["wire"][k].values()) for k in impls},
           "collectives_first_calculate": {k: per_rank[0]["first"][k] for k in impls},
           "collectives_calculate_by_kind": {k: per_rank[0]["wire"][k] for k in impls},
           "api_calls_calculate": {k: per_rank[0]["api"][k] for k in impls},
           "collectives_per_accumulate": {k: per_rank[0]["acc_wire"][k] for k in impls},
           "packed_bytes": per_rank[0]["nbytes"], "iterations": iters}
    if "ours" in lat:
        out["ratio_to_ours"] = {k: common.median([a / b for a, b in zip(lat[k], lat["ours"])])
                                for k in impls if k != "ours"}
        if "floor" in lat:
            out["ours_over_floor"] = common.median([a / b for a, b in zip(lat["ours"], lat["floor"])])
        if "floor_gather" in lat:
            out["ours_over_floor_gather"] = common.median(
                [a / b for a, b in zip(lat["ours"], lat["floor_gather"])])
    if "floor" in lat:  # every implementation against one bare all_reduce, per iteration
        out["ratio_to_floor"] = {k: common.median([a / b for a, b in zip(lat[k], lat["floor"])])
                                 for k in impls if k != "floor"}
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations (at least 2)")
    p.add_argument("--metrics", choices=("core", "all"), default="core")
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--out", default="calculate")
    args = p.parse_args(argv)
    names = suite.CORE if args.metrics == "core" else suite.ALL
    impls = [i for i in IMPLS if i in args.impls]
    results = {}
    t_start = time.time()
    for world in args.ranks:
        per_rank = common.run_ranks(world, rank_fn, world, names, impls, args.iters, max(args.warmup, 2))
        res = summarise(per_rank, impls)
        results[str(world)] = res
        lat = res["latency_ms"]
        print(f"ranks={world}: " + "  ".join(
            f"{k} {lat[k]['median']:.1f} ms ({res['collectives_calculate'][k]} coll, first call "
            f"{res['collectives_first_calculate'][k]})" for k in impls))
        if "ratio_to_ours" in res:
            print("   ratio to ours: " + "  ".join(f"{k} {v:.2f}x" for k, v in res["ratio_to_ours"].items()))
        if "ratio_to_floor" in res:
            print("   over the floor: " + "  ".join(f"{k} {v:.2f}x" for k, v in res["ratio_to_floor"].items()))
        sys.stdout.flush()
    command = "benchmarks/.venv/bin/python -m benchmarks.bench_calculate " + " ".join(argv or sys.argv[1:])
    path = common.save(args.out, {"metrics": list(names), "ours_implementation": suite.implementation(names),
                                  "results_by_ranks": results, "wall_s": round(time.time() - t_start, 1)},
                       command.strip())
    print("wrote", path)


if __name__ == "__main__":
    main()
