"""Count the Python-level calls that make the host wait for the device.

The same calls ``twinkle_metrics.testing.forbid_device_waits()`` forbids
(``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``float(t)``, ``int(t)``,
``bool(t)``, ``nonzero``, ``masked_select``, ``unique``, ``any``/``all``,
boolean-mask indexing), counted instead of raised. On a CUDA device each of these
is a stream synchronisation; on CPU they cost little, which is why we count them.
Nested calls (``bool(t)`` calling ``.item()`` inside torch) count once. Reads a
metric marks with ``twinkle_metrics.comm.host.host_reads()`` (CPU tensors of
host-known sizes exchanged over gloo: no device involved) are counted apart, in
``host_reads``, and not in ``total``.
"""
from __future__ import annotations

import contextlib
from collections import Counter

from twinkle_metrics.comm.host import host_reads_active
from twinkle_metrics.testing import intercept_device_waits


class WaitCounter:
    def __init__(self):
        self.counts: Counter = Counter()
        self.host_reads = 0

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@contextlib.contextmanager
def count_device_waits():
    counter = WaitCounter()

    def count(label):
        if host_reads_active():
            counter.host_reads += 1
        else:
            counter.counts[label] += 1

    with intercept_device_waits(count):
        yield counter
