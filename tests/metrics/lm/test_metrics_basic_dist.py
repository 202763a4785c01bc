"""Multi-rank tests of TrainMetric, LossMetric, Accuracy and EmbeddingMetric on 8 gloo ranks.

Central invariant: every rank accumulating its shard (DP rows, CP token chunks, TP
vocab shards, pipeline microbatches) then calculating == one process on the whole batch.
"""
import functools
import math

import pytest
import torch

from parallel import DeviceMesh
from tests.refmetric import cp_slice
from twinkle_metrics import Accuracy, EmbeddingMetric, LossMetric, MetricCollection, TrainMetric, vocab_parallel_argmax
from twinkle_metrics.testing import assert_layout_invariant, assert_results_close, forbid_device_waits, parse_layout

pytestmark = pytest.mark.xdist_group("dist")

V, SEQ, NSEQ = 16, 8, 8


def lm_batch(seed):
    """Labels with ragged valid tokens; rows 5.. (the last DP rank's) have none."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (NSEQ, SEQ), generator=g)
    labels = torch.where(torch.rand(NSEQ, SEQ, generator=g) < 0.6, labels, torch.full_like(labels, -100))
    labels[5:] = -100
    labels[1] = -100
    logits = (torch.randn(NSEQ, SEQ, V, generator=g) * 1.5).round()      # ties, also across TP shards
    hit = torch.rand(NSEQ, SEQ, generator=g) < 0.4                        # make some predictions right
    logits.scatter_(-1, labels.clamp(min=0).unsqueeze(-1),
                    torch.where(hit, 9.0, -9.0).unsqueeze(-1))
    logits[0, :, 3] = logits[0, :, 3 + V // 2] = 20.0                      # planted cross-shard tie
    token_loss = torch.rand(NSEQ, SEQ, generator=g, dtype=torch.float64)
    return labels, logits.to(torch.bfloat16), token_loss


def emb_batch(seed, d=6):
    g = torch.Generator().manual_seed(seed)
    labels = torch.tensor([1, 0, 1, 0, 1, 0, 1, 0, 0, 1, 0])
    return torch.randn(len(labels), d, generator=g), labels


# Pair-aligned, uneven row ranges per data rank; an empty one for 4 ranks.
EMB_SHARDS = {1: [(0, 11)], 2: [(0, 4), (4, 11)], 4: [(0, 4), (4, 6), (6, 6), (6, 11)]}


def dp_rows(dp_size, dp_rank):
    return [range(0, 5), range(5, NSEQ)][dp_rank] if dp_size == 2 else range(NSEQ)


def local_inputs(mesh, seed):
    """This rank's microbatches, vocab shard, Megatron loss reports and embedding rows."""
    labels, logits, token_loss = lm_batch(seed)
    rows = list(dp_rows(mesh.dp_size, mesh.dp_rank))
    cols = cp_slice(SEQ, mesh.cp_size, mesh.cp_rank) if mesh.cp_size > 1 else torch.arange(SEQ)
    v = V // mesh.tp_size
    shard = slice(mesh.tp_rank * v, (mesh.tp_rank + 1) * v)
    feats, outs, reports = [], [], []
    for part in (rows[:2], rows[2:]):           # two microbatches of uneven size
        r = torch.tensor(part)
        lab = labels[r][:, cols]
        feats.append({"labels": lab})
        outs.append(logits[r][:, cols][..., shard])
        mask = lab != -100
        reports.append({"lm loss": torch.stack([(token_loss[r][:, cols] * mask).sum(),
                                                mask.sum().double()])})
    emb, elab = emb_batch(seed)
    # Pooled embeddings are per sequence: the ranks of a CP group hold the same rows.
    lo, hi = EMB_SHARDS[mesh.dp_size][mesh.dp_rank]
    return feats, outs, reports, emb[lo:hi], elab[lo:hi]


def whole_results(seed):
    labels, logits, token_loss = lm_batch(seed)
    mask = labels != -100
    acc = Accuracy(DeviceMesh.single()).accumulate({"labels": labels}, {"logits": logits})
    loss = LossMetric(DeviceMesh.single(), loss_reduction="sum").accumulate(
        None, [{"lm loss": torch.stack([(token_loss * mask).sum(), mask.sum().double()])}], grad_norm=4.0)
    emb, elab = emb_batch(seed)
    embm = EmbeddingMetric(DeviceMesh.single())
    embm.accumulate({"labels": elab}, {"embeddings": emb})
    embm.accumulate({"labels": torch.zeros(3, dtype=torch.long)}, {"embeddings": torch.randn(3, 6)})
    return MetricCollection({"acc": acc, "loss": loss, "emb": embm}).calculate()


def make_metrics(mesh):
    return MetricCollection({"acc": Accuracy(mesh, vocab_parallel=True), "loss": LossMetric(mesh, loss_reduction="sum"),
                             "emb": EmbeddingMetric(mesh), "": TrainMetric(mesh, counts="local")})


def feed(coll, place, seed):
    """This rank's share of batch ``seed`` (``place``: the rank's mesh, or the harness's
    Shard, which names its place alike)."""
    acc, loss, embm, train = coll["acc"], coll["loss"], coll["emb"], coll[""]
    feats, outs, reports, emb, elab = local_inputs(place, seed)
    last = place.is_last_stage
    n_tok = sum(int((f["labels"] != -100).sum()) for f in feats) if last else 0
    with forbid_device_waits():
        if last:
            acc.accumulate(feats, {"logits": outs})
            loss.accumulate(None, reports[:1], grad_norm=torch.tensor(4.0 if place.dp_rank == 0 else 1.0))
            loss.accumulate(None, reports[1:])
            embm.accumulate({"labels": elab}, {"embeddings": emb})
            # A batch without anchors (rows on some ranks only) is skipped alike on every rank.
            z = 3 if place.dp_rank == 0 else 0
            embm.accumulate({"labels": torch.zeros(z, dtype=torch.long)}, {"embeddings": torch.randn(z, 6)})
        else:   # what a non-last stage gets from the schedule
            acc.accumulate([], {})
            loss.accumulate(None, [])
            embm.accumulate([], {})
            embm.accumulate([], {})
        train.accumulate(None, None, lr=[1e-3, 1e-4], step=6, gradient_accumulation_steps=2,
                         tokens=n_tok, samples=1)


def feed_interval(coll, shard, seed):
    """The harness's feed: batch ``seed + interval``."""
    feed(coll, shard, seed + shard.interval)


def case_megatron_tp2_pp2_dp2(seed):
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                 create_gloo_process_groups=False, distributed_timeout_minutes=1)
    try:
        mesh = DeviceMesh.from_megatron()
        coll = make_metrics(mesh)
        feed(coll, mesh, seed)
        return coll.calculate(), mesh.tp_rank, mesh.data_rank
    finally:
        ps.destroy_model_parallel()


def _lm_keys(res):
    return {k: v for k, v in res.items() if k.split("/")[0] in ("acc", "loss", "emb")}


def _check_rank(res, seed, data_size):
    labels, _, _ = lm_batch(seed)
    n_tokens = int((labels != -100).sum())
    assert_results_close(_lm_keys(res), whole_results(seed), rel=1e-12)
    assert res["learning rate(param group 2)"] == 1e-4 and res["iters"] == 3
    # counts='local': token counts summed over the data group == the whole batch's
    assert math.isclose(res["tokens/s"] / res["samples/s"], n_tokens / data_size, rel_tol=1e-12)


def _check(out, seed):
    for res, _tp_rank, _ in out:
        _check_rank(res, seed, _data_size(out))
    # identical on every rank, TP replicas and pipeline stages included (times too)
    assert all(r == out[0][0] for r, _, _ in out)


def _data_size(out):
    return len({d for _, _, d in out})


@pytest.mark.megatron
def test_sharded_equals_whole_megatron_tp2_pp2_dp2(dist_pool):
    out = dist_pool.run(case_megatron_tp2_pp2_dp2, 5)
    _check(out, 5)
    whole = whole_results(5)
    assert whole["acc/total_tokens"] > 0 and "emb/neg_sim" in whole and whole["loss/grad_norm"] == 4.0


@pytest.mark.parametrize("layout", ["tp2xcp2xdp2", "cp2xdp2xpp2"])
def test_sharded_equals_whole_dp2_cp2(dist_pool, layout):
    # every rank == one process fed the whole batch, two intervals (batches 9 and 10); the
    # TrainMetric's wall-clock rates are checked by ratio below
    report = assert_layout_invariant(make_metrics, functools.partial(feed_interval, seed=9), [layout],
                                     pool=dist_pool, rel=1e-12, ignore=lambda k: not _lm_keys({k: 0}))
    lay = parse_layout(layout)
    for i, seed in enumerate((9, 10)):
        # the harness's reference is the hand-built whole too
        assert_results_close(_lm_keys(report.reference[i]), whole_results(seed), rel=1e-12)
        per_rank = [r[i] for r in report.results[layout]]
        for res in per_rank:
            _check_rank(res, seed, lay.dp * lay.cp)
        # identical on every rank, TP replicas and pipeline stages included (times too)
        assert all(r == per_rank[0] for r in per_rank)


def tie_logits(dtype):
    g = torch.Generator().manual_seed(3)
    full = (torch.randn(3, 5, V, generator=g) * 2).round()
    full[0, 0, :] = 1.0                                   # all equal: index 0
    full[0, 1, 2] = full[0, 1, 2 + V // 2] = 50.0          # tie across shards: lower wins
    full[0, 2, V // 2 + 1] = full[0, 2, V // 2 + 4] = 50.0  # tie inside shard 1
    full[0, 3, :] = -7.0
    full[0, 3, V - 1] = full[0, 3, V // 2] = -1.0          # negative tie on shard 1
    full[0, 4, 0] = -0.0
    full[0, 4, 1:] = -1.0
    full[0, 4, V // 2] = 0.0                               # -0.0 == +0.0: index 0
    full[1, 0, 5] = full[1, 0, V // 2 + 5] = float("nan")  # first NaN wins
    full[1, 1, V // 2 + 2] = float("nan")                  # NaN only on shard 1
    full[1, 2, :] = -math.inf
    return full.to(dtype)


def case_vocab_parallel_ties(dtype):
    mesh = DeviceMesh.from_sizes(tp_size=2, dp_size=4)
    full = tie_logits(dtype)
    v = V // 2
    local = full[..., mesh.tp_rank * v:(mesh.tp_rank + 1) * v]
    with forbid_device_waits():
        preds = vocab_parallel_argmax([local, local[:1]], mesh.tp_group, mesh.tp_rank, mesh.tp_size)
        empty = vocab_parallel_argmax([], mesh.tp_group, mesh.tp_rank, mesh.tp_size)
    labels = full.float().nan_to_num(0.0).argmax(-1)      # a label per position, some hits
    acc = Accuracy(mesh, vocab_parallel=True)
    acc.accumulate({"labels": labels}, {"logits": local})
    return preds[0], preds[1], empty, acc.calculate()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_vocab_parallel_argmax_ties_on_tp2(dist_pool, dtype):
    full = tie_logits(dtype)
    want = full.argmax(-1)
    labels = full.float().nan_to_num(0.0).argmax(-1)
    whole = Accuracy().accumulate({"labels": labels}, {"logits": full}).calculate()
    assert want[0, 1] == 2 and want[0, 4] == 0 and want[1, 0] == 5 and want[1, 1] == V // 2 + 2
    for pred, pred_first, empty, res in dist_pool.run(case_vocab_parallel_ties, dtype):
        assert torch.equal(pred, want) and torch.equal(pred_first, want[:1]) and empty == []
        # every DP rank held the same batch: counts are 4x the whole, the fraction equal
        assert res == {"accuracy": whole["accuracy"], "correct_tokens": 4 * whole["correct_tokens"],
                       "total_tokens": 4 * whole["total_tokens"]}


def case_embedding_uneven_and_empty():
    mesh = DeviceMesh.from_sizes(dp_size=8)
    emb, labels = emb_batch(1)
    bounds = [0, 4, 4, 6, 6, 6, 8, 11, 11]       # ranks 1, 3, 4, 7 have no rows
    lo, hi = bounds[mesh.data_rank], bounds[mesh.data_rank + 1]
    m = EmbeddingMetric(mesh)
    with forbid_device_waits():
        if hi > lo:
            m.accumulate({"labels": labels[lo:hi]}, {"embeddings": emb[lo:hi], "loss": 1.0 + mesh.data_rank})
        else:
            m.accumulate([], {})
    return m.calculate()


def test_embedding_gathers_over_data_group_with_empty_ranks(dist_pool):
    emb, labels = emb_batch(1)
    whole = EmbeddingMetric().accumulate({"labels": labels}, {"embeddings": emb}).calculate()
    whole["loss"] = (1 + 3 + 6 + 7) / 4
    for got in dist_pool.run(case_embedding_uneven_and_empty):
        assert_results_close(got, whole, rel=1e-12)


# rows per DP rank: dp rank 2 of 4 has none
EMB_CP_BOUNDS = {1: [0, 11], 4: [0, 4, 6, 6, 11]}


def feed_embedding_rows(m, shard):
    """CP ranks hold the same pooled rows (batch 1 + interval); pairs must not be counted twice."""
    emb, labels = emb_batch(1 + shard.interval)
    bounds = EMB_CP_BOUNDS[shard.dp_size]
    lo, hi = bounds[shard.dp_rank], bounds[shard.dp_rank + 1]
    with forbid_device_waits():
        if hi > lo:
            m.accumulate({"labels": labels[lo:hi]}, {"embeddings": emb[lo:hi]})
        else:
            m.accumulate([], {})


def test_embedding_under_cp_counts_each_pair_once(dist_pool):
    report = assert_layout_invariant(EmbeddingMetric, feed_embedding_rows, ["cp2xdp4"], pool=dist_pool,
                                     rel=1e-12)
    for i in range(2):
        emb, labels = emb_batch(1 + i)
        whole = EmbeddingMetric().accumulate({"labels": labels}, {"embeddings": emb}).calculate()
        assert_results_close(report.reference[i], whole, rel=1e-12)


def case_train_metric_over_world():
    mesh = DeviceMesh.from_sizes(tp_size=2, pp_size=2, dp_size=2)
    m = TrainMetric(mesh, flops_per_token=10.0, peak_flops=1e6)
    with forbid_device_waits():
        m.accumulate(None, None, lr=1e-3, step=4, gradient_accumulation_steps=2, tokens=640, samples=8)
    return m.calculate()


def test_train_metric_same_on_every_rank(dist_pool):
    out = dist_pool.run(case_train_metric_over_world)
    assert all(r == out[0] for r in out)
    assert out[0]["iters"] == 2 and math.isclose(out[0]["tokens/s"] / out[0]["samples/s"], 80.0)
    assert math.isclose(out[0]["mfu"], out[0]["tokens/s"] * 10.0 / 8 / 1e6, rel_tol=1e-12)
