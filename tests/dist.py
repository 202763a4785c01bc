"""A pool of real gloo ranks, started once and reused by every multi-rank test.

The pool itself ships with the package (``twinkle_metrics.testing.pool.DistPool``) so
users' tests and the layout-invariance harness can use it too; it is re-exported here
for the project's tests. ``DistPool(world).run(fn, *args)`` calls ``fn(*args)`` on every
rank and returns the per-rank results in rank order.
"""
from __future__ import annotations

from twinkle_metrics.testing.pool import COLLECTIVE_TIMEOUT_S, WORLD, DistPool

__all__ = ["COLLECTIVE_TIMEOUT_S", "WORLD", "DistPool", "sync_error"]


def sync_error(call):
    """Run ``call()`` (a calculate, a wait, a logger's close) on this rank: the text of the
    ``MetricSyncError`` it raised, or None."""
    from twinkle_metrics import MetricSyncError

    try:
        call()
    except MetricSyncError as e:
        return str(e)
    return None
