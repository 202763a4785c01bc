"""Bounded, named waits: every wait the library adds to a training step ends within the
mesh's ``wait_timeout()``, and the ranks left waiting name the ranks that never came.

Whatever created the groups (the mesh, Megatron, DeepSpeed, torch), ``calculate()`` (and
the background thread of an asynchronous one) takes one of three paths:

* CPU groups whose own timeout is within the bound: their gathers are the waits
  (``all_gather_rows``, waited on through ``settle``); the first time, the ranks meet in
  the default store (a counter and one key per rank, every step of it bounded).
* CPU groups that wait longer (Megatron's and DeepSpeed's 30-minute gloo groups): the
  same gathers on gloo twins over the same ranks, created with the bound
  (``bounded_groups``).
* device groups (NCCL), or a mesh over part of the world: ``arrive``, one barrier over
  the mesh's ranks on a gloo group the library owns, created with the bound, before
  the device collectives.

Steady-state cost of each: ``benchmarks/bench_waits.py``. The host-side collectives
inside ``accumulate`` (agreements, host sizes) run on CPU groups within the bound
(``host_group``: a group the library owns where the group's own timeout is longer) and
are waited on through ``settle``.

Every wait goes through ``_finish``: a first short wait (``EARLY_S``); a rank still
waiting then writes one key, ``twinkle_metrics/<door>/<rank> = <call number>``, to the
default store and waits out the rest. When the wait fails, the ranks of the group with
no key for this call are the ones that did not arrive. So a healthy step writes nothing;
only a wait longer than ``EARLY_S`` costs one store write.

A failed wait leaves the group's collectives out of step (the ranks that never came
may enter later), so the door is closed: later waits on it raise at once, naming the
first failure. Nothing accumulated is lost: a failed ``calculate()`` keeps the interval
in the metrics (an asynchronous one gives it back), a failed ``accumulate`` adds nothing.
"""
from __future__ import annotations

import hashlib
import threading
import time
from datetime import timedelta
from typing import Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from parallel import groups as G
from twinkle_metrics.comm.plan import MetricSyncError

#: seconds a wait runs before the rank writes its arrival key (a healthy step ends sooner)
EARLY_S = 1.0
#: callables told ``(name, check)`` for each collective run on a group the library owns
#: (not ``torch.distributed`` calls, which ``testing.CollectiveCounter`` wraps); ``check``:
#: an arrival barrier, not part of the metrics' own collectives
OBSERVERS: list = []


def observed(name: str, check: bool = False) -> None:
    for fn in list(OBSERVERS):
        fn(name, check)


class _Door:
    """One sequence of waits over a set of ranks: its call count, group and state."""

    def __init__(self, purpose: str, ranks: Tuple[int, ...], timeout: timedelta):
        self.purpose, self.ranks = purpose, ranks
        digest = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:12]
        # a door per bound (its group gives up within it), and never a name used before:
        # the epoch counts ``forget`` calls, made alike on every rank
        self.prefix = f"twinkle_metrics/{_EPOCH[0]}/{purpose}/{timeout.total_seconds():g}/{digest}"
        self.calls = 0
        self.group = None
        self.world = None  # the default group the door's group was made under
        self.met = False  # the ranks met once in the store (``arrive_mesh``'s inline case)
        self.closed: Optional[str] = None

    def ready(self) -> bool:
        """Whether the door's group exists under the current default group."""
        return self.group is not None and G.dist_ready() and self.world is dist.group.WORLD


_DOORS: Dict[Tuple[str, Tuple[int, ...], timedelta], _Door] = {}
_LOCK = threading.Lock()
_EPOCH = [0]


def _door(purpose: str, ranks: Sequence[int], timeout: timedelta) -> _Door:
    key = (purpose, tuple(ranks), timeout)
    with _LOCK:
        door = _DOORS.get(key)
        if door is None:
            door = _DOORS[key] = _Door(*key)
        return door


def forget() -> None:
    """Drop every door (their groups go with ``groups.release_owned``); every rank must
    call it at the same point (``destroy_process_group()``, exit)."""
    with _LOCK:
        _DOORS.clear()
        _EPOCH[0] += 1


def prepare(what: str, ranks: Sequence[int], timeout: timedelta, label: str, purpose: str) -> None:
    """Create the door's group now, on the caller's thread (creating a group must happen
    at the same point of every rank's program), so that ``arrive`` from another thread
    finds it. Bounded and named like ``arrive``."""
    door = _door(purpose, ranks, timeout)
    if not door.ready():
        _open(door, what, timeout, label)


def arrive(what: str, ranks: Sequence[int], timeout: timedelta, label: str, purpose: str = "calculate") -> None:
    """Return once every rank of ``ranks`` got here, or raise ``MetricSyncError`` within
    about ``timeout`` naming the ranks that did not.

    ``ranks``: the same tuple on each of them (every rank of a mesh, or a group);
    ``what`` names the call (``"calculate()"``), ``label`` the ranks (``"mesh ranks 0-7"``).
    """
    if len(ranks) <= 1:
        return
    door = _door(purpose, ranks, timeout)
    if not door.ready():
        _open(door, what, timeout, label)
        return
    _check_open(door)
    door.calls += 1
    work = door.group.barrier()
    observed("barrier", check=True)
    _finish(work, door, what, timeout, label)


def arrive_mesh(what: str, mesh, data_group, share_group, purpose: str = "calculate", used=None) -> bool:
    """Bound the waits of a ``calculate()`` on ``(data_group, share_group)``.

    When both are CPU groups whose own timeout is within the bound, their collectives
    are bounded already: the ranks meet once in the store (the first time, bounded and
    named), and the caller runs its collectives through ``all_gather_rows`` (returns
    True: nothing added in the steady state). Else ``arrive`` over every rank the call
    involves: the whole mesh in one barrier when it spans WORLD, else each group's
    ranks in turn (returns False). ``used``: the groups the collectives run on, when
    not these (an asynchronous calculate's private twins); the ranks come from these.
    """
    timeout = mesh.wait_timeout()
    held = [g for g in (used or (data_group, share_group)) if g is not None]
    inline = all(G.is_cpu_group(g) and G.within(g, timeout) for g in held)
    for ranks, label in _spans(mesh, data_group, share_group):
        if not inline:
            arrive(what, ranks, timeout, label, purpose)
            continue
        door = _door(purpose, ranks, timeout)
        if len(ranks) > 1 and not door.met:
            _open(door, what, timeout, label, create=False)
            door.met = True
    return inline


def bounded_groups(what: str, mesh, data_group, share_group):
    """The groups a ``calculate()`` on ``(data_group, share_group)`` runs its collectives
    on: these, or, when they are CPU groups and some waits longer than the bound
    (Megatron's and DeepSpeed's 30-minute gloo groups), gloo twins over the same ranks
    created with the bound (``groups.private_twins(..., "bounded")``; the first time, the
    ranks meet in the store before creating them, bounded and named), so that the
    gathers themselves are the bounded waits and no arrival barrier is added. Device
    groups (NCCL) are returned as they are (``arrive_mesh`` then adds the barrier)."""
    held = [g for g in (data_group, share_group) if g is not None]
    limit = mesh.wait_timeout()
    if (not held or not all(G.is_cpu_group(g) for g in held) or all(G.within(g, limit) for g in held)
            or mesh.member_ranks() is None):  # twins are made over WORLD: a mesh over all of it
        return data_group, share_group
    if not G.private_twins_ready(held, "bounded", limit):  # creating them is collective over WORLD
        meet(what, tuple(range(G.world_size())), limit, "world", "bounded-twins")
    twins = G.private_twins(held, "bounded", limit)
    return tuple(None if g is None else twins[id(g)] for g in (data_group, share_group))


def all_gather_rows(buf, group, what: str, label: str):
    """``groups.all_gather_rows`` on a CPU ``group`` within the bound, its wait named
    like ``arrive``'s (``settle``)."""
    return G.all_gather_rows(buf, group, wait=lambda work: settle(work, what, group, label))


def prepare_mesh(what: str, mesh, data_group, share_group, purpose: str) -> None:
    """``prepare`` the doors ``arrive_mesh`` with these arguments will use. Before creating
    a group, the ranks meet in the store (bounded and named), so the collective creation
    never waits for a rank that is not coming."""
    timeout = mesh.wait_timeout()
    for ranks, label in _spans(mesh, data_group, share_group):
        if len(ranks) > 1:
            prepare(what, ranks, timeout, label, purpose)


def meet(what: str, ranks: Sequence[int], timeout: timedelta, label: str, purpose: str) -> None:
    """A one-off bounded, named meeting of ``ranks`` in the default store (no group):
    before a collective that cannot be bounded otherwise (creating groups over WORLD)."""
    if len(ranks) > 1:
        _open(_door(purpose, ranks, timeout), what, timeout, label, create=False)


def _spans(mesh, data_group, share_group) -> List[Tuple[Tuple[int, ...], str]]:
    members = mesh.member_ranks()
    held = [g for g in (data_group, share_group) if g is not None]
    if len(held) == 2 and members is not None and data_group is mesh.data_group:
        return [(members, f"mesh from {mesh.source} (ranks {_ranges(members)})")]
    return [(tuple(G.group_ranks(g)), mesh.group_label(g)) for g in held]


def host_group(mesh, group, what: str):
    """The CPU group the host-side exchanges over ``group`` run on, within the mesh's
    ``wait_timeout()``: ``group`` itself or the mesh's gloo twin of it when their own
    timeout is within it, else a gloo group the library owns over the same ranks with
    the bound (created the first time, bounded and named like ``arrive``)."""
    if group is None or G.group_size(group) <= 1:
        return None
    limit = mesh.wait_timeout()
    known = mesh.cpu_group(group, create=False)
    if known is not None and G.within(known, limit):
        return known
    ranks = tuple(G.group_ranks(group))
    door = _door("host", ranks, limit)
    if not door.ready():
        _open(door, what, limit, mesh.group_label(group))
    return door.group


def settle(work, what: str, group, label: str) -> None:
    """Wait for ``work``, a collective on ``group`` (a CPU group whose own timeout is
    within the bound), raising ``MetricSyncError`` named like ``arrive`` when it fails
    (after the group's own timeout, which ends the work)."""
    timeout = G.group_timeout(group) or timedelta(minutes=30)
    door = _door("collective", tuple(G.group_ranks(group)), timeout)
    _check_open(door)
    door.calls += 1
    _finish(work, door, what, timeout, label)


# ------------------------------------------------------------------------ internals
def _check_open(door: _Door) -> None:
    if door.closed is not None:
        raise MetricSyncError(f"{door.closed} (an earlier wait on these ranks failed, so their "
                              "collectives are out of step; restart the job)")


def _finish(work, door: _Door, what: str, timeout: timedelta, label: str) -> None:
    early = min(EARLY_S, timeout.total_seconds() / 4)
    start = time.monotonic()
    try:
        work.wait(timedelta(seconds=early))
        return
    except RuntimeError:  # not done yet ("Operation timed out!"), or failed: see below
        pass
    _mark(door)
    try:
        # the group gives up within ``timeout`` itself (created or chosen so), and only
        # then is its work done: waiting less would leave the operation in flight on it
        work.wait()
    except RuntimeError as exc:
        _fail(door, what, timeout, label, time.monotonic() - start, exc)


def _open(door: _Door, what: str, timeout: timedelta, label: str, create: bool = True) -> None:
    """First wait of a door: meet in the default store (every step bounded by
    ``timeout``), then create the door's gloo group together (``create``)."""
    _check_open(door)
    door.calls += 1
    store = G.default_store()
    start = time.monotonic()
    if store is not None:
        _mark(door)
        count_key, all_key = f"{door.prefix}/count/{door.calls}", f"{door.prefix}/all/{door.calls}"
        try:
            if store.add(count_key, 1) >= len(door.ranks):
                store.set(all_key, "1")
            _poll(store, all_key, start + timeout.total_seconds())
        except (RuntimeError, TimeoutError, dist.DistError) as exc:
            _fail(door, what, timeout, label, time.monotonic() - start, exc)
    if not create:
        return
    try:
        door.group = G.owned_gloo_group(door.ranks, timeout, f"{door.prefix}/group/{door.calls}")
        door.world = dist.group.WORLD
    except (RuntimeError, dist.DistError) as exc:
        _fail(door, what, timeout, label, time.monotonic() - start, exc)


def _poll(store, key: str, deadline: float) -> None:
    """Until ``key`` is set or ``deadline`` passes (``TimeoutError``). Short requests, not
    ``store.wait``: a store client serves one request at a time, so a blocking wait on
    one thread (the asynchronous calculate's) would hold back another's (the training
    loop's) arrival, and two ranks waiting for each other's other thread never meet."""
    pause = 0.001
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"store key {key} not set in time")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def _mark(door: _Door) -> None:
    store = G.default_store()
    if store is None:
        return
    try:
        store.set(f"{door.prefix}/{G.global_rank()}", str(door.calls))
    except (RuntimeError, dist.DistError):
        pass


def _absent(door: _Door) -> Optional[List[int]]:
    """Ranks of the door with no key for this call; ``None`` when the store cannot say."""
    store = G.default_store()
    if store is None:
        return None
    out = []
    try:
        for r in door.ranks:
            key = f"{door.prefix}/{r}"
            if not store.check([key]) or int(store.get(key)) < door.calls:
                out.append(r)
    except (RuntimeError, ValueError, dist.DistError):
        return None
    return out


def _ranges(ranks: Sequence[int]) -> str:
    """``[1, 2, 3, 5]`` as ``"1-3, 5"`` (16k ranks must not make a 100 kB message)."""
    out, run = [], []
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


def _fail(door: _Door, what: str, timeout: timedelta, label: str, waited: float, cause) -> None:
    # A wait can also fail at once (a peer that moved on closed its connections); the
    # ranks that came fail together: each writes its key, and gives the others as long
    # as the first wait to write theirs, before reading who is missing.
    _mark(door)
    time.sleep(min(EARLY_S, timeout.total_seconds() / 4))
    absent = _absent(door)
    me = G.global_rank()
    if absent:
        who = (f"rank{'s' if len(absent) > 1 else ''} {_ranges(absent)} of the {label} did not arrive "
               f"(this is rank {me}; every rank of the {label} must call {what} at the same point)")
    elif absent is None:
        who = f"some ranks of the {label} did not arrive (this is rank {me}; the store could not say which)"
    else:
        who = (f"every rank of the {label} arrived, but not within {timeout.total_seconds():g} s of "
               f"each other (this is rank {me})")
    msg = (f"{what}: waited {waited:.1f} s (the bound is {timeout.total_seconds():g} s: DeviceMesh "
           f"timeout= or TWINKLE_METRICS_TIMEOUT_S); {who}. Nothing accumulated was lost")
    door.closed = msg
    raise MetricSyncError(msg) from cause
