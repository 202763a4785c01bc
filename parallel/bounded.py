"""The library's waits on a mesh's ranks: the bound, and CPU groups that give up within it.

``BoundedWaits`` (a base of ``DeviceMesh``) holds the bound (``wait_timeout()``), the CPU
groups within it (``cpu_group()``) and the check that the mesh's groups still exist.

The library's collectives (``calculate()``'s sync, the agreements inside ``accumulate``)
run on CPU (gloo) groups whose own timeout is within the mesh's ``wait_timeout()``: a
group that is already one is used as it is; for any other (a device group, or
Megatron's and DeepSpeed's 30-minute gloo groups) the mesh makes a gloo group over the
same ranks with the bound as its timeout, through torch's registry (``new_group``).
Building a mesh is collective already, so that is where every rank makes them, in one
order: from the layout where the mesh has one, else after one exchange over WORLD of
each rank's groups. A mesh over part of the world makes none (its ranks alone cannot
call ``new_group``): its waits are bounded by ``Work.wait`` only.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import threading
import weakref
from datetime import timedelta
from typing import Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from . import groups as G
from .sizes import LAYOUT_AXES

#: the mesh's groups the library's collectives run over
AXES = ("dp_cp", "dp", "tp", "cp", "mp")


def needs_twin(group, bound: timedelta) -> bool:
    """Whether the library needs a gloo group over the ranks of ``group`` to keep its
    waits within ``bound``."""
    if group is None or G.group_size(group) <= 1:
        return False
    return not (G.is_cpu_group(group) and G.within(group, bound))


def make(mesh, bound: timedelta) -> Dict[Tuple[int, ...], "dist.ProcessGroup"]:
    """``{ranks: gloo group}`` over the ranks of this rank's groups of ``mesh`` that need
    one (``needs_twin``), each with ``bound`` as its timeout. Collective over WORLD:
    every rank calls it at the same point (building the mesh)."""
    if not G.dist_ready() or G.world_size() <= 1:
        return {}
    mine = {name: mesh.get_group(name) for name in AXES}
    cpu_data = mesh.get_group("dp_cp_cpu")
    if mine["dp_cp"] is not None and cpu_data is not None and not needs_twin(cpu_data, bound):
        mine["dp_cp"] = None  # the source's own gloo data group is within the bound
    if mesh.layout is not None:
        wanted = [tuple(r) for name in AXES if needs_twin(mine[name], bound)
                  for r in mesh.layout.all_groups(LAYOUT_AXES[name]) if len(r) > 1]
    elif mesh.member_ranks() is not None:
        own = sorted({tuple(G.group_ranks(g)) for g in mine.values() if needs_twin(g, bound)})
        # building a mesh is not a training step: the ranks get the default group's timeout
        wanted = [r for ranks in exchange(own, G.default_timeout(), "DeviceMesh") for r in ranks]
    else:
        return {}
    made: Dict[Tuple[int, ...], "dist.ProcessGroup"] = {}
    me = G.global_rank()
    for ranks in sorted(set(wanted)):
        try:
            group = dist.new_group(list(ranks), backend="gloo", timeout=bound)
        except (RuntimeError, ValueError, NotImplementedError):  # no gloo here: waits use Work.wait
            return {}
        if me in ranks:
            made[ranks] = group
    return made


def twins(groups: Sequence, timeout: Optional[timedelta], what: str) -> dict:
    """Second groups over the ranks of each of ``groups``, with their backends and
    ``timeout``, made through torch's registry: for a user that must not interleave its
    collectives with others' on the originals (the background thread of an asynchronous
    calculate). Returns ``{id(group): twin}`` (``None`` for groups of one rank).

    Collective over WORLD: every rank lists its groups, the lists are exchanged
    (bounded by ``timeout``), and every rank makes the twins of every listed group in
    one order. So every rank must come here at the same point of its program.
    """
    mine = sorted({(tuple(G.group_ranks(g)), str(dist.get_backend(g))) for g in groups
                   if g is not None and G.group_size(g) > 1})
    made = {}
    for ranks, backend in sorted({entry for entries in exchange(mine, timeout, what) for entry in entries}):
        twin = dist.new_group(list(ranks), backend=backend, timeout=timeout or G.default_timeout())
        if G.global_rank() in ranks:
            made[ranks] = twin
    return {id(g): None if g is None or G.group_size(g) <= 1 else made[tuple(G.group_ranks(g))]
            for g in groups}


def exchange(obj, timeout: Optional[timedelta], what: str) -> List:
    """Every rank's picklable ``obj``, in rank order, over WORLD: two gathers (sizes,
    then bytes), each wait bounded by ``timeout``."""
    world = dist.group.WORLD

    def wait(work):
        try:
            work.wait(timeout) if timeout is not None else work.wait()
        except RuntimeError as exc:
            raise RuntimeError(f"{what}: not every rank of the world came within "
                               f"{timeout.total_seconds() if timeout else '?'} s to make the library's "
                               "groups (every rank must build the same meshes, in the same order, "
                               "and call calculate(async_op=True) at the same points)") from exc

    return [pickle.loads(b) for b in G.all_gather_bytes(pickle.dumps(obj), world, wait=wait)]


#: per default group (a new ``init_process_group`` starts afresh): the meshes of each kind
#: built so far, for ``BoundedWaits.wait_key``
_BUILT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_BUILT_LOCK = threading.Lock()


def _built(kind: str) -> int:
    """How many meshes of ``kind`` this rank has built in this world, this one included."""
    world = dist.group.WORLD if G.dist_ready() else None
    if world is None:
        return 0
    with _BUILT_LOCK:
        counts = _BUILT.setdefault(world, {})
        counts[kind] = n = counts.get(kind, 0) + 1
    return n


class BoundedWaits:
    """What ``DeviceMesh`` knows about the library's waits on its ranks: the bound, the
    CPU groups within it, and whether its groups are still there to wait on."""

    #: a name for this mesh, the same on every rank of it (``_name_waits``)
    wait_key: str = ""

    def _name_waits(self) -> None:
        """Name the mesh for the keys its waits write (``comm.waits.Bound``): its source,
        its sizes, and how many meshes like it were built before it. The same on every
        rank, which build the same meshes in the same order (as their groups need); a
        rank's own groups (its data group, its TP x PP group) would name it differently
        on each rank. No collective."""
        kind = f"{self.source}:" + "x".join(f"{a}{self.size(a)}" for a in ("tp", "cp", "dp", "pp", "ep"))
        kind += f"xvpp{self.vpp_size}" if self.vpp_size > 1 else ""
        self.wait_key = f"{kind}#{_built(kind)}"

    def member_ranks(self) -> Optional[Tuple[int, ...]]:
        """Every rank of this mesh, when it spans WORLD (its data, TP and PP groups
        multiply to the world size: the groups of different axes meet in one rank
        only); ``None`` otherwise (a mesh over part of the world)."""
        if not G.dist_ready():
            return None
        size = self.dp_size * self.cp_size * self.tp_size * self.pp_size
        return tuple(range(G.world_size())) if size == G.world_size() else None

    def wait_timeout(self) -> timedelta:
        """How long any wait the library adds to a step may last on this mesh's ranks.

        The collectives of ``calculate()`` (sync or async) and the agreements inside
        ``accumulate`` end within it: ranks that arrived raise ``MetricSyncError``
        naming the ranks that did not. Set in one place, alike on every rank: the
        constructor's ``timeout=`` (a ``timedelta`` or seconds), else the environment
        variable ``TWINKLE_METRICS_TIMEOUT_S``, else the timeout given to
        ``init_process_group``, else torch's 30 minutes. Set it before the mesh is
        built: the gloo groups it needs are made then, with it as their timeout. It does
        not change the groups' own timeouts (Megatron's ``distributed_timeout_minutes``,
        DeepSpeed's).
        """
        if self.timeout is not None:
            return self.timeout
        text = os.environ.get("TWINKLE_METRICS_TIMEOUT_S")
        if text:
            return _as_timedelta(text, "TWINKLE_METRICS_TIMEOUT_S")
        return G.default_timeout() or timedelta(minutes=30)

    def _make_cpu_groups(self) -> None:
        """Make the gloo groups the library's waits need (``parallel.bounded``): collective
        over WORLD, on every rank as the mesh is built."""
        if self._layout_only or not G.dist_ready():
            return
        bound = self.wait_timeout()
        if self._bound_made != bound:
            self._cpu_twins.update(make(self, bound))
            self._bound_made = bound

    # ------------------------------------------------------------- liveness
    def check_live(self, what: str) -> None:
        """Raise ``RuntimeError`` when a collective over this mesh would reduce nothing.

        Cheap (no collective; one dictionary lookup per group held), so it runs on
        every ``calculate()``. Raises when the mesh is layout-only with an axis of
        more than one rank (built before ``init_process_group`` or with
        ``create_groups=False``), or when it holds groups but torch.distributed has
        been shut down or one of its groups destroyed. A single-rank mesh is always live.

        Args:
            what: the call being checked, named in the message, e.g. ``"calculate()"``.
        """
        if self._layout_only:
            if self.layout is not None and self.layout.world_size > 1:
                raise RuntimeError(
                    f"{what}: {self.describe()} is layout-only: it knows the sizes but holds no "
                    "process groups, so nothing would be reduced and every rank would report its "
                    "own local numbers as if they were global. Build the mesh after "
                    "init_process_group (DeviceMesh.from_sizes(...) then creates the groups); "
                    "create_groups=False gives a layout-only mesh for printing only.")
            return
        held = [(n, g) for n, g in self._groups.items() if g is not None]
        held += [("cpu twin", g) for g in self._cpu_twins.values() if g is not None]
        if not held:
            return
        if not G.dist_ready():
            raise RuntimeError(
                f"{what}: this DeviceMesh (from {self.source}) holds process groups "
                f"({', '.join(sorted({n for n, _ in held}))}) but torch.distributed is no longer "
                "initialised (destroy_process_group() was called), so nothing would be reduced "
                "and each rank would report its local numbers. Call it before "
                "destroy_process_group(), or build a new mesh after init_process_group.")
        for name, group in held:
            if not G.group_alive(group):
                raise RuntimeError(
                    f"{what}: the {name!r} group of this DeviceMesh (from {self.source}) was "
                    "destroyed (destroy_process_group(group)), so it cannot reduce anything; "
                    "build a new mesh after recreating the groups.")

    def cpu_group(self, group: G.ProcessGroup, create: bool = True) -> G.ProcessGroup:
        """The CPU (gloo) group the library's collectives over the ranks of ``group`` run
        on, whose own timeout is within ``wait_timeout()`` where the mesh could make one.

        ``group`` itself when it is such a group; else the gloo group over its ranks the
        mesh made when it was built (``parallel.bounded``), or the source's own gloo data
        group; else ``group`` itself when it is a CPU group (its waits are then bounded
        by ``Work.wait`` only); else a gloo twin created on first use over the ranks of
        ``group`` only (every rank of ``group`` must ask at the same point, as for a
        collective over it), unless ``create=False``. ``None`` for a group of one rank,
        or when no gloo group can be made.
        """
        if group is None or G.group_size(group) <= 1:
            return None
        bound = self.wait_timeout()
        if not needs_twin(group, bound):
            return group
        cpu_data = self._groups["dp_cp_cpu"]
        if group is self._groups["dp_cp"] and cpu_data is not None and not needs_twin(cpu_data, bound):
            return cpu_data
        key = tuple(G.group_ranks(group))
        twin = self._cpu_twins.get(key)
        if twin is None and G.is_cpu_group(group):
            return group
        if twin is None and create:
            twin = G.cpu_twin(group, bound)
            if twin is not None:
                self._cpu_twins[key] = twin
        return twin


def _as_timedelta(value, name: str = "timeout") -> Optional[timedelta]:
    """``value`` (a ``timedelta``, seconds, or their text) as a positive ``timedelta``."""
    if value is None or isinstance(value, timedelta):
        if value is not None and value.total_seconds() <= 0:
            raise ValueError(f"DeviceMesh: {name} must be positive, got {value}")
        return value
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"DeviceMesh: {name} must be a timedelta or a number of seconds, "
                         f"got {value!r}") from None
    if not seconds > 0:
        raise ValueError(f"DeviceMesh: {name} must be a positive number of seconds, got {value!r}")
    return timedelta(seconds=seconds)


_BUILDING = threading.local()


@contextlib.contextmanager
def _deferred():
    """Meshes built inside make their CPU groups only in ``_timed``, once their bound is set."""
    before = getattr(_BUILDING, "deferred", False)
    _BUILDING.deferred = True
    try:
        yield
    finally:
        _BUILDING.deferred = before


def _timed(mesh, timeout):
    """``mesh`` with the library's wait bound ``timeout`` (kept when ``None``), and the
    CPU groups its waits need within it."""
    if timeout is not None:
        mesh.timeout = _as_timedelta(timeout)
    if not getattr(_BUILDING, "deferred", False):
        mesh._make_cpu_groups()
    return mesh
