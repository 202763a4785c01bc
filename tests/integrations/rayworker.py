"""A Ray actor of a worker group (``tests/integrations/test_ray.py``): it joins a gloo process group of
the group's actors, builds the mesh (TP2 x DP2), accumulates its shard of a batch and
returns its ``export()``, which travels back through ``ray.get``.

Plain Python here (the test wraps it with ``ray.remote``), so this module imports without
ray; the library never imports ray. ``drive`` is the driver: the test runs it in a process
of its own, so Ray's threads never live in the test process, which forks the ranks of
later tests (a process forked while gRPC's threads run can hang before it starts). In the
same Ray session it runs the documentation's Ray block, a complete program, as written.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from parallel import DeviceMesh
from tests.rlref import make_rl_batch
from twinkle_metrics import Accuracy, GRPOMetric, LossMetric, MetricCollection
from twinkle_metrics.testing import Rendezvous

TP, DP = 2, 2
N_SEQ, VOCAB = 12, 12
#: how long the group's own waits last (the actors start one by one on a busy machine)
TIMEOUT_S = 300
#: how long Ray's processes may take to go after ray.shutdown() on a busy machine
GONE_S = 120


def make_metrics(mesh=None):
    """The worker group's metrics; with no mesh, the driver's (same arguments)."""
    return MetricCollection({"acc": Accuracy(mesh, vocab_parallel=True), "lm": LossMetric(mesh, loss_reduction="sum"),
                             "grpo": GRPOMetric(mesh)})


def feed(metrics, seed, rows, shard=slice(None)):
    """Sequences ``rows`` of batch ``seed``, the logits' vocab ``shard`` (a TP rank's)."""
    b = make_rl_batch(seed, N_SEQ, vocab=VOCAB)
    idx = torch.tensor(list(rows))
    lab, lp = b["labels"][idx], b["logps"][idx]
    mask = lab != -100
    metrics["acc"].accumulate({"labels": lab}, {"logits": b["logits"][idx][..., shard]})
    metrics["lm"].accumulate(None, [{"lm loss": torch.stack([-(lp * mask).sum(), mask.sum().double()])}])
    metrics["grpo"].accumulate({"labels": lab}, {"logps": lp}, old_logps=b["old"][idx], advantages=b["adv"][idx])


class Worker:
    """One rank of the worker group: ``rank`` of ``world``, meeting the others in the
    store the driver hosts at ``host:port`` (``twinkle_metrics.testing.Rendezvous``)."""

    def __init__(self, rank: int, world: int, host: str, port: int):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        timeout = timedelta(seconds=TIMEOUT_S)
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=dist.PrefixStore("workers", store), rank=rank, world_size=world,
                                timeout=timeout)
        self.mesh = DeviceMesh.from_sizes(tp_size=TP, dp_size=DP)
        self.metrics = make_metrics(self.mesh)

    def step(self, seed: int):
        """Accumulate this rank's share of batch ``seed`` (its DP rows, its TP vocab shard)
        and return the export: not collective, the interval ends."""
        v = VOCAB // TP
        rows = range(self.mesh.dp_rank, N_SEQ, DP)
        feed(self.metrics, seed, rows, slice(self.mesh.tp_rank * v, (self.mesh.tp_rank + 1) * v))
        return self.metrics.export()

    def close(self) -> None:
        dist.destroy_process_group()


def descendants(pid: int) -> set:
    """The processes under ``pid`` (from /proc)."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, set()).add(int(entry))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


#: the session's settings on a busy 2-core machine: no dashboard, quiet, little object store
RAY_SETTINGS = dict(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                    object_store_memory=100 * 1024 ** 2)


def run_doc_block(ray, block: str) -> dict:
    """``block`` (docs/single-controller.md's Ray program) as written, its ``ray.init()`` and
    ``ray.shutdown()`` standing for the session ``drive`` holds; its names after the run.
    Defined in ``__main__`` as a user's script is, so Ray ships its classes by value."""
    init, shutdown = ray.init, ray.shutdown
    ray.init = ray.shutdown = lambda *args, **kwargs: None
    ns = {"__name__": "__main__"}
    try:
        exec(compile(block, "docs/single-controller.md (Ray)", "exec"), ns)
    finally:
        ray.init, ray.shutdown = init, shutdown
        for w in ns.get("workers", ()):
            ray.kill(w)
    return {k: ns[k] for k in ("results", "labels", "logits", "world")}


def drive(seeds, doc_block):
    """A local Ray of 2 CPUs (``RAY_SETTINGS``, its files in a fresh temp folder): the
    documentation's Ray block, then a worker group of TP x DP actors. ``{"doc": the block's
    names, "steps": [the actors' exports of each seed], "left": Ray's processes still here
    GONE_S after ray.shutdown()}``."""
    import ray

    os.environ.update(RAY_USAGE_STATS_ENABLED="0", OMP_NUM_THREADS="1")
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    ray.init(**RAY_SETTINGS, _temp_dir=temp)
    try:
        doc = run_doc_block(ray, doc_block)
        world = TP * DP
        remote = ray.remote(num_cpus=2 / world)(Worker)
        with Rendezvous() as rdzv:  # the driver hosts the store on a port of its own: no race
            workers = [remote.remote(r, world, rdzv.host, rdzv.port) for r in range(world)]
            try:
                steps = [ray.get([w.step.remote(seed) for w in workers]) for seed in seeds]
            finally:
                ray.get([w.close.remote() for w in workers])
    finally:
        ray.shutdown()
        deadline = time.monotonic() + GONE_S
        while descendants(os.getpid()) and time.monotonic() < deadline:
            time.sleep(0.5)
        shutil.rmtree(temp, ignore_errors=True)
    return {"steps": steps, "doc": doc, "left": sorted(descendants(os.getpid()))}
