"""The worker groups' metrics and batch for the single-controller tests (verl, the docs'
recipes): what each rank feeds, and what one process holding the whole batch returns."""
from __future__ import annotations

import torch

from parallel import DeviceMesh
from tests.rlref import make_rl_batch
from twinkle_metrics import CompletionRewardMetric, GRPOMetric, LossMetric, MetricCollection

SEED, N_SEQ = 9, 16


def make_metrics(mesh=None):
    return MetricCollection({"lm": LossMetric(mesh, loss_reduction="sum"), "grpo": GRPOMetric(mesh),
                             "": CompletionRewardMetric(mesh, reward_names=["acc"])})


def feed(coll, rows, seed=SEED):
    """One micro-batch of sequences ``rows`` (what a loss function sees)."""
    b = make_rl_batch(seed, N_SEQ)
    idx = torch.tensor(list(rows))
    lab, lp = b["labels"][idx], b["logps"][idx]
    mask = lab != -100
    coll["lm"].accumulate(None, [{"lm loss": torch.stack([-(lp * mask).sum(), mask.sum().double()])}])
    coll["grpo"].accumulate({"labels": lab}, {"logps": lp}, old_logps=b["old"][idx], advantages=b["adv"][idx])
    coll[""].accumulate(rewards={"acc": [float(r % 3 == 0) for r in idx.tolist()]},
                        completion_lengths=[r + 2 for r in idx.tolist()])


def fed(mesh, seed=SEED):
    """The metrics of a rank of ``mesh``, fed its data-parallel share on the last stage
    (in two micro-batches of uneven size)."""
    coll = make_metrics(mesh)
    if mesh.is_last_stage:
        mine = list(range(mesh.dp_rank, N_SEQ, mesh.dp_size))
        for part in (mine[:1], mine[1:]):
            if part:
                feed(coll, part, seed)
    return coll


def whole(seed=SEED):
    coll = make_metrics(DeviceMesh.single())
    feed(coll, range(N_SEQ), seed)
    return coll.calculate()
