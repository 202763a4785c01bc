"""slice_by on 8 gloo ranks: slices present on only some ranks, stages or intervals merge
exactly (sharded == whole per slice), and steady state keeps its collective count."""
import pytest
import torch

from parallel import DeviceMesh
from tests.dist import sync_error
from tests.refmetric import cp_slice, dp_shards
from tests.rlref import make_rl_batch, ragged
from twinkle_metrics import Accuracy, CompletionRewardMetric, GRPOMetric, MetricCollection
from twinkle_metrics.testing import CollectiveCounter, assert_results_close

pytestmark = pytest.mark.xdist_group("dist")

N_SEQ, SEQ_LEN, SEED = 12, 8, 17
# DP rank 0 holds rows 0..6 (math, code), DP rank 1 rows 7..11 (chat, math): "code" and
# "chat" live on one DP rank each; "chat" appears only in the second interval.
SOURCES = ["math", "code", "math", "code", "code", "math", "math", "math", "chat", "math", "chat", "chat"]


def _metrics(mesh):
    return MetricCollection({
        "acc": Accuracy(slice_by="data_source"),
        "grpo": GRPOMetric(slice_by="data_source", top_k_kl=2),
        "": CompletionRewardMetric(slice_by="data_source", reward_names=["acc"]),
    }, device_mesh=mesh)


def _feed(coll, b, rows, cols, interval):
    rows = [r for r in rows if (SOURCES[r] != "chat") == (interval == 0) or SOURCES[r] == "math"]
    if not rows:
        for m in coll:
            m.accumulate([], {})
        return
    r = torch.tensor(rows)
    lab = b["labels"][r][:, cols]
    feat = {"labels": lab, "position_ids": b["pos"][r][:, cols], "data_source": [SOURCES[i] for i in rows]}
    coll["acc"].accumulate(feat, {"logits": b["logits"][r][:, cols]})
    coll["grpo"].accumulate(feat, {"logps": b["logps"][r][:, cols]}, old_logps=ragged(b["old"][r][:, cols], lab),
                            advantages=b["adv"][r])
    coll[""].accumulate(feat, None, rewards={"acc": [float(i % 3) for i in rows]},
                        completion_lengths=[2 + i for i in rows])


def whole():
    b = make_rl_batch(SEED, N_SEQ, SEQ_LEN)
    coll = _metrics(DeviceMesh.single())
    out = []
    for interval in range(2):
        _feed(coll, b, range(N_SEQ), torch.arange(SEQ_LEN), interval)
        out.append(coll.calculate())
    return out


def case_sliced(sizes):
    mesh = DeviceMesh.from_sizes(**{f"{k}_size": v for k, v in sizes.items()})
    b = make_rl_batch(SEED, N_SEQ, SEQ_LEN)
    coll = _metrics(mesh)
    out, counts = [], []
    for interval in range(3):
        if mesh.is_last_stage:
            rows = dp_shards(N_SEQ, mesh.dp_size)[mesh.dp_rank]
            _feed(coll, b, rows, cp_slice(SEQ_LEN, mesh.cp_size, mesh.cp_rank), min(interval, 1))
        else:
            for m in coll:
                m.accumulate([], {})
        with CollectiveCounter() as c:
            out.append(coll.calculate())
        counts.append(c.total)
    return out, counts


@pytest.mark.parametrize("sizes", [dict(tp=2, pp=2, dp=2), dict(tp=2, cp=2, dp=2)])
def test_slices_on_some_ranks_merge_exactly(dist_pool, sizes):
    first, second = whole()
    assert "acc/accuracy/code" in first and "acc/accuracy/chat" not in first
    assert "acc/accuracy/chat" in second and "train/acc_reward/chat" in second
    for (got, counts) in dist_pool.run(case_sliced, sizes):
        assert_results_close(got[0], first, rel=1e-12)
        assert_results_close(got[1], second, rel=1e-12)  # "chat" appears: one more negotiation
        assert_results_close(got[2], second, rel=1e-12)
        assert counts[2] == 2  # steady state: the data group, then TP x PP


def _bounded_feed(m, rank, sources):
    lab = torch.ones(len(sources), 2, dtype=torch.long)
    logits = torch.zeros(len(sources), 2, 3)
    logits[..., 1] = torch.arange(len(sources), dtype=torch.float32)[:, None] % 2  # some hits, some misses
    m.accumulate({"labels": lab, "src": sources}, {"logits": logits})


def case_slices_over_the_bound():
    """Each rank within max_slices=2, the data group beyond it: every rank raises at
    calculate(), keeps its states, and with the bound raised every rank gets the exact result."""
    mesh = DeviceMesh.from_sizes(dp_size=8)
    m = Accuracy(mesh, slice_by="src", max_slices=2)
    mine = {0: ["a", "b"], 1: ["c"]}.get(mesh.dp_rank, [])
    if mine:
        _bounded_feed(m, mesh.dp_rank, mine)
    first = sync_error(m.calculate)
    if mine:
        _bounded_feed(m, mesh.dp_rank, mine[:1])  # slices this rank knows: still accepted
    m.max_slices = 3
    return first, m.calculate()


def test_slices_beyond_max_slices_over_the_data_group_raise_on_every_rank(dist_pool):
    whole = Accuracy(slice_by="src", max_slices=3)
    for rank, sources in ((0, ["a", "b"]), (1, ["c"]), (0, ["a"]), (1, ["c"])):
        _bounded_feed(whole, rank, sources)
    want = whole.calculate()
    assert {"accuracy/a", "accuracy/b", "accuracy/c"} <= set(want)
    for first, got in dist_pool.run(case_slices_over_the_bound):
        assert first is not None and "3 slices of 'src'" in first and "max_slices=2" in first
        assert_results_close(got, want, rel=1e-12)
