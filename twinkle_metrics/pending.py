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
A failed synchronous call keeps the interval in the metrics; so, with ``reset=True``,
the first ``wait()`` that raises folds the handed-off interval back into them (on the
caller's thread, merged with what they accumulated since, as ``load_state_dict`` of
both would): fix the cause and calculate again, and it is reported.
At interpreter exit, pending syncs get ``EXIT_WAIT_S`` seconds to finish; the
thread is a daemon, so a sync whose peers are gone cannot hold the process.
"""
from __future__ import annotations

import atexit
import contextlib
import copy
import os
import queue
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from parallel.groups import private_twins

from .sync import sync_and_compute

#: seconds that pending asynchronous syncs get at interpreter exit
EXIT_WAIT_S = float(os.environ.get("TWINKLE_METRICS_EXIT_WAIT_S", "10"))


class CalculateHandle:
    """The results of one asynchronous ``calculate()``.

    ``done()`` says whether they are ready (never blocks); ``wait(timeout=None)``
    returns them (the dict the synchronous call returns) or raises its error.
    Handles complete in the order of their calls.
    """

    def __init__(self, what: str, restore: Optional[Callable[[], None]] = None):
        self._what = what
        self._ready = threading.Event()
        self._result: Optional[Dict[str, Any]] = None
        self._error: Optional[BaseException] = None
        self._restore = restore  # run once, by the first wait() that raises

    def done(self) -> bool:
        return self._ready.is_set()

    def wait(self, timeout: Optional[float] = None) -> Dict[str, Any]:
        if not self._ready.wait(timeout):
            raise TimeoutError(f"{self._what}: the asynchronous calculate() did not complete within "
                               f"{timeout} s (its collectives are still running); call wait() again")
        if self._error is not None:
            restore, self._restore = self._restore, None
            if restore is not None:
                try:
                    restore()
                except Exception as e:  # noqa: BLE001 - the sync's error is the one to raise
                    note = getattr(self._error, "add_note", None)
                    if note is not None:
                        note(f"{self._what}: the interval could not be folded back into the metric: {e}")
            raise self._error
        return dict(self._result)

    def _finish(self, result=None, error=None) -> None:
        self._result, self._error = result, error
        self._ready.set()

    def __repr__(self):
        return f"CalculateHandle({self._what}, {'done' if self.done() else 'pending'})"


class _Worker:
    """One daemon thread running jobs in submission order."""

    def __init__(self):
        self._jobs: "queue.Queue" = queue.Queue()
        self._pending = 0
        self._idle = threading.Condition()
        self.pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name="twinkle-metrics-calculate", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], Dict[str, Any]], handle: CalculateHandle, stream_guard) -> None:
        with self._idle:
            self._pending += 1
        self._jobs.put((job, handle, stream_guard))

    def _run(self) -> None:
        while True:
            job, handle, stream_guard = self._jobs.get()
            try:
                with stream_guard():
                    result = job()
            except BaseException as e:  # noqa: BLE001 - every error belongs to the handle
                handle._finish(error=e)
            else:
                handle._finish(result=result)
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()

    def drain(self, timeout: float) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)


_WORKER: Optional[_Worker] = None
_WORKER_LOCK = threading.Lock()
_SIDE_STREAMS: Dict[Any, Any] = {}


def _worker() -> _Worker:
    global _WORKER
    with _WORKER_LOCK:
        if _WORKER is None or _WORKER.pid != os.getpid():  # a forked child needs its own thread
            _WORKER = _Worker()
        return _WORKER


@atexit.register
def _drain_at_exit() -> None:
    if _WORKER is not None and _WORKER.pid == os.getpid():
        _WORKER.drain(EXIT_WAIT_S)


def submit(metrics: Sequence, finish: Callable[[List[Dict[str, Any]]], Dict[str, Any]], reset: bool,
           what: str) -> CalculateHandle:
    """Hand the interval of ``metrics`` off and sync it in the background; ``finish``
    turns the per-metric results into the handle's dict (on the background thread)."""
    originals: Dict[int, Any] = {}
    for m in metrics:
        mesh = m.resolve_mesh()
        mesh.check_live("calculate()")
        for group in (m.data_group(), mesh.result_group):
            originals.setdefault(id(group), group)
    # On the caller's thread: creating the twins (once) is collective, in program order.
    twins = private_twins(list(originals.values()))

    def groups(data_group, share_group):
        return tuple(None if g is None else twins[id(g)] for g in (data_group, share_group))

    snapshots = [_hand_off(m, reset) for m in metrics]
    guard = _stream_guard(snapshots)

    def restore():
        for m, snap in zip(metrics, snapshots):
            m._fold_back(snap)

    handle = CalculateHandle(what, restore if reset else None)
    _worker().submit(lambda: finish(sync_and_compute(snapshots, reset=False, groups=groups)), handle, guard)
    return handle


def _hand_off(metric, reset: bool):
    """A copy of ``metric`` holding its interval's states; the metric itself is reset
    (``reset=True``: the states move, no copy) or keeps its states (they are cloned)."""
    snap = copy.copy(metric)
    snap._specs = dict(metric._specs)
    if reset:
        snap._states = metric._states
        metric.reset()
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
