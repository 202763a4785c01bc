"""A Ray actor of a worker group (``tests/test_ray.py``): it joins a gloo process group of
the group's actors, builds the mesh (TP2 x DP2), accumulates its shard of a batch and
returns its ``export()``, which travels back through ``ray.get``.

Plain Python here (the test wraps it with ``ray.remote``), so this module imports without
ray; the library never imports ray.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from parallel import DeviceMesh
from tests.rlref import make_rl_batch
from twinkle_metrics import Accuracy, GRPOMetric, LossMetric, MetricCollection

TP, DP = 2, 2
N_SEQ, VOCAB = 12, 12
#: how long the group's own waits last (the actors start one by one on a busy machine)
TIMEOUT_S = 300


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
