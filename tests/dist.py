"""A pool of real gloo ranks, started once and reused by every multi-rank test.

The pool itself ships with the package (``twinkle_metrics.testing.pool.DistPool``) so
users' tests and the layout-invariance harness can use it too; it is re-exported here
for the project's tests. ``DistPool(world).run(fn, *args)`` calls ``fn(*args)`` on every
rank and returns the per-rank results in rank order.
"""
from __future__ import annotations

from contextlib import contextmanager

from twinkle_metrics.testing.pool import COLLECTIVE_TIMEOUT_S, WORLD, DistPool

__all__ = ["COLLECTIVE_TIMEOUT_S", "WORLD", "DistPool", "megatron_tp2_pp2", "sync_error"]


@contextmanager
def megatron_tp2_pp2():
    """megatron-core's parallel_state groups for TP2 x PP2 x DP2 (8 ranks, its gloo groups
    off) inside a case, as ``DeviceMesh.from_megatron()``; destroyed after."""
    from megatron.core import parallel_state as ps

    from parallel import DeviceMesh

    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                 create_gloo_process_groups=False)
    mesh = DeviceMesh.from_megatron()
    try:
        yield mesh
    finally:
        ps.destroy_model_parallel()


def sync_error(call):
    """Run ``call()`` (a calculate, a wait, a logger's close) on this rank: the text of the
    ``MetricSyncError`` it raised, or None."""
    from twinkle_metrics import MetricSyncError

    try:
        call()
    except MetricSyncError as e:
        return str(e)
    return None
