"""Quantiles from fixed log-spaced histograms that merge exactly by summing counts.

A quantile of values spread over ranks cannot be reduced from per-rank quantiles.
Counts in fixed buckets can: a histogram is one int64 ``[n_buckets]`` state merged by
``"sum"``, so it rides in the one fused sync like any counter, merges exactly (integers)
whatever the layout, and the quantile is read from the merged counts on the host.

Buckets (``Histogram(lo, hi, rel_error)``), in ascending order of value:

* magnitudes in ``[lo, hi)`` fall in log-spaced buckets ``[lo * g**k, lo * g**(k + 1))``
  with ``g = (1 + rel_error) ** 2``; ``hi`` is rounded up to the next bucket edge;
* a bucket is reported as its geometric midpoint ``lo * g**(k + 1/2)``, so for a
  true value ``x`` in it the reported ``v`` satisfies ``1 / (1 + e) < v / x <= 1 + e``,
  hence ``|v - x| <= e * |x|`` with ``e = rel_error`` (exact up to the rounding of
  one float64 logarithm at bucket edges, ~1e-15 relative);
* ``signed=True`` (default) mirrors the buckets for negative values, with an
  exact-zero bucket between; ``signed=False`` is for quantities that cannot be
  negative (lengths, ratios, KL, entropy) and has half the buckets: a negative
  value (rounding noise) counts as zero;
* magnitudes below ``lo`` (underflow) are reported as ``+-lo``, magnitudes at or
  above ``hi`` (overflow, +-inf included) as ``+-hi``: outside ``[lo, hi)`` the bound
  above does not hold, the value is clamped to the range;
* NaN is counted in its own last bucket, in no value bucket.

The quantile ``q`` is nearest-rank over the non-NaN values: the value of rank
``ceil(q * n)`` (1-based) in sorted order, ``q`` taken as the decimal it is written
as (0.7 of 10 values is rank 7). The reported value is within the bound above of
that value, which is a member of the data (no interpolation).

Counting runs on the device without a host read: a bucket index from
log / floor / clamp, then ``index_add_`` of the 0/1 mask weights into zeros.

Example:
    >>> import torch
    >>> h = Histogram(1e-3, 1e3, rel_error=0.01, signed=False)
    >>> counts = h.counts(torch.tensor([1.0, 2.0, 3.0, 100.0]), torch.tensor([True, True, True, False]))
    >>> [round(v, 1) for v in h.quantiles(counts.tolist(), (0.5, 1.0))]
    [2.0, 3.0]
"""
from __future__ import annotations

import math
from decimal import Decimal
from fractions import Fraction
from typing import Any, List, Optional, Sequence, Tuple

import torch

from twinkle_metrics.core.state import State

#: most buckets a histogram may have (an int64 each in every sync buffer)
MAX_BUCKETS = 100_000


class Histogram:
    """A fixed log-spaced bucket layout (see the module docstring).

    Args:
        lo: smallest magnitude with its own bucket (> 0).
        hi: magnitudes from here on are overflow (> lo; rounded up to a bucket edge).
        rel_error: the relative error bound of a reported quantile, in (0, 0.5].
        signed: buckets for negative values too (else negatives count as zero).
    """

    def __init__(self, lo: float = 1e-6, hi: float = 1e9, rel_error: float = 0.01, signed: bool = True) -> None:
        lo, hi, rel_error = float(lo), float(hi), float(rel_error)
        if not (0 < lo < hi < math.inf):
            raise ValueError(f"Histogram: need 0 < lo < hi < inf, got lo={lo}, hi={hi}")
        if not (0 < rel_error <= 0.5):
            raise ValueError(f"Histogram: rel_error must be in (0, 0.5], got {rel_error}")
        self.lo, self.rel_error, self.signed = lo, rel_error, bool(signed)
        self.gamma = (1.0 + rel_error) ** 2
        self._log_gamma = math.log(self.gamma)
        #: log-spaced buckets per sign
        self.magnitudes = max(1, math.ceil((math.log(hi) - math.log(lo)) / self._log_gamma - 1e-9))
        # per sign: underflow, the magnitudes, overflow; then zero and NaN
        side = self.magnitudes + 2
        self.zero = side if self.signed else 0
        self.n_buckets = (2 * side if self.signed else side) + 2
        if self.n_buckets > MAX_BUCKETS:
            raise ValueError(f"Histogram: lo={lo}, hi={hi}, rel_error={rel_error} need {self.n_buckets} "
                             f"buckets, more than {MAX_BUCKETS}; narrow [lo, hi] or raise rel_error")
        self.hi = lo * self.gamma ** self.magnitudes  # hi rounded up to a bucket edge
        if self.hi * self.gamma == math.inf:
            raise ValueError(f"Histogram: hi={hi} is too close to the float64 limit; pass hi <= 1e300")
        self.nan = self.n_buckets - 1
        self._values: Optional[List[float]] = None

    def __repr__(self) -> str:
        return (f"Histogram(lo={self.lo:g}, hi={self.hi:g}, rel_error={self.rel_error:g}, "
                f"signed={self.signed}, n_buckets={self.n_buckets})")

    def state(self, per_rank: bool = False) -> State:
        """The metric state holding this histogram's counts: int64, merged by sum."""
        return State("sum", torch.int64, shape=(self.n_buckets,), per_rank=per_rank)

    # ------------------------------------------------------------ device side
    def index(self, values: torch.Tensor) -> torch.Tensor:
        """The bucket of every value (int64, same shape); no host read."""
        x = values.detach()
        x = x.to(torch.float64) if x.dtype != torch.float64 else x
        # log(0) = -inf and tiny magnitudes clamp to the underflow slot -1, log(inf) to
        # the overflow slot; NaN stays NaN until the where below.
        j = torch.floor(torch.log(x.abs() / self.lo) / self._log_gamma).clamp_(-1.0, float(self.magnitudes))
        sign = torch.sign(x)  # 0 for +-0.0: the zero bucket
        if not self.signed:
            sign = sign.clamp_(min=0.0)
        idx = j.add_(2.0).mul_(sign).add_(float(self.zero))
        return torch.where(torch.isnan(x), float(self.nan), idx).to(torch.int64)

    def counts(self, values: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[n_buckets]`` int64 counts of ``values`` where ``mask`` (bool, broadcast to
        ``values``; None: all) holds, on ``values``' device, without a host read."""
        idx = self.index(values).reshape(-1)
        if mask is None:
            weights = torch.ones_like(idx)
        else:
            weights = mask.expand(values.shape).reshape(-1).to(torch.int64)
        return torch.zeros(self.n_buckets, dtype=torch.int64, device=idx.device).index_add_(0, idx, weights)

    # -------------------------------------------------------------- host side
    def bucket_values(self) -> List[float]:
        """The value each bucket reports (NaN for the NaN bucket)."""
        if self._values is None:
            mags = [self.lo] + [self.lo * self.gamma ** (k + 0.5) for k in range(self.magnitudes)] + [self.hi]
            if self.signed:
                values = [-m for m in reversed(mags)] + [0.0] + mags
            else:
                values = [0.0] + mags
            self._values = values + [math.nan]
        return self._values

    def quantiles(self, counts: Sequence[int], qs: Sequence[float], propagate_nan: bool = False) -> List[float]:
        """Nearest-rank quantiles ``qs`` of merged ``counts`` (plain ints, as ``compute``
        gets them); ``[]`` when there is no value. ``propagate_nan``: NaN for every q
        when a NaN was counted (else NaN values are left out)."""
        counts = list(counts)
        if len(counts) != self.n_buckets:
            raise ValueError(f"Histogram: got {len(counts)} counts, expected {self.n_buckets}")
        n = sum(counts[:self.nan])
        if n <= 0:
            return []
        if propagate_nan and counts[self.nan]:
            return [math.nan] * len(qs)
        values = self.bucket_values()
        ranks = sorted((nearest_rank(q, n), i) for i, q in enumerate(qs))
        out: List[float] = [0.0] * len(qs)
        seen, b = 0, -1
        for rank, i in ranks:
            while seen < rank:
                b += 1
                seen += counts[b]
            out[i] = values[b]
        return out

    def quantile(self, counts: Sequence[int], q: float) -> Optional[float]:
        """One nearest-rank quantile of ``counts``; None when there is no value."""
        out = self.quantiles(counts, (q,))
        return out[0] if out else None


def nearest_rank(q: float, n: int) -> int:
    """The 1-based rank of the nearest-rank ``q``-quantile of ``n`` values: ceil(q * n)
    with ``q`` read as the decimal it is written as (Python's shortest repr), so
    binary rounding of 0.7 * 10 does not move the rank; at least 1."""
    return max(1, min(n, math.ceil(Fraction(repr(float(q))) * n)))


def check_quantiles(metric: str, quantiles: Any) -> Optional[Tuple[float, ...]]:
    """A ``quantiles`` constructor argument as a tuple of floats in (0, 1), or None."""
    if quantiles is None:
        return None
    if isinstance(quantiles, (str, bytes)) or not hasattr(quantiles, "__iter__"):
        raise TypeError(f"{metric}: quantiles must be a sequence of numbers in (0, 1), got "
                        f"{type(quantiles).__name__}; pass e.g. quantiles=(0.5, 0.9, 0.99)")
    out = []
    for q in quantiles:
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not (0 < q < 1):
            raise ValueError(f"{metric}: quantiles must each be a number in (0, 1) (exclusive), got "
                             f"{q!r}; pass e.g. quantiles=(0.5, 0.9, 0.99) (min/max have their own keys)")
        out.append(float(q))
    if len(set(out)) != len(out) or len({quantile_suffix(q) for q in out}) != len(out):
        raise ValueError(f"{metric}: quantiles has duplicates {quantiles!r}; pass each quantile once")
    if not out:
        raise ValueError(f"{metric}: quantiles is empty; pass None for no quantiles, or e.g. (0.5, 0.9)")
    return tuple(out)


def quantile_suffix(q: float) -> str:
    """The key suffix of quantile ``q``: ``p50`` for 0.5, ``p99.9`` for 0.999."""
    text = f"{Decimal(repr(float(q))) * 100:f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return f"p{text}"


def quantile_keys(key: str, hist: Histogram, counts: Sequence[int], qs: Sequence[float],
                  propagate_nan: bool = False) -> dict:
    """``{f'{key}_p50': value, ...}`` for ``qs`` from merged ``counts``; ``{}`` if empty."""
    values = hist.quantiles(counts, qs, propagate_nan)
    return {f"{key}_{quantile_suffix(q)}": v for q, v in zip(qs, values)}
