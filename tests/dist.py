"""A pool of real gloo ranks, started once and reused by every multi-rank test.

``DistPool(world).run(fn, *args)`` calls ``fn(*args)`` on every rank (``fn`` must
be importable: a module-level function) and returns the per-rank results in rank
order. A failure on any rank fails the call with that rank's traceback, and the
pool is rebuilt before the next call so one broken test cannot poison the rest.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import traceback
from datetime import timedelta

from parallel.groups import free_port

WORLD = 8
COLLECTIVE_TIMEOUT_S = 60


def _worker(rank, world, port, tasks, results, timeout_s=COLLECTIVE_TIMEOUT_S):
    os.environ.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    results.put(("ready", rank, True, None))
    while True:
        job = tasks.get()
        if job is None:
            break
        job_id, fn, args = job
        before = _groups()
        try:
            results.put((job_id, rank, True, fn(*args)))
        except BaseException:  # noqa: BLE001 - report everything to the test
            results.put((job_id, rank, False, traceback.format_exc()))
        finally:
            _destroy_groups_since(before)
    dist.destroy_process_group()


def _groups():
    from torch.distributed import distributed_c10d as c10d

    return set(c10d._world.pg_map)  # torch's private registry: test infrastructure only


def _destroy_groups_since(before):
    """Destroy the groups a job created: every gloo group keeps two worker threads and a
    TCP loop thread, and a session's few hundred meshes left ~1000 threads per rank that
    slowed every later multi-process test (the Megatron demo from 35 s to over 240 s)."""
    import gc

    import torch.distributed as dist

    for group in _groups() - before:
        try:
            dist.destroy_process_group(group)
        except Exception:  # noqa: BLE001 - already gone
            pass
    gc.collect()


def sync_error(call):
    """Run ``call()`` (a calculate, a wait, a logger's close) on this rank: the text of the
    ``MetricSyncError`` it raised, or None."""
    from twinkle_metrics import MetricSyncError

    try:
        call()
    except MetricSyncError as e:
        return str(e)
    return None


class DistPool:
    def __init__(self, world: int = WORLD, timeout_s: float = COLLECTIVE_TIMEOUT_S):
        """``timeout_s``: the ``init_process_group`` timeout of every rank."""
        self.world = world
        self.timeout_s = timeout_s
        self._procs = []
        self._job = 0
        self._start()

    def _start(self):
        ctx = mp.get_context("spawn")
        port = free_port()
        self._tasks = [ctx.Queue() for _ in range(self.world)]
        self._results = ctx.Queue()
        self._procs = [ctx.Process(target=_worker, args=(r, self.world, port, self._tasks[r], self._results,
                                                                 self.timeout_s),
                                   daemon=True) for r in range(self.world)]
        for p in self._procs:
            p.start()
        self._collect("ready", timeout=180)

    def _collect(self, job_id, timeout):
        got = {}
        while len(got) < self.world:
            try:
                jid, rank, ok, value = self._results.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"ranks {sorted(set(range(self.world)) - set(got))} did not answer "
                                   f"within {timeout}s") from None
            if jid == job_id:
                got[rank] = (ok, value)
        return got

    def run(self, fn, *args, timeout: float = 240):
        """Run ``fn(*args)`` on every rank; return ``[result of rank 0, ...]``."""
        self._job += 1
        for q in self._tasks:
            q.put((self._job, fn, args))
        try:
            got = self._collect(self._job, timeout)
        except TimeoutError:
            self.restart()
            raise
        failed = {r: v for r, (ok, v) in got.items() if not ok}
        if failed:
            self.restart()
            first = min(failed)
            raise AssertionError(f"{len(failed)} rank(s) failed; rank {first}:\n{failed[first]}")
        return [got[r][1] for r in range(self.world)]

    def restart(self):
        self.close()
        self._start()

    def close(self):
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=10)
        self._procs = []
