"""Host time of calculate(async_op=True) against the synchronous calculate() on N gloo ranks.

    .venv/bin/python -m benchmarks.bench_async --ranks 8          # our suite only: no peers needed

Each rank builds two identical collections of the core metrics (``suite.build``, ours)
and, every iteration, accumulates the same two microbatches into both, enters a
barrier, times the synchronous ``calculate()`` of one, enters a barrier, and times
the asynchronous call of the other until it returns (the host time the training
loop pays), then waits for its handle (untimed) and checks that its dict equals
the synchronous one exactly (TrainMetric's clock readings aside). An iteration's time is the slowest rank's; the ratio
is taken per iteration and summarised by its median.
"""
from __future__ import annotations

import argparse
import sys
import time

from benchmarks import common, suite


def comparable(results):
    """Everything but TrainMetric's clock readings (two collections, two clocks)."""
    return {k: v for k, v in results.items() if not k.startswith("TrainMetric/")}


def rank_fn(world, names, iters, warmup):
    import torch.distributed as dist

    rank = dist.get_rank()
    sync = suite.build(["ours"], names, world)[0]["ours"]
    asyn = suite.build(["ours"], names, world)[0]["ours"]
    batches = [suite.make_batch(100 * rank + i, step=i + 1) for i in range(2)]
    sync_s, call_s, equal = [], [], True
    for it in range(warmup + iters):
        for s in (sync, asyn):
            for b in batches:
                s.accumulate(b)
        dist.barrier()
        t0 = time.perf_counter()
        expected = sync.collection.calculate()
        t_sync = time.perf_counter() - t0
        dist.barrier()
        t0 = time.perf_counter()
        handle = asyn.collection.calculate(async_op=True)
        t_call = time.perf_counter() - t0
        got = handle.wait(timeout=120)
        equal = equal and comparable(got) == comparable(expected)
        if it >= warmup:
            sync_s.append(t_sync)
            call_s.append(t_call)
    return {"sync": sync_s, "call": call_s, "equal": equal}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[8])
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default="async")
    args = p.parse_args(argv)
    names = suite.CORE
    results = {}
    for world in args.ranks:
        per_rank = common.run_ranks(world, rank_fn, world, names, args.iters, args.warmup)
        n = len(per_rank[0]["sync"])
        sync = [max(r["sync"][i] for r in per_rank) for i in range(n)]
        call = [max(r["call"][i] for r in per_rank) for i in range(n)]
        res = {"sync_ms": 1e3 * common.median(sync), "async_call_ms": 1e3 * common.median(call),
               "async_call_over_sync": common.median([c / s for c, s in zip(call, sync)]),
               "results_equal": all(r["equal"] for r in per_rank), "iterations": n}
        results[str(world)] = res
        print(f"ranks={world}: sync calculate {res['sync_ms']:.2f} ms, async call {res['async_call_ms']:.3f} ms "
              f"({100 * res['async_call_over_sync']:.1f}% of sync), results equal: {res['results_equal']}")
        sys.stdout.flush()
    command = ".venv/bin/python -m benchmarks.bench_async " + " ".join(argv or sys.argv[1:])
    print("wrote", common.save(args.out, {"metrics": list(names), "results_by_ranks": results}, command.strip()))


if __name__ == "__main__":
    main()
