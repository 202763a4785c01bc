"""Benchmark 7: the data phase of calculate() at data-group sizes up to 16k ranks.

    .venv/bin/python -m benchmarks.bench_sync_scaling

No process group: for each simulated data-group size N, one process builds what a
rank of that group would hold after the collectives and times the rank's own work
on it, with the library's code.

* gather path: the N gathered rows (perturbed copies of the real packed buffer of
  the 7 core metrics, ``suite.OursSuite``) merged by ``sync._merge``;
* reduce path: ``sync._reduce_pack`` (the MAX keys, the sums, the gathered columns)
  and ``sync._reduce_unpack`` given N rows of the gathered columns (the states a
  metric merges itself) and the reduced tensors.

Bytes each rank receives: the gather path N x B (B: the packed buffer); the reduce
path about 2 x the reduced bytes (a ring all-reduce; a tree moves about as much)
plus N x the gathered columns' bytes. The network time itself is not simulated.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from benchmarks import common, suite

SIZES = (8, 64, 128, 256, 512, 1024, 2048, 4096, 16384)


def _setup():
    from twinkle_metrics.comm import fused as sync

    ours = suite.OursSuite(suite.CORE)
    ours.accumulate(suite.make_batch(0))
    ours.accumulate(suite.make_batch(1))
    from twinkle_metrics.core.state import interval_of

    configs = tuple(m.fingerprint() for m in ours.collection)
    metrics = [interval_of(m) for m in ours.collection]  # what the sync reads: each metric's interval
    plan = sync._local_plan(metrics, configs)
    cpu = torch.device("cpu")
    buf = sync._pack(plan, metrics, plan.length, cpu, cpu, need=False, is_source=True, pp_rank=0)
    assert 8 * buf.numel() == ours.packed_bytes()
    return sync, ours, metrics, plan, buf


def _rows(sync, plan, buf: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` ranks' rows: the buffer with every float64 state scaled by a per-rank factor
    (ints and the header as they are: they stay valid counts and the same plan)."""
    floats = torch.zeros(buf.numel(), dtype=torch.bool)
    for entries in plan.entries:
        for _, spec, offset in entries:
            if spec.dtype == torch.float64:
                floats[sync._HEADER + offset:sync._HEADER + offset + spec.numel] = True
    g = torch.Generator().manual_seed(n)
    scale = 1.0 + 1e-3 * torch.randn(n, 1, generator=g, dtype=torch.float64)
    rows = buf.expand(n, -1).clone()
    return torch.where(floats, rows * scale, rows)


def _time(fn, budget_s: float, min_reps: int = 3, max_reps: int = 200) -> float:
    """Median seconds of ``fn()`` over repetitions filling about ``budget_s``."""
    fn()  # warm caches (column index tensors, allocator)
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or (len(times) < max_reps and time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return common.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    p.add_argument("--budget", type=float, default=1.0, help="seconds of timing per measurement")
    p.add_argument("--out", default="sync_scaling")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # one rank's share of a training host's cores
    sync, ours, metrics, plan, buf = _setup()
    n_sf, n_si, n_ord, n_g = plan.reduce_sizes
    b = 8 * buf.numel()
    reduced_b = 8 * (n_sf + n_si + sync._KEYS_HEAD + n_ord)
    own_b = 8 * n_g
    pack_s = _time(lambda: sync._pack(plan, metrics, plan.length, torch.device("cpu"), torch.device("cpu"),
                                      need=False, is_source=True, pp_rank=0), args.budget)
    results = {}
    print(f"packed buffer B = {b} bytes ({buf.numel()} float64: {n_sf} float sums, {n_si} int sums, "
          f"{n_ord} extremes, {n_g} self-merged, {sync._HEADER} header); pack {pack_s * 1e6:.0f} us")
    print(f"{'N':>6} | {'gather: recv':>12} | {'merge ms':>9} | {'reduce: recv':>12} | {'pack+unpack ms':>14}"
          f" | {'merge / reduce host':>19}")
    for n in args.sizes:
        rows = _rows(sync, plan, buf, n)
        merged = sync._merge(plan, metrics, rows)
        # what the collectives return: the reductions of the ranks' tensors (of the first 64
        # ranks: the values only matter for the check, the shapes for the timing)
        parts = [sync._reduce_pack(plan, r, plan.reduce_sizes) for r in rows[:64]]
        top = torch.stack([t for t, *_ in parts]).amax(0)
        sums_f = torch.stack([x for _, x, _, _ in parts]).sum(0) if n_sf else None
        sums_i = torch.stack([x for _, _, x, _ in parts]).sum(0) if n_si else None
        own_rows = rows.index_select(1, plan.reduce_columns(rows.device)[6]) if n_g else None
        reduced = sync._reduce_unpack(plan, metrics, buf, top, sums_f, sums_i, own_rows)
        if n <= 64:  # the two paths agree (same rows; sums up to their order)
            same = torch.allclose(reduced[sync._HEADER:], merged[sync._HEADER:], rtol=1e-12, atol=0,
                                  equal_nan=True)
            assert same, "reduce path and gather path disagree"
        merge_s = _time(lambda rows=rows: sync._merge(plan, metrics, rows), args.budget)

        def reduce_host(own_rows=own_rows):
            t, f, i, _ = sync._reduce_pack(plan, buf, plan.reduce_sizes)
            sync._reduce_unpack(plan, metrics, buf, t, f, i, own_rows)

        reduce_s = _time(reduce_host, args.budget)
        res = {"gather_recv_bytes": n * b, "gather_merge_ms": 1e3 * merge_s,
               "reduce_recv_bytes": round(2 * (n - 1) / n * reduced_b) + n * own_b,
               "reduce_host_ms": 1e3 * reduce_s, "merge_over_reduce_host": merge_s / reduce_s}
        results[str(n)] = res
        print(f"{n:>6} | {_kib(res['gather_recv_bytes']):>12} | {res['gather_merge_ms']:>9.3f} | "
              f"{_kib(res['reduce_recv_bytes']):>12} | {res['reduce_host_ms']:>14.3f} | "
              f"{res['merge_over_reduce_host']:>18.2f}x")
        sys.stdout.flush()
    command = ".venv/bin/python -m benchmarks.bench_sync_scaling " + " ".join(argv or sys.argv[1:])
    path = common.save(args.out, {
        "metrics": list(suite.CORE), "packed_bytes": b, "reduced_bytes": reduced_b, "gathered_bytes_per_rank": own_b,
        "columns": {"float_sums": n_sf, "int_sums": n_si, "extremes": n_ord, "self_merged": n_g,
                    "header": sync._HEADER},
        "pack_us": 1e6 * pack_s, "reduce_above": sync.REDUCE_ABOVE, "torch_threads": 1,
        "results_by_ranks": results}, command.strip())
    print("wrote", path)


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.1f} MiB"


if __name__ == "__main__":
    main()
