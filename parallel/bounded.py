"""CPU groups that give up within the library's wait bound, made when a mesh is built.

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

import pickle
from datetime import timedelta
from typing import Dict, List, Optional, Sequence, Tuple

import torch
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
        wanted = [r for ranks in exchange(own, bound, "DeviceMesh") for r in ranks]
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
    device = G.comm_device(world)
    data = pickle.dumps(obj)

    def wait(work):
        try:
            work.wait(timeout) if timeout is not None else work.wait()
        except RuntimeError as exc:
            raise RuntimeError(f"{what}: not every rank of the world came within "
                               f"{timeout.total_seconds() if timeout else '?'} s to make the library's "
                               "groups (every rank must build the same meshes, in the same order, "
                               "and call calculate(async_op=True) at the same points)") from exc

    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = G.all_gather_rows(n, world, wait=wait).flatten().tolist()
    buf = torch.zeros(max(sizes), dtype=torch.uint8)
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    rows = G.all_gather_rows(buf.to(device), world, wait=wait).cpu()
    return [pickle.loads(bytes(rows[i, :s].tolist())) for i, s in enumerate(sizes)]
