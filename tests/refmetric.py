"""A reference metric built on the base, and batch sharding helpers for tests."""
from __future__ import annotations

import torch

from twinkle_metrics import Metric, State, microbatches


class TokenStats(Metric):
    """Masked token mean / max / min / count of ``outputs['values']`` (a reference metric)."""

    total = State("sum")
    count = State("sum", torch.int64)
    peak = State("max")
    low = State("min")

    def update(self, inputs, outputs, **kwargs):
        out = {"total": 0.0, "count": 0, "peak": -float("inf"), "low": float("inf")}
        for feat, o in microbatches(type(self).__name__, inputs, outputs, ("values",)):
            if "values" not in o:
                continue
            v = o["values"].to(torch.float64)
            m = torch.as_tensor(feat["labels"]) != -100
            out["total"] = out["total"] + (v * m).sum()
            out["count"] = out["count"] + m.sum()
            out["peak"] = torch.maximum(torch.as_tensor(out["peak"], dtype=torch.float64),
                                        torch.where(m, v, -torch.inf).amax())
            out["low"] = torch.minimum(torch.as_tensor(out["low"], dtype=torch.float64),
                                       torch.where(m, v, torch.inf).amin())
        return out

    def compute(self, s):
        if s["count"] == 0:
            return {}
        return {"mean": s["total"] / s["count"], "max": s["peak"], "min": s["low"], "tokens": s["count"]}


def make_batch(seed: int, n_seq: int = 10, seq_len: int = 8):
    """A global batch with ragged valid tokens; some sequences fully masked."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 50, (n_seq, seq_len), generator=g)
    keep = torch.rand(n_seq, seq_len, generator=g) < 0.7
    keep[0] = False  # a sequence with no valid token
    labels = torch.where(keep, labels, torch.full_like(labels, -100))
    values = torch.randn(n_seq, seq_len, generator=g, dtype=torch.float64)
    return labels, values


def dp_shards(n_seq: int, dp_size: int):
    """Uneven contiguous sequence ranges per DP rank; the last DP rank gets fewer."""
    bounds = [0]
    for r in range(dp_size):
        bounds.append(min(n_seq, bounds[-1] + (n_seq // dp_size) + (1 if r == 0 else 0)))
    bounds[-1] = n_seq
    return [range(bounds[r], bounds[r + 1]) for r in range(dp_size)]


def cp_slice(seq_len: int, cp_size: int, cp_rank: int):
    """Megatron's load-balanced split: chunks r and 2*cp-1-r of 2*cp chunks."""
    chunk = seq_len // (2 * cp_size)
    idx = list(range(cp_rank * chunk, (cp_rank + 1) * chunk))
    j = 2 * cp_size - 1 - cp_rank
    idx += list(range(j * chunk, (j + 1) * chunk))
    return torch.tensor(idx)


def shard_for_rank(labels, values, dp_size, dp_rank, cp_size, cp_rank, n_micro=2):
    """This rank's microbatch list: its DP sequences, its CP token chunks."""
    rows = list(dp_shards(labels.shape[0], dp_size)[dp_rank])
    cols = cp_slice(labels.shape[1], cp_size, cp_rank)
    feats, outs = [], []
    step = max(1, -(-len(rows) // n_micro))
    for i in range(0, len(rows), step):
        r = torch.tensor(rows[i:i + step])
        feats.append({"labels": labels[r][:, cols]})
        outs.append(values[r][:, cols])
    return feats, outs
