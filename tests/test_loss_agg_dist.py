"""loss_agg_mode= on real gloo ranks: sharded == whole on DP, TP, PP and CP layouts, with the
per-sequence sums completed over CP before they are averaged."""
import math

import pytest
import torch

from tests.refmetric import cp_slice, dp_shards
from tests.rlref import make_rl_batch, ragged
from twinkle_metrics import CISPOMetric, GRPOMetric, GSPOMetric, MetricCollection, RolloutMismatchMetric
from twinkle_metrics.testing import assert_layout_invariant

pytestmark = pytest.mark.xdist_group("dist")

SEED = 31
N_SEQ, SEQ_LEN = 12, 8


def _metrics(mesh):
    """Every non-default mode on GRPO, one on each of GSPO, CISPO and RolloutMismatch: one
    collection, so each layout runs once."""
    return MetricCollection({
        "mean": GRPOMetric(None, loss_agg_mode="seq-mean-token-mean"),
        "sum": GRPOMetric(None, loss_agg_mode="seq-mean-token-sum"),
        "norm": GRPOMetric(None, loss_agg_mode="seq-mean-token-sum-norm"),
        "norm64": GRPOMetric(None, loss_agg_mode="seq-mean-token-sum-norm", loss_agg_norm=64),
        "gspo": GSPOMetric(None, epsilon=0.05, loss_agg_mode="seq-mean-token-mean"),
        "cispo": CISPOMetric(None, loss_agg_mode="seq-mean-token-sum"),
        "roll": RolloutMismatchMetric(None, is_threshold=1.3, loss_agg_mode="seq-mean-token-mean"),
    }, device_mesh=mesh)


def _batch(interval):
    b = make_rl_batch(SEED + interval, N_SEQ, SEQ_LEN)
    b["labels"][7, 1:] = -100  # a one-token sequence: on one CP rank only
    return b


def feed(coll, shard):
    """This rank's DP rows and CP columns as two microbatches, Twinkle's ragged old log-probs
    (each CP rank's own valid tokens); what a schedule gives a non-last stage."""
    if not shard.is_last_stage:
        for m in coll:
            m.accumulate([], {})
        return
    b = _batch(shard.interval)
    rows = torch.tensor(list(dp_shards(N_SEQ, shard.dp_size)[shard.dp_rank]))
    cols = cp_slice(SEQ_LEN, shard.cp_size, shard.cp_rank)
    lab, lp, old = b["labels"][rows][:, cols], b["logps"][rows][:, cols], b["old"][rows][:, cols]
    half = (len(rows) + 1) // 2
    parts = [slice(0, half), slice(half, None)]
    coll.accumulate([{"labels": lab[p]} for p in parts], {"logps": [lp[p] for p in parts]},
                    old_logps=ragged(old, lab), advantages=b["adv"][rows], ref_logps=b["ref"][rows][:, cols],
                    rollout_logps=ragged(old, lab))


def _clip_fraction_per_sequence(b, eps=0.2):
    """Mean over sequences (with a counted token) of each sequence's clipped-token fraction."""
    fractions = []
    for i in range(N_SEQ):
        clipped = []
        for t in range(SEQ_LEN):
            if b["labels"][i, t] == -100:
                continue
            r, a = math.exp(float(b["logps"][i, t]) - float(b["old"][i, t])), float(b["adv"][i])
            clipped.append((r < 1 - eps and a < 0) or (r > 1 + eps and a > 0))
        if clipped:
            fractions.append(sum(clipped) / len(clipped))
    return sum(fractions) / len(fractions)


def test_sequence_modes_are_layout_invariant_and_complete_sequences_over_cp(dist_pool):
    report = assert_layout_invariant(_metrics, feed, ["dp2", "tp2xdp2", "pp2xdp2", "cp2xdp2"], pool=dist_pool)
    for interval, ref in enumerate(report.reference):
        want = _clip_fraction_per_sequence(_batch(interval))
        assert ref["mean/train/clip_ratio"] > 0
        assert math.isclose(ref["mean/train/clip_ratio"], want, rel_tol=1e-12)
        # the acceptance reading on DP2 x CP2 (4 gloo ranks), every rank
        for rank in report.results["cp2xdp2"]:
            assert math.isclose(rank[interval]["mean/train/clip_ratio"], want, rel_tol=1e-12)
        # the modes differ, so the comparison above can tell them apart
        assert ref["mean/train/approx_kl"] != ref["sum/train/approx_kl"] != ref["norm/train/approx_kl"]
        assert math.isclose(ref["norm64/train/approx_kl"] * 64, ref["norm/train/approx_kl"] * SEQ_LEN,
                            rel_tol=1e-12)
