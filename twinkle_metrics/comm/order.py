"""Floats as integers of the same order, so an integer MAX all-reduce is a float max.

Integer reductions are exact and every backend has them (NCCL and gloo MAX on
int64); mapping a float to an int with the same order lets one collective carry
float maxima, float minima (negated) and integer extremes together. NaN sorts
above +inf, so a MAX of keys propagates NaN as ``torch.amax`` does; -0.0 and +0.0
share one key (index tie-breaks need them equal), unless ``signed_zero`` puts -0.0
just below +0.0 (extremes that keep the sign of a zero).
"""
from __future__ import annotations

import torch

_LOW31 = 0x7FFFFFFF
_LOW63 = 0x7FFFFFFFFFFFFFFF


def ordered_f32(values: torch.Tensor) -> torch.Tensor:
    """float32 -> int32 with the same order (NaN above +inf, -0.0 == +0.0)."""
    return _ordered(values.to(torch.float32), torch.int32, _LOW31)


def ordered_f64(values: torch.Tensor, signed_zero: bool = False) -> torch.Tensor:
    """float64 -> int64 with the same order (NaN above +inf; -0.0 == +0.0, or just below
    it with ``signed_zero``)."""
    return _ordered(values.to(torch.float64), torch.int64, _LOW63, signed_zero)


def from_ordered_f64(keys: torch.Tensor) -> torch.Tensor:
    """The float64 an ``ordered_f64`` key stands for (a signed zero keeps its sign; the NaN key
    gives a NaN)."""
    return torch.where(keys >= 0, keys, keys ^ _LOW63).view(torch.float64)


def _ordered(v: torch.Tensor, int_dtype: torch.dtype, low: int, signed_zero: bool = False) -> torch.Tensor:
    if not signed_zero:
        v = v + 0.0  # -0.0 + 0.0 == +0.0: both zeros get one key (else -0.0 is key -1)
    bits = v.view(int_dtype)
    # negative floats order backwards by their bits: flip every bit but the sign
    ordered = torch.where(bits >= 0, bits, bits ^ low)
    return torch.where(torch.isnan(v), torch.full_like(ordered, low), ordered)
