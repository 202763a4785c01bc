"""``CollectiveCounter``: counts the torch.distributed collectives made inside it."""
from __future__ import annotations

from typing import Any, Dict, Optional

# torch's documented way to see every operator a block runs (the ``__torch_dispatch__``
# extension point); every collective runs one c10d operator
from torch.utils._python_dispatch import TorchDispatchMode

#: torch's c10d operators -> the name shown
_OPS = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "allgather_": "all_gather",
    "_allgather_base_": "all_gather", "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "reduce_": "reduce", "broadcast_": "broadcast",
    "barrier": "barrier", "monitored_barrier_": "barrier", "gather_": "gather", "scatter_": "scatter",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all", "send": "send", "recv_": "recv", "recv_any_source_": "recv",
}


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives the calling thread issues inside it, as torch dispatches
    them (each runs one c10d operator), without touching a torch function. Counters nest.

    ``wire``: collectives by kind (``"all_gather"``, ``"all_reduce"``, ...), as they go
    over the network: a helper built from several (``all_gather_object`` is a gather of
    sizes and one of data) counts each. ``api`` is the same count (kept for reports);
    ``total`` their sum. The background thread of an asynchronous ``calculate()`` is not
    the calling thread: count its collectives inside the job, not around the call.

    Example::

        with CollectiveCounter() as counter:
            metrics.calculate()
        assert counter.total <= 2
    """

    def __init__(self) -> None:
        super().__init__()
        self.wire: Dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[Dict[str, Any]] = None
                           ) -> Any:
        if func.namespace == "c10d":
            kind = _OPS.get(func._overloadpacket.__name__)
            if kind is not None:
                self.wire[kind] = self.wire.get(kind, 0) + 1
        return func(*args, **(kwargs or {}))

    @property
    def api(self) -> Dict[str, int]:
        return self.wire

    def reset(self) -> None:
        self.wire.clear()

    @property
    def total(self) -> int:
        return sum(self.wire.values())
