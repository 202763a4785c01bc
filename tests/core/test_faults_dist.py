"""Fault injection on 8 real gloo ranks: the sync protocol at the edges.

Every case runs under a short per-case timeout and asserts, on every rank, either the
error type and text or the exact numbers. Ranks that build different metrics, states
created on the fly on some ranks or stages only, arguments that change meaning, TP
replicas that disagree (a forgotten ``vocab_parallel=True``), integers past 2**53,
non-finite values, resuming at another data-parallel size.
"""
import math

import pytest
import torch
import torch.distributed as dist

from parallel import DeviceMesh
from tests.dist import megatron_tp2_pp2
from tests.refmetric import TokenStats, make_batch, shard_for_rank
from twinkle_metrics import (
    Accuracy,
    CompletionRewardMetric,
    DPOMetric,
    LossMetric,
    Metric,
    MetricCollection,
    MetricSyncError,
    State,
    TrainMetric,
)
from twinkle_metrics.testing import CollectiveCounter

pytestmark = pytest.mark.xdist_group("dist")

CASE_TIMEOUT = 120
LAYOUTS = [dict(dp=8), dict(tp=2, pp=2, dp=2), dict(cp=2, dp=4)]


def _mesh(sizes):
    return DeviceMesh.from_sizes(**{f"{k}_size": v for k, v in sizes.items()})


def _with_source(source, fn):
    """``fn(mesh)`` on TP2 x PP2 x DP2 groups made by the library or by megatron-core."""
    if source == "megatron":
        with megatron_tp2_pp2() as mesh:
            return fn(mesh)
    return fn(_mesh(dict(tp=2, pp=2, dp=2)))


def _outcome(fn):
    try:
        return "ok", fn()
    except MetricSyncError as e:
        return "MetricSyncError", str(e)


# ------------------------------------------------ rewards known on the last stage only
def _reward_batch(dp_rank, dp_size):
    g = torch.Generator().manual_seed(11)
    acc = torch.rand(16, generator=g, dtype=torch.float64)
    fmt = torch.rand(16, generator=g, dtype=torch.float64)
    lens = torch.randint(1, 50, (16,), generator=g).to(torch.float64)
    rows = slice(dp_rank * 16 // dp_size, (dp_rank + 1) * 16 // dp_size)
    return {"acc": acc[rows], "fmt": fmt[rows]}, lens[rows], (acc, fmt, lens)


def case_rewards_on_last_stage(source):
    return _with_source(source, _rewards_on_last_stage)


def _rewards_on_last_stage(mesh):
    m = CompletionRewardMetric(mesh, num_generations=4)  # names created on first sight
    out = []
    for _interval in range(3):
        if mesh.is_last_stage:
            rewards, lens, _ = _reward_batch(mesh.dp_rank, mesh.dp_size)
            m.accumulate(rewards=rewards, completion_lengths=lens)
        else:
            m.accumulate()  # a non-last stage has nothing to pass
        with CollectiveCounter() as c:
            out.append((m.calculate(), c.total))
    return out


@pytest.mark.parametrize("source", ["sizes", pytest.param("megatron", marks=pytest.mark.megatron)])
def test_rewards_known_on_the_last_stage_only(dist_pool, source):
    _, _, (acc, fmt, lens) = _reward_batch(0, 1)
    whole = CompletionRewardMetric(num_generations=4).accumulate(
        rewards={"acc": acc, "fmt": fmt}, completion_lengths=lens).calculate()
    results = dist_pool.run(case_rewards_on_last_stage, source, timeout=CASE_TIMEOUT)
    for per_interval in results:
        for got, _ in per_interval:
            assert got.keys() == whole.keys()
            for k in whole:
                assert math.isclose(got[k], whole[k], rel_tol=1e-12), k
        assert [count for _, count in per_interval][1:] == [2, 2]  # steady state after the first
    assert all(r == results[0] for r in results)


# --------------------------------------------------------- different metric sets per rank
def case_metric_sets_differ(sizes, how):
    mesh = _mesh(sizes)
    me = dist.get_rank()
    metrics = [LossMetric(mesh), TokenStats(mesh)]
    if how == "extra" and me == 5:
        metrics.append(TrainMetric(mesh))
    elif how == "order" and me == 2:
        metrics.reverse()
    elif how == "argument" and me == 6:
        metrics[0] = LossMetric(mesh, loss_reduction="sum")
    coll = MetricCollection(metrics)
    coll.accumulate(None, {"loss": 1.0, "num_tokens": 2})
    first = _outcome(coll.calculate)
    # the job goes on: a later calculate on the same groups with the same (mismatched) sets
    return first, _outcome(coll.calculate)


@pytest.mark.parametrize("sizes", LAYOUTS)
@pytest.mark.parametrize("how,rank", [("extra", 5), ("order", 2), ("argument", 6)])
def test_different_metric_sets_raise_on_every_rank(dist_pool, sizes, how, rank):
    results = dist_pool.run(case_metric_sets_differ, sizes, how, timeout=CASE_TIMEOUT)
    for first, second in results:
        for kind, text in (first, second):
            assert kind == "MetricSyncError", text
            assert text == results[0][0][1]  # the same words everywhere
            assert f"ranks [{rank}] hold" in text and "same arguments on every rank" in text
    if how == "argument":
        assert "loss_reduction='sum'" in results[0][0][1] and "loss_reduction='mean'" in results[0][0][1]


def case_dpo_beta_differs():
    mesh = _mesh(dict(dp=8))
    m = DPOMetric(mesh, beta=1.0 if dist.get_rank() == 0 else 0.1)
    return _outcome(m.calculate)


def test_dpo_beta_differs(dist_pool):
    for kind, text in dist_pool.run(case_dpo_beta_differs, timeout=CASE_TIMEOUT):
        assert kind == "MetricSyncError" and "beta=1.0" in text and "beta=0.1" in text


class _Adds(Metric):
    """A custom metric that adds a state on the fly without declaring dynamic_state()."""

    n = State("sum", torch.int64)

    def update(self, inputs, outputs, extra_state=None, **kwargs):
        if extra_state and "extra" not in self.declarations:
            self.add_state("extra", State("sum"))
        return {"n": 1}

    def compute(self, s):
        return dict(s)


def case_undeclared_state_on_some_ranks():
    m = _Adds(_mesh(dict(tp=2, pp=2, dp=2)))
    m.accumulate(extra_state=dist.get_rank() == 7)
    return _outcome(m.calculate)


def test_state_added_on_some_ranks_without_dynamic_state_raises(dist_pool):
    for kind, text in dist_pool.run(case_undeclared_state_on_some_ranks, timeout=CASE_TIMEOUT):
        assert kind == "MetricSyncError" and "_Adds.extra exists on ranks [7] only" in text


def case_new_name_mid_run():
    mesh = _mesh(dict(tp=2, dp=4))  # new groups: nothing agreed on them yet
    m = CompletionRewardMetric(mesh)
    counts, out = [], []
    for interval in range(4):
        rewards = {"acc": [1.0]}
        if interval == 2 and mesh.dp_rank == 2:
            rewards["late"] = [2.0]  # a name one DP rank (both its TP ranks) meets in interval 3
        m.accumulate(rewards=rewards)
        with CollectiveCounter() as c:
            out.append(m.calculate())
        counts.append(c.total)
    return counts, out


def test_a_name_met_mid_run_renegotiates_once(dist_pool):
    results = dist_pool.run(case_new_name_mid_run, timeout=CASE_TIMEOUT)
    for counts, out in results:
        # over DP and TP: handshake + data; data; data that flags the new name + handshake +
        # data; data
        assert counts == [6, 2, 8, 2]
        assert out[2]["train/late_reward"] == 2.0 and out[2]["train/acc_reward"] == 1.0
        assert "train/late_reward" not in out[3]  # known everywhere now, but unseen this interval
    assert all(r[1] == results[0][1] for r in results)


# ------------------------------------------------------------- TP replicas must agree
def _vocab_batch():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 6, 16, generator=g)
    return logits, logits.argmax(-1)


def case_forgotten_vocab_parallel(vocab_parallel, source):
    return _with_source(source, lambda mesh: _forgotten_vocab_parallel(mesh, vocab_parallel))


def _forgotten_vocab_parallel(mesh, vocab_parallel):
    m = Accuracy(mesh, vocab_parallel=vocab_parallel)
    logits, labels = _vocab_batch()
    shard = logits.chunk(2, dim=-1)[mesh.tp_rank]  # Megatron's vocab shard of this TP rank
    if mesh.is_last_stage:
        m.accumulate([{"labels": labels}], [{"logits": shard}])
    else:
        m.accumulate([], [])
    return _outcome(m.calculate)


@pytest.mark.parametrize("source", ["sizes", pytest.param("megatron", marks=pytest.mark.megatron)])
def test_forgotten_vocab_parallel_raises_with_the_likely_cause(dist_pool, source):
    for kind, text in dist_pool.run(case_forgotten_vocab_parallel, False, source, timeout=CASE_TIMEOUT):
        assert kind == "MetricSyncError", text
        assert "TP replicas" in text and "Accuracy.correct" in text
        assert "pass vocab_parallel=True" in text
    for kind, got in dist_pool.run(case_forgotten_vocab_parallel, True, source, timeout=CASE_TIMEOUT):
        assert kind == "ok" and got["accuracy"] == 1.0  # and with it, the right number


def case_clock_readings_may_differ():
    import sys
    import types

    module = sys.modules[TrainMetric.__module__]
    real, now = module.time, [100.0]
    module.time = types.SimpleNamespace(perf_counter=lambda: now[0])
    try:
        mesh = _mesh(dict(tp=2, dp=4))
        m = TrainMetric(mesh)
        now[0] += 1.0 + dist.get_rank()  # every rank's clock reads differently
        m.accumulate(step=3, lr=1e-3)
        return _outcome(m.calculate)
    finally:
        module.time = real


def test_per_rank_readings_are_not_compared(dist_pool):
    results = dist_pool.run(case_clock_readings_may_differ, timeout=CASE_TIMEOUT)
    assert all(kind == "ok" for kind, _ in results)
    assert all(got == results[0][1] for _, got in results)  # one source's numbers everywhere


# ------------------------------------------------------------------ exact integers
class _Count(Metric):
    n = State("sum", torch.int64)
    hi = State("max", torch.int64)

    def update(self, inputs, outputs, value=None, **kwargs):
        return {"n": value, "hi": value}

    def compute(self, s):
        return dict(s)


def case_int64_exact(sizes):
    mesh = _mesh(sizes)
    m = _Count(mesh)
    m.accumulate(value=2 ** 53 + 1 + mesh.dp_rank)  # TP replicas hold the same numbers
    return m.calculate()


@pytest.mark.parametrize("sizes", [dict(dp=8), dict(tp=2, pp=2, dp=2)])
def test_int64_states_travel_bit_exact(dist_pool, sizes):
    dp = sizes["dp"]
    for got in dist_pool.run(case_int64_exact, sizes, timeout=CASE_TIMEOUT):
        assert got == {"n": dp * (2 ** 53 + 1) + sum(range(dp)), "hi": 2 ** 53 + dp}


# --------------------------------------------------------------------------- NaN policy
def case_nan_loss(policy):
    m = LossMetric(_mesh(dict(dp=8)), loss_reduction="sum", nan_policy=policy)
    loss = math.nan if dist.get_rank() == 3 else 2.0 * (dist.get_rank() + 1)
    m.accumulate(None, {"loss": loss, "num_tokens": 2})
    return m.calculate()


def test_one_nan_loss_shows_on_every_rank_or_is_skipped_and_counted(dist_pool):
    for got in dist_pool.run(case_nan_loss, "propagate", timeout=CASE_TIMEOUT):
        assert math.isnan(got["loss"]) and got["loss_nonfinite"] == 1
    want = sum(2.0 * (r + 1) for r in range(8) if r != 3) / 14
    for got in dist_pool.run(case_nan_loss, "skip", timeout=CASE_TIMEOUT):
        assert math.isclose(got["loss"], want, rel_tol=1e-12) and got["loss_nonfinite"] == 1


# --------------------------------------------------------- resume at another DP size
def case_resume_smaller_dp():
    """DP8 saves mid-interval; the run resumes as TP2 x DP4 on the same 8 ranks."""
    labels, values = make_batch(21, n_seq=16)
    me = dist.get_rank()
    first = TokenStats(_mesh(dict(dp=8)))
    feats, outs = shard_for_rank(labels[:8], values[:8], 8, me, 1, 0)
    first.accumulate(feats, {"values": outs})
    saved = [None] * 8
    dist.all_gather_object(saved, first.state_dict())  # the checkpoint, as every rank sees it
    mesh = _mesh(dict(tp=2, dp=4))
    k = mesh.dp_rank
    resumed = TokenStats(mesh).load_state_dict(saved[2 * k:2 * k + 2])  # old DP ranks 2k, 2k+1
    feats, outs = shard_for_rank(labels[8:], values[8:], 4, k, 1, 0)
    resumed.accumulate(feats, {"values": outs})
    return resumed.calculate()


def test_resume_at_a_smaller_dp_size_equals_the_uninterrupted_run(dist_pool):
    labels, values = make_batch(21, n_seq=16)
    whole = TokenStats().accumulate({"labels": labels}, {"values": values}).calculate()
    for got in dist_pool.run(case_resume_smaller_dp, timeout=CASE_TIMEOUT):
        assert got["tokens"] == whole["tokens"] and got["max"] == whole["max"]
        assert math.isclose(got["mean"], whole["mean"], rel_tol=1e-12)
