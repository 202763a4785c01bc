"""``CollectiveCounter``: counts the torch.distributed collectives made inside it."""
from __future__ import annotations

from typing import Dict

#: torch's c10d operators (what the profiler records for each collective) -> the name shown
_OPS = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "allgather_": "all_gather",
    "_allgather_base_": "all_gather", "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "reduce_": "reduce", "broadcast_": "broadcast",
    "barrier": "barrier", "monitored_barrier_": "barrier", "gather_": "gather", "scatter_": "scatter",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all", "send": "send", "recv_": "recv", "recv_any_source_": "recv",
}


class CollectiveCounter:
    """Counts the collectives issued inside it, on any thread, from torch's own record of
    them (``torch.profiler``: every collective runs one c10d operator), without touching
    a torch function.

    ``wire``: collectives by kind (``"all_gather"``, ``"all_reduce"``, ...), as they go
    over the network: a helper built from several (``all_gather_object`` is a gather of
    sizes and one of data) counts each. ``api`` is the same count (kept for reports);
    ``total`` their sum. Counts are read when the block ends.

    Example::

        with CollectiveCounter() as counter:
            metrics.calculate()
        assert counter.total <= 2
    """

    def __init__(self):
        self.wire: Dict[str, int] = {}
        self._prof = None

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU])
        self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        prof, self._prof = self._prof, None
        prof.__exit__(*exc)
        for event in prof.events():
            kind = _OPS.get(event.name[len("c10d::"):]) if event.name.startswith("c10d::") else None
            if kind is not None:
                self.wire[kind] = self.wire.get(kind, 0) + 1

    @property
    def api(self) -> Dict[str, int]:
        return self.wire

    def reset(self):
        self.wire.clear()

    @property
    def total(self) -> int:
        return sum(self.wire.values())
