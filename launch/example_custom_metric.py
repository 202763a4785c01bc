"""A small multi-rank example: a custom metric, a TP2 x PP2 x DP2 mesh, one fused sync.

    torchrun --nproc_per_node 8 launch/example_custom_metric.py

Runs single-process when RANK/WORLD_SIZE are absent.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel import DeviceMesh  # noqa: E402
from twinkle_metrics import Metric, MetricCollection, State, fold, microbatches


class MaskedMean(Metric):
    """Token-weighted mean and max of outputs["values"] where labels != -100."""
    total = State("sum")                    # float64, summed over the data group (DP x CP)
    count = State("sum", torch.int64)
    peak = State("max")
    result_keys = ("mean", "max", "tokens")

    def update(self, inputs, outputs, **kwargs):
        out = {}                            # a dict, or a pipeline schedule's list of microbatches
        for feat, o in microbatches("MaskedMean", inputs, outputs, ("values",)):
            mask = feat["labels"] != -100
            values = o["values"].double()
            fold.add(out, "total", (values * mask).sum())
            fold.add(out, "count", mask.sum())
            fold.maximum(out, "peak", torch.where(mask, values, -torch.inf).amax())
        return out

    def compute(self, s):                   # s: the reduced states, as plain numbers
        return {"mean": s["total"] / s["count"], "max": s["peak"], "tokens": s["count"]} if s["count"] else {}


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=None)  # DeepSpeed's launcher passes it
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    tp, pp = (2, 2) if world % 4 == 0 else (1, 1)
    mesh = DeviceMesh.from_sizes(tp_size=tp, pp_size=pp)
    metrics = MetricCollection({"a": MaskedMean(), "b": MaskedMean()}, device_mesh=mesh)
    for step in range(args.steps):
        g = torch.Generator().manual_seed(100 * step + mesh.dp_rank)  # same data on TP replicas
        labels = torch.randint(-1, 5, (4, 16), generator=g).masked_fill_(
            torch.rand(4, 16, generator=g) < 0.3, -100)
        values = torch.randn(4, 16, generator=g, dtype=torch.float64)
        if mesh.is_last_stage:
            metrics.accumulate([{"labels": labels[:2]}, {"labels": labels[2:]}], {"values": values})
        else:
            metrics.accumulate([], {})
        results = metrics.calculate()
        if mesh.is_logging_rank:
            print(f"[{mesh.describe()}] step {step}: "
                  + ", ".join(f"{k}={v:.4f}" for k, v in results.items()), flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
