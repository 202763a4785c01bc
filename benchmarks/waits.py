"""Count the Python-level calls that make the host wait for the device.

The same calls ``twinkle_metrics.testing.forbid_device_waits()`` forbids
(``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``float(t)``, ``int(t)``,
``bool(t)``, ``nonzero``, ``masked_select``, ``unique``, ``any``/``all``,
boolean-mask indexing), counted instead of raised. On a CUDA device each of these
is a stream synchronisation; on CPU they cost little, which is why we count them.
Nested calls (``bool(t)`` calling ``.item()`` inside torch) count once. Reads a
metric marks with ``twinkle_metrics._host.host_reads()`` (CPU tensors of
host-known sizes exchanged over gloo: no device involved) are counted apart, in
``host_reads``, and not in ``total``.
"""
from __future__ import annotations

import contextlib
from collections import Counter

import torch

from twinkle_metrics.testing import _TENSOR_METHODS, _TORCH_FUNCS

try:
    from twinkle_metrics._host import host_reads_active
except ImportError:  # a tree without the host-exchange helper
    def host_reads_active() -> bool:
        return False


class WaitCounter:
    def __init__(self):
        self.counts: Counter = Counter()
        self.host_reads = 0
        self._depth = 0

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@contextlib.contextmanager
def count_device_waits():
    counter = WaitCounter()
    saved = []

    def wrap(owner, name, original, label):
        def counted(*args, **kwargs):
            if counter._depth == 0:
                if host_reads_active():
                    counter.host_reads += 1
                else:
                    counter.counts[label] += 1
            counter._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                counter._depth -= 1
        saved.append((owner, name, original))
        setattr(owner, name, counted)

    for name in _TENSOR_METHODS:
        wrap(torch.Tensor, name, getattr(torch.Tensor, name), name.strip("_"))
    for name in _TORCH_FUNCS:
        wrap(torch, name, getattr(torch, name), name)

    orig_getitem = torch.Tensor.__getitem__

    def getitem(self, index):
        parts = index if isinstance(index, tuple) else (index,)
        if counter._depth == 0 and any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
            counter.counts["bool_mask_index"] += 1
        return orig_getitem(self, index)

    saved.append((torch.Tensor, "__getitem__", orig_getitem))
    torch.Tensor.__getitem__ = getitem
    try:
        yield counter
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)
