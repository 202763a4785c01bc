"""(count, mean, M2) moments: a state that merges exactly across calls and ranks.

A mean and a variance carried as (n, sum, sum of squares) lose every digit of the
variance when the mean is large next to the spread (a reward offset of 1e8, values
that sit near a common level). Carrying (n, mean, M2) and merging with Chan et al.'s
parallel formula takes deviations from the merged mean instead, so the spread keeps
its precision whatever the offset. The merge is the state's declared reduction, so it
rides in the fused sync like any sum.
"""
from __future__ import annotations

from typing import Optional

import torch

from twinkle_metrics.core.state import State, batched


def chan(rows: torch.Tensor) -> torch.Tensor:
    """Merge ``[..., k, 3]`` rows of (count, mean, M2) into one ``[..., 3]`` (Chan et al.'s
    parallel merge), for each leading index.

    Rows with count 0 are identities (their mean is 0); all empty gives (0, 0, 0). The
    merged mean is the count-weighted mean; M2 adds each row's spread about it.
    """
    n, mean, m2 = rows.unbind(-1)
    total = n.sum(-1)
    mu = (n * mean).sum(-1) / total.clamp(min=1.0)  # 0 when every row is empty
    dev = mean - (mu.unsqueeze(-1) if mu.dim() else mu)  # a 0-d mean broadcasts as it is
    return torch.stack([total, mu, m2.sum(-1) + (n * dev * dev).sum(-1)], -1)


def _moments_reduce(rows: torch.Tensor) -> torch.Tensor:
    return chan(rows)


@batched
def _moments_fold(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    return chan(torch.stack([old, new], -2))


def moments_state() -> State:
    """A ``[3]`` float64 (count, mean, M2) state, identity (0, 0, 0)."""
    return State(_moments_reduce, torch.float64, shape=(3,), default=0.0, local=_moments_fold)


def moments(x: torch.Tensor, where: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(count, mean, M2) of ``x`` in float64 over the positions ``where`` is True (all
    when None), on the device, without a host read.

    ``where`` broadcasts with ``x`` (a ``[b, 1]`` value per sequence over a ``[b, s]``
    token mask counts once per token). Values outside ``where`` are never read into
    the sums (a select, not a multiply), so NaN/inf there is harmless; NaN/inf inside
    flows into the mean and M2.
    """
    x = x.to(torch.float64)
    if where is None:
        n = torch.full((), x.numel(), dtype=torch.float64, device=x.device)
        mean = x.sum() / n.clamp(min=1.0)
        return torch.stack([n, mean, ((x - mean) ** 2).sum()])
    n = where.sum(dtype=torch.float64)
    mean = torch.where(where, x, 0.0).sum() / n.clamp(min=1.0)
    m2 = torch.where(where, (x - mean) ** 2, 0.0).sum()
    return torch.stack([n, mean, m2])
