"""``CollectiveCounter``: counts the torch.distributed collectives made inside it."""
from __future__ import annotations

from typing import Dict, List

from twinkle_metrics.comm import bounded

_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
                "_all_gather_base", "all_gather_object", "all_gather_coalesced", "reduce",
                "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "gather",
                "gather_object", "scatter", "scatter_object_list", "reduce_scatter",
                "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send", "recv",
                "isend", "irecv", "all_reduce_coalesced", "batch_isend_irecv")


class CollectiveCounter:
    """Counts torch.distributed collectives by wrapping the c10d functions.

    Both namespaces are patched (``torch.distributed.X`` and
    ``torch.distributed.distributed_c10d.X``), so helpers built from other
    collectives (``all_gather_object`` = an all_gather of sizes + one of data)
    count their inner collectives too. ``wire`` counts only the innermost calls
    (those that issue no further wrapped collective): what goes over the network.
    ``api`` counts the outermost calls a library made. Collectives on the gloo groups
    the library owns (``comm.bounded``) are not ``torch.distributed`` calls: the library
    reports them, host exchanges into ``wire`` and ``api``, arrival barriers into
    ``checks`` (outside ``wire``, ``api`` and ``total``).
    """

    def __init__(self):
        self.wire: Dict[str, int] = {}
        self.api: Dict[str, int] = {}
        self.checks = 0
        self._stack: List[List[bool]] = []
        self._saved = []

    def __enter__(self):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        bounded.OBSERVERS.append(self._owned)

        originals = {}
        for name in _COLLECTIVES:
            fn = getattr(c10d, name, None) or getattr(dist, name, None)
            if fn is not None:
                originals[name] = fn
        for name, fn in originals.items():
            wrapped = self._wrap(name, fn)
            for mod in (dist, c10d):
                if hasattr(mod, name):
                    self._saved.append((mod, name, getattr(mod, name)))
                    setattr(mod, name, wrapped)
        return self

    def _owned(self, name: str, check: bool) -> None:
        """A collective on a group the library owns (``comm.bounded``)."""
        if check:
            self.checks += 1
            return
        self.wire[name] = self.wire.get(name, 0) + 1
        if not self._stack:
            self.api[name] = self.api.get(name, 0) + 1

    def __exit__(self, *exc):
        if self._owned in bounded.OBSERVERS:
            bounded.OBSERVERS.remove(self._owned)
        for mod, name, fn in reversed(self._saved):
            setattr(mod, name, fn)
        self._saved = []

    def _wrap(self, name, fn):
        counter = self

        def wrapper(*args, **kwargs):
            top = not counter._stack
            if counter._stack:
                counter._stack[-1][0] = True  # the caller has an inner collective
            counter._stack.append([False])
            try:
                return fn(*args, **kwargs)
            finally:
                had_inner = counter._stack.pop()[0]
                if not had_inner:
                    counter.wire[name] = counter.wire.get(name, 0) + 1
                if top:
                    counter.api[name] = counter.api.get(name, 0) + 1

        wrapper.__wrapped__ = fn
        return wrapper

    def reset(self):
        self.wire.clear()
        self.api.clear()
        self.checks = 0

    @property
    def total(self) -> int:
        return sum(self.wire.values())
