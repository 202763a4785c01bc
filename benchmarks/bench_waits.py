"""What the bounded waits add to a steady-state calculate() (issue: bounded, named waits).

    .venv/bin/python -m benchmarks.bench_waits [--world 8] [--iters 60] [--layout dp|tp2]

On ``--world`` ranks (one process each, one intra-op thread), one collection
(LossMetric, Accuracy, GRPOMetric, CompletionRewardMetric with quantiles) is
calculated in alternating iterations with the bounded waits (``comm.waits``: the host
waits for a work's completion within the bound) and without them (in this process only:
``waits.wait`` replaced by a plain, unbounded ``work.wait()``), on the same metrics and
tensors, after a barrier. Both run on the mesh's own groups (``--backend gloo``, or the
device-backend stand-in ``standin``). ``--bound`` sets ``TWINKLE_METRICS_TIMEOUT_S``;
``--partial`` builds the mesh over half of the world (4 + 4 ranks). An iteration's latency is the slowest
rank's; the ratio is taken per pair of neighbouring iterations and summarised by its
median (p10, p90). Collectives are counted in one steady-state call
(``testing.CollectiveCounter``). Writes ``benchmarks/results/waits_<layout>_<path>.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from benchmarks import common


def _rank(layout: str, iters: int, bound: float, partial: bool = False):
    import torch
    import torch.distributed as dist

    from parallel import DeviceMesh
    from twinkle_metrics import Accuracy, CompletionRewardMetric, GRPOMetric, LossMetric, MetricCollection
    from twinkle_metrics.comm import waits
    from twinkle_metrics.testing import CollectiveCounter

    world = dist.get_world_size()
    os.environ["TWINKLE_METRICS_TIMEOUT_S"] = str(bound)
    if partial:
        halves = [dist.new_group(list(range(world // 2))), dist.new_group(list(range(world // 2, world)))]
        mesh = DeviceMesh({"dp": halves[dist.get_rank() * 2 // world]})
    else:
        mesh = (DeviceMesh.from_sizes(dp_size=world) if layout == "dp"
                else DeviceMesh.from_sizes(tp_size=2, dp_size=world // 2))
    coll = MetricCollection({"loss": LossMetric(loss_reduction="sum"), "acc": Accuracy(),
                             "grpo": GRPOMetric(), "rew": CompletionRewardMetric(quantiles=(0.5, 0.9))},
                            device_mesh=mesh)
    g = torch.Generator().manual_seed(mesh.dp_rank)
    labels = torch.randint(0, 64, (4, 32), generator=g)
    logits, lp = torch.randn(4, 32, 64, generator=g), -torch.rand(4, 32, generator=g)

    def step():
        coll.accumulate({"labels": labels}, {"logits": logits, "logps": lp, "lm loss": torch.tensor([3.0, 4.0])},
                        old_logps=lp + 0.01, advantages=torch.ones(4), rewards=[0.1, 0.2, 0.3, 0.4])

    real = waits.wait
    plain = lambda work, *a, **k: work.wait()  # noqa: E731
    for mode in (plain, real):
        waits.wait = mode
        for _ in range(2):
            step()
            coll.calculate()
    step()
    with CollectiveCounter() as counter:
        coll.calculate()
    counts = (counter.total, 0)
    times = {"on": [], "off": []}
    for it in range(2 * iters):
        mode = "on" if it % 2 == 0 else "off"
        waits.wait = real if mode == "on" else plain
        step()
        dist.barrier()
        t0 = time.perf_counter()
        coll.calculate()
        times[mode].append(time.perf_counter() - t0)
    waits.wait = real
    everyone = [None] * world
    dist.all_gather_object(everyone, times)
    return counts, everyone


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--layout", choices=("dp", "tp2"), default="dp")
    ap.add_argument("--bound", type=float, default=120, help="TWINKLE_METRICS_TIMEOUT_S")
    ap.add_argument("--backend", choices=("gloo", "standin"), default="gloo")
    ap.add_argument("--partial", action="store_true", help="a mesh over half of the world")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = common.pool_run(args.world, _rank, args.layout, args.iters, args.bound, args.partial, timeout=900,
                          backend=args.backend)
    (total, _), everyone = out[0]
    slow = common.slowest(everyone, ("on", "off"), args.iters)
    ratios = sorted(a / b for a, b in zip(slow["on"], slow["off"]))
    q = statistics.quantiles(ratios, n=10)
    path_name = "partial" if args.partial else args.backend
    report = {"world": args.world, "layout": args.layout, "iters": args.iters, "path": path_name,
              "median_ms_bounded": 1e3 * statistics.median(slow["on"]),
              "median_ms_without": 1e3 * statistics.median(slow["off"]),
              "ratio_median": statistics.median(ratios), "ratio_p10": q[0], "ratio_p90": q[-1],
              "collectives": total}
    print(f"calculate() on {args.world} gloo ranks ({args.layout}, {path_name} path): bounded "
          f"{report['median_ms_bounded']:.2f} ms, unbounded {report['median_ms_without']:.2f} ms; "
          f"ratio {report['ratio_median']:.3f} (p10 {q[0]:.3f}, p90 {q[-1]:.3f}); "
          f"collectives {total}")
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"waits_{args.layout}_{path_name}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
