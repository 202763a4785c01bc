"""A stand-in for a device backend on a CPU-only machine.

``register()`` registers the backend ``"standin"`` with torch (``Backend.register_backend``):
its groups run every collective on gloo, over host tensors, but report the backend name
``"standin"``, so to the library they are device groups (not CPU groups), as NCCL's are. A
job started with ``init_process_group("standin")`` (``DistPool.run(..., backend="standin")``)
reaches the library's device path on CPU.

Its groups also record every call that would harm a user's communicator if the library made
it on one it does not own: ``Work.wait(timeout)`` (on NCCL a wait that times out aborts the
communicator), ``abort``, ``shutdown`` (what ``destroy_process_group`` calls), ``barrier`` and
``monitored_barrier``. Only calls made from the library's own code are recorded (the
harness's ``destroy_process_group()`` at a job's end is not); ``calls()`` returns them. Every
group of the backend is a group the library did not make unless the library made it, and
the library makes its own groups on gloo (CPU) only, so ``calls()`` must stay empty:
``DistPool`` fails a stand-in job that leaves any.

Collectives go through a gloo ``ProcessGroup`` inside, so torch's dispatcher sees them
(``CollectiveCounter`` counts them as on any group).
"""
from __future__ import annotations

import os
import sys
import threading
import warnings
from datetime import timedelta
from types import FrameType
from typing import Any, List, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

#: the backend's name, as ``init_process_group`` and ``new_group`` take it
NAME = "standin"

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: where the library's code lives: calls made from these files are recorded
_LIBRARY = (_PACKAGE + os.sep, os.path.join(os.path.dirname(_PACKAGE), "parallel") + os.sep)
_HARNESS = os.path.join(_PACKAGE, "testing") + os.sep


class Call(NamedTuple):
    """One recorded call: what (``"wait(timeout)"``, ``"abort"``, ...), on which group (its
    ranks), and where in the library it was made (``file:line``)."""

    what: str
    ranks: tuple
    where: str


_CALLS: List[Call] = []
_LOCK = threading.Lock()


def calls() -> List[Call]:
    """The calls the library made on this process's stand-in groups since ``clear()``."""
    with _LOCK:
        return list(_CALLS)


def clear() -> None:
    with _LOCK:
        _CALLS.clear()


def _library_frame():
    """``file:line`` of the innermost frame of the library's own code on this stack (the
    harness in ``twinkle_metrics/testing`` excluded), or None."""
    frame: Optional[FrameType] = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_LIBRARY) and not name.startswith(_HARNESS):
            return f"{os.path.relpath(name, os.path.dirname(_PACKAGE))}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def _record(what: str, ranks: tuple) -> None:
    where = _library_frame()
    if where is not None:
        with _LOCK:
            _CALLS.append(Call(what, ranks, where))


class _Work(c10d.Work):
    """A gloo work that records a wait with a timeout."""

    def __init__(self, inner, ranks: tuple):
        super().__init__()
        self._inner, self._ranks = inner, ranks

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if timeout is not None and timeout != timedelta(0):
            _record("wait(timeout)", self._ranks)
        return self._inner.wait()

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def is_success(self) -> bool:
        return self._inner.is_success()

    def exception(self):
        return self._inner.exception()

    def get_future(self):
        return self._inner.get_future()

    def result(self):
        return self._inner.result()

    def source_rank(self) -> int:
        return self._inner.source_rank()


def _delegate(name: str):
    def call(self, *args):
        return _Work(getattr(self._inner, name)(*args), self._ranks)

    call.__name__ = name
    return call


class _StandIn(dist.ProcessGroup):
    """A group of the ``"standin"`` backend: gloo inside, another name outside."""

    def __init__(self, options: Any) -> None:
        store, rank, size = options.store, options.group_rank, options.group_size
        super().__init__(rank, size)  # type: ignore[call-arg]  # torch's stub lacks the (rank, size) overload
        inner = c10d.ProcessGroup(store, rank, size)
        gloo = c10d.ProcessGroupGloo(store, rank, size, options.timeout)
        for pg in (inner, self):  # self holds it too: torch keeps a group's name in its backend
            pg._set_default_backend(c10d.ProcessGroup.BackendType.GLOO)
            pg._register_backend(torch.device("cpu"), c10d.ProcessGroup.BackendType.GLOO, gloo)
        self._set_group_name(options.group_id)
        self._inner, self._store = inner, store
        self._ranks = tuple(options.global_ranks_in_group or range(size))

    def barrier(self, opts=None):
        _record("barrier", self._ranks)
        return _Work(self._inner.barrier() if opts is None else self._inner.barrier(opts), self._ranks)

    def monitored_barrier(self, *args, **kwargs):
        _record("monitored_barrier", self._ranks)
        return self._inner.monitored_barrier(*args, **kwargs)  # type: ignore[attr-defined]  # not in torch's stub

    def abort(self) -> None:
        _record("abort", self._ranks)

    def shutdown(self) -> None:
        _record("shutdown", self._ranks)

    def get_group_store(self):
        return self._store

    def name(self) -> str:
        return NAME

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return NAME


#: the collectives, run by the gloo group inside
_COLLECTIVES = ("allreduce", "allreduce_coalesced", "allgather", "_allgather_base", "all_gather_single",
                "allgather_coalesced", "allgather_into_tensor_coalesced", "broadcast", "reduce", "reduce_scatter",
                "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base", "gather",
                "scatter", "send", "recv", "recv_anysource")
for _name in _COLLECTIVES:
    setattr(_StandIn, _name, _delegate(_name))


def _create(options, backend_options=None) -> _StandIn:
    return _StandIn(options)


def register() -> str:
    """Register the backend with torch in this process (once); returns its name."""
    global _REGISTERED
    with _LOCK:
        if not _REGISTERED:
            dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu"])
            # torch warns at every group of a backend given by name alone; ours is cpu only
            warnings.filterwarnings("ignore", message=f"Device capability of {NAME} unknown")
            _REGISTERED = True
    return NAME


_REGISTERED = False
