"""Benchmark 12: what exports cost: JSON size, export() on a worker, calculate_from() on a driver.

    benchmarks/.venv/bin/python -m benchmarks.bench_export          # 1, 8, 64, 256, 1024 workers

One process, no process group. The 7 core metrics (``suite.CORE``, one collection),
quantiles off (as the suite builds them) and on (CompletionRewardMetric, DPOMetric and
GRPOMetric with ``quantiles=(0.5, 0.9, 0.99)``), fed two microbatches per interval:

* ``calculate()`` of those states in this process (the local path: pack, one copy,
  compute) is the unit every time is given in;
* ``export()`` of the same states (pack, one copy, JSON-ready values), and
  ``json.dumps`` / ``json.loads`` of it (what a transport adds);
* ``calculate_from`` of N workers' exports (one worker's export with its place set to
  data shard i of N; decoding and checking every field included), against the host work
  of one rank of an N-rank data group in ``calculate()`` (``plan._merge`` of the N gathered
  rows, unpack, compute: what ``bench_sync_scaling`` times) at the same N.

Times are medians of repetitions filling ``--budget`` seconds, taken interleaved.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time

import torch

from benchmarks import common, suite
from benchmarks.bench_sync_scaling import _time  # median seconds over repetitions filling a budget

SIZES = (1, 8, 64, 256, 1024)
QUANTILES = (0.5, 0.9, 0.99)
WITH_QUANTILES = ("CompletionRewardMetric", "DPOMetric", "GRPOMetric")


def collection(quantiles: bool):
    from twinkle_metrics import MetricCollection

    classes = suite.ours_classes(suite.CORE)
    return MetricCollection({n: classes[n](**({"quantiles": QUANTILES} if quantiles and n in WITH_QUANTILES else {}))
                             for n in suite.CORE})


def fed(quantiles: bool):
    c = collection(quantiles)
    for i in range(2):
        b = suite.make_batch(i, step=i + 1)
        for name, m in zip(suite.CORE, c):
            suite._accumulate_ours(name, m, b)
    return c


def _timed_after(make, act, budget_s: float, min_reps: int = 3, max_reps: int = 100) -> float:
    """Median seconds of ``act(x)`` on a fresh ``x = make()`` each time (untimed)."""
    times = []
    start = time.perf_counter()
    act(make())
    while len(times) < min_reps or (len(times) < max_reps and time.perf_counter() - start < budget_s):
        x = make()
        t0 = time.perf_counter()
        act(x)
        times.append(time.perf_counter() - t0)
    return common.median(times)


def workers(export, n: int):
    """``n`` workers' exports: ``export`` as data shard i of n (DP ranks)."""
    out = []
    for i in range(n):
        e = copy.deepcopy(export)
        e["place"].update(rank=i, data_rank=i, data_size=n, dp_rank=i, dp_size=n)
        out.append(e)
    return out


def spmd_merge(c, n: int):
    """One rank's host work in calculate() of an n-rank data group, on the gather path:
    merge the n gathered rows, unpack, compute (the collective itself not included)."""
    from twinkle_metrics.comm import fused
    from twinkle_metrics.comm import plan as plans
    from twinkle_metrics.core.interval import results
    from twinkle_metrics.core.state import interval_of

    configs = tuple(m.sync_fingerprint() for m in c)
    metrics = [interval_of(m) for m in c]  # what the sync is handed
    p = fused._local_plan(metrics, configs)
    cpu = torch.device("cpu")
    buf = fused._pack(p, metrics, p.length, cpu, cpu, need=False, is_source=True, pp_rank=0)
    rows = buf.expand(n, -1).clone()

    def run():
        vec = plans._merge(p, metrics, rows)
        return [results(m, s) for m, s in zip(metrics, fused._unpack(vec, p, metrics))]

    return run


def measure(quantiles: bool, sizes, budget: float):
    source = fed(quantiles)
    export = source.export()
    text = json.dumps(export, allow_nan=False)
    packed = 8 * (4 + sum(spec.numel for m in source for spec in m.declarations.values()))
    t_calc = _timed_after(lambda: fed(quantiles), lambda c: c.calculate(), budget)
    t_export = _timed_after(lambda: fed(quantiles), lambda c: c.export(), budget)
    t_dumps = _time(lambda: json.dumps(export, allow_nan=False), budget)
    t_loads = _time(lambda: json.loads(text), budget)
    driver = collection(quantiles)
    one = {"json_bytes": len(text), "packed_bytes": packed, "calculate_ms": 1e3 * t_calc,
           "export_ms": 1e3 * t_export, "export_over_calculate": t_export / t_calc,
           "json_dumps_ms": 1e3 * t_dumps, "json_loads_ms": 1e3 * t_loads, "by_workers": {}}
    print(f"quantiles {'on' if quantiles else 'off'}: one export {len(text)} B of JSON ({packed} B packed); "
          f"calculate() {1e3 * t_calc:.2f} ms, export() {1e3 * t_export:.2f} ms "
          f"({t_export / t_calc:.2f}x), dumps {1e3 * t_dumps:.2f} ms, loads {1e3 * t_loads:.2f} ms")
    for n in sizes:
        exports = workers(export, n)
        t_merge = _time(lambda ex=exports: driver.calculate_from(ex), budget, max_reps=50)
        t_spmd = _time(spmd_merge(fed(quantiles), n), budget, max_reps=50)
        row = {"driver_receives_bytes": n * len(text), "calculate_from_ms": 1e3 * t_merge,
               "per_export_us": 1e6 * t_merge / n, "over_calculate": t_merge / t_calc,
               "spmd_rank_merge_ms": 1e3 * t_spmd, "over_spmd_rank_merge": t_merge / t_spmd}
        one["by_workers"][str(n)] = row
        print(f"  {n:>5} workers: driver receives {n * len(text) / 2**20:8.2f} MiB, calculate_from "
              f"{1e3 * t_merge:9.2f} ms ({1e6 * t_merge / n:7.1f} us/export, {t_merge / t_calc:7.1f}x calculate(), "
              f"{t_merge / t_spmd:6.1f}x an SPMD rank's merge of {n} rows: {1e3 * t_spmd:.2f} ms)")
        sys.stdout.flush()
    return one


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    p.add_argument("--budget", type=float, default=1.0, help="seconds of timing per measurement")
    p.add_argument("--out", default="export")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    t_start = time.time()
    results = {"quantiles_off": measure(False, args.sizes, args.budget),
               "quantiles_on": measure(True, args.sizes, args.budget)}
    command = "benchmarks/.venv/bin/python -m benchmarks.bench_export " + " ".join(argv or sys.argv[1:])
    path = common.save(args.out, {"metrics": list(suite.CORE), "quantiles": list(QUANTILES),
                                  "quantiles_on": list(WITH_QUANTILES), "results": results,
                                  "wall_s": round(time.time() - t_start, 1)}, command.strip())
    print("wrote", path)


if __name__ == "__main__":
    main()
