"""What the library adds to a rank's process groups: nothing when a mesh is built, nothing for
``calculate()`` on the job's own groups (device groups, or gloo groups whatever their
timeout), and for a host agreement only a lazily connected gloo group over the few ranks it
agrees with, made at its first call, on megatron-core with its gloo groups off."""
import os

import pytest
import torch
import torch.distributed as dist

from parallel import DeviceMesh
from parallel import groups as G
from twinkle_metrics import Accuracy, GRPOMetric, LossMetric, MetricCollection, TrainMetric

pytestmark = pytest.mark.xdist_group("dist")


def case_groups_made(vocab_parallel):
    from megatron.core import parallel_state as ps

    made = []
    real = dist.new_group

    def counting(*args, **kwargs):  # the library's calls only: counted from here on
        group = real(*args, **kwargs)
        made.append((tuple(kwargs.get("ranks", args[0] if args else ())), kwargs.get("backend"),
                     os.environ.get(G.LAZY_GLOO)))
        return group

    ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    try:
        dist.new_group = counting
        try:
            mesh = DeviceMesh.from_megatron(timeout=30)  # a bound below the groups' own timeout
            after_build = list(made)
            metrics = MetricCollection({"loss": LossMetric(loss_reduction="sum"), "train": TrainMetric(),
                                        "grpo": GRPOMetric(), "acc": Accuracy(vocab_parallel=vocab_parallel)},
                                       device_mesh=mesh)
            g = torch.Generator().manual_seed(mesh.dp_rank)
            for step in range(12):
                labels = torch.randint(0, 8, (2, 5), generator=g)
                width = 4 if vocab_parallel else 8  # TP replicas hold the same shard
                logits = torch.randn(2, 5, width, generator=torch.Generator().manual_seed(step))
                metrics.accumulate({"labels": labels}, {"logits": logits, "logps": -torch.rand(2, 5, generator=g),
                                                        "loss": torch.tensor(1.0), "num_tokens": 10},
                                   old_logps=-torch.rand(2, 5, generator=g), advantages=torch.ones(2),
                                   lr=1e-3, step=step + 1)
                metrics.calculate()
        finally:
            dist.new_group = real
        return after_build, made, [tuple(G.group_ranks(g)) for g in G.world_state().made]
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("backend", ["standin", "gloo"])
def test_a_mesh_and_a_dozen_calculates_add_no_group_but_a_lazy_one_for_a_tp_agreement(dist_pool, backend):
    for rank, (after_build, made, library) in enumerate(dist_pool.run(case_groups_made, False, backend=backend)):
        assert after_build == [] and made == [] and library == [], (rank, made)
    for rank, (after_build, made, library) in enumerate(dist_pool.run(case_groups_made, True, backend=backend)):
        tp = (rank - rank % 2, rank - rank % 2 + 1)
        if backend == "gloo":  # the TP group is a gloo group: the agreement runs on it
            assert made == [] and library == [], (rank, made)
            continue
        assert after_build == [], rank
        assert made == [(tp, "gloo", "1")] and library == [tp], (rank, made)  # lazily connected
