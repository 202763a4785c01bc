"""The instrument of ``bench_footprint``: what a rank holds and what it asked the store.

* ``CountingStore``: a ``torch.distributed.Store`` that counts every request made through it,
  by kind, and the value bytes each moves, then forwards it to the real store. Given to
  ``init_process_group(store=...)`` it sees every request of every group of the job (torch
  wraps it in a ``PrefixStore`` per group), torch's, megatron-core's and the library's.
* ``snapshot()``: that count, the sockets among ``/proc/self/fd``, the threads of the
  process, and the process groups in torch's registry.
* ``rank_phases()``: the benchmark's phases on one rank, each measured as a delta.
"""
from __future__ import annotations

import collections
import datetime
import os
from typing import Any, Dict, List, Optional, Set

import torch.distributed as dist

#: the keys the library writes itself (``twinkle_metrics.comm.waits``: a wait that ran long)
LIBRARY_KEYS = "twinkle_metrics/"


class CountingStore(dist.Store):
    """``inner`` with every request counted: ``counts[kind]``, ``nbytes[kind]`` (value bytes
    sent or received), ``marks`` (requests on keys the library writes itself)."""

    def __init__(self, inner: dist.Store):
        super().__init__()
        self._inner = inner
        self.counts: collections.Counter = collections.Counter()
        self.nbytes: collections.Counter = collections.Counter()
        self.marks = 0

    def _count(self, kind: str, keys, nbytes: int = 0) -> None:
        self.counts[kind] += 1
        self.nbytes[kind] += nbytes
        keys = [keys] if isinstance(keys, str) else keys
        self.marks += any(LIBRARY_KEYS in k for k in keys)

    def set(self, key, value):
        self._count("set", key, len(value))
        return self._inner.set(key, value)

    def get(self, key):
        value = self._inner.get(key)
        self._count("get", key, len(value))
        return value

    def add(self, key, amount):
        self._count("add", key)
        return self._inner.add(key, amount)

    def compare_set(self, key, expected, desired):
        self._count("compare_set", key, len(expected) + len(desired))
        return self._inner.compare_set(key, expected, desired)

    def wait(self, keys, timeout=None):
        self._count("wait", keys)
        return self._inner.wait(keys) if timeout is None else self._inner.wait(keys, timeout)

    def check(self, keys):
        self._count("check", keys)
        return self._inner.check(keys)

    def delete_key(self, key):
        self._count("delete_key", key)
        return self._inner.delete_key(key)

    def num_keys(self):
        self._count("num_keys", [])
        return self._inner.num_keys()

    def append(self, key, value):
        self._count("append", key, len(value))
        return self._inner.append(key, value)

    def multi_get(self, keys):
        values = self._inner.multi_get(keys)
        self._count("multi_get", keys, sum(len(v) for v in values))
        return values

    def multi_set(self, keys, values):
        self._count("multi_set", keys, sum(len(v) for v in values))
        return self._inner.multi_set(keys, values)

    def has_extended_api(self):
        return self._inner.has_extended_api()

    def set_timeout(self, timeout):
        return self._inner.set_timeout(timeout)


_STORE: Optional[CountingStore] = None


def counting_init(rank: int, world: int, host: str, port: int, backend: str = "gloo",
                  timeout_s: float = 600) -> None:
    """``common.run_ranks``'s ``init``: the default group on ``backend`` (``"standin"``:
    ``twinkle_metrics.testing.standin``) over a ``CountingStore`` of the parent's store."""
    global _STORE
    if backend == "standin":
        from twinkle_metrics.testing import standin

        standin.register()
    timeout = datetime.timedelta(seconds=timeout_s)
    _STORE = CountingStore(dist.TCPStore(host, port, is_master=False, timeout=timeout))
    dist.init_process_group(backend, store=_STORE, rank=rank, world_size=world, timeout=timeout)


# ----------------------------------------------------------------------- what a rank holds
def torch_groups() -> Dict[str, int]:
    """``member``: the process groups this rank is in, WORLD included; ``named``: the groups
    torch has numbered in this world, this rank in them or not (every ``new_group`` call
    over WORLD; one with ``use_local_synchronization=True`` takes a hashed name instead).

    torch keeps no public count: ``_world.pg_map`` (its registry; a group this rank is not
    in is never entered) and ``_world.group_count`` are private in torch 2.13 and 2.14. The
    one private read here."""
    world = dist.distributed_c10d._world
    return {"member": len(world.pg_map), "named": world.group_count}


def sockets() -> Set[str]:
    """The open sockets of this process: the ``socket:[inode]`` targets of ``/proc/self/fd``."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the fd of the listing itself, closed by now
            continue
        if target.startswith("socket:"):
            out.add(target)
    return out


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def snapshot() -> Dict[str, Any]:
    """What this rank holds and has asked the store so far (a barrier over WORLD first:
    every rank takes it at the same point, peers' connections included)."""
    dist.barrier()
    store, groups = _STORE, torch_groups()
    return {"sockets": sockets(), "threads": threads(), "groups": groups["member"], "named": groups["named"],
            "store": dict(store.counts), "store_bytes": sum(store.nbytes.values()), "marks": store.marks}


def delta(before: Dict[str, Any], after: Dict[str, Any]) -> Dict[str, Any]:
    kinds = set(before["store"]) | set(after["store"])
    by_kind = {k: after["store"].get(k, 0) - before["store"].get(k, 0) for k in sorted(kinds)}
    # opened in the phase and still open; a socket of an earlier phase closed in it is counted apart
    return {"sockets": len(after["sockets"] - before["sockets"]),
            "sockets_closed": len(before["sockets"] - after["sockets"]),
            "threads": after["threads"] - before["threads"],
            "groups": after["groups"] - before["groups"], "new_groups_over_world": after["named"] - before["named"],
            "store_requests": sum(by_kind.values()), "store_by_kind": {k: v for k, v in by_kind.items() if v},
            "store_bytes": after["store_bytes"] - before["store_bytes"],
            "store_marks": after["marks"] - before["marks"]}


# ---------------------------------------------------------------------------- the phases
#: the phases, in order, as the table names them
PHASES = ("megatron", "mesh", "calculate", "calculate_more")


def _collection(mesh):
    """The 7 core metrics (``suite.CORE``) in one collection; Accuracy vocab-parallel, as
    under Megatron, where the logits are sharded over TP."""
    from benchmarks import suite
    from twinkle_metrics import MetricCollection

    classes = suite.ours_classes(suite.CORE)
    return MetricCollection({n: classes[n](vocab_parallel=True) if n == "Accuracy" else classes[n]()
                             for n in suite.CORE}, device_mesh=mesh)


def _feed(coll, mesh, step: int) -> None:
    """This rank's microbatch: the same on the TP replicas of a data rank (they see the same
    tokens), Accuracy given this rank's vocab shard of the logits."""
    from benchmarks import suite

    b = suite.make_batch(1000 * step + mesh.data_rank, step=step)
    width = b["logits"].shape[-1] // mesh.tp_size
    b["logits"] = b["logits"][..., mesh.tp_rank * width:(mesh.tp_rank + 1) * width]
    for name in suite.CORE:
        suite._accumulate_ours(name, coll[name], b)


def rank_phases(tp: int, calls: int, bound_s: Optional[float]) -> Dict[str, Any]:
    """One rank's deltas over the phases (``PHASES``): megatron-core's
    ``initialize_model_parallel(tp, create_gloo_process_groups=False)``, the library's
    ``DeviceMesh.from_megatron()``, ``calls`` x (accumulate + ``calculate()``) of the core
    metrics (the collection built first), and ``calls`` more. ``bound_s``: the library's
    wait bound (``TWINKLE_METRICS_TIMEOUT_S``), else the default group's timeout."""
    from megatron.core import parallel_state as ps

    from parallel import DeviceMesh

    if bound_s is not None:
        os.environ["TWINKLE_METRICS_TIMEOUT_S"] = str(bound_s)
    marks: List[Dict[str, Any]] = [snapshot()]
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)
    try:
        marks.append(snapshot())
        mesh = DeviceMesh.from_megatron()
        marks.append(snapshot())
        coll = _collection(mesh)
        keys = 0
        for rounds in range(2):
            for i in range(calls):
                _feed(coll, mesh, rounds * calls + i)
                keys = len(coll.calculate())
            marks.append(snapshot())
        out = {"deltas": {p: delta(a, b) for p, a, b in zip(PHASES, marks, marks[1:])},
               "result_keys": keys, "mesh": mesh.describe(), "bound_s": mesh.wait_timeout().total_seconds(),
               "backend": str(dist.get_backend())}
        if out["backend"] == "standin":  # what the library did on groups it did not make (must be none)
            from twinkle_metrics.testing import standin

            out["standin_calls"] = [c._asdict() for c in standin.calls()]
        return out
    finally:
        ps.destroy_model_parallel()
