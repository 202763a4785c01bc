"""``Transport``: where one call's collectives run and how long they may wait.

A sync runs on two groups of the mesh, the data group (DP x CP: ranks that hold disjoint
data) and the model-parallel group ``mp`` (TP x PP: ranks that hold one rank of each data
group), on the groups themselves: the job's device groups (NCCL) on a GPU job, as
Megatron's own loss reduction does, its gloo groups on a CPU job. Its buffers live on the
device those groups need (``parallel.comm_device``); the host keeps the bound
(``comm.waits``), reads the device once at the end (``host``), and never waits on a group
with a timeout, aborts, barriers or destroys one.

An asynchronous ``calculate()`` syncs on twins of the two groups instead (groups over the
same ranks, that nothing else uses, made by those ranks alone when first needed:
``twins``), so that its collectives on the background thread never interleave with the
training loop's on the real groups.

Example (what ``calculate()`` does on one rank)::

    t = Transport("calculate()", mesh, mesh.data_group)
    rows = t.gather(buf, t.data)       # every data rank's buffer (on the device: no host wait)
    row = t.host(t.gather(merged, t.mp))  # the TP x PP rows, read once by the host
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, List, Tuple

import torch
import torch.distributed as dist

from parallel import DeviceMesh, comm_device
from parallel import groups as G
from twinkle_metrics.comm import links, waits

#: ``Transport``'s default TP x PP group: the mesh's
MESH = object()


class Transport:
    """The groups of one call (``data``: DP x CP, ``mp``: TP x PP; ``None`` for an axis
    of one rank), the device their buffers live on, and the bound of its waits: the
    mesh's ``wait_timeout()``, with the roll of the mesh's ranks that names the ranks that
    never came (``waits.mesh_roll``).

    Args:
        what: the call, named in errors (``"calculate()"``).
        mesh: the ``DeviceMesh`` the call runs over.
        data: the data group (the metrics' ``data_group()``).
        mp: the TP x PP group (``None``: none); default (``MESH``) the mesh's.
        roll: name absent ranks over every rank of the mesh (a call every rank makes).
    """

    def __init__(self, what: str, mesh: DeviceMesh, data: G.ProcessGroup, mp: Any = MESH, *,
                 roll: bool = True) -> None:
        self.what, self.mesh = what, mesh
        self.data = G.normalize(data)
        self.mp = G.normalize(mesh.mp_group if mp is MESH else mp)
        self.device = comm_device(self.data if self.data is not None else self.mp)
        self.timeout = mesh.wait_timeout()
        has_groups = self.data is not None or self.mp is not None
        self.roll = waits.mesh_roll(what, mesh) if roll and has_groups else None
        self._pending: List[Tuple[Any, G.ProcessGroup]] = []  # device works the host has not waited on

    def __repr__(self) -> str:
        def name(g: G.ProcessGroup) -> str:
            return "-" if g is None else f"{G.group_ranks(g)} ({dist.get_backend(g)})"
        return (f"Transport({self.what}: data {name(self.data)}, mp {name(self.mp)}, on {self.device}, "
                f"within {self.timeout.total_seconds():g} s)")

    # ------------------------------------------------------------- collectives
    def gather(self, buf: torch.Tensor, group: G.ProcessGroup) -> torch.Tensor:
        """Every rank's 1-D ``buf`` over ``group`` as ``[ranks, len]`` (one collective)."""
        buf = buf if group is None else buf.to(comm_device(group))
        return G.all_gather_rows(buf, group, wait=lambda work: self._after(work, group, buf))

    def all_reduce(self, t: torch.Tensor, group: G.ProcessGroup, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
        """``t`` reduced in place over ``group`` with ``op`` (one collective)."""
        if G.group_size(group) > 1:
            self._after(dist.all_reduce(t, op=op, group=group, async_op=True), group, t)
        return t

    def gather_bytes(self, data: bytes, group: G.ProcessGroup) -> List[bytes]:
        """Every rank's ``data`` over ``group`` (two collectives), read by the host."""
        on_host = comm_device(group).type == "cpu"
        return G.all_gather_bytes(data, group, wait=lambda work: self.wait(work, group, on_host))

    def wait(self, work: Any, group: G.ProcessGroup, on_host: bool = True) -> None:
        """Return once ``work`` on ``group`` is done (bounded and named: ``waits.wait``);
        ``on_host``: its tensors are host tensors."""
        waits.wait(work, group, self.what, lambda: self.mesh.group_label(group), self.timeout, self.roll, on_host)

    def _after(self, work: Any, group: G.ProcessGroup, t: torch.Tensor) -> None:
        if t.device.type == "cpu":
            self.wait(work, group)  # the host reads host tensors next: it waits for them now
        else:  # the device orders what follows after the collective; the host waits once, in host()
            waits.check_open(group)
            work.wait()
            self._pending.append((work, group))

    def host(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the host: the one device-to-host read of a sync, once every collective
        issued on the device is done (each wait bounded and named)."""
        pending, self._pending = self._pending, []
        for work, group in pending:
            self.wait(work, group, on_host=False)
        return t.cpu()


# ---------------------------------------------------------------- asynchronous twins
def twins(mesh: DeviceMesh, data: G.ProcessGroup) -> Tuple[G.ProcessGroup, G.ProcessGroup]:
    """Twins of the data group ``data`` and of the mesh's TP x PP group: groups over the
    same ranks, with the same backend, that only the background thread of an asynchronous
    ``calculate()`` uses. Made the first time, by the ranks of each group alone
    (``use_local_synchronization``), data group first: every rank of the mesh comes here
    at the same point of its program (``calculate(async_op=True)``); a gloo twin is
    connected lazily, with the mesh's bound as its timeout. Raises ``RuntimeError`` when
    torch cannot make them (torchcomms refuses local synchronisation)."""
    return _twin(G.normalize(data), mesh), _twin(G.normalize(mesh.mp_group), mesh)


def _twin(group: G.ProcessGroup, mesh: DeviceMesh) -> G.ProcessGroup:
    if group is None:
        return None
    with links.LOCK:  # the twin is held weakly, as torch's registry holds it
        held = links.link(group).twin
    twin = held() if held is not None else None
    if twin is not None:
        return twin
    ranks = G.group_ranks(group)
    backend = str(dist.get_backend(group))
    if G.is_cpu_group(group):
        twin = G.gloo_group(ranks, mesh.wait_timeout())
    else:
        try:
            twin = G.held_by_me(dist.new_group(ranks, backend=backend, use_local_synchronization=True,
                                               timeout=G.group_timeout(group)))
        except (RuntimeError, ValueError, NotImplementedError):
            twin = None
    if twin is None:
        raise RuntimeError(f"calculate(async_op=True): torch could not make a private {backend} group over "
                           f"ranks {waits.ranges(ranks)} for the background sync; call calculate() "
                           "without async_op")
    with links.LOCK:
        links.link(group).twin = weakref.ref(twin)
    G.world_state().made.add(twin)
    return twin


def on_twins(mesh: DeviceMesh, data: G.ProcessGroup) -> Callable[[str], Transport]:
    """A maker of the ``Transport`` an asynchronous calculate of ``data``'s metrics syncs
    on (``twins``, made now, on the caller's thread)."""
    data_twin, mp_twin = twins(mesh, data)

    def make(what: str) -> Transport:
        return Transport(what, mesh, data_twin, mp_twin)

    return make
