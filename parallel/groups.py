"""Small helpers over torch.distributed that treat "no group" as "one rank".

A group of ``None`` always means "this axis has one rank: no collective".
WORLD is passed explicitly as ``torch.distributed.group.WORLD``.
"""
from __future__ import annotations

import socket
from typing import List, Optional

import torch
import torch.distributed as dist

ProcessGroup = Optional["dist.ProcessGroup"]


def free_port() -> int:
    """A free TCP port on the loopback interface, for a single-host rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dist_ready() -> bool:
    """True when torch.distributed is usable and initialised."""
    return dist.is_available() and dist.is_initialized()


def global_rank() -> int:
    return dist.get_rank() if dist_ready() else 0


def world_size() -> int:
    return dist.get_world_size() if dist_ready() else 1


def group_size(group: ProcessGroup) -> int:
    """Size of ``group``; 1 for ``None`` or without torch.distributed (never 0)."""
    if group is None or not dist_ready():
        return 1
    return dist.get_world_size(group)


def group_rank(group: ProcessGroup) -> int:
    """This rank's index inside ``group``; 0 for ``None`` or without torch.distributed."""
    if group is None or not dist_ready():
        return 0
    return dist.get_rank(group)


def group_ranks(group: ProcessGroup) -> List[int]:
    """Global ranks of ``group`` in group order; ``[this rank]`` for ``None``."""
    if group is None or not dist_ready():
        return [global_rank()]
    for g, _, ranks in _owned:
        if g is group:
            return list(ranks)
    return list(dist.get_process_group_ranks(group))


def normalize(group: ProcessGroup) -> ProcessGroup:
    """Map groups of one rank (and anything without torch.distributed) to ``None``."""
    return None if group_size(group) <= 1 else group


def is_cpu_group(group: ProcessGroup) -> bool:
    """Whether collectives on ``group`` run on host tensors (gloo, mpi)."""
    if group is None or not dist_ready():
        return False
    backend = str(dist.get_backend(group)).lower()
    return "gloo" in backend or "mpi" in backend


def comm_device(group: ProcessGroup) -> torch.device:
    """The device a collective on ``group`` needs its tensors on."""
    if group is None or not dist_ready():
        return torch.device("cpu")
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if "cpu:gloo" in backend or backend == "gloo" or "mpi" in backend:
        return torch.device("cpu")
    if torch.cuda.is_available() and "cuda" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_rows(buf: torch.Tensor, group: ProcessGroup, wait=None) -> torch.Tensor:
    """Gather a 1-D buffer from every rank of ``group`` into ``[group size, len]``.

    One collective; none for a group of one rank. ``wait``: run it asynchronously and
    hand its work to ``wait(work)``, which returns once it is done (a bounded wait).
    """
    n = group_size(group)
    if n == 1:
        return buf.unsqueeze(0)
    out = torch.empty(n * buf.numel(), dtype=buf.dtype, device=buf.device)
    # torch >= 2.13 names it all_gather_single; older releases all_gather_into_tensor.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work = gather(out, buf.contiguous(), group=group, async_op=wait is not None)
    if wait is not None:
        wait(work)
    return out.view(n, buf.numel())


# ------------------------------------------------------------------ compat
def group_timeout(group: ProcessGroup):
    """The collective timeout of ``group``, or ``None`` if unknown.

    torch 2.13 keeps no public getter: ``init_process_group(timeout=...)`` stores it in
    each backend's options (``pg._get_backend(device).options._timeout``), while
    ``new_group(timeout=None)`` falls back to torch's 30-minute default. This is the
    one place that reads the private field; ``None`` (torch's default) when it moves.
    """
    for g, timeout, _ in _owned:
        if g is group:
            return timeout
    try:
        for device in group._device_types:
            timeout = group._get_backend(device).options._timeout
            if timeout is not None:
                return timeout
    except (AttributeError, RuntimeError, TypeError):
        pass
    return None


def default_timeout():
    """The collective timeout of the default (WORLD) group, or ``None`` if unknown."""
    return group_timeout(dist.group.WORLD) if dist_ready() else None


def default_store():
    """The key-value store of the default group (``init_process_group``'s), or ``None``.

    torch keeps no public getter either; ``bounded`` waits write a few keys to it to name
    the ranks that never arrived. ``None`` when it moves: the waits stay bounded, the
    message then cannot name the absent ranks.
    """
    if not dist_ready():
        return None
    try:
        from torch.distributed import distributed_c10d as c10d

        return c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def group_alive(group: ProcessGroup) -> bool:
    """Whether ``group`` is still registered with torch.distributed (not destroyed).

    A dictionary lookup (``get_backend``), no collective.
    """
    if group is None:
        return True
    if not dist_ready():
        return False
    try:
        dist.get_backend(group)
    except (ValueError, RuntimeError, KeyError):
        return False
    return True


_twins = {}  # tuple(ranks) -> gloo group; shared by every mesh so a twin is created once


def cpu_twin(group: ProcessGroup, timeout=None) -> ProcessGroup:
    """A CPU (gloo) group over the ranks of ``group``: ``group`` itself when it is a CPU
    group, else a cached gloo twin created on first use, or ``None`` when one cannot be
    made (callers then fall back to the device).

    The twin is created with ``use_local_synchronization=True``, so only the ranks of
    ``group`` take part (torch names such a group by a hash of its ranks, so twins of
    different TP groups created concurrently do not collide). Every rank of ``group``
    must ask for it at the same point of its sequence of collectives, as for any
    collective over ``group``; the metrics do (their first agreement over ``group``).
    """
    if group is None or group_size(group) <= 1:
        return None
    if is_cpu_group(group):
        return group
    key = tuple(group_ranks(group))
    twin = _twins.get(key)
    if twin is not None and group_alive(twin):
        return twin
    try:
        twin = dist.new_group(list(key), backend="gloo", use_local_synchronization=True,
                              timeout=timeout or default_timeout())
    except (RuntimeError, ValueError, NotImplementedError):  # no gloo, or torchcomms
        return None
    _twins[key] = twin
    return twin


def within(group: ProcessGroup, timeout) -> bool:
    """Whether a collective on ``group`` gives up within ``timeout`` (a ``timedelta``). A
    group of unknown timeout has torch's 30 minutes."""
    own = group_timeout(group)
    return own is not None and own <= timeout


def owned_gloo_group(ranks, timeout, name: str):
    """A gloo group over ``ranks`` with ``timeout`` that only the library uses, kept out of
    torch's registry of groups.

    torch names a group created over some ranks only (``use_local_synchronization``) by
    its ranks and the number of groups each rank holds, so a group that ranks create
    at different times, or again after one was destroyed, can meet stale peers; and a
    registered group of ours would shift the names of the user's own such groups. This
    one lives under ``name`` (``twinkle_metrics/...``, the same on every rank of
    ``ranks`` and never reused) in the default store, and is used through its methods
    (``barrier()``), not ``torch.distributed``'s functions. Only ``ranks`` take part.
    Dropped by ``release_owned`` (at exit, or at ``destroy_process_group()``).
    """
    me = global_rank()
    store = dist.PrefixStore(f"{name}/", default_store())
    group = dist.ProcessGroupGloo(store, list(ranks).index(me), len(ranks), timeout)
    _owned.append((group, timeout, tuple(ranks)))
    return group


_owned: list = []  # (group, timeout, ranks) of the groups owned_gloo_group made, in creation order


def is_owned(group) -> bool:
    """Whether ``group`` is one ``owned_gloo_group`` made: used through its own methods,
    since torch's functions do not know it."""
    return group is not None and any(group is g for g, _, _ in _owned)


def release_owned() -> None:
    """Destroy what this module created (twins, private twins, owned groups), newest first,
    and forget it; groups already destroyed are skipped. Call it before the groups'
    backends go (``destroy_process_group()`` of WORLD, interpreter exit)."""
    made = list(_twins.values()) + [g for cache in _private.values() for g in cache.values()]
    _owned.clear()  # unregistered: dropping the last reference ends them
    _twins.clear()
    _private.clear()
    if not dist_ready():
        return
    seen = set()
    for group in reversed(made):
        if group is None or id(group) in seen or group is dist.group.WORLD:
            continue
        seen.add(id(group))
        if group_alive(group):
            try:
                dist.destroy_process_group(group)
            except (RuntimeError, ValueError, KeyError):
                pass


_private: dict = {}  # (purpose, timeout) -> {tuple(ranks): group used by one user only}


def private_twins_ready(groups, purpose: str = "async", timeout=None) -> bool:
    """Whether ``private_twins(groups, purpose, timeout)`` has every twin already (then it
    is not collective)."""
    cache = _private.setdefault((purpose, timeout), {})
    for g in groups:
        if g is None or group_size(g) <= 1:
            continue
        twin = cache.get(tuple(group_ranks(g)))
        if twin is None or not group_alive(twin):
            return False
    return True


def private_twins(groups, purpose: str = "async", timeout=None) -> dict:
    """Second groups over the ranks of each of ``groups``, with their backends, that only
    one user issues collectives on: the background thread of an asynchronous calculate
    (``purpose="async"``: their collectives cannot interleave with the training loop's
    on the originals, whatever the timing), or the library's waits on CPU groups whose
    own timeout is longer than its bound (``"bounded"``, with ``timeout``). Returns
    ``{id(group): twin}`` (``None`` for groups of one rank); cached per purpose and
    timeout (``None``: the default group's).

    Creating groups is collective over WORLD: when this rank lacks a twin, every rank
    lists its own groups (one ``all_gather_object`` over WORLD) and all create the
    twins of every listed group, in one order, as ``new_group`` requires. So every
    rank must come here at the same point of its program, the first time it uses a
    set of groups (meshes are built alike on every rank, and so are the calls).
    """
    cache = _private.setdefault((purpose, timeout), {})
    if private_twins_ready(groups, purpose, timeout):
        return {id(g): None if g is None or group_size(g) <= 1 else cache[tuple(group_ranks(g))]
                for g in groups}
    mine = [(tuple(group_ranks(g)), str(dist.get_backend(g))) for g in groups
            if g is not None and group_size(g) > 1]
    everyone: list = [None] * world_size()
    dist.all_gather_object(everyone, mine)
    for ranks, backend in sorted({entry for entries in everyone for entry in entries}):
        twin = dist.new_group(list(ranks), backend=backend, timeout=timeout or default_timeout())
        if global_rank() in ranks:
            cache[ranks] = twin
    return {id(g): None if g is None or group_size(g) <= 1 else cache[tuple(group_ranks(g))]
            for g in groups}
