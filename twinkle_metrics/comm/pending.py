"""Asynchronous ``calculate()``: the interval is handed off at the call, the fused sync
runs on a background thread, the results wait in a handle.

``metric.calculate(async_op=True)`` (or a collection's) returns a
:class:`CalculateHandle` at once. At the call, on the caller's thread:

* the metrics' states are handed to a snapshot and the metrics are reset (with
  ``reset=False`` the snapshot holds copies), so ``accumulate`` goes on into the
  next interval at once;
* on CUDA an event is recorded on the current stream: the background work waits
  for it on a side stream, never blocking the compute stream.

Then one background thread per process runs the handed-off syncs one after the
other, in call order: the same packed buffer, merge and ``compute`` as the
synchronous path, but on *private twins* of the data and TP x PP groups (groups
over the same ranks that nothing else uses), so that these collectives cannot
interleave with the training loop's collectives on the real groups, however the
threads are timed. Every rank calls ``calculate(async_op=True)`` at the same
points, so every rank's thread runs the same syncs in the same order.

``handle.wait()`` returns exactly what the synchronous call would have returned,
or raises what it would have raised (a ``MetricSyncError`` raises on every rank).
A failed synchronous call keeps the interval in the metrics, and so does a failed
asynchronous one (with ``reset=True``): its interval goes back under the next one, in
call order. If a later hand-off of the metric is still waiting its turn, the worker puts
the failed interval under that snapshot before syncing it (and under a ``reset=False``
one's copy as well as further on); otherwise the metric keeps it aside and puts it under
its live states on the caller's thread at the next ``calculate()``, hand-off,
``state_dict()`` or ``states`` (``settle``). Either way each state folds as
``accumulate`` folds a call (``Metric._fold_under``): fix the cause and calculate again,
and both intervals are reported, as one. ``reset()`` and loads drop intervals handed
off before them (each metric counts them in ``_epoch``).
The thread runs only while syncs are queued: interpreter exit waits for the ones
still running (as for any thread), each bounded by its mesh's ``wait_timeout()``.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import os
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from parallel.bounded import twins
from parallel.groups import DESTROYED
from twinkle_metrics.comm.fused import sync_and_compute, sync_groups
from twinkle_metrics.comm.waits import Bound


class CalculateHandle:
    """The results of one asynchronous ``calculate()``.

    ``done()`` says whether they are ready (never blocks); ``wait(timeout=None)``
    returns them (the dict the synchronous call returns) or raises its error.
    Handles complete in the order of their calls.
    """

    def __init__(self, what: str):
        self._what = what
        self._ready = threading.Event()
        self._result: Optional[Dict[str, Any]] = None
        self._error: Optional[BaseException] = None

    def done(self) -> bool:
        return self._ready.is_set()

    def wait(self, timeout: Optional[float] = None) -> Dict[str, Any]:
        if not self._ready.wait(timeout):
            raise TimeoutError(f"{self._what}: the asynchronous calculate() did not complete within "
                               f"{timeout} s (its collectives are still running); call wait() again")
        if self._error is not None:
            raise self._error
        return dict(self._result)

    def _finish(self, result=None, error=None) -> None:
        self._result, self._error = result, error
        self._ready.set()

    def __repr__(self):
        return f"CalculateHandle({self._what}, {'done' if self.done() else 'pending'})"


class _Worker:
    """Runs jobs in submission order on one thread, started when a job comes and ended
    when none is left: no thread outlives the syncs, so interpreter exit (which waits
    for it, as for any non-daemon thread) waits only for syncs still running, each
    bounded by its mesh's ``wait_timeout()``."""

    def __init__(self):
        self._jobs: "collections.deque" = collections.deque()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._pid = os.getpid()

    def submit(self, job: Callable[[], Dict[str, Any]], handle: CalculateHandle, stream_guard,
               handed: Sequence = ()) -> None:
        """``handed``: (metric, snapshot) pairs whose interval returns if the job fails."""
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's thread is not here
                self._jobs.clear()
                self._pid, self._thread = os.getpid(), None
            self._jobs.append((job, handle, stream_guard, handed))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="twinkle-metrics-calculate")
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._jobs:
                    self._thread = None
                    return
                job, handle, stream_guard, handed = self._jobs.popleft()
            try:
                with stream_guard():
                    try:
                        result = job()
                    except BaseException as e:  # noqa: BLE001 - given back on the job's stream
                        _give_back(handed, e)
                        raise
            except BaseException as e:  # noqa: BLE001 - every error belongs to the handle
                handle._finish(error=e)
            else:
                _done(handed)
                handle._finish(result=result)


_WORKER = _Worker()
_SIDE_STREAMS: Dict[Any, Any] = {}
_TWINS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # group -> its twin for the worker


def _twins(groups, bound) -> Dict[int, Any]:
    """The worker's twin of each of ``groups`` (``{id(group): twin}``), made the first time
    (collective over WORLD: ``parallel.bounded.twins``, its exchange bounded by ``bound``)."""
    held = [g for g in groups if g is not None]
    if not all(g in _TWINS for g in held):
        made = twins(held, bound.timeout, bound.what)
        for g in held:  # weakly, as torch's registry holds them: they end with destroy_process_group()
            _TWINS[g] = None if made[id(g)] is None else weakref.ref(made[id(g)])
    return {id(g): _TWINS[g] and (_TWINS[g]() or DESTROYED) for g in held}


def submit(metrics: Sequence, finish: Callable[[List[Dict[str, Any]]], Dict[str, Any]], reset: bool,
           what: str) -> CalculateHandle:
    """Hand the interval of ``metrics`` off and sync it in the background; ``finish``
    turns the per-metric results into the handle's dict (on the background thread)."""
    originals: Dict[int, Any] = {}
    for m in metrics:
        mesh = m.resolve_mesh()
        mesh.check_live("calculate()")
        for group in sync_groups(mesh, m.data_group(), mesh.result_group):
            originals.setdefault(id(group), group)
    # On the caller's thread: creating the twins (once) is collective, in program order.
    what = "calculate(async_op=True)"
    twins_of = _twins(list(originals.values()), Bound(what, metrics[0].resolve_mesh()))

    def groups(data_group, share_group):
        return tuple(None if g is None else twins_of[id(g)] for g in (data_group, share_group))

    with _RETURN_LOCK:  # no interval given back between the settle and the hand-off
        for m in metrics:
            settle(m)
        snapshots = [_hand_off(m, reset) for m in metrics]
        handed = list(zip(metrics, snapshots))
        for m, snap in handed:
            m._in_flight.append(snap)
    guard = _stream_guard(snapshots)
    handle = CalculateHandle(what)
    _WORKER.submit(lambda: finish(sync_and_compute(snapshots, reset=False, groups=groups)), handle, guard,
                   handed)
    return handle


_RETURN_LOCK = threading.RLock()


def _done(handed) -> None:
    with _RETURN_LOCK:
        for m, snap in handed:
            _forget(m._in_flight, snap)


def _give_back(handed, error: BaseException) -> None:
    """On the worker, after a failed sync: each handed-off interval (``reset=True``; a
    ``reset=False`` one never left its metric) goes under the later snapshots of its
    metric still in flight (synced after this one, by this thread) up to the first that
    took the metric's states, or, when none did, back to the metric, to be settled on the
    caller's thread. An interval from before a ``reset()`` or a load is dropped, as they
    dropped the states."""
    with _RETURN_LOCK:
        for m, snap in handed:
            _forget(m._in_flight, snap)
            if not snap._gives_back or snap._epoch != m._epoch:
                continue
            try:
                for later in [x for x in m._in_flight if x._epoch == m._epoch]:
                    if later._ready is not None:  # its states may still be in the caller's queue
                        torch.cuda.current_stream().wait_event(later._ready)
                    later._fold_under(snap)
                    if later._gives_back:
                        break
                else:
                    m._returned.append(snap)
                if snap._ready is not None:  # the caller folds what it gets back on its own stream
                    torch.cuda.current_stream().synchronize()
            except Exception as e:  # noqa: BLE001 - the sync's error is the one to raise
                note = getattr(error, "add_note", None)
                if note is not None:
                    note(f"{type(m).__name__}: the interval could not be given back: {e}")


def settle(metric) -> None:
    """On the caller's thread: put the intervals given back to ``metric`` under its live
    states, oldest first (they are older than everything it accumulated since)."""
    if not metric._returned:
        return
    with _RETURN_LOCK:
        returned, metric._returned = metric._returned, []
    for snap in reversed(returned):  # the newest goes right under the live states
        metric._fold_under(snap)


def drop_returned(metric) -> None:
    """``reset()`` and loads discard intervals given back, and those still in flight, as
    they discard the states; the resets that end an interval (``Metric._end_interval``)
    keep them, since those belong under the next interval."""
    if getattr(metric, "_keep_returned", False) or not hasattr(metric, "_returned"):
        return
    with _RETURN_LOCK:
        metric._returned = []
        metric._epoch = getattr(metric, "_epoch", 0) + 1


def _forget(items: List, obj) -> None:
    for i, x in enumerate(items):
        if x is obj:
            del items[i]
            return


def _hand_off(metric, reset: bool):
    """A copy of ``metric`` holding its interval's states; the metric itself is reset
    (``reset=True``: the states move, no copy) or keeps its states (they are cloned)."""
    snap = copy.copy(metric)
    snap._specs = dict(metric._specs)
    snap._touched = set(metric._touched)
    snap._returned, snap._in_flight = [], []
    snap._epoch = metric._epoch
    snap._gives_back = reset
    snap._ready = None  # CUDA: the event after which its states are complete (_stream_guard)
    if reset:
        snap._states = metric._states
        metric._end_interval()
    else:
        snap._states = {k: v.clone() for k, v in metric._states.items()}
    return snap


def _stream_guard(snapshots) -> Callable[[], Any]:
    """A factory of the context the background job runs in. On CUDA: a side stream that
    waits for an event recorded now on the caller's stream (so it sees every queued
    accumulate), and the allocator is told the handed-off states are in use there."""
    devices = {s._device for s in snapshots if s._device.type == "cuda"}
    if not devices:
        return contextlib.nullcontext
    device = sorted(devices, key=str)[0]
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    for s in snapshots:
        s._ready = event
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    for s in snapshots:
        for t in s._states.values():
            if t.is_cuda:
                t.record_stream(stream)

    @contextlib.contextmanager
    def on_side_stream():
        with torch.cuda.device(device), torch.cuda.stream(stream):
            stream.wait_event(event)
            yield

    return on_side_stream
