"""The data phase's reduce path (all-reduces instead of one gather), forced on 8 gloo ranks.

Data groups of more than ``sync.REDUCE_ABOVE`` ranks all-reduce their sums and
extremes and gather only the states a metric merges itself. Each case here sets the
threshold to 1 on every rank, so the 2- to 8-rank data groups of the pool take that
path, and checks it against the single-process run and the gather path.

Steady state on the reduce path: one int64 MAX all_reduce (plan agreement, need
flag, every max and min), one float64 SUM and one int64 SUM all_reduce (each only
when such states exist), one all_gather of the self-merged states (only when there
are some) over the data group; then, under TP or PP, the one all_gather over TP x PP.
"""
import math

import pytest
import torch
import torch.distributed as dist

from parallel import DeviceMesh
from tests.comm import test_foundation_dist as foundation
from tests.core import test_faults_dist as faults
from tests.dist import sync_error
from tests.metrics.rl import test_metrics_rl_dist as rl
from tests.refmetric import TokenStats
from twinkle_metrics import Metric, MetricCollection, State
from twinkle_metrics.comm import fused as sync
from twinkle_metrics.testing import CollectiveCounter, assert_results_close

pytestmark = pytest.mark.xdist_group("dist")

CASE_TIMEOUT = 120
LAYOUTS = [dict(tp=2, pp=2, dp=2), dict(tp=2, cp=2, dp=2), dict(dp=8)]


def case_reduced(fn, *args):
    """``fn(*args)`` with every data group of 2+ ranks on the reduce path; returns its
    result and the collectives it made by kind."""
    saved = sync.REDUCE_ABOVE
    sync.REDUCE_ABOVE = 1
    try:
        with CollectiveCounter() as c:
            out = fn(*args)
        return out, dict(c.wire)
    finally:
        sync.REDUCE_ABOVE = saved


# ---------------------------------------------------------------- sharded == whole
@pytest.mark.parametrize("sizes", LAYOUTS)
def test_core_sharded_equals_whole(dist_pool, sizes):
    whole = foundation._whole(7)
    for got, kinds in dist_pool.run(case_reduced, foundation.case_sharded_equals_whole, sizes, 7,
                                    timeout=CASE_TIMEOUT):
        # the path taken: MAX, float SUM, int SUM per data phase; on groups that carried
        # other metric sets before (WORLD for dp=8, in a shared pool) one data phase may
        # flag the new set first, then the negotiation and a second data phase
        assert kinds.get("all_reduce") in (3, 6), kinds
        assert got.keys() == whole.keys()
        assert got["tokens"] == whole["tokens"]
        assert math.isclose(got["mean"], whole["mean"], rel_tol=1e-12)
        assert got["max"] == whole["max"] and got["min"] == whole["min"]


@pytest.mark.parametrize("sizes", LAYOUTS[:2] + [dict(cp=2, dp=4)])
def test_rl_sharded_equals_whole(dist_pool, sizes):
    """GRPO's top-k records and the reward moments are gathered and merged by their own
    merge; every other state of the five RL metrics is all-reduced. (The RL batch has 6
    DPO pairs, so its layouts stop at DP4, as in tests/metrics/rl/test_metrics_rl_dist.py.)"""
    whole = rl.whole_results()
    assert len(whole["grpo/_high_kl_records"]) == 6
    for (got, _, _), kinds in dist_pool.run(case_reduced, rl.case_sharded_equals_whole, "sizes", sizes,
                                            timeout=CASE_TIMEOUT):
        assert kinds.get("all_reduce", 0) >= 3, kinds
        assert_results_close(got, whole, rel=1e-9)


# ------------------------------------------------------- exactness, NaN, both paths
class Extremes(Metric):
    """Every reduction of both dtypes, fed the values the test picks per rank."""

    f_max = State("max")
    f_min = State("min")
    g_max = State("max")
    g_min = State("min")
    i_max = State("max", torch.int64)
    i_min = State("min", torch.int64)
    f_sum = State("sum")
    i_sum = State("sum", torch.int64)

    def update(self, inputs, outputs, **kwargs):
        return dict(outputs)

    def compute(self, s):
        return dict(s)


def _extreme_values(dp, pp):
    """A NaN in one rank's max and min; -0.0 and -inf; int64 past 2**53 (not exact in
    float64) with ranks differing in the last bits. TP replicas hold the same numbers."""
    return {"f_max": math.nan if dp == 1 else 0.25 * dp - 3.0 + pp,
            "f_min": math.nan if dp == 1 else 1.5 * dp + pp,
            "g_max": -math.inf if dp == 0 else -1e300 * dp + pp,
            "g_min": -0.0 if dp == 0 else 2.0 ** -1074 * (dp + pp),
            "i_max": 2 ** 62 + 3 * dp + pp, "i_min": -(2 ** 62) - 5 * dp - pp,
            "f_sum": 0.1 * dp + pp, "i_sum": 2 ** 58 + 7 * dp + pp}


def case_extremes(sizes):
    mesh = DeviceMesh.from_sizes(**{f"{k}_size": v for k, v in sizes.items()})
    m = Extremes(mesh)
    m.accumulate(None, _extreme_values(mesh.dp_rank, mesh.pp_rank))
    reduced, _ = case_reduced(m.calculate, False)
    saved = sync.REDUCE_ABOVE
    sync.REDUCE_ABOVE = 1 << 30
    try:
        gathered = m.calculate()
    finally:
        sync.REDUCE_ABOVE = saved
    return reduced, gathered, mesh.pp_size


@pytest.mark.parametrize("sizes", [dict(dp=8), dict(tp=2, pp=2, dp=2)])
def test_extremes_and_int64_match_the_gather_path(dist_pool, sizes):
    for reduced, gathered, pp in dist_pool.run(case_extremes, sizes, timeout=CASE_TIMEOUT):
        rows = [_extreme_values(dp, pp - 1) for dp in range(sizes["dp"])]  # the last stage's
        want = {k: sum(r[k] for r in rows) for k in ("f_sum", "i_sum")}
        for k in ("f_max", "g_max", "i_max"):
            want[k] = math.nan if any(math.isnan(r[k]) for r in rows) else max(r[k] for r in rows)
        for k in ("f_min", "g_min", "i_min"):
            want[k] = math.nan if any(math.isnan(r[k]) for r in rows) else min(r[k] for r in rows)
        assert math.isnan(reduced["f_max"]) and math.isnan(reduced["f_min"])
        assert isinstance(reduced["i_sum"], int) and reduced["i_sum"] > 2 ** 58
        assert_results_close(reduced, want, rel=1e-12, abs_tol=0.0)
        for k in want:  # ints bit-exact, floats within the sum's rounding, NaN as NaN
            if isinstance(want[k], int):
                assert reduced[k] == gathered[k] == want[k], k
        assert_results_close(reduced, gathered, rel=1e-12, abs_tol=0.0)


@pytest.mark.parametrize("sizes", [dict(tp=2, pp=2, dp=2), dict(tp=2, cp=2, dp=2)])
def test_state_scopes_on_the_reduce_path(dist_pool, sizes):
    """Stage and model scopes merge over TP x PP after the reduced data phase; int64
    stays exact past 2**53."""
    out = dist_pool.run(case_reduced, foundation.case_state_scopes, sizes, timeout=CASE_TIMEOUT)
    last = out[0][0][1] - 1
    every = [foundation._placed_values(**pos) for (pos, *_), _ in out]
    tp0 = [v for ((pos, *_), _), v in zip(out, every) if pos["tp"] == 0]
    expected = {
        "d": sum(v["d"] for ((pos, *_), _), v in zip(out, every) if pos["tp"] == 0 and pos["pp"] == last),
        "s": sum(v["s"] for v in tp0), "s_low": min(v["s_low"] for v in tp0),
        "m": sum(v["m"] for v in every), "m_peak": max(v["m_peak"] for v in every)}
    assert isinstance(expected["m"], int) and expected["m"] > 2 ** 56
    for (pos, _, counts, results), _ in out:
        assert results == [expected, expected], (pos, results)
        assert counts[1] == 4  # MAX, float SUM, int SUM over the data group; one share


# ------------------------------------------------------------------ collectives
def case_steady_counts(sizes):
    # new groups: the collectives' sizes are the largest any set synced on these groups
    # needed (as the gather path's width), so a set run before on them would count here
    mesh = DeviceMesh.from_sizes(**{f"{k}_size": v for k, v in sizes.items()})
    sets = {"core": MetricCollection({f"m{i}": TokenStats() for i in range(3)}, device_mesh=mesh),
            "rl": rl._metrics(mesh)}
    counts = {}
    for name, coll in sets.items():
        counts[name] = []
        for _ in range(3):
            with CollectiveCounter() as c:
                coll.calculate()
            counts[name].append(dict(c.wire))
    return counts


def _by_kind(wire):
    """(all-reduces, all-gathers, anything else) in a ``CollectiveCounter.wire``."""
    gathers = sum(n for k, n in wire.items() if k.startswith("all_gather"))
    return wire.get("all_reduce", 0), gathers, sum(wire.values()) - gathers - wire.get("all_reduce", 0)


@pytest.mark.parametrize("sizes", [dict(tp=2, dp=4), dict(tp=2, pp=2, dp=2)])
def test_steady_state_collectives(dist_pool, sizes):
    share = 1 if sizes.get("tp", 1) * sizes.get("pp", 1) > 1 else 0
    for counts, _ in dist_pool.run(case_reduced, case_steady_counts, sizes, timeout=CASE_TIMEOUT):
        # only sums and extremes: 3 all-reduces, and the share gather under TP x PP
        assert [_by_kind(w) for w in counts["core"][1:]] == [(3, share, 0)] * 2, counts
        # the RL set also gathers GRPO's top-k records and the reward moments: one gather
        assert [_by_kind(w) for w in counts["rl"][1:]] == [(3, 1 + share, 0)] * 2, counts


# ------------------------------------------------------------------------ errors
@pytest.mark.parametrize("sizes,how,rank", [(dict(dp=8), "extra", 5), (dict(tp=2, pp=2, dp=2), "order", 2)])
def test_different_metric_sets_raise_on_every_rank(dist_pool, sizes, how, rank):
    results = dist_pool.run(case_reduced, faults.case_metric_sets_differ, sizes, how, timeout=CASE_TIMEOUT)
    for (first, second), _ in results:
        for kind, text in (first, second):
            assert kind == "MetricSyncError", text
            assert text == results[0][0][0][1]
            assert f"ranks [{rank}] hold" in text


def test_a_name_met_mid_run_renegotiates_once(dist_pool):
    """A rank that flags a new state packs no states; the MAX carries its flag to all."""
    results = dist_pool.run(case_reduced, faults.case_new_name_mid_run, timeout=CASE_TIMEOUT)
    for (counts, out), _ in results:
        # handshake (4) + data (4 + share); data; data that flags the name + handshake + data; data
        assert counts == [9, 5, 14, 5]
        assert out[2]["train/late_reward"] == 2.0 and out[2]["train/acc_reward"] == 1.0
        assert "train/late_reward" not in out[3]
    assert all(r[0][1] == results[0][0][1] for r in results)


def case_paths_differ():
    saved = sync.REDUCE_ABOVE
    sync.REDUCE_ABOVE = 1 if dist.get_rank() == 0 else 1 << 30  # rank 0 alone would all-reduce
    try:
        m = TokenStats(DeviceMesh.from_sizes(tp_size=2, dp_size=4))  # new groups: a handshake first
        return sync_error(m.calculate)
    finally:
        sync.REDUCE_ABOVE = saved


def test_ranks_on_different_paths_raise_instead_of_hanging(dist_pool):
    for err in dist_pool.run(case_paths_differ, timeout=CASE_TIMEOUT):
        assert err is not None and "TWINKLE_METRICS_REDUCE_ABOVE" in err, err
        assert "ranks [0]: reduce" in err and "ranks [1-7]: gather" in err, err
