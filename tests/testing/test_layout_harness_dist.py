"""The layout-invariance harness (twinkle_metrics.testing.assert_layout_invariant) on real
gloo ranks: a correct metric passes every layout, a wrong reduction and an extra
collective fail naming the layout, the rank and the key; it runs from a plain script."""
import functools
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from twinkle_metrics import Metric, State
from twinkle_metrics.testing import Shard, assert_layout_invariant, collective_budget, parse_layout
from twinkle_metrics.testing.layout import check_collectives, shard_of

pytestmark = pytest.mark.xdist_group("dist")

ROOT = os.path.abspath(os.path.join(__file__, "../../.."))
LAYOUTS = ["dp2", "tp2xdp2", "cp2xdp2", "pp2xdp2"]
NSEQ, SEQ = 6, 8


class MaskedMean(Metric):
    total = State("sum", torch.float64)
    count = State("sum", torch.int64)

    def update(self, inputs, outputs, **kwargs):
        mask = inputs["labels"] != -100
        return {"total": (outputs["values"].double() * mask).sum(), "count": mask.sum()}

    def compute(self, s):
        return {"mean": s["total"] / s["count"], "tokens": s["count"]} if s["count"] else {}


class MaxCountMean(MaskedMean):
    """The token count reduced with max instead of sum: right on one rank only."""

    count = State("max", torch.int64)


class ChattyMean(MaskedMean):
    """Right numbers, but its calculate() adds an all_reduce over the data group."""

    def calculate(self, *args, **kwargs):
        out = super().calculate(*args, **kwargs)
        mesh = self.device_mesh
        if mesh.data_size > 1:
            dist.all_reduce(torch.zeros(1), group=mesh.data_group)
        return out


class MiscountedExport(MaskedMean):
    """Right calculate(), but its exports count one token too many on each rank."""

    def export(self):
        out = super().export()
        out["metrics"][0]["states"]["count"][1] += 1
        return out


def batch(interval):
    g = torch.Generator().manual_seed(100 + interval)
    labels = torch.randint(0, 9, (NSEQ, SEQ), generator=g)
    labels[torch.rand(NSEQ, SEQ, generator=g) < 0.3] = -100
    return labels, torch.randn(NSEQ, SEQ, generator=g, dtype=torch.float64)


def feed(metric, shard):
    if not shard.is_last_stage:
        return  # a non-last pipeline stage has no outputs
    labels, values = batch(shard.interval)
    rows = torch.arange(NSEQ).tensor_split(shard.dp_size)[shard.dp_rank]
    cols = torch.arange(SEQ).tensor_split(shard.cp_size)[shard.cp_rank]
    metric.accumulate({"labels": labels[rows][:, cols]}, {"values": values[rows][:, cols]})


def feed_failing_on_rank_1(metric, shard):
    if shard.rank == 1:
        raise RuntimeError("feed broke on purpose")
    feed(metric, shard)


def whole(interval):
    labels, values = batch(interval)
    mask = labels != -100
    return {"mean": float((values * mask).sum() / mask.sum()), "tokens": int(mask.sum())}


@pytest.mark.parametrize("layouts", [LAYOUTS, ["tp2xpp2xdp2", "ep2xdp2", "ep2xcp2xdp2"]])
def test_correct_metric_passes(dist_pool, layouts):
    report = assert_layout_invariant(MaskedMean, feed, layouts, pool=dist_pool, intervals=3)
    for i in range(3):
        assert report.reference[i] == pytest.approx(whole(i), rel=1e-12)
    assert report.reference[0] != report.reference[1]  # the intervals hold different data
    for name in layouts:
        n = parse_layout(name).world_size
        assert len(report.results[name]) == n and len(report.collectives[name]) == n
        # the steady state is exactly the library's budget: 1, or 2 with TP or PP
        assert all(c[1:] == [collective_budget(parse_layout(name))] * 2 for c in report.collectives[name])


def test_wrong_reduction_names_layout_rank_and_key(dist_pool):
    with pytest.raises(AssertionError) as e:
        assert_layout_invariant(MaxCountMean, feed, ["dp2"], pool=dist_pool)
    text = str(e.value)
    assert "layout 'dp2', rank 0, interval 0" in text and "tokens: " in text and "mean: " in text


def test_extra_collective_trips_the_budget(dist_pool):
    with pytest.raises(AssertionError) as e:
        assert_layout_invariant(ChattyMean, feed, ["tp2xdp2"], pool=dist_pool)
    assert "layout 'tp2xdp2', rank 0, interval 1: calculate() issued 3 collectives" in str(e.value)
    assert "budget of 2" in str(e.value)
    # the same metric under a budget that allows it
    assert_layout_invariant(ChattyMean, feed, ["tp2xdp2"], pool=dist_pool, max_collectives=3)


def test_a_wrong_export_names_the_layout_and_the_driver(dist_pool):
    """The export path is checked too: a driver merging the exports must get the single
    process's numbers; ``exports=False`` leaves it out."""
    with pytest.raises(AssertionError) as e:
        assert_layout_invariant(MiscountedExport, feed, ["tp2xdp2"], pool=dist_pool)
    assert "layout 'tp2xdp2', rank driver (every rank's export), interval 0" in str(e.value)
    assert "tokens: " in str(e.value)
    assert_layout_invariant(MiscountedExport, feed, ["tp2xdp2"], pool=dist_pool, exports=False)


def test_budget_check_and_shards_unit():
    check_collectives("dp2", 0, [7, 1, 1], 1)  # the first calculate agrees on the plan: exempt
    with pytest.raises(AssertionError, match="rank 3, interval 2: calculate\\(\\) issued 2"):
        check_collectives("dp2", 3, [3, 1, 2], 1)
    lay = parse_layout("tp2xpp2xdp2")
    shards = [shard_of(lay, r) for r in range(8)]
    # Megatron order: TP fastest, then DP, then PP; TP replicas share (dp, cp)
    assert [(s.tp_rank, s.dp_rank, s.pp_rank) for s in shards[:4]] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
    assert [s.is_last_stage for s in shards] == [False] * 4 + [True] * 4
    ep = [shard_of(parse_layout("ep2xdp2"), r) for r in range(4)]
    assert [(s.dp_rank, s.dp_size, s.ep_rank, s.ep_size) for s in ep] == [(r, 4, r % 2, 2) for r in range(4)]
    assert Shard() == Shard(dp_rank=0, dp_size=1, is_last_stage=True, interval=0)
    for bad in ("dp2xdp2", "tp0xdp2", "dq2", "", "tp2-dp2"):
        with pytest.raises(ValueError, match="accepted: '<axis><size>' joined by 'x'"):
            assert_layout_invariant(MaskedMean, feed, [bad])


def test_pool_too_small_and_intervals(dist_pool):
    with pytest.raises(ValueError, match="need more ranks than the pool's 8"):
        assert_layout_invariant(MaskedMean, feed, ["tp2xpp2xdp4"], pool=dist_pool)
    with pytest.raises(ValueError, match="intervals must be >= 2"):
        assert_layout_invariant(MaskedMean, feed, ["dp2"], pool=dist_pool, intervals=1)


def test_own_ranks_from_pytest_and_a_failing_rank():
    """Without a pool the harness starts (fork) and kills its own ranks."""
    assert_layout_invariant(MaskedMean, functools.partial(feed), ["dp2", "cp2xdp2"])
    failed = "(?s)layout 'dp2': 1 rank\\(s\\) failed.*; rank 1:.*feed broke on purpose"
    with pytest.raises(AssertionError, match=failed):
        assert_layout_invariant(MaskedMean, feed_failing_on_rank_1, ["dp2"])


SCRIPT = textwrap.dedent('''
    import sys

    import torch

    from twinkle_metrics import Metric, State
    from twinkle_metrics.testing import assert_layout_invariant


    class MaskedMean(Metric):
        total = State("sum", torch.float64)
        count = State({count!r}, torch.int64)

        def update(self, inputs, outputs, **kwargs):
            mask = inputs["labels"] != -100
            return {{"total": (outputs["values"].double() * mask).sum(), "count": mask.sum()}}

        def compute(self, s):
            return {{"mean": s["total"] / s["count"], "tokens": s["count"]}} if s["count"] else {{}}


    def make_metric(mesh):
        return MaskedMean(mesh)


    def feed(metric, shard):
        if not shard.is_last_stage:
            return
        g = torch.Generator().manual_seed(shard.interval)
        labels = torch.randint(0, 9, (6, 8), generator=g)
        labels[torch.rand(6, 8, generator=g) < 0.3] = -100
        values = torch.randn(6, 8, generator=g, dtype=torch.float64)
        rows = torch.arange(6).tensor_split(shard.dp_size)[shard.dp_rank]
        cols = torch.arange(8).tensor_split(shard.cp_size)[shard.cp_rank]
        metric.accumulate({{"labels": labels[rows][:, cols]}}, {{"values": values[rows][:, cols]}})


    if __name__ == "__main__":
        assert_layout_invariant(make_metric, feed, {layouts!r}, start_method={start!r})
        print("invariant")
''')


def _run_script(tmp_path, name, **fmt):
    path = tmp_path / name
    path.write_text(SCRIPT.format(**fmt))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)


def test_plain_script(tmp_path):
    ok = _run_script(tmp_path, "good.py", count="sum", layouts=LAYOUTS, start=None)
    assert ok.returncode == 0 and "invariant" in ok.stdout, ok.stderr
    # spawned ranks re-import the script as __mp_main__: its functions reach them too
    bad = _run_script(tmp_path, "bad.py", count="max", layouts=["dp2"], start="spawn")
    assert bad.returncode != 0 and "invariant" not in bad.stdout
    assert "AssertionError: layout 'dp2', rank 0, interval 0" in bad.stderr and "tokens: " in bad.stderr, bad.stderr
