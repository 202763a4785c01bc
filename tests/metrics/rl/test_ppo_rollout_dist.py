"""PPOValueMetric and RolloutMismatchMetric on 8 real gloo ranks: sharded == whole."""
import pytest
import torch

from parallel import DeviceMesh
from tests.refmetric import cp_slice, dp_shards
from tests.rlref import make_ppo_batch, ragged
from twinkle_metrics import MetricCollection, PPOValueMetric, RolloutMismatchMetric
from twinkle_metrics.testing import CollectiveCounter, assert_results_close, forbid_device_waits

pytestmark = pytest.mark.xdist_group("dist")

SEED = 31
N_SEQ, SEQ_LEN = 12, 8


def _metrics(mesh):
    return MetricCollection([PPOValueMetric(epsilon=0.3), RolloutMismatchMetric(is_threshold=1.5)],
                            device_mesh=mesh)


def _accumulate(coll, b, rows, cols):
    """One rank's shard as 2 microbatches: values and trainer logps per microbatch,
    old values and rollout logps ragged per sequence (Twinkle's form), returns as one
    tensor over the shard, advantages per microbatch."""
    rows = torch.tensor(list(rows))
    half = (len(rows) + 1) // 2
    parts = [rows[:half], rows[half:]]
    lab = b["labels"][:, cols]
    cut = {k: b[k][:, cols] for k in ("values", "old", "returns", "adv", "train", "rollout")}
    feats = [{"labels": lab[p]} for p in parts]
    outputs = {"values": [cut["values"][p] for p in parts], "logps": [cut["train"][p] for p in parts]}
    kwargs = dict(old_values=ragged(cut["old"][rows], lab[rows]), returns=cut["returns"][rows],
                  advantages=[cut["adv"][p] for p in parts],
                  rollout_logps=ragged(cut["rollout"][rows], lab[rows]))
    with forbid_device_waits(), CollectiveCounter() as c:
        coll.accumulate(feats, outputs, **kwargs)
    return c.total


def whole_results():
    b = make_ppo_batch(SEED, N_SEQ, SEQ_LEN, offset=50.0)
    coll = _metrics(DeviceMesh.single())
    _accumulate(coll, b, range(N_SEQ), torch.arange(SEQ_LEN))
    return coll.calculate()


def case_sharded_equals_whole(sizes):
    # DeviceMesh.from_sizes creates real groups in Megatron's rank order; the metrics
    # only ask the mesh, so no Megatron import (its first import costs a minute of
    # this 2-core machine on 8 ranks)
    mesh = DeviceMesh.from_sizes(**{f"{k}_size": v for k, v in sizes.items()})
    b = make_ppo_batch(SEED, N_SEQ, SEQ_LEN, offset=50.0)
    coll = _metrics(mesh)
    counts = None
    if mesh.is_last_stage:
        rows = dp_shards(N_SEQ, mesh.dp_size)[mesh.dp_rank]
        counts = _accumulate(coll, b, rows, cp_slice(SEQ_LEN, mesh.cp_size, mesh.cp_rank))
    else:
        coll.accumulate([], {})  # what a non-last stage gets from the schedule
    return coll.calculate(), counts, mesh.cp_size


@pytest.mark.parametrize("sizes", [dict(tp=2, pp=2, dp=2), dict(tp=2, cp=2, dp=2)])
def test_ppo_value_and_rollout_sharded_equal_whole(dist_pool, sizes):
    whole = whole_results()
    # the comparison can fail: clipping and threshold fractions are neither 0 nor 1
    assert 0 < whole["train/value_clip_ratio"] < 1 and 0 < whole["rollout/is_fraction_high"] < 1
    assert whole["rollout/seq_ess"] < whole["rollout/token_ess"] < 1
    for got, counts, cp in dist_pool.run(case_sharded_equals_whole, sizes):
        assert_results_close(got, whole, rel=1e-9)
        if counts is not None:
            # accumulate's only collectives: RolloutMismatchMetric's host-side CP agreement
            # and its all_reduce of per-sequence sums; PPOValueMetric's tokens just add
            assert counts == (2 if cp > 1 else 0)
