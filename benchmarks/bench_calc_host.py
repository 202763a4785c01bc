"""Where the host time of calculate() goes: the 7 core metrics, counted and timed (~1 min).

    python -m benchmarks.bench_calc_host

1. One process: each phase of ``calculate()`` on its own, on the states of two
   microbatches: its torch ops (counted by a ``TorchDispatchMode``) and its CPU time
   (``time.thread_time``, best of 5 blocks: the machine is shared, and a thread's CPU time
   is the least disturbed measure of its own work).
2. Two gloo ranks (no more ranks than cores): per steady-state ``calculate()``, the torch ops,
   the Python function calls (cProfile, builtins included), and the wall time before the
   collective (host), in it (the gather and its bounded wait) and after it (host), medians,
   beside one bare all_reduce and one bare all_gather of the same bytes.

The counts are deterministic, so they compare two versions of the code on a busy machine
where the times do not.
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import pstats
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks import common, suite


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while it is active."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _cpu_us(fn, n: int) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.thread_time()
        for _ in range(n):
            fn()
        best = min(best, (time.thread_time() - t0) / n)
    return 1e6 * best


def phases(n: int):
    """{phase: (torch ops, CPU microseconds)} in one process."""
    from parallel import DeviceMesh
    from twinkle_metrics.comm import fused
    from twinkle_metrics.core import interval
    from twinkle_metrics.core.state import interval_of

    ours = suite.OursSuite(suite.CORE, mesh=DeviceMesh.single())
    metrics = list(ours.collection)
    batch = suite.make_batch(0)
    ours.accumulate(batch)
    ours.calculate()
    ours.accumulate(batch)
    ours.accumulate(batch)
    ivs = [interval_of(m) for m in metrics]
    configs = tuple(m.sync_fingerprint() for m in metrics)
    plan = fused._Plan(ivs, [sorted(iv.specs) for iv in ivs], configs)
    cpu = torch.device("cpu")

    def pack():
        return fused._pack(plan, ivs, plan.length, cpu, cpu, need=False, is_source=True, pp_rank=0)

    rows = torch.stack([pack(), pack()])
    merged = fused._merge(plan, ivs, rows)
    states = fused._unpack(merged, plan, ivs)
    steps = {
        "fingerprints and groups (_places)": lambda: interval._places(metrics),
        "plan covers the states": lambda: plan.covers(ivs),
        "pack": pack,
        "merge two ranks' rows": lambda: fused._merge(plan, ivs, rows),
        "unpack": lambda: fused._unpack(merged, plan, ivs),
        "compute (7 metrics)": lambda: [interval.results(iv, s) for iv, s in zip(ivs, states)],
        "reset (7 metrics, ended together)": lambda: interval.end(metrics),
    }
    out = {}
    for name, fn in steps.items():
        for _ in range(20):
            fn()
        counter = OpCounter()
        with counter:
            fn()
        out[name] = (sum(counter.ops.values()), _cpu_us(fn, n))
    return out


#: (module, class or "", function) timed where it runs (``in_situ``): the phases, and the
#: sync's bookkeeping around them
IN_SITU = [("twinkle_metrics.comm.fused", "", "_pack"), ("twinkle_metrics.comm.fused", "", "_merge"),
           ("twinkle_metrics.comm.fused", "", "_unpack"), ("twinkle_metrics.core.interval", "", "end"),
           ("twinkle_metrics.core.interval", "", "results"), ("twinkle_metrics.core.interval", "", "_places"),
           ("twinkle_metrics.comm.fused", "", "_data_phase"), ("twinkle_metrics.comm.fused", "", "sync_states"),
           ("twinkle_metrics.comm.waits", "", "wait"), ("twinkle_metrics.comm.waits", "", "mesh_roll"),
           ("twinkle_metrics.comm.transport", "Transport", "gather"), ("parallel.groups", "", "all_gather_rows")]


def in_situ(prepare, calculate, n: int):
    """CPU ms per ``calculate()`` of each function of ``IN_SITU``, timed where it runs: a
    wrapper put wherever the function's name is bound (a function that moved is skipped);
    ``prepare()`` runs untimed before each call."""
    import importlib

    spent, undo = {}, []
    for module, cls, name in IN_SITU:
        owner = importlib.import_module(module)
        owner = getattr(owner, cls, None) if cls else owner
        plain = getattr(owner, name, None) if owner is not None else None
        if plain is None:
            continue
        label = f"{cls or module.rsplit('.', 1)[-1]}.{name}"
        spent[label] = 0.0

        def timed(*args, _plain=plain, _label=label, **kwargs):
            t0 = time.thread_time()
            try:
                return _plain(*args, **kwargs)
            finally:
                spent[_label] += time.thread_time() - t0

        holders = [owner] + ([] if cls else [m for m in list(sys.modules.values())
                                             if m is not owner and getattr(m, name, None) is plain])
        for h in holders:
            setattr(h, name, timed)
            undo.append((h, name, plain))
    total, collecting, collections = 0.0, [], [0.0, 0]
    timing = [False]

    def on_gc(phase, info):  # Python's cyclic collector, run inside calculate() when its count is due
        if not timing[0]:
            return
        if phase == "start":
            collecting.append(time.thread_time())
        elif collecting:
            collections[0] += time.thread_time() - collecting.pop()
            collections[1] += 1

    gc.callbacks.append(on_gc)
    try:
        for _ in range(n):
            prepare()
            timing[0] = True
            t0 = time.thread_time()
            calculate()
            total += time.thread_time() - t0
            timing[0] = False
    finally:
        gc.callbacks.remove(on_gc)
        for h, name, plain in reversed(undo):
            setattr(h, name, plain)
    out = {"calculate()": 1e3 * total / n, "of it, garbage collections": 1e3 * collections[0] / n,
           "collections per call": collections[1] / n}
    out.update((k, 1e3 * v / n) for k, v in sorted(spent.items(), key=lambda kv: -kv[1]))
    return out


def rank_fn(n: int):
    import torch.distributed as dist

    import parallel.groups as G

    rank = dist.get_rank()
    suites, nbytes = suite.build(["ours", "floor", "floor_gather"], suite.CORE, 2)
    ours, floor, gather = suites["ours"], suites["floor"], suites["floor_gather"]
    batches = [suite.make_batch(100 * rank + i, step=i + 1) for i in range(2)]
    for _ in range(10):
        ours.accumulate(batches[0])
        ours.calculate()
    ours.accumulate(batches[0])
    ours.accumulate(batches[1])
    counter = OpCounter()
    with counter:
        ours.calculate()
    marks: list = []
    plain = G.all_gather_rows

    def marked(*args, **kwargs):
        marks.append(time.perf_counter())
        try:
            return plain(*args, **kwargs)
        finally:
            marks.append(time.perf_counter())

    G.all_gather_rows = marked
    profile = cProfile.Profile()
    split = {"before": [], "collective": [], "after": [], "total": [], "floor": [], "floor_gather": []}
    starts = {"ours": [], "floor": []}  # when each left the barrier before it (one clock for all ranks)
    try:
        for it in range(2 * n):
            ours.accumulate(batches[0])
            ours.accumulate(batches[1])
            dist.barrier()
            marks.clear()
            if it < n:  # timed, then profiled: the profiler slows what it watches
                t0 = time.perf_counter()
                ours.calculate()
                t1 = time.perf_counter()
                starts["ours"].append(t0)
                split["before"].append(marks[0] - t0)
                split["collective"].append(marks[1] - marks[0])
                split["after"].append(t1 - marks[1])
                split["total"].append(t1 - t0)
            else:
                profile.enable()
                ours.calculate()
                profile.disable()
            for name, s in (("floor", floor), ("floor_gather", gather)):
                dist.barrier()
                t0 = time.perf_counter()
                s.calculate()
                split[name].append(time.perf_counter() - t0)
                if name == "floor" and it < n:
                    starts["floor"].append(t0)
    finally:
        G.all_gather_rows = plain


    def prepare():
        ours.accumulate(batches[0])
        ours.accumulate(batches[1])
        dist.barrier()

    cpu_ms = in_situ(prepare, ours.calculate, n)
    stats = pstats.Stats(profile)
    calls = sum(v[1] for v in stats.stats.values()) / n
    by_function = sorted(((v[1] / n, f"{k[0].rsplit('/', 1)[-1]}:{k[2]}") for k, v in stats.stats.items()),
                         reverse=True)[:25]
    return {"torch_ops": sum(counter.ops.values()), "ops": counter.ops.most_common(),
            "python_calls": calls, "by_function": by_function, "nbytes": nbytes, "starts": starts, "cpu_ms": cpu_ms,
            "median_ms": {k: 1e3 * common.median(v) for k, v in split.items()}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=400, help="calls per timed block of a phase")
    p.add_argument("--iters", type=int, default=100, help="calculate() calls timed (and as many profiled) at 2 ranks")
    p.add_argument("--out", default="calc_host", help="results/<out>.json")
    args = p.parse_args(argv)
    one = phases(args.calls)
    print("one process, per calculate() of the 7 core metrics:")
    for name, (ops, us) in one.items():
        print(f"  {name:36s} {ops:4d} torch ops  {us:7.1f} us CPU")
    ops, us = sum(o for o, _ in one.values()), sum(u for _, u in one.values())
    print(f"  {'total':36s} {ops:4d} torch ops  {us:7.1f} us CPU")
    ranks = common.run_ranks(2, rank_fn, args.iters)
    r0 = ranks[0]
    ms = r0["median_ms"]
    print(f"2 gloo ranks: {r0['torch_ops']} torch ops and {r0['python_calls']:.0f} Python calls per calculate(); "
          f"wall ms (median, rank 0): before the collective {ms['before']:.3f}, in it {ms['collective']:.3f}, "
          f"after it {ms['after']:.3f}, total {ms['total']:.3f}; bare all_reduce {ms['floor']:.3f}, "
          f"bare all_gather {ms['floor_gather']:.3f}")
    skew = {k: 1e3 * common.median([abs(a - b) for a, b in zip(ranks[0]["starts"][k], ranks[1]["starts"][k])])
            for k in ("ours", "floor")}
    print(f"  the ranks leave the barrier before it {skew['ours']:.3f} ms apart (median) before ours, "
          f"{skew['floor']:.3f} ms before the bare all_reduce: where they share a core, one runs after the other")
    print("  CPU ms per calculate() where it runs (rank 0, wrappers): " + ", ".join(
        f"{k} {v:.3f}" for k, v in r0["cpu_ms"].items()))
    print("  ops: " + ", ".join(f"{k.replace('aten.', '')} {v}" for k, v in r0["ops"]))
    print("  most called: " + ", ".join(f"{name} {c:.0f}" for c, name in r0["by_function"][:12]))
    command = "python -m benchmarks.bench_calc_host " + " ".join(argv or sys.argv[1:])
    path = common.save(args.out, {"phases": {k: {"torch_ops": o, "cpu_us": u} for k, (o, u) in one.items()},
                                     "ranks2": {k: v for k, v in r0.items() if k != "starts"},
                                     "barrier_skew_ms": skew}, command.strip())
    print("wrote", path)


if __name__ == "__main__":
    main()
