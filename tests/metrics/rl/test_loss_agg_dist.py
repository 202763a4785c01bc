"""loss_agg_mode= on real gloo ranks: sharded == whole on DP (4 ranks too), TP, PP and CP
layouts, with the per-sequence sums completed over CP before they are averaged; the
sequence-sum-norm mode and verl's dual-clip and token-weighted clip fractions equal verl
0.9.1's definitions (``tests/rlref.py``) on every rank of 4 DP ranks."""
import math

import pytest
import torch

from tests.refmetric import cp_slice, dp_shards
from tests.rlref import make_rl_batch, ragged, verl_agg_loss, verl_clip_tokens
from twinkle_metrics import CISPOMetric, GRPOMetric, GSPOMetric, MetricCollection, PPOMetric, RolloutMismatchMetric
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
        "dual": PPOMetric(None, clip_ratio_c=1.25, token_clip_ratio=True, loss_agg_mode="seq-mean-token-sum-norm"),
        "gspo_tok": GSPOMetric(None, epsilon=0.05, token_clip_ratio=True),
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


def _verl(b):
    """verl 0.9.1's values of the batch: the norm mode's k3 KL and clip fraction (agg_loss over
    the whole batch), the dual-clip and token-weighted clip fractions (masked means)."""
    mask = [[float(b["labels"][i, t] != -100) for t in range(SEQ_LEN)] for i in range(N_SEQ)]
    lp, old = b["logps"].tolist(), b["old"].tolist()
    adv = [[a] * SEQ_LEN for a in b["adv"].tolist()]
    d = [[x - o for x, o in zip(lr, orow)] for lr, orow in zip(lp, old)]
    clipped, lower = verl_clip_tokens("ppo", lp, old, adv, mask, clip_ratio_c=1.25)
    gspo, _ = verl_clip_tokens("gspo", lp, old, adv, mask, eps=0.05)
    tokens = sum(map(sum, mask))

    def mean(rows):
        return sum(v * w for r, mr in zip(rows, mask) for v, w in zip(r, mr)) / tokens

    norm = "seq-mean-token-sum-norm"
    return {"dual/train/approx_kl": verl_agg_loss([[math.exp(x) - x - 1 for x in r] for r in d], mask, norm),
            "dual/train/clip_ratio": verl_agg_loss(clipped, mask, norm),
            "dual/train/clip_ratio_dual": mean(lower), "dual/train/token_clip_ratio": mean(clipped),
            "gspo_tok/train/token_clip_ratio": mean(gspo)}


def test_sequence_modes_are_layout_invariant_and_complete_sequences_over_cp(dist_pool):
    report = assert_layout_invariant(_metrics, feed, ["dp2", "dp4", "tp2xdp2", "pp2xdp2", "cp2xdp2"],
                                     pool=dist_pool)
    for interval, ref in enumerate(report.reference):
        # verl 0.9.1's definitions, on every rank of 4 DP ranks (the acceptance reading)
        for key, want in _verl(_batch(interval)).items():
            assert 0 < want < 1, key
            for rank in report.results["dp4"]:
                assert math.isclose(rank[interval][key], want, rel_tol=1e-12), (key, rank[interval][key], want)
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
