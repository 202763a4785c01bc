"""Multi-rank tests of ``MTPMetric`` on the gloo rank pool: sharded == whole.

Every rank feeds its share of each depth's batch (its DP sequences, its CP token chunks, its
TP vocab shard of the logits, ties across the shards planted) and calculates; the harness
checks every rank, and a driver merging the ranks' exports, against one process fed the
whole batch.
"""
import functools

import pytest
import torch

from tests.refmetric import cp_slice
from twinkle_metrics import MTPMetric
from twinkle_metrics.testing import assert_layout_invariant

pytestmark = pytest.mark.xdist_group("dist")

V, SEQ, NSEQ, DEPTHS = 16, 8, 4, 2


def depth_batch(seed, k):
    """The whole batch of depth ``k``: labels, a float loss mask (ragged, a row all masked),
    logits with ties inside and across the vocab halves, per-token losses."""
    g = torch.Generator().manual_seed(100 * seed + k)
    labels = torch.randint(0, V, (NSEQ, SEQ), generator=g)
    mask = (torch.rand(NSEQ, SEQ, generator=g) < 0.75).float() * torch.randint(1, 3, (NSEQ, SEQ), generator=g)
    mask[1] = 0.0
    mask[:, SEQ - k:] = 0.0  # the last k positions have no depth-k target
    logits = (torch.randn(NSEQ, SEQ, V, generator=g) * 1.5).round()
    hit = torch.rand(NSEQ, SEQ, generator=g) < 0.4
    logits.scatter_(-1, labels.unsqueeze(-1), torch.where(hit, 9.0, -9.0).unsqueeze(-1))
    logits[0, :, 2] = logits[0, :, 2 + V // 2] = 20.0  # a tie across the TP shards: the lower id wins
    losses = torch.rand(NSEQ, SEQ, generator=g, dtype=torch.float64) * 3
    return labels, mask, logits.to(torch.bfloat16), losses


def feed(metric, shard, seed):
    """This rank's part of interval ``shard.interval``: per depth, its rows, tokens and vocab shard."""
    rows = torch.arange(NSEQ).chunk(shard.dp_size)[shard.dp_rank]
    cols = cp_slice(SEQ, shard.cp_size, shard.cp_rank)
    width = V // shard.tp_size
    for k in range(1, DEPTHS + 1):
        labels, mask, logits, losses = depth_batch(seed + shard.interval, k)
        labels, mask, losses = labels[rows][:, cols], mask[rows][:, cols], losses[rows][:, cols]
        logits = logits[rows][:, cols][..., shard.tp_rank * width:(shard.tp_rank + 1) * width]
        metric.accumulate({"labels": labels, "completion_mask": mask}, {"mtp_logits": logits}, depth=k)
        metric.accumulate({"completion_mask": mask}, {"mtp_losses": losses}, depth=k)
        # a trainer's own sum and count of this shard (TP replicas pass the same)
        metric.accumulate(None, {"mtp_loss": float((losses * mask).sum()), "mtp_num_tokens": int(mask.sum())},
                          depth=k)


def make_metric(mesh):
    return MTPMetric(mesh, depths=DEPTHS, vocab_parallel=True, megatron_keys=True)


@pytest.mark.parametrize("layout", ["tp2xdp2", "cp2xdp2"])
def test_mtp_sharded_equals_whole(dist_pool, layout):
    report = assert_layout_invariant(make_metric, functools.partial(feed, seed=3), [layout], pool=dist_pool,
                                     rel=1e-12)
    for i, ref in enumerate(report.reference):
        for k in range(1, DEPTHS + 1):
            labels, mask, logits, losses = depth_batch(3 + i, k)
            valid = mask != 0
            correct = int(((logits.float().argmax(-1) == labels) & valid).sum())
            assert ref[f"mtp/depth{k}/correct_tokens"] == correct and ref[f"mtp/depth{k}/total_tokens"] == valid.sum()
            assert ref[f"mtp/depth{k}/loss"] == pytest.approx(float((losses * mask).sum() / mask.sum()), rel=1e-12)
            assert 0 < correct < valid.sum()
        assert all(r[i] == report.results[layout][0][i] for r in report.results[layout])  # every rank alike
