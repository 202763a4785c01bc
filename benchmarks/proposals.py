"""Prototypes of design fixes the benchmarks point to (measured, not used by the library).

``entropy_from_logits``: per-token entropy of (vocab-parallel) logits with peak
extra memory of two chunk-sized fp32 buffers, the chunk sized in *bytes* (a
fraction of the logits), instead of a fixed token count. Proposed for
``GRPOMetric._entropy_from_logits`` (see benchmarks/README.md, memory).

With y = z / T - max, e = exp(y), S = sum e:  H = -sum p log p = log S - (sum e y) / S.
``sum e y`` is a batched dot product (``bmm``), so no third [rows, V] buffer is
made; -inf logits are clamped in the chunk's own buffer so that 0 * -inf never
appears. Under TP the max is all-reduced first (MAX), then [S, sum e y] (SUM):
the same two collectives as the current code.
"""
from __future__ import annotations

import torch


def entropy_from_logits(z: torch.Tensor, temperature: float = 1.0, tp_group=None,
                        budget_fraction: float = 1 / 64, min_rows: int = 1) -> torch.Tensor:
    """Entropy per row of ``z`` ([..., V] local vocab shard) -> [...] float64."""
    lead, v = z.shape[:-1], z.shape[-1]
    rows = z.reshape(-1, v)
    n = rows.shape[0]
    budget = max(int(n * v * 4 * budget_fraction), v * 4 * min_rows)  # bytes of one fp32 chunk
    step = max(min_rows, budget // (v * 4))
    low = torch.finfo(torch.float32).min

    def scaled(c):
        y = c.to(torch.float32, copy=True)          # the chunk's own buffer (1 of 2)
        if temperature != 1.0:
            y.div_(temperature)
        return y

    if tp_group is not None:
        import torch.distributed as dist

        zmax = torch.cat([scaled(c).amax(-1) for c in torch.split(rows, step)])
        dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=tp_group)
    stats, start = [], 0
    for c in torch.split(rows, step):
        y = scaled(c)
        m = zmax[start:start + c.shape[0]] if tp_group is not None else y.amax(-1)
        start += c.shape[0]
        y.sub_(m[:, None]).clamp_(min=low)
        e = torch.exp(y)                             # buffer 2 of 2
        s = e.sum(-1)
        ey = torch.bmm(e.unsqueeze(1), y.unsqueeze(2)).view(-1)
        stats.append(torch.stack([s, ey], 1).to(torch.float64))
        del y, e
    st = torch.cat(stats) if stats else rows.new_zeros(0, 2, dtype=torch.float64)
    if tp_group is not None:
        import torch.distributed as dist

        dist.all_reduce(st, op=dist.ReduceOp.SUM, group=tp_group)
    h = torch.log(st[:, 0]) - st[:, 1] / st[:, 0]
    return h.reshape(lead)

