"""Folding several contributions of one ``update`` call into its result dict.

An ``update`` that loops over microbatches (or layers, or chunks) gathers what each
adds into ``out``; these helpers start a key with the first value and merge the next
ones by the state's reduction, on tensors (no host read) or Python numbers::

    out = {}
    for feat, o in microbatches("MyMetric", inputs, outputs, ("values",)):
        mask = feat["labels"] != -100
        fold.add(out, "total", (o["values"] * mask).sum())
        fold.maximum(out, "peak", torch.where(mask, o["values"], -torch.inf).amax())
    return out
"""
from __future__ import annotations

from typing import Any, Callable, Dict

import torch

from twinkle_metrics.core.state import Reduce


def add(out: Dict[str, Any], key: str, value: Any) -> None:
    """``out[key] += value`` (or ``= value`` the first time)."""
    out[key] = out[key] + value if key in out else value


def maximum(out: Dict[str, Any], key: str, value: Any) -> None:
    """``out[key] = max(out[key], value)`` elementwise (or ``= value`` the first time)."""
    out[key] = _pair(torch.maximum, max, out[key], value) if key in out else value


def minimum(out: Dict[str, Any], key: str, value: Any) -> None:
    """``out[key] = min(out[key], value)`` elementwise (or ``= value`` the first time)."""
    out[key] = _pair(torch.minimum, min, out[key], value) if key in out else value


def by(out: Dict[str, Any], key: str, value: Any, reduce: Reduce) -> None:
    """``add``, ``maximum`` or ``minimum`` as a state declares it (``"sum"``, ``"max"``,
    ``"min"``; not a callable reduction): folds many states' contributions, each by its own."""
    _BY[reduce](out, key, value)


def _pair(tensor_op, number_op, a, b):
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return tensor_op(a, b)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        # a Python number against a tensor: a fill kernel on the tensor's device, no copy
        t, x = (a, b) if isinstance(a, torch.Tensor) else (b, a)
        return tensor_op(t, torch.full_like(t, x))
    return number_op(a, b)


_BY: Dict[Reduce, Callable[[Dict[str, Any], str, Any], None]] = {"sum": add, "max": maximum, "min": minimum}
