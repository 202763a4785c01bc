"""StalenessMetric (and MoERoutingMetric's percentiles, LossMetric's ppl) on real gloo ranks:
sharded == whole on DP, TP, PP and CP layouts."""
import math

import pytest
import torch

from tests.metrics.rl.test_staleness import _reference
from tests.refmetric import cp_slice, dp_shards
from twinkle_metrics import LossMetric, MetricCollection, MoERoutingMetric
from twinkle_metrics.metrics.rl.staleness import StalenessMetric
from twinkle_metrics.testing import assert_layout_invariant, assert_results_close

pytestmark = pytest.mark.xdist_group("dist")

SEED = 41
N_SEQ, SEQ_LEN, POLICY = 12, 8, 20
LAYERS, EXPERTS = 4, 4


def _batch(interval):
    """Labels with padding and one sequence without a counted token; per-sequence versions
    in interval 0, per-token versions (partial rollouts) in interval 1."""
    g = torch.Generator().manual_seed(SEED + interval)
    labels = torch.randint(0, 50, (N_SEQ, SEQ_LEN), generator=g)
    labels[torch.rand(N_SEQ, SEQ_LEN, generator=g) < 0.3] = -100
    labels[5] = -100
    if interval % 2 == 0:
        versions = torch.randint(10, POLICY + 1, (N_SEQ,), generator=g).tolist()
    else:
        versions = torch.randint(10, POLICY + 1, (N_SEQ, SEQ_LEN), generator=g)
    token_loss = torch.rand(N_SEQ, SEQ_LEN, generator=g, dtype=torch.float64) * 4
    experts = torch.randint(0, EXPERTS, (LAYERS, N_SEQ, SEQ_LEN), generator=g)
    experts[:, :, 0] = 0  # a crowded expert: percentiles differ from the mean
    return labels, versions, token_loss, experts


def _reading(shard):
    """A host reading that differs over ranks: the last DP rank sees the most in flight."""
    return 5 + shard.interval + (3 if shard.dp_rank == shard.dp_size - 1 else 0)


def make_staleness(mesh):
    return StalenessMetric(mesh, max_staleness=4)


def feed_staleness(m, shard):
    labels, versions, _, _ = _batch(shard.interval)
    if not shard.is_last_stage:
        m.accumulate([], None, policy_version=POLICY, rollout_versions=versions, in_flight=_reading(shard))
        return
    rows = torch.tensor(list(dp_shards(N_SEQ, shard.dp_size)[shard.dp_rank]))
    cols = cp_slice(SEQ_LEN, shard.cp_size, shard.cp_rank)
    half = (len(rows) + 1) // 2
    parts = [rows[:half], rows[half:]]  # two pipeline microbatches
    feats = [{"labels": labels[p][:, cols]} for p in parts]
    if isinstance(versions, list):
        mine = [versions[i] for i in rows.tolist()]
    else:
        mine = versions[rows][:, cols]
    m.accumulate(feats, None, policy_version=POLICY, rollout_versions=mine, in_flight=_reading(shard))


def make_all(mesh):
    return MetricCollection({
        "": StalenessMetric(max_staleness=4),
        "moe": MoERoutingMetric(num_layers=LAYERS, num_experts=EXPERTS, percentiles=(0, 50, 90, 100)),
        "lm": LossMetric(loss_reduction="sum", ppl=True),
    }, device_mesh=mesh)


def feed_all(coll, shard):
    feed_staleness(coll[""], shard)
    labels, _, token_loss, experts = _batch(shard.interval)
    rows = torch.tensor(list(dp_shards(N_SEQ, shard.dp_size)[shard.dp_rank]))
    cols = cp_slice(SEQ_LEN, shard.cp_size, shard.cp_rank)
    # every stage routes its own layers' tokens (this rank's DP rows and CP columns)
    for layer in range(shard.pp_rank, LAYERS, shard.pp_size):
        routed = experts[layer][rows][:, cols].reshape(-1)
        coll["moe"].observe(layer, routing_map=torch.nn.functional.one_hot(routed, EXPERTS).bool())
    if not shard.is_last_stage:
        coll["lm"].accumulate(None, [])  # Megatron's report list off the last stage
        return
    half = (len(rows) + 1) // 2
    reports = []
    for p in (rows[:half], rows[half:]):
        keep = labels[p][:, cols] != -100
        loss = torch.where(keep, token_loss[p][:, cols], 0.0)
        reports.append({"lm loss": torch.stack([loss.sum(), keep.sum().double()])})
    coll["lm"].accumulate(None, reports)


def test_staleness_over_two_gloo_ranks_equals_the_hand_formulas(dist_pool):
    """Acceptance: token-weighted mean, sequence mean, min and max (and the rest) over 2 gloo
    ranks equal plain Python over the whole batch; the in-flight reading is the max over ranks."""
    report = assert_layout_invariant(make_staleness, feed_staleness, ["dp2"], pool=dist_pool)
    for i in range(2):
        labels, versions, _, _ = _batch(i)
        versions = versions if isinstance(versions, list) else versions.tolist()
        want = {**_reference(labels, POLICY, versions, over=4), "staleness/in_flight_max": 8 + i}
        assert_results_close(report.reference[i], want, rel=1e-12)
        for rank in report.results["dp2"]:  # rank 0 read 5 + i in flight, rank 1 8 + i
            assert_results_close(rank[i], want, rel=1e-12)
    first, second = report.reference
    assert "staleness/span_max" not in first and second["staleness/span_max"] > 0
    assert first["staleness/min"] < first["staleness/max"] and 0 < first["staleness/frac_over_4"] < 1
    assert not math.isclose(first["staleness/mean"], first["staleness/seq_mean"])  # weighting matters


def test_staleness_moe_percentiles_and_ppl_are_layout_invariant(dist_pool):
    """Sharded == whole on DP, TP, PP and CP (CP slices completed per sequence), two intervals."""
    report = assert_layout_invariant(make_all, feed_all, ["dp2", "tp2xdp2", "pp2xdp2", "cp2xdp2"], pool=dist_pool)
    first, second = report.reference
    assert second["staleness/span_max"] > 0 and "moe/moe/layer3/tokens_per_expert_p90" in first
    assert first["moe/moe/tokens_per_expert_p50"] != first["moe/moe/tokens_per_expert_p100"]
    assert first["lm/ppl"] == pytest.approx(math.exp(first["lm/loss"]))
