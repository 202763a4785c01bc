"""A metric's interval: the one object staging, the sync, hand-offs and checkpoints work on."""
from __future__ import annotations

import torch

from twinkle_metrics import LossMetric, Metric, MetricCollection, State
from twinkle_metrics.core import interval
from twinkle_metrics.core.interval import Interval
from twinkle_metrics.core.state import interval_of


class Peak(Metric):
    peak = State("max")
    count = State("sum", torch.int64)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state_family("seen/", State("sum", torch.int64))

    def update(self, inputs, outputs, *, value=None, tag=None, **kwargs):
        out = {"peak": float(value), "count": 1}
        if tag is not None:
            out[f"seen/{tag}"] = 1
        return out

    def compute(self, s):
        return {"peak": s["peak"], "count": s["count"], **{k: v for k, v in s.items() if k.startswith("seen/")}}


def test_accumulate_folds_into_the_current_interval_and_reset_starts_a_new_one():
    m = Peak()
    first = interval_of(m)
    assert isinstance(first, Interval) and first.owner is m and first.name == "Peak"
    m.accumulate(value=3.0, tag="a")
    assert interval_of(m) is first
    assert first.touched == {"peak", "count", "seen/a"} and first.states["count"].item() == 1
    assert m.peak.item() == 3.0  # the author's view reads the same interval
    m.reset()
    second = interval_of(m)
    assert second is not first and second.touched == set() and second.number == first.number
    assert "seen/a" in second.specs and second.specs is not first.specs  # declarations carry over
    assert first.states["count"].item() == 1  # the ended interval is left as it was


def test_calculate_ends_the_interval_and_numbers_the_next():
    m = Peak()
    m.accumulate(value=2.0)
    before = interval_of(m)
    assert m.calculate() == {"peak": 2.0, "count": 1}
    assert interval_of(m) is not before and interval_of(m).number == before.number + 1
    assert m.calculate(reset=False) == {"peak": -float("inf"), "count": 0}
    assert interval_of(m).number == before.number + 1


def test_an_asynchronous_calculate_hands_the_interval_itself_off():
    m = Peak()
    m.accumulate(value=5.0, tag="b")
    handed = interval_of(m)
    handle = m.calculate(async_op=True)
    assert interval_of(m) is not handed  # the metric goes on in a new interval at once
    m.accumulate(value=1.0)
    assert handle.wait(30) == {"peak": 5.0, "count": 1, "seen/b": 1}
    assert m.calculate() == {"peak": 1.0, "count": 1, "seen/b": 0}


def test_fold_under_puts_an_earlier_interval_first():
    m = Peak()
    m.accumulate(value=4.0, tag="x")
    earlier = interval_of(m)
    m.reset()
    m.accumulate(value=1.0, tag="y")
    interval_of(m).fold_under(earlier)
    assert m.calculate() == {"peak": 4.0, "count": 2, "seen/x": 1, "seen/y": 1}


def test_sync_and_compute_of_a_collection_without_a_group():
    coll = MetricCollection({"loss": LossMetric(), "peak": Peak()})
    coll.accumulate(None, {"loss": 2.0, "num_tokens": 4}, value=7.0)
    got = interval.sync_and_compute(list(coll))
    assert got[0]["loss"] == 2.0 and got[1] == {"peak": 7.0, "count": 1}
    assert coll.calculate()["peak/count"] == 1  # sync_and_compute ended nothing


def test_copy_and_adopt_leave_the_original_alone():
    m = Peak()
    m.accumulate(value=1.0)
    iv = interval_of(m)
    scratch = iv.copy(states={}, device=torch.device("cpu"), touched=set())
    scratch.adopt(["seen/z"])
    assert "seen/z" in scratch.specs and "seen/z" not in iv.specs and scratch.states["seen/z"].item() == 0


class Spread(Metric):
    """A shaped state, a kept total and an int64 minimum: one of each kind a block holds."""

    hist = State("sum", shape=(2, 3))
    low = State("min", torch.int64)
    total = State("sum", keep=True)

    def update(self, inputs, outputs, *, value=None, **kwargs):
        return {"hist": torch.full((2, 3), float(value), dtype=torch.float64), "low": int(value), "total": value}

    def compute(self, s):
        return {"hist": s["hist"], "low": s["low"], "total": s["total"]}


def test_a_collection_ends_its_members_intervals_together_each_on_its_own_states():
    coll = MetricCollection({"peak": Peak(), "spread": Spread(), "loss": LossMetric()})
    coll.accumulate(None, {"loss": 2.0, "num_tokens": 4}, value=3.0, tag="a")
    ended = [interval_of(m) for m in coll]
    assert coll.calculate()["spread/total"] == 3.0
    for m, old in zip(coll, ended):  # every state at its default again (a kept one carried on)
        new = interval_of(m)
        assert new is not old and new.number == old.number + 1 and new.fresh is None and old.fresh is None
        for name, spec in new.specs.items():
            want = old.states[name] if spec.keep else torch.full(spec.shape, spec.identity, dtype=spec.dtype)
            assert torch.equal(new.states[name], want), (type(m).__name__, name)
    assert ended[1].states["low"].item() == 3 and ended[0].states["count"].item() == 1  # left as they were
    peak, spread, loss = coll
    spread.accumulate(value=5.0)  # one member's states share no element with another's
    assert peak.calculate(reset=False) == {"peak": -float("inf"), "count": 0, "seen/a": 0}
    assert loss.calculate(reset=False) == {}  # nothing accumulated: no loss
    got = coll.calculate()
    assert got["spread/hist"] == [[5.0] * 3] * 2 and got["spread/low"] == 5 and got["spread/total"] == 8.0
    assert got["peak/count"] == 0
