"""``DistPool``: a pool of real gloo ranks on this host, started once and reused.

``DistPool(world).run(fn, *args)`` calls ``fn(*args)`` on every rank (``fn`` must be
picklable: a module-level function, or a ``functools.partial`` of one) and returns
the per-rank results in rank order. A failure on any rank fails the call with that
rank's traceback, and the pool is rebuilt before the next call (``restart_on_failure``)
so one broken job cannot poison the rest.

Each job runs in a world of its own: a fresh default group, on a part of the pool's
store no earlier job wrote to, destroyed with every group the job created once every
rank is done with the job. torch names a group created over some ranks only (``new_group(...,
use_local_synchronization=True)``, as ``DeviceMesh`` does) by its ranks and the number of
groups the rank holds, so a later job would create one under the same name again and
could read the addresses an earlier job's ranks left in the store: it would connect to a
port that another process may listen on by then. The store itself is hosted by the
process that made the pool (``twinkle_metrics.testing.rendezvous``): no other job on the
host can take its port.

``start_method``: ``"spawn"`` (the default) or ``"fork"``. Forked ranks start in a
fraction of a second (no fresh import of torch); spawned ones also work where the
calling process already holds a process group or runs threads that must not be forked.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from twinkle_metrics.testing import standin
from twinkle_metrics.testing.rendezvous import Rendezvous

WORLD = 8
COLLECTIVE_TIMEOUT_S = 60
#: how long a rank waits in the store for the others at a job's start and end (a stuck job
#: meets the caller's job timeout first)
STORE_TIMEOUT_S = 900


def _worker(rank, world, tasks, results, timeout_s=COLLECTIVE_TIMEOUT_S):
    # The store's address comes once every rank is started (see DistPool._start).
    host, port = tasks.get()
    # MASTER_ADDR/PORT for code that reads them (DeepSpeed's launcher check); the groups use the store
    os.environ.update(OMP_NUM_THREADS="1", MASTER_ADDR=host, MASTER_PORT=str(port),
                      RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import gc

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = timedelta(seconds=timeout_s)
    # the store's own timeout is the groups' (as with env://): some waits on it take no other bound
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    results.put(("ready", rank, True, None))
    while True:
        job = tasks.get()
        if job is None:
            break
        job_id, fn, args, backend = job
        own = dist.PrefixStore(f"job{job_id}", store)
        try:
            if backend == standin.NAME:
                standin.register()
                standin.clear()
            # Connecting the default group may take only the pool's collective timeout (a few
            # seconds in some tests), and a busy host can keep a rank from its queue longer.
            _all_reach(own, "arrived", world)
            dist.init_process_group(backend, store=own, rank=rank, world_size=world, timeout=timeout)
            value = fn(*args)
            if backend == standin.NAME and standin.calls():
                raise AssertionError(f"the library made calls that can harm a user's communicator on a "
                                     f"group it did not make: {standin.calls()}")
            results.put((job_id, rank, True, value))
        except BaseException:  # noqa: BLE001 - report everything to the caller
            results.put((job_id, rank, False, traceback.format_exc()))
        finally:
            # gloo counts a connection as made on the side that opens it once its hello is
            # written: a rank done with the job would close sockets its peers, slower on a
            # busy host, are still accepting ("Connection closed by peer" in their
            # connectFullMesh). So no rank destroys the job's groups before all are done.
            try:
                _all_reach(own, "done", world)
            except Exception:  # noqa: BLE001 - a rank that never came: the caller restarts the pool
                pass
            # Every gloo group keeps two worker threads and a TCP loop thread: a session's few
            # hundred meshes left ~1000 threads per rank that slowed every later multi-process
            # test (the Megatron demo from 35 s to over 240 s).
            if dist.is_initialized():
                dist.destroy_process_group()
            gc.collect()


def _all_reach(store, point, world):
    """Wait, in the store and without a bound of the pool's own, until every rank has
    reached ``point`` of the job."""
    if store.add(point, 1) == world:
        store.set(f"{point}: all", "1")
    store.wait([f"{point}: all"], timedelta(seconds=STORE_TIMEOUT_S))


class DistPool:
    """``world`` gloo ranks on this host (see the module docstring).

    Args:
        world: the number of ranks.
        timeout_s: the ``init_process_group`` timeout of every rank (every collective
            that waits longer raises on its rank).
        start_method: ``"spawn"`` or ``"fork"`` (a ``multiprocessing`` start method).
        restart_on_failure: rebuild the ranks after a failed or timed-out job (else they
            are only killed: call ``close()``).
    """

    def __init__(self, world: int = WORLD, timeout_s: float = COLLECTIVE_TIMEOUT_S, *,
                 start_method: str = "spawn", restart_on_failure: bool = True) -> None:
        self.world = world
        self.timeout_s = timeout_s
        self.start_method = start_method
        self.restart_on_failure = restart_on_failure
        self._procs: List[Any] = []
        self._rendezvous: Optional[Rendezvous] = None
        self._job = 0
        self._start()

    def _start(self) -> None:
        ctx: Any = mp.get_context(self.start_method)  # BaseContext's stub lacks Process, which every context has
        self._tasks = [ctx.Queue() for _ in range(self.world)]
        self._results = ctx.Queue()
        self._procs = [ctx.Process(target=_worker, args=(r, self.world, self._tasks[r], self._results,
                                                         self.timeout_s),
                                   daemon=True) for r in range(self.world)]
        # Every rank starts before the store does: a rank forked while the store's thread
        # serves another rank's connection can inherit a lock that thread held, and hang in
        # its own connection for good (one start in about a hundred did).
        for p in self._procs:
            p.start()
        self._rendezvous = Rendezvous()  # this pool's own store, on a port no other job can take
        for q in self._tasks:
            q.put((self._rendezvous.host, self._rendezvous.port))
        try:
            self._ready(timeout=180)
        except BaseException:
            self.close()
            raise

    def _ready(self, timeout):
        """Wait until every rank has connected to the store; a rank that died on the way
        fails the wait at once, naming its exit code."""
        got: Set[int] = set()
        deadline = time.monotonic() + timeout
        while len(got) < self.world:
            try:
                jid, rank, _, _ = self._results.get(timeout=1)
                if jid == "ready":
                    got.add(rank)
                continue
            except queue.Empty:
                pass
            dead = {r: p.exitcode for r, p in enumerate(self._procs) if r not in got and p.exitcode is not None}
            if dead:
                raise RuntimeError(f"DistPool: ranks {sorted(dead)} exited before they connected "
                                   f"(exit codes {dead}); their stderr says why")
            if time.monotonic() > deadline:
                raise TimeoutError(f"DistPool: ranks {sorted(set(range(self.world)) - got)} did not connect "
                                   f"within {timeout}s (start method {self.start_method!r}: a process forked "
                                   f"while another thread of this one holds a lock can hang; use 'spawn')")

    def _collect(self, job_id, timeout, grace=None):
        """``{rank: (ok, value)}`` of job ``job_id``. ``grace``: once a rank failed, how long
        to wait for the others (ranks left waiting in a collective for the failed one would
        answer only at the collective timeout); the missing ranks are left out."""
        got: Dict[int, Tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        failed_at = None
        while len(got) < self.world:
            wait = deadline - time.monotonic()
            if grace is not None and failed_at is not None:
                wait = min(wait, failed_at + grace - time.monotonic())
                if wait <= 0:
                    return got
            try:
                jid, rank, ok, value = self._results.get(timeout=max(wait, 0.01))
            except queue.Empty:
                if grace is not None and failed_at is not None:
                    return got
                raise TimeoutError(f"ranks {sorted(set(range(self.world)) - set(got))} did not answer "
                                   f"within {timeout}s") from None
            if jid == job_id:
                if not ok and failed_at is None:
                    failed_at = time.monotonic()
                got[rank] = (ok, value)
        return got

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 240, failure_grace: float = 2,
            backend: str = "gloo") -> List[Any]:
        """Run ``fn(*args)`` on every rank; return ``[result of rank 0, ...]``.

        ``backend``: the default group's backend, ``"gloo"`` or ``"standin"``
        (``twinkle_metrics.testing.standin``: gloo that the library takes for a device
        backend; the job fails if the library made a bounded wait, an abort, a barrier or a
        destroy on one of its groups).

        Raises ``AssertionError`` with the lowest failed rank's traceback when any rank
        raised (ranks still running ``failure_grace`` seconds after the first failure, such
        as its partners in a collective, are stopped), ``TimeoutError`` when a rank did not
        answer within ``timeout`` seconds.
        """
        self._job += 1
        for q in self._tasks:
            q.put((self._job, fn, args, backend))
        try:
            got = self._collect(self._job, timeout, failure_grace)
        except TimeoutError:
            self._after_failure()
            raise
        failed = {r: v for r, (ok, v) in got.items() if not ok}
        if failed:
            self._after_failure()
            first = min(failed)
            stopped = sorted(set(range(self.world)) - set(got))
            note = f" (ranks {stopped} still running were stopped)" if stopped else ""
            raise AssertionError(f"{len(failed)} rank(s) failed{note}; rank {first}:\n{failed[first]}")
        return [got[r][1] for r in range(self.world)]

    def _after_failure(self):
        if self.restart_on_failure:
            self.restart()
        else:
            self.close()

    def restart(self) -> None:
        self.close()
        self._start()

    def close(self) -> None:
        """Kill the ranks (also after a failure: nothing is left running)."""
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=10)
        self._procs = []
        if self._rendezvous is not None:
            self._rendezvous.close()
            self._rendezvous = None

    def __enter__(self) -> "DistPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
