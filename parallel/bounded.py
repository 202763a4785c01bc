"""The library's waits on a mesh's ranks: the bound, and the CPU groups of host exchanges.

``BoundedWaits`` (a base of ``DeviceMesh``) holds the bound (``wait_timeout()``), the
host groups of the library's host exchanges (``host_group()``) and the check that the
mesh's groups still exist.

Building a mesh makes no group. ``calculate()`` runs on the mesh's own groups (device or
CPU), its waits kept within the bound from the host (``twinkle_metrics.comm.waits``). Only
the host exchanges of values the host already knows (the agreements inside ``accumulate``
over TP or CP, ``EmbeddingMetric``'s row counts) need a CPU group: the group itself when it
is one, else a gloo group over the same ranks that the source made (Megatron's DP x CP gloo
group), else one the library makes when first needed, over those ranks alone and lazily
connected (``parallel.groups.gloo_group``).
"""
from __future__ import annotations

import math
import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional, Tuple, TypeVar, Union, overload

from . import groups as G

if TYPE_CHECKING:
    from .layout import Layout

#: the library's wait bound on a mesh: a ``timedelta``, seconds (or their text), None for the default
Timeout = Union[timedelta, float, str, None]


def _built(kind: str) -> int:
    """How many meshes of ``kind`` this rank has built in this world, this one included."""
    if not G.dist_ready():
        return 0
    with G.WORLD_LOCK:
        meshes = G.world_state().meshes
        meshes[kind] = n = meshes.get(kind, 0) + 1
    return n


class BoundedWaits:
    """What ``DeviceMesh`` knows about the library's waits on its ranks: the bound, the
    CPU groups within it, and whether its groups are still there to wait on."""

    #: a name for this mesh, the same on every rank of it (``_name_waits``)
    wait_key: str = ""
    #: (world size, every rank of the mesh or None): ``member_ranks``, built once
    _members: Optional[Tuple[int, Optional[Tuple[int, ...]]]] = None
    if TYPE_CHECKING:  # what ``DeviceMesh`` holds and answers
        source: str
        timeout: Optional[timedelta]
        vpp_size: int
        layout: Optional[Layout]
        _layout_only: bool
        _groups: G.GroupTable

        def size(self, name: str) -> int: ...
        def describe(self) -> str: ...

    def _name_waits(self) -> None:
        """Name the mesh for the keys its waits write (``comm.waits.mesh_roll``): its source,
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
        world = G.world_size()
        cached = self._members  # the groups' sizes are fixed: O(world) once
        if cached is None or cached[0] != world:
            size = math.prod(self.size(a) for a in ("dp", "cp", "tp", "pp"))
            self._members = cached = (world, tuple(range(world)) if size == world else None)
        return cached[1]

    def wait_timeout(self) -> timedelta:
        """How long any wait the library adds to a step may last on this mesh's ranks.

        The collectives of ``calculate()`` (sync or async) and the agreements inside
        ``accumulate`` end within it: ranks that arrived raise ``MetricSyncError``
        naming the ranks that did not. Set in one place, alike on every rank: the
        constructor's ``timeout=`` (a ``timedelta`` or seconds), else the environment
        variable ``TWINKLE_METRICS_TIMEOUT_S``, else the timeout given to
        ``init_process_group``, else torch's 30 minutes. It does not change the groups'
        own timeouts (Megatron's ``distributed_timeout_minutes``, DeepSpeed's: 10 minutes
        by default in their training loops): on the job's groups the library keeps its bound
        from the host and never waits on them with a timeout of its own.
        """
        if self.timeout is not None:
            return self.timeout
        text = os.environ.get("TWINKLE_METRICS_TIMEOUT_S")
        if text:
            return _as_timedelta(text, "TWINKLE_METRICS_TIMEOUT_S")
        return G.default_timeout() or timedelta(minutes=30)

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
        held: dict = {}  # one check per group: the data group is often the DP and the host group too
        for n, g in self._groups.items():
            if g is not None and id(g) not in held:
                held[id(g)] = (n, g)
        if not held:
            return
        if not G.dist_ready():
            raise RuntimeError(
                f"{what}: this DeviceMesh (from {self.source}) holds process groups "
                f"({', '.join(sorted(n for n, g in self._groups.items() if g is not None))}) but "
                "torch.distributed is no longer "
                "initialised (destroy_process_group() was called), so nothing would be reduced "
                "and each rank would report its local numbers. Call it before "
                "destroy_process_group(), or build a new mesh after init_process_group.")
        for name, group in held.values():
            if not G.group_alive(group):
                raise RuntimeError(
                    f"{what}: the {name!r} group of this DeviceMesh (from {self.source}) was "
                    "destroyed (destroy_process_group(group)), so it cannot reduce anything; "
                    "build a new mesh after recreating the groups.")

    def host_group(self, group: G.ProcessGroup, create: bool = True) -> G.ProcessGroup:
        """The CPU group that host-known values are exchanged over for the ranks of
        ``group`` (reading its result waits for the network, never for the device).

        ``group`` itself when it is a CPU group; else the source's gloo group over the same
        ranks (Megatron's DP x CP gloo group, when it made one); else a gloo group over its
        ranks that the library makes the first time any mesh asks (``G.gloo_group``: those
        ranks alone take part, so every rank of ``group`` must ask at the same point, as for
        a collective over it; connected lazily; its own timeout the bound), unless
        ``create=False``. ``None`` for a group of one rank, or when no CPU group can be had
        (callers then exchange on ``group`` itself and read the result back).
        """
        if group is None or G.group_size(group) <= 1:
            return None
        if G.is_cpu_group(group):
            return group
        cpu_data = self._groups["dp_cp_cpu"]
        ranks = tuple(G.group_ranks(group))
        if cpu_data is not None and tuple(G.group_ranks(cpu_data)) == ranks:
            return cpu_data
        return _made_host_group(ranks, self.wait_timeout() if create else None)


def _made_host_group(ranks: Tuple[int, ...], timeout: Optional[timedelta]) -> G.ProcessGroup:
    """The gloo group over ``ranks`` made for host exchanges in this world (made now unless
    ``timeout`` is None); ``None`` when there is none."""
    table = G.world_state().host_groups
    with G.WORLD_LOCK:
        group = table.get(ranks)
        if group is G.DESTROYED:
            group = None
        if group is None and timeout is not None:
            group = G.gloo_group(ranks, timeout)
            table[ranks] = group
    return group


@overload
def _as_timedelta(value: None, name: str = ...) -> None: ...
@overload
def _as_timedelta(value: Union[timedelta, float, str], name: str = ...) -> timedelta: ...


def _as_timedelta(value: Any, name: str = "timeout") -> Optional[timedelta]:
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


_M = TypeVar("_M", bound=BoundedWaits)


def _timed(mesh: _M, timeout: Timeout) -> _M:
    """``mesh`` with the library's wait bound ``timeout`` (kept when ``None``)."""
    if timeout is not None:
        mesh.timeout = _as_timedelta(timeout)
    return mesh
