"""Benchmark 15: gloo's ring on this machine: small all_reduce and all_gather from 2 to 32 ranks.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_ring                  # ~3 min

torch's gloo ``all_reduce`` and ``all_gather`` are rings: 2(N-1) and N-1 dependent hops
over TCP. Each rank times blocks of ``--per-block`` calls of each on a ``--bytes`` buffer
(float64; the blocks start after a barrier, the two collectives alternate block by
block); a block's time is its slowest rank's, per call; the median over blocks is
reported with the best block, and ``t = a + h x hops`` is fitted by least squares per
collective, to each. Every rank
here is a process on one host (loopback TCP): above as many ranks as cores, a hop waits
for the next rank to be scheduled, so the fitted ``h`` is an upper bound of a hop's cost
on an idle host, and well above it on a busy one.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Dict, List

from benchmarks import common

HOPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1}


def rank_fn(nbytes: int, blocks: int, per_block: int) -> Dict[str, List[float]]:
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    buf = torch.ones(max(1, nbytes // 8), dtype=torch.float64)
    out = torch.empty(n * buf.numel(), dtype=torch.float64)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    ops = {"all_reduce": lambda: dist.all_reduce(buf), "all_gather": lambda: gather(out, buf)}
    for op in ops.values():  # connect, warm
        for _ in range(3):
            op()
    times: Dict[str, List[float]] = {k: [] for k in ops}
    for blk in range(blocks):
        for name in (list(ops) if blk % 2 == 0 else list(ops)[::-1]):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(per_block):
                ops[name]()
            times[name].append((time.perf_counter() - t0) / per_block)
    return times


def fit(points: List[tuple]) -> Dict[str, float]:
    """Least squares ``t = a + h x hops`` over ``(hops, t)``."""
    k = len(points)
    if k < 2:
        return {"a_us": float("nan"), "h_us": float("nan")}
    mx = sum(x for x, _ in points) / k
    my = sum(y for _, y in points) / k
    sxx = sum((x - mx) ** 2 for x, _ in points)
    h = sum((x - mx) * (y - my) for x, y in points) / sxx
    return {"a_us": my - h * mx, "h_us": h}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    p.add_argument("--bytes", type=int, default=1024)
    p.add_argument("--blocks", type=int, default=20)
    p.add_argument("--per-block", type=int, default=10)
    p.add_argument("--out", default="ring")
    args = p.parse_args(argv)
    results = {}
    for world in args.ranks:
        per_rank = common.run_ranks(world, rank_fn, args.bytes, args.blocks, args.per_block,
                                    preload=("torch", "torch.distributed"))
        res = {}
        for op, hops in HOPS.items():
            slowest = [max(r[op][b] for r in per_rank) for b in range(args.blocks)]
            us, best = 1e6 * common.median(slowest), 1e6 * min(slowest)
            res[op] = {"median_us": us, "best_us": best, "hops": hops(world), "us_per_hop": us / hops(world),
                       "best_us_per_hop": best / hops(world)}
        results[str(world)] = res
        print(f"ranks={world:2d}: " + "  ".join(
            f"{op} {r['median_us']:.0f} us ({r['us_per_hop']:.0f} us/hop; best block {r['best_us_per_hop']:.0f})"
            for op, r in res.items()))
        sys.stdout.flush()
    cores = common.machine()["cpus"]
    fits = {}
    for op in HOPS:
        for stat in ("median_us", "best_us"):
            fits[f"{op}_{stat[:-3]}"] = fit([(r[op]["hops"], r[op][stat]) for r in results.values()])
    for name, f in fits.items():
        print(f"fit {name}: {f['a_us']:.0f} us + {f['h_us']:.1f} us x hops")
    command = "PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_ring " + " ".join(argv or sys.argv[1:])
    path = common.save(args.out, {"bytes": args.bytes, "blocks": args.blocks, "per_block": args.per_block,
                                  "cores": cores, "results_by_ranks": results, "fits": fits}, command.strip())
    print("wrote", path)


if __name__ == "__main__":
    main()
