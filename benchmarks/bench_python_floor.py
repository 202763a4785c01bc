"""What the least Python sync of the 7 core metrics spends, step by step, at 2 gloo ranks (~1 min).

    python -m benchmarks.bench_python_floor

``suite.PythonFloor`` (``bench_calculate``'s ``floor_python``) stopped after each of its steps
(the gather and its wait; the merge of the kinds merged by one reduction each; the states merged
by their own reduction; the read and each metric's ``compute``; the reset), beside one bare
all_reduce of the same bytes and ours, timed in one run as ``bench_calculate`` times (a rotating
order, a barrier before each call, the slowest rank's time). Each step's ratio to the bare
all_reduce says what that step adds.
"""
from __future__ import annotations

import argparse
import sys
import time

from benchmarks import common, suite


def rank_fn(iters: int, warmup: int):
    import torch.distributed as dist

    rank = dist.get_rank()
    built, _ = suite.build(["ours", "floor"], suite.CORE, 2)
    steps = {f"floor_python upto {s}": suite.PythonFloor(suite.CORE, upto=s) for s in suite.PythonFloor.STEPS}
    suites = {**built, **steps}
    batches = [suite.make_batch(100 * rank + i, step=i + 1) for i in range(2)]
    times = {k: [] for k in suites}
    for it in range(warmup + iters):
        order = list(suites)
        order = order[it % len(order):] + order[:it % len(order)]
        for name in order:
            s = suites[name]
            s.accumulate(batches[0])
            s.accumulate(batches[1])
            dist.barrier()
            t0 = time.perf_counter()
            s.calculate()
            if it >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--out", default="python_floor")
    args = p.parse_args(argv)
    per_rank = common.run_ranks(2, rank_fn, args.iters, 20)
    lat = {k: [max(r[k][i] for r in per_rank) for i in range(args.iters)] for k in per_rank[0]}
    out = {k: {"median_ms": 1e3 * common.median(v),
               "over_floor": common.median([a / b for a, b in zip(v, lat["floor"])])} for k, v in lat.items()}
    for k, v in out.items():
        print(f"{k:32s} {v['median_ms']:6.3f} ms  {v['over_floor']:5.2f}x the bare all_reduce")
    command = "python -m benchmarks.bench_python_floor " + " ".join(argv or sys.argv[1:])
    print("wrote", common.save(args.out, {"ranks": 2, "by_step": out}, command.strip()))


if __name__ == "__main__":
    main()
