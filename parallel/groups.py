"""Small helpers over torch.distributed that treat "no group" as "one rank".

A group of ``None`` always means "this axis has one rank: no collective".
WORLD is passed explicitly as ``torch.distributed.group.WORLD``.
"""
from __future__ import annotations

import os
import threading
import weakref
from collections.abc import MutableMapping
from datetime import timedelta
from types import MappingProxyType
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

ProcessGroup = Optional["dist.ProcessGroup"]
#: ``wait(work)`` of a collective run asynchronously: returns once it is done
Wait = Optional[Callable[[Any], Any]]


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
    return list(dist.get_process_group_ranks(group))


def held_by_me(made: Any) -> ProcessGroup:
    """What ``dist.new_group`` returned, as this rank holds it: the group, or None on a rank
    outside it (torch's ``GroupMember.NON_GROUP_MEMBER``, an int: typed so since torch 2.14)."""
    return None if isinstance(made, int) else made


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


def all_gather_rows(buf: torch.Tensor, group: ProcessGroup, wait: Wait = None) -> torch.Tensor:
    """Gather a 1-D buffer from every rank of ``group`` into ``[group size, len]``.

    One collective; none for a group of one rank. ``wait``: run it asynchronously and
    hand its work to ``wait(work)``, which returns once it is done (a bounded wait).
    """
    if group is not None and not dist_ready():
        raise RuntimeError("the process groups were destroyed (destroy_process_group()) before this "
                           "collective over them")
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


def all_gather_bytes(data: bytes, group: ProcessGroup, wait: Wait = None) -> List[bytes]:
    """Every rank's ``data`` over ``group``, in group order: two gathers (sizes, then the
    bytes padded to the longest); ``wait`` as for ``all_gather_rows``."""
    if group is None:
        return [data]
    device = comm_device(group)
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = all_gather_rows(n, group, wait=wait).flatten().tolist()
    buf = torch.zeros(max(sizes), dtype=torch.uint8)
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[:0]
    rows = all_gather_rows(buf.to(device), group, wait=wait).cpu()
    return [bytes(rows[i, :s].tolist()) for i, s in enumerate(sizes)]


# ------------------------------------------------------------------ torch's private fields
# torch 2.13/2.14 keep no public getter for these; each is read in this one function, and
# tests/package/test_guest.py fails when torch moves it.
def group_timeout(group: ProcessGroup) -> Optional[timedelta]:
    """The collective timeout of ``group``, or ``None`` if unknown.

    ``init_process_group(timeout=...)`` and ``new_group(timeout=...)`` store it in each
    backend's options (``pg._get_backend(device).options._timeout``); ``None`` when that
    moves.
    """
    if group is None:
        return None
    try:
        for device in group._device_types:
            timeout = group._get_backend(device).options._timeout
            if timeout is not None:
                return timeout
    except (AttributeError, RuntimeError, TypeError):
        pass
    return None


def default_timeout() -> Optional[timedelta]:
    """The collective timeout of the default (WORLD) group, or ``None`` if unknown."""
    return group_timeout(dist.group.WORLD) if dist_ready() else None


def group_store(group: ProcessGroup) -> Optional[dist.Store]:
    """The key-value store of ``group`` (``ProcessGroup.get_group_store()``), or ``None``."""
    if group is None or not dist_ready():
        return None
    try:
        return group.get_group_store()
    except (AttributeError, RuntimeError):
        return None


def group_name(group: ProcessGroup) -> str:
    """torch's name of ``group``: the same on every rank of it."""
    return str(getattr(group, "group_name", "") or "")


def group_alive(group: ProcessGroup) -> bool:
    """Whether ``group`` is still registered with torch.distributed (not destroyed).

    A dictionary lookup (``get_backend``), no collective.
    """
    if group is None:
        return True
    if group is DESTROYED or not dist_ready():
        return False
    try:
        dist.get_backend(group)
    except (ValueError, RuntimeError, KeyError):
        return False
    return True


# ------------------------------------------------------------------ the world's record
class WorldState:
    """What the library keeps about one world (one ``init_process_group``, up to its
    ``destroy_process_group()``), alike on every rank: a new world starts afresh.

    ``meshes``: the meshes of each kind built so far (``DeviceMesh.wait_key``);
    ``serials``: the groups of each name met so far, and ``calls``: the calls of each kind
    on each mesh (the keys of ``twinkle_metrics.comm.waits``); ``host_groups``: the gloo
    groups made for host exchanges, by ranks (``DeviceMesh.host_group``); ``made``: every
    group the library made itself (held weakly, as torch's registry holds them)."""

    def __init__(self) -> None:
        self.meshes: Dict[str, int] = {}
        self.serials: Dict[str, int] = {}
        self.calls: Dict[str, int] = {}
        self.host_groups = GroupTable()
        self.made: "weakref.WeakSet" = weakref.WeakSet()


_WORLDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # WORLD -> WorldState
#: guards every ``WorldState`` (the asynchronous calculate's thread reads them too)
WORLD_LOCK = threading.RLock()


def world_state() -> WorldState:
    """This world's ``WorldState`` (a throwaway one without torch.distributed)."""
    world = dist.group.WORLD if dist_ready() else None
    if world is None:
        return WorldState()
    with WORLD_LOCK:
        state = _WORLDS.get(world)
        if state is None:
            state = _WORLDS[world] = WorldState()
        return state


def made_here(group: ProcessGroup) -> bool:
    """Whether the library made ``group`` (every other group is the user's: the library never
    waits on one with a timeout, aborts, barriers or destroys it)."""
    return group is not None and group in world_state().made


#: torch reads it at every gloo group it builds (since 2.8, pytorch/pytorch #150801): the
#: group then connects a pair of ranks when a collective first needs it, not all pairs at once
LAZY_GLOO = "TORCH_GLOO_LAZY_INIT"


def gloo_group(ranks: Iterable[int], timeout: Optional[timedelta]) -> ProcessGroup:
    """A gloo group over ``ranks`` (this rank among them) with ``timeout``, made by those ranks
    alone (``use_local_synchronization=True``: each must ask at the same point of its
    collectives over them) and connected lazily where torch can (``TORCH_GLOO_LAZY_INIT``,
    torch 2.8 and later): building it makes one store write and no connection; a ring
    collective then connects this rank to its two neighbours only. ``None`` when no gloo
    group can be made (torch without gloo; torchcomms, which refuses local synchronisation)."""
    lazy = _LAZY_TORCH and LAZY_GLOO not in os.environ
    try:
        with WORLD_LOCK:  # the variable is the process's: set only around this call
            if lazy:
                os.environ[LAZY_GLOO] = "1"
            try:
                group = held_by_me(dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True,
                                                  timeout=timeout))
            finally:
                if lazy:
                    del os.environ[LAZY_GLOO]
    except (RuntimeError, ValueError, NotImplementedError):
        return None
    if group is not None:
        world_state().made.add(group)
    return group


_LAZY_TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 8)


# ------------------------------------------------------------------ holding groups
class _Destroyed:
    """What a table of groups holds for a group torch let go (``destroy_process_group()``)."""

    def __repr__(self) -> str:
        return "<destroyed process group>"


#: a group torch's registry dropped (destroyed) and nothing else kept
DESTROYED = _Destroyed()


class GroupTable(MutableMapping):
    """A mapping of groups that never keeps a group alive past torch: one registered with
    torch.distributed (``new_group``, WORLD) is held by a weak reference, so the object goes
    when ``destroy_process_group()`` drops it (its threads and connections with it), not
    at interpreter exit; one torch does not know (built directly, or ``None``) is held as
    it is. Reading a group that went gives ``DESTROYED``."""

    def __init__(self, items: Mapping[Any, ProcessGroup] = MappingProxyType({})) -> None:
        self._held: Dict[Any, Any] = {}
        for key, group in items.items():
            self[key] = group

    def __setitem__(self, key: Any, group: ProcessGroup) -> None:
        self._held[key] = weakref.ref(group) if group is not None and group_alive(group) else group

    def __getitem__(self, key: Any) -> Any:
        """The group (or None), or ``DESTROYED``."""
        held = self._held[key]
        if isinstance(held, weakref.ref):
            group = held()
            return DESTROYED if group is None else group
        return held

    def __delitem__(self, key: Any) -> None:
        del self._held[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._held)

    def __len__(self) -> int:
        return len(self._held)

    def __reduce__(self) -> Tuple[type, Tuple[Dict[Any, Any]]]:  # copy and pickle see the groups
        return (type(self), (dict(self.items()),))
