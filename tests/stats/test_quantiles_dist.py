"""Quantiles and TrainMetric's straggler keys on 8 real gloo ranks.

Histogram counts are integers, so the quantiles of a sharded run must equal those of
one process on the whole batch exactly, whatever the layout; the slowest rank is set
by a controlled clock per rank, and every rank must name the same one.
"""
import types

import pytest
import torch

from parallel import DeviceMesh
from tests.refmetric import cp_slice, dp_shards
from tests.rlref import make_rl_batch
from twinkle_metrics import CompletionRewardMetric, DPOMetric, GRPOMetric, MetricCollection, TrainMetric
from twinkle_metrics.testing import assert_results_close, forbid_device_waits

pytestmark = pytest.mark.xdist_group("dist")

SEED = 33
N_SEQ, SEQ_LEN = 16, 8
QS = (0.5, 0.9, 0.99)
LAYOUTS = [dict(dp=8), dict(tp=2, pp=2, dp=2), dict(tp=2, cp=2, dp=2)]


def _data():
    b = make_rl_batch(SEED, N_SEQ, SEQ_LEN)
    g = torch.Generator().manual_seed(SEED)
    b["ent"] = torch.rand(N_SEQ, SEQ_LEN, generator=g, dtype=torch.float64) * 4
    b["fmt"] = (torch.randn(N_SEQ, generator=g, dtype=torch.float64) * 3).tolist()
    b["acc"] = (torch.rand(N_SEQ, generator=g) < 0.5).double().tolist()
    b["lens"] = torch.randint(0, 300, (N_SEQ,), generator=g).tolist()
    return b


def _metrics(mesh):
    return MetricCollection({"grpo": GRPOMetric(quantiles=QS), "dpo": DPOMetric(beta=0.2, quantiles=QS),
                             "": CompletionRewardMetric(quantiles=QS)}, device_mesh=mesh)


def _accumulate(coll, b, rows, cols, pairs):
    """One rank's shard; the 'fmt' reward only for sequences 4.. (a name some ranks never see)."""
    rows, seq = torch.tensor(list(rows)), list(rows)
    dpo_rows = torch.tensor([r for p in pairs for r in (2 * p, 2 * p + 1)], dtype=torch.long)
    lab, lp, old, ref = (b[k][:, cols] for k in ("labels", "logps", "old", "ref"))
    with forbid_device_waits():
        coll["grpo"].accumulate({"labels": lab[rows]}, {"logps": lp[rows], "entropies": b["ent"][:, cols][rows]},
                                old_logps=old[rows], advantages=b["adv"][rows])
        coll["dpo"].accumulate({"labels": lab[dpo_rows]}, {"logps": lp[dpo_rows]},
                               ref_outputs={"logps": ref[dpo_rows]})
        rewards = {"acc": [b["acc"][i] for i in seq]}
        fmt = [b["fmt"][i] for i in seq if i >= 4]
        if fmt:
            rewards["fmt"] = fmt
        coll[""].accumulate(rewards=rewards, completion_lengths=[b["lens"][i] for i in seq])


def whole_results():
    b = _data()
    coll = _metrics(DeviceMesh.single())
    for part in (range(0, 4), range(4, N_SEQ)):  # the same reward calls as the shards make
        _accumulate(coll, b, part, torch.arange(SEQ_LEN), range(part.start // 2, part.stop // 2))
    return coll.calculate()


def _step_seconds(rank):
    """A distinct interval per rank, slowest not at either end of the world."""
    return 2.0 + ((rank * 5) % 8) * 0.25


def case_quantiles_and_stragglers(sizes):
    import twinkle_metrics.metrics.system.train as train_module

    mesh = DeviceMesh.from_sizes(**{f"{k}_size": v for k, v in sizes.items()})
    b = _data()
    coll = _metrics(mesh)
    if mesh.is_last_stage:
        rows = dp_shards(N_SEQ, mesh.dp_size)[mesh.dp_rank]
        pairs = dp_shards(N_SEQ // 2, mesh.dp_size)[mesh.dp_rank]
        _accumulate(coll, b, rows, cp_slice(SEQ_LEN, mesh.cp_size, mesh.cp_rank), pairs)
    else:
        for m in coll:
            m.accumulate([], {})  # what a non-last stage gets from the schedule
    quantiles = coll.calculate()

    now = [100.0]
    real_time = train_module.time
    train_module.time = types.SimpleNamespace(perf_counter=lambda: now[0])
    try:
        train = TrainMetric(mesh)
        now[0] += 3 * _step_seconds(torch.distributed.get_rank())  # 3 iterations of 2 micro steps
        with forbid_device_waits():
            train.accumulate(None, None, step=6, gradient_accumulation_steps=2)
        stragglers = train.calculate()
    finally:
        train_module.time = real_time
    return quantiles, stragglers


@pytest.mark.parametrize("sizes", LAYOUTS)
def test_quantiles_exact_and_slowest_rank_on_every_layout(dist_pool, sizes):
    whole = whole_results()
    qkeys = sorted(k for k in whole if k.rsplit("_", 1)[-1] in ("p50", "p90", "p99"))
    # every histogram reports: GRPO's three, DPO's margins, lengths and both rewards
    assert len(qkeys) == 3 * 7 and "train/fmt_reward_p50" in qkeys and "dpo/rewards/margins_p99" in qkeys
    seconds = [_step_seconds(r) for r in range(dist_pool.world)]
    slowest = seconds.index(max(seconds))
    assert 0 < slowest < dist_pool.world - 1
    for quantiles, stragglers in dist_pool.run(case_quantiles_and_stragglers, sizes):
        assert {k: quantiles[k] for k in qkeys} == {k: whole[k] for k in qkeys}  # integers: exact
        assert_results_close(quantiles, whole, rel=1e-9)
        assert stragglers["train/step_time_slowest_rank"] == slowest
        assert stragglers["train/step_time_max"] == pytest.approx(max(seconds), rel=1e-12)
        assert stragglers["train/step_time_min"] == pytest.approx(min(seconds), rel=1e-12)
