"""Bounded, named waits that never touch the job's communicators.

Every collective the library issues (``calculate()``'s gathers and all-reduces, a plan's
negotiation, the agreements inside ``accumulate``) runs with ``async_op=True``, and the
host keeps the bound (the mesh's ``wait_timeout()``) itself: it waits for the work's
completion, never with ``Work.wait(timeout)`` (on NCCL a wait that times out aborts the
communicator, the user's group), and makes no barrier, abort or destroy:

* a work on host tensors (gloo, or a device backend over host tensors) completes its
  future on the host: the host waits for that, within the bound;
* a work on device tensors (NCCL) completes its end event: the host polls it
  (``Work.is_completed``), within the bound. A collective whose result the host does not
  need yet is only ordered before the device's next work (``Work.wait()``), so a sync of
  several collectives reads the device once, at its end (``Transport.host``).

Once done, ``Work.wait()`` (no timeout) raises what the work raised (a peer that gave up
closed its connections) and orders the current stream after it.

Naming the ranks that never came uses the group's own store
(``ProcessGroup.get_group_store()``), and only when a wait runs long:

* a wait that ends within ``EARLY_S`` touches nothing else (the healthy step);
* a rank still waiting then appends its rank to one key of the group's call,
  ``twinkle_metrics/waits/<n>/<call>/in`` (one store request), and waits out the rest;
* when the wait fails (the bound passed, or a peer that gave up closed the group's
  connections), the rank appends too, gives the others ``EARLY_S`` to do the same, and
  the first rank to fail reads that key once and writes the absent ranks, as ranges
  (``1-7``), and the time it gave up to ``.../absent``; the others read that short answer.
  A rank that finds itself in it came after the others gave up: it raises saying so
  (which ranks left, how long before), never naming itself absent.

The key of a call is the same on every rank that should come: for a group, its name, its
incarnation and its calls so far; for a call that every rank of a mesh makes
(``mesh_roll``), the mesh's ``wait_key`` (its source, sizes and place among the meshes built
alike on every rank) and its calls so far, never a rank's own groups.

A failed wait leaves the group's collectives out of step: on the job's own groups a
collective is still in flight that the absent ranks never joined (torch's own timeout and,
on NCCL, its watchdog end the job), so the group is closed for the library: later waits
on it raise at once, naming the first failure. Nothing accumulated is lost: a failed
``calculate()`` keeps the interval in the metrics (an asynchronous one gives it back), a
failed ``accumulate`` adds nothing.

Costs per wait, over a group of N ranks: healthy, nothing; slow (longer than
``EARLY_S``), one store request per waiting rank; failed, about four store requests per
rank and one read of O(N) bytes by the first rank to fail.
"""
from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch.distributed as dist

from parallel import DeviceMesh
from parallel import groups as G
from twinkle_metrics.comm import links
from twinkle_metrics.comm.plan import MetricSyncError

#: seconds a wait runs before the rank writes its arrival (a healthy step ends sooner)
EARLY_S = 1.0
#: the longest pause between two polls of a device work's completion
POLL_MAX_S = 1e-3


def completion(work: Any, on_host: bool) -> Callable[[float], bool]:
    """``done(seconds) -> bool``: whether ``work`` completed within ``seconds`` more, kept
    from the host. ``on_host``: the work's tensors are host tensors, so its future
    completes on the host when it does (a device work's future completes at once, its
    end event later: that is polled, the pause growing from 20 us to ``POLL_MAX_S``)."""
    if on_host:  # a bare lock the callback releases: lighter than an Event
        done = threading.Lock()
        done.acquire()
        work.get_future().add_done_callback(lambda _: done.release())

        def wait(seconds: float) -> bool:
            if done.acquire(timeout=seconds):
                done.release()  # a second wait returns at once too
                return True
            return False

        return wait
    pause = [2e-5]

    def poll(seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while not work.is_completed():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause[0], left))
            pause[0] = min(2 * pause[0], POLL_MAX_S)
        return True

    return poll


class _Group:
    """The library's record of one group (``links.Link.waits``): its store, its calls so
    far, and why it was closed."""

    def __init__(self, group: G.ProcessGroup) -> None:
        self.ranks = tuple(G.group_ranks(group))
        self.store = G.group_store(group)
        name = G.group_name(group)
        # a group torch makes again under the same name (after one was destroyed) must not
        # read the keys of the one before: every rank counts the incarnations alike
        serials = G.world_state().serials
        serials[name] = serials.get(name, 0) + 1
        self.prefix = f"twinkle_metrics/waits/{serials[name]}"
        self.calls = 0
        self.closed: Optional[str] = None


def _record(group: G.ProcessGroup) -> _Group:
    with links.LOCK:
        found = links.link(group)
        if found.waits is None:
            found.waits = _Group(group)
        return found.waits


def check_open(group: G.ProcessGroup) -> None:
    """Raise ``MetricSyncError`` when an earlier wait on ``group`` failed."""
    found = None if group is None else links.find(group)
    record = None if found is None else found.waits
    if record is not None and record.closed is not None:
        raise MetricSyncError(f"{record.closed} (an earlier wait on these ranks failed, so their "
                              "collectives are out of step; restart the job)")


def wait(work: Any, group: G.ProcessGroup, what: str, label: Union[str, Callable[[], str]], timeout: timedelta,
         roll: Optional["Roll"] = None,
         on_host: bool = True) -> None:
    """Return once ``work`` (a collective on ``group``) is done, or raise
    ``MetricSyncError`` within about ``timeout`` naming the ranks that did not come:
    of ``roll`` when given (every rank of a mesh), else of ``group``. ``what`` names the
    call (``"calculate()"``), ``label`` the group (or a callable giving it, called only
    when the wait runs long); ``on_host``: the work's tensors are
    host tensors (``completion``)."""
    record = _record(group)
    check_open(group)
    record.calls += 1
    me = G.global_rank()
    if roll is None:
        roll = Roll(record.store, f"{record.prefix}/{record.calls}", record.ranks, label)
    start = time.monotonic()
    done = completion(work, on_host)
    early = min(EARLY_S, timeout.total_seconds() / 4)
    marked = False
    if not done(early):
        marked = roll.mark(me)
        if not done(max(timeout.total_seconds() - (time.monotonic() - start), 0.001)):
            _fail(record, roll, marked, what, timeout, time.monotonic() - start, None, group, me)
    try:
        work.wait()  # done: raises what the work raised; orders the current stream after it
    except RuntimeError as exc:  # a peer that gave up closed the group's connections
        _fail(record, roll, marked, what, timeout, time.monotonic() - start, exc, group, me)


def mesh_roll(what: str, mesh: DeviceMesh) -> Optional["Roll"]:
    """The roll of one call that every rank of ``mesh`` makes (``calculate()``): ``None``
    for a mesh over part of the world or of one rank (each group's own roll names its ranks).

    Every rank of a mesh that spans the world ends up waiting on one of the call's
    collectives when some rank is missing (each TP x PP group holds a rank of every data
    group), so the ranks that never marked the roll are the absent ones, named in one
    message on every rank that came. Its key is the mesh's ``wait_key``, ``what`` and the
    count of such calls on the mesh: the same on every rank (every rank of the mesh makes
    its calls in one order), where the names of a rank's own groups are not (rank 4's data
    group is not rank 5's)."""
    ranks = mesh.member_ranks()
    if ranks is None or len(ranks) <= 1:
        return None
    ident = f"{what}:{mesh.wait_key}"
    with G.WORLD_LOCK:
        calls = G.world_state().calls
        calls[ident] = n = calls.get(ident, 0) + 1
    return Roll(lambda: G.group_store(dist.group.WORLD), f"twinkle_metrics/calls/{ident}/{n}", ranks,
                lambda: f"mesh from {mesh.source} (ranks {ranges(ranks)})")


# ------------------------------------------------------------------------ naming
class Roll:
    """Who came to one call: ``ranks`` that should, and one key of ``store`` they mark.
    ``store`` and ``label`` may be given as callables, read only when a wait runs long:
    a healthy step reads neither."""

    def __init__(self, store: Any, key: str, ranks: Sequence[int], label: Union[str, Callable[[], str]]) -> None:
        self._store, self.key, self.ranks, self._label = store, key, tuple(ranks), label

    @property
    def store(self) -> Any:
        """The ``torch.distributed.Store`` (its ``append`` is missing from torch's stubs), or None."""
        if callable(self._store):
            self._store = self._store()
        return self._store

    @property
    def label(self) -> str:
        if callable(self._label):
            self._label = self._label()
        return self._label

    def mark(self, rank: int) -> bool:
        """Append ``rank`` to the ranks that came (one store request)."""
        if self.store is None:
            return False
        try:
            self.store.append(f"{self.key}/in", f"{rank},")
            return True
        except (RuntimeError, dist.DistError):
            return False

    def absent(self, pause: float) -> Optional[Tuple[list, float]]:
        """The ranks that had not marked when the first rank gave up, and when it did
        (``time.time()``, its host's clock); ``None`` when the store cannot say. The first
        rank to ask reads the marks and writes the answer for the rest."""
        if self.store is None:
            return None
        key = self.key
        try:
            if self.store.add(f"{key}/failed", 1) == 1:
                came = {int(r) for r in self.store.get(f"{key}/in").decode().split(",") if r}
                absent, now = [r for r in self.ranks if r not in came], round(time.time(), 3)
                self.store.set(f"{key}/absent", f"{ranges(absent) or '-'} @ {now:.3f}")
                return absent, now
            self.store.wait([f"{key}/absent"], timedelta(seconds=max(pause, 1.0)))
            text, _, at = self.store.get(f"{key}/absent").decode().partition(" @ ")
            return unranges(text), float(at)
        except (RuntimeError, ValueError, dist.DistError):
            return None


def ranges(ranks: Sequence[int]) -> str:
    """``[1, 2, 3, 5]`` as ``"1-3, 5"`` (16k ranks must not make a 100 kB message)."""
    out: List[str] = []
    run: List[int] = []
    for r in sorted(ranks):
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [r]
    if run:
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ", ".join(out)


def unranges(text: str) -> list:
    """``ranges``' text back to ranks (``"-"``: none)."""
    out: List[int] = []
    for part in text.split(","):
        part = part.strip()
        if part and part != "-":
            lo, _, hi = part.partition("-")
            out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def _fail(record: _Group, roll: Roll, marked: bool, what: str, timeout: timedelta, waited: float,
          cause: Optional[BaseException], group: G.ProcessGroup, me: int) -> None:
    if not G.group_alive(group):
        record.closed = (f"{what}: the process groups were destroyed (destroy_process_group()) while "
                         f"it waited on them (rank {me}); nothing accumulated was lost")
        raise MetricSyncError(record.closed) from cause
    # A wait can also fail at once (a peer that gave up closed its connections); the
    # ranks that came fail together: each marks, and gives the others as long as the
    # first wait to mark before the answer is read.
    arrived = time.time() - waited
    if not marked:
        roll.mark(me)
    pause = min(EARLY_S, timeout.total_seconds() / 4)
    time.sleep(pause)
    record.closed = message(what, timeout, waited, roll, me, roll.absent(pause), arrived)
    if not G.made_here(group):
        record.closed += in_flight(group, cause is None)
    raise MetricSyncError(record.closed) from cause


def in_flight(group: G.ProcessGroup, pending: bool) -> str:
    """What a failed wait leaves on a group of the job's (the library never cancels or aborts
    it): said after the names of the ranks that never came."""
    if not pending:  # the work failed: a peer that gave up closed the group's connections
        return f". The group {G.group_ranks(group)} is spent for this job: stop it"
    return (f". The group {G.group_ranks(group)} ({dist.get_backend(group)}, the job's own) now holds a "
            "collective in flight that the absent ranks never joined; the library does not cancel or abort "
            "it, so the job must stop (torch's own timeout, and on NCCL its watchdog, end it)")


def message(what: str, timeout: timedelta, waited: float, roll: Roll, me: int,
            answer: Optional[Tuple[list, float]], arrived: float) -> str:
    """What rank ``me`` says when its wait on ``roll``'s ranks failed, from the store's
    ``answer`` (``Roll.absent``); ``arrived``: when its wait began (``time.time()``)."""
    bound, label = timeout.total_seconds(), roll.label
    absent = None if answer is None else answer[0]
    if answer is not None and absent is not None and me in absent:  # written before this rank came
        left = [r for r in roll.ranks if r not in absent]
        late = arrived - answer[1]  # two hosts' clocks: about
        when = f"about {late:.0f} s before" if late >= 1 else "less than a second before"
        others = [r for r in absent if r != me]
        also = f" (rank{'s' if len(others) > 1 else ''} {ranges(others)} had not come either)" if others else ""
        return (f"{what}: rank{'s' if len(left) > 1 else ''} {ranges(left)} of the {label} gave up waiting "
                f"for this call (the bound is {bound:g} s) {when} this rank ({me}) came{also}; their "
                "collectives are out of step with this rank's, so these groups are spent: restart the "
                "job. Nothing accumulated was lost")
    if absent:
        who = (f"rank{'s' if len(absent) > 1 else ''} {ranges(absent)} of the {label} did not arrive "
               f"(this is rank {me}; every rank of the {label} must call {what} at the same point)")
    elif absent is None:
        who = f"some ranks of the {label} did not arrive (this is rank {me}; the store could not say which)"
    else:
        who = f"every rank of the {label} arrived, but not within {bound:g} s of each other (this is rank {me})"
    return (f"{what}: waited {waited:.1f} s (the bound is {bound:g} s: DeviceMesh timeout= or "
            f"TWINKLE_METRICS_TIMEOUT_S); {who}. Nothing accumulated was lost")
