"""Asynchronous ``calculate()``: the interval is handed off at the call, the fused sync
runs on a background thread, the results wait in a handle.

``metric.calculate(async_op=True)`` (or a collection's) returns a
:class:`CalculateHandle` at once. At the call, on the caller's thread:

* each metric's interval (``core.interval.Interval``) is handed off and the metric
  starts a new one (with ``reset=False`` the hand-off holds copies), so ``accumulate``
  goes on into the next interval at once;
* on CUDA an event is recorded on the current stream: the background work waits
  for it on a side stream, never blocking the compute stream.

Then one background thread per process runs the handed-off syncs one after the
other, in call order: the same packed buffer, merge and ``compute`` as the
synchronous path, but on *private twins* of the data and TP x PP groups (groups
over the same ranks that nothing else uses), so that these collectives cannot
interleave with the training loop's collectives on the real groups, however the
threads are timed (``comm.transport.twins``: made by each group's ranks alone when first
needed, on the caller's thread). Every rank calls ``calculate(async_op=True)`` at the same
points, so every rank's thread runs the same syncs in the same order.

``handle.wait()`` returns exactly what the synchronous call would have returned,
or raises what it would have raised (a ``MetricSyncError`` raises on every rank).
A failed synchronous call keeps the interval in the metrics, and so does a failed
asynchronous one (with ``reset=True``): its interval goes back under the next one, in
call order. If a later hand-off of the metric is still waiting its turn, the worker puts
the failed interval under that one before syncing it (and under a ``reset=False``
one's copy as well as further on); otherwise the metric's ``HandOffs`` keeps it aside and
it goes under the live interval on the caller's thread at the next ``calculate()``,
hand-off, ``state_dict()`` or ``states`` (``settle``). Either way each state folds as
``accumulate`` folds a call (``Interval.fold_under``): fix the cause and calculate again,
and both intervals are reported, as one. ``reset()`` and loads drop intervals handed
off before them (``HandOffs.epoch``). This module never sees a metric: it is handed
intervals, their ledgers and the callables that take and sync them.
The thread runs only while syncs are queued: interpreter exit waits for the ones
still running (as for any thread), each bounded by its mesh's ``wait_timeout()``.
"""
from __future__ import annotations

import collections
import contextlib
import os
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch


class Outcome:
    """Where the worker leaves one job's result or error (``finish``), once."""

    __slots__ = ("ready", "result", "error")

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.result: Optional[Dict[str, Any]] = None
        self.error: Optional[BaseException] = None

    def finish(self, result: Optional[Dict[str, Any]] = None, error: Optional[BaseException] = None) -> None:
        self.result, self.error = result, error
        self.ready.set()


class CalculateHandle:
    """The results of one asynchronous ``calculate()``.

    ``done()`` says whether they are ready (never blocks); ``wait(timeout=None)``
    returns them (the dict the synchronous call returns) or raises its error.
    Handles complete in the order of their calls.
    """

    def __init__(self, what: str, outcome: Optional[Outcome] = None) -> None:
        self._what = what
        self._outcome = Outcome() if outcome is None else outcome

    def done(self) -> bool:
        return self._outcome.ready.is_set()

    def wait(self, timeout: Optional[float] = None) -> Dict[str, Any]:
        if not self._outcome.ready.wait(timeout):
            raise TimeoutError(f"{self._what}: the asynchronous calculate() did not complete within "
                               f"{timeout} s (its collectives are still running); call wait() again")
        if self._outcome.error is not None:
            raise self._outcome.error
        return dict(self._outcome.result or {})

    def __repr__(self) -> str:
        return f"CalculateHandle({self._what}, {'done' if self.done() else 'pending'})"


class _Worker:
    """Runs jobs in submission order on one thread, started when a job comes and ended
    when none is left: no thread outlives the syncs, so interpreter exit (which waits
    for it, as for any non-daemon thread) waits only for syncs still running, each
    bounded by its mesh's ``wait_timeout()``."""

    def __init__(self) -> None:
        self._jobs: "collections.deque" = collections.deque()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._pid = os.getpid()

    def submit(self, job: Callable[[], Dict[str, Any]], outcome: Outcome, stream_guard: Callable[[], Any],
               handed: Sequence = ()) -> None:
        """``handed``: (``HandOffs``, ``HandOff``) pairs whose interval returns if the job fails."""
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's thread is not here
                self._jobs.clear()
                self._pid, self._thread = os.getpid(), None
            self._jobs.append((job, outcome, stream_guard, handed))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="twinkle-metrics-calculate")
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._jobs:
                    self._thread = None
                    return
                job, outcome, stream_guard, handed = self._jobs.popleft()
            try:
                with stream_guard():
                    try:
                        result = job()
                    except BaseException as e:  # noqa: BLE001 - given back on the job's stream
                        _give_back(handed, e)
                        raise
            except BaseException as e:  # noqa: BLE001 - every error belongs to the handle
                outcome.finish(error=e)
            else:
                _done(handed)
                outcome.finish(result=result)


_WORKER = _Worker()
_SIDE_STREAMS: Dict[Any, Any] = {}


class HandOffs:
    """One metric's asynchronous bookkeeping, kept over its intervals.

    ``returned``: hand-offs whose sync failed, oldest first, waiting to be folded back on
    the caller's thread (``settle``); ``in_flight``: hand-offs queued or syncing;
    ``epoch``: bumped by ``reset()`` and loads (hand-offs from before them are dropped);
    ``keep``: set while a reset only ends an interval (its hand-offs stay)."""

    __slots__ = ("returned", "in_flight", "epoch", "keep")

    def __init__(self) -> None:
        self.returned: List[HandOff] = []
        self.in_flight: List[HandOff] = []
        self.epoch = 0
        self.keep = False


class HandOff:
    """One interval handed off to the worker: ``gives_back`` when its metric was reset at
    the hand-off (a failed sync then returns the interval); ``ready``: on CUDA, the event
    after which its states are complete (``_stream_guard``)."""

    __slots__ = ("interval", "epoch", "gives_back", "ready")

    def __init__(self, interval: Any, epoch: int, gives_back: bool) -> None:
        self.interval, self.epoch, self.gives_back = interval, epoch, gives_back
        self.ready: Optional[torch.cuda.Event] = None


def submit(ledgers: Sequence[HandOffs], take: Callable[[], List[Any]],
           run: Callable[[List[Any]], Dict[str, Any]], reset: bool) -> CalculateHandle:
    """Hand an interval of each metric off and sync them in the background.

    ``ledgers``: each metric's ``HandOffs``; ``take()``: on the caller's thread, under the
    lock that keeps intervals from being given back meanwhile, settles each metric and
    returns its handed-off ``Interval`` (the live one, the metric reset; or a copy);
    ``run(intervals)``: on the worker, the sync (on the private twins the caller took,
    ``comm.transport.twins``) and the handle's dict."""
    with _RETURN_LOCK:  # no interval given back between the settle and the hand-off
        intervals = take()
        handed = [(ledger, HandOff(iv, ledger.epoch, reset)) for ledger, iv in zip(ledgers, intervals)]
        for ledger, h in handed:
            ledger.in_flight.append(h)
    guard = _stream_guard([h for _, h in handed])
    outcome = Outcome()
    _WORKER.submit(lambda: run(intervals), outcome, guard, handed)
    return CalculateHandle("calculate(async_op=True)", outcome)


_RETURN_LOCK = threading.RLock()


def _done(handed) -> None:
    with _RETURN_LOCK:
        for ledger, h in handed:
            _forget(ledger.in_flight, h)


def _give_back(handed, error: BaseException) -> None:
    """On the worker, after a failed sync: each handed-off interval (``reset=True``; a
    ``reset=False`` one never left its metric) goes under the later hand-offs of its
    metric still in flight (synced after this one, by this thread) up to the first that
    took the metric's states, or, when none did, back to the metric, to be settled on the
    caller's thread. An interval from before a ``reset()`` or a load is dropped, as they
    dropped the states."""
    with _RETURN_LOCK:
        for ledger, h in handed:
            _forget(ledger.in_flight, h)
            if not h.gives_back or h.epoch != ledger.epoch:
                continue
            try:
                for later in [x for x in ledger.in_flight if x.epoch == ledger.epoch]:
                    if later.ready is not None:  # its states may still be in the caller's queue
                        torch.cuda.current_stream().wait_event(later.ready)
                    later.interval.fold_under(h.interval)
                    if later.gives_back:
                        break
                else:
                    ledger.returned.append(h)
                if h.ready is not None:  # the caller folds what it gets back on its own stream
                    torch.cuda.current_stream().synchronize()
            except Exception as e:  # noqa: BLE001 - the sync's error is the one to raise
                note = getattr(error, "add_note", None)
                if note is not None:
                    note(f"{h.interval.name}: the interval could not be given back: {e}")


def settle(ledger: Optional[HandOffs], live: Any) -> None:
    """On the caller's thread: put the intervals given back (``ledger``) under the live
    interval ``live``, oldest first (they are older than everything it accumulated since).
    None: an interval out of any ledger (a copy), with nothing given back."""
    if ledger is None or not ledger.returned:
        return
    with _RETURN_LOCK:
        returned, ledger.returned = ledger.returned, []
    for h in reversed(returned):  # the newest goes right under the live states
        live.fold_under(h.interval)


def drop_returned(ledger: Optional[HandOffs]) -> None:
    """``reset()`` and loads discard intervals given back, and those still in flight, as
    they discard the states; the resets that end an interval (``ledger.keep``) keep them,
    since those belong under the next interval."""
    if ledger is None or ledger.keep:
        return
    with _RETURN_LOCK:
        ledger.returned = []
        ledger.epoch += 1


def _forget(items: List, obj) -> None:
    for i, x in enumerate(items):
        if x is obj:
            del items[i]
            return


def _stream_guard(handed: Sequence[HandOff]) -> Callable[[], Any]:
    """A factory of the context the background job runs in. On CUDA: a side stream that
    waits for an event recorded now on the caller's stream (so it sees every queued
    accumulate), and the allocator is told the handed-off states are in use there."""
    devices = {h.interval.device for h in handed if h.interval.device.type == "cuda"}
    if not devices:
        return contextlib.nullcontext
    device = sorted(devices, key=str)[0]
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    for h in handed:
        h.ready = event
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    for h in handed:
        for t in h.interval.states.values():
            if t.is_cuda:
                t.record_stream(stream)

    @contextlib.contextmanager
    def on_side_stream() -> Iterator[None]:
        with torch.cuda.device(device), torch.cuda.stream(stream):
            stream.wait_event(event)
            yield

    return on_side_stream
