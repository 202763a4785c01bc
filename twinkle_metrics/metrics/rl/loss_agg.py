"""verl's ``agg_loss`` modes for the GRPO family and ``RolloutMismatchMetric``: the
argument checks and the means over sequences, from per-sequence token sums.

The definitions are verl 0.9.1's (``verl/trainer/ppo/core_algos.py``, ``agg_loss``), over
the whole batch (``global_batch_size`` the number of sequences of every DP rank): with
S_i a key's token sum over sequence i, n_i its counted tokens, H_i the normaliser and N
the number of sequences with n_i > 0,

* ``token-mean``: sum_i S_i / sum_i n_i;
* ``seq-mean-token-mean``: (1/N) sum_i S_i / n_i (verl divides by n_i + 1e-8: a relative
  difference below 1e-8 / n_i, which we leave out);
* ``seq-mean-token-sum``: (1/N) sum_i S_i;
* ``seq-mean-token-sum-norm``: (1/N) sum_i S_i / H_i, H_i = ``loss_agg_norm`` (verl's
  ``loss_scale_factor``) or the row's token capacity (verl's ``loss_mask.shape[-1]``).
  verl up to 0.7.0 did not divide by N (a sum that grows with the batch); 0.7.1 and later do.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Tuple

import torch

#: verl's ``agg_loss`` modes; the first is the default. (verl 0.9 also has ``'token-sum'``, a
#: sum over the batch's tokens: a logged statistic that grows with the batch is not offered.)
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")

def check_loss_agg(name: str, mode: Any, norm: Any) -> Tuple[str, Optional[float]]:
    """``(loss_agg_mode, loss_agg_norm)`` validated; raises ``ValueError`` naming the metric."""
    if not isinstance(mode, str) or mode not in LOSS_AGG_MODES:
        raise ValueError(f"{name}: loss_agg_mode must be one of {', '.join(map(repr, LOSS_AGG_MODES))}, "
                         f"got {mode!r}")
    if norm is None:
        return mode, None
    if mode != "seq-mean-token-sum-norm":
        raise ValueError(f"{name}: loss_agg_norm applies to loss_agg_mode='seq-mean-token-sum-norm' only, got "
                         f"loss_agg_norm={norm!r} with loss_agg_mode={mode!r}; leave it None")
    if isinstance(norm, bool) or not isinstance(norm, (int, float)) or not 0 < norm < math.inf:
        raise ValueError(f"{name}: loss_agg_norm must be a finite number > 0 (verl's loss_scale_factor, e.g. "
                         f"the maximum response length) or None (each sequence's token capacity), got {norm!r}")
    return mode, float(norm)


def sequence_table(sums: torch.Tensor, counts: torch.Tensor, width: torch.Tensor, count_of: Sequence[int],
                   mode: str, norm: Optional[float]) -> Tuple[torch.Tensor, torch.Tensor]:
    """One call's contributions to the sequence-aggregated keys, from whole-sequence totals.

    ``sums`` ``[B, F]`` (a quantity's token sum per sequence), ``counts`` ``[B, G]`` (token
    counts per sequence), ``width`` ``[B]`` (each sequence's token capacity), all float64
    and already summed over CP; ``count_of[f]``: the count column of sum column ``f``.
    Returns ``(values [F], sequences [G])``: per column the sum over sequences that have a
    counted token of the sequence's token mean (``seq-mean-token-mean``), token sum
    (``seq-mean-token-sum``) or token sum / (``norm`` or its capacity)
    (``seq-mean-token-sum-norm``); per count column the number of such sequences (int64).
    """
    live = counts > 0
    c = counts[:, list(count_of)]
    if mode == "seq-mean-token-mean":
        per = sums / torch.where(c > 0, c, 1.0)
    elif mode == "seq-mean-token-sum":
        per = sums
    else:
        per = sums / (norm if norm is not None else torch.where(width > 0, width, 1.0)[:, None])
    return torch.where(c > 0, per, 0.0).sum(0), live.sum(0)


def sequence_mean(total: float, sequences: float) -> float:
    """A key's value from its reduced ``sequence_table`` sums: the mean over the sequences
    that have a counted token (every sequence mode divides by their number, as verl 0.9.1's
    ``agg_loss`` divides by ``global_batch_size``)."""
    return total / sequences if sequences else math.nan
