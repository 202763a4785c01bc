"""Cross-rank communication: the fused sync of ``calculate()`` and the waits around it.

* ``fused``: the plan every rank agrees on and the one or two packed collectives
  (all-reduce, or the reduce path for large data groups) that carry every state;
* ``agreement``: the fixed-size host exchange before a collective inside ``accumulate``;
* ``host``: exchanges of host-known integers over a CPU group (no device wait);
* ``pending``: asynchronous ``calculate()`` on a background thread;
* ``order``: floats as order-preserving integers, so one MAX carries every extreme.

Depends on ``parallel`` and ``inputs`` only; ``core`` builds on it.
"""
from twinkle_metrics.sync.fused import MetricSyncError, plain_states, sync_and_compute, sync_states

__all__ = ["MetricSyncError", "plain_states", "sync_and_compute", "sync_states"]
