"""Cross-rank communication: the fused sync of ``calculate()`` and the waits around it.

* ``fused``: ``sync_states``: the one or two packed collectives that carry every
  state of every metric's interval, and the TP x PP hand-off of one rank's results;
* ``plan``: where each state sits in the packed buffer, how ranks agree on that, and how
  every rank's rows merge by it; ``reduce``: the all-reduce path of large data groups;
* ``agreement``: the fixed-size host exchange before a collective inside ``accumulate``;
* ``host``: exchanges of host-known integers over a CPU group (no device wait);
* ``pending``: asynchronous ``calculate()`` on a background thread;
* ``order``: floats as order-preserving integers, so one MAX carries every extreme.

Depends on ``parallel`` and ``inputs`` only; ``core`` builds on it. It never sees a
``Metric``: it is handed the metrics' intervals (``core.interval.Interval``: states,
declarations, what was touched, and the few facts of the metric the sync needs) with
plain data (mesh, groups, fingerprints) and callables.
"""
from twinkle_metrics.comm.fused import MetricSyncError, plain_states, sync_states

__all__ = ["MetricSyncError", "plain_states", "sync_states"]
