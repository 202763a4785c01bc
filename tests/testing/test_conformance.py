"""``check_metric`` passes a metric that keeps the contract and names each way one breaks it
(single-process checks; its layout part is ``assert_layout_invariant``, run by
tests/metrics/test_conformance_dist.py and the executed example of docs/testing.md)."""
import functools
import itertools

import pytest
import torch

from twinkle_metrics import Metric, MetricCollection, State
from twinkle_metrics.testing import check_metric


class Total(Metric):
    total = State("sum")
    count = State("sum", torch.int64)
    result_keys = ("mean", "count")

    def update(self, inputs, outputs, **kwargs):
        values = torch.as_tensor(outputs["values"], dtype=torch.float64)
        if values.dim() != 1:
            raise ValueError(f"Total: values must be 1-D, got shape {list(values.shape)}")
        return {"total": values.sum(), "count": values.numel()}

    def compute(self, s):
        return {"mean": s["total"] / s["count"], "count": s["count"]} if s["count"] else {}


def feed(metric, shard):
    values = torch.arange(6, dtype=torch.float64) + shard.interval
    metric.accumulate(None, {"values": values.tensor_split(shard.dp_size)[shard.dp_rank]})


def reject(metric):
    metric.accumulate(None, {"values": torch.ones(2, 2)})


def pair(mesh):
    return MetricCollection({"a": Total(mesh), "b": Total(mesh)})


class Undeclared(Total):
    def compute(self, s):
        return {**super().compute(s), "extra": 1}


class Counting(Total):
    """Its results count its calls: calculate(reset=False) is not idempotent."""

    result_keys = ("mean", "count", "calls")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0

    def compute(self, s):
        self.calls += 1
        return {**super().compute(s), "calls": self.calls}


class Salted(Total):
    """Its results read an attribute that is neither an argument nor a state."""

    result_keys = ("mean", "count", "salt")
    made = itertools.count()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.salt = next(Salted.made)  # lost by a checkpoint

    def compute(self, s):
        return {**super().compute(s), "salt": self.salt}


class Unpicklable(Total):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.hook = lambda: None


class InPlace(Total):
    def update(self, inputs, outputs, **kwargs):
        self.count.add_(1)  # the live state: the library folds what update returns, nothing else
        return super().update(inputs, outputs, **kwargs)


class Clock(Total):
    result_keys = ("mean", "count", "now")
    ticks = itertools.count()

    def compute(self, s):
        return {**super().compute(s), "now": next(Clock.ticks)}


def test_a_metric_that_keeps_the_contract_passes():
    assert check_metric(Total, feed, (), reject=reject) is None
    check_metric(pair, feed, ())


def test_an_undeclared_key_is_the_librarys_error():
    with pytest.raises(ValueError, match="Undeclared: compute\\(\\) returned the key 'extra'"):
        check_metric(Undeclared, feed, ())


def test_a_calculate_that_changes_its_results():
    with pytest.raises(AssertionError, match="Counting: a second calculate\\(reset=False\\) returned other "
                                             "results.*calls"):
        check_metric(Counting, feed, ())


def test_results_that_depend_on_more_than_the_states():
    with pytest.raises(AssertionError, match="Salted: load_state_dict\\(state_dict\\(\\)\\) returned other results"):
        check_metric(Salted, feed, ())


def test_a_metric_that_cannot_be_pickled():
    with pytest.raises(AssertionError, match="Unpicklable: it cannot be pickled"):
        check_metric(Unpicklable, feed, ())


def test_an_update_that_changes_the_states_itself():
    with pytest.raises(AssertionError, match="InPlace: a call refused after update\\(\\) returned changed the "
                                             "states.*'count'"):
        check_metric(InPlace, feed, ())


def test_a_rejected_call_that_is_accepted_or_changes_states():
    with pytest.raises(AssertionError, match="Total: reject\\(metric\\) was accepted"):
        check_metric(Total, feed, (), reject=lambda m: m.accumulate(None, {"values": [1.0]}))

    def half_done(m):
        m.accumulate(None, {"values": [1.0]})
        m.accumulate(None, {"values": torch.ones(2, 2)})

    with pytest.raises(AssertionError, match="Total: a rejected call \\(reject\\) changed the states"):
        check_metric(Total, feed, (), reject=half_done)


def test_a_feed_that_never_reaches_update():
    with pytest.raises(AssertionError, match="Total: feed\\(metric, Shard\\(\\)\\) never reached update"):
        check_metric(Total, lambda m, shard: None, ())


def test_ignored_keys_are_left_out_of_every_comparison():
    with pytest.raises(AssertionError, match="Clock: a second calculate.*now"):
        check_metric(Clock, feed, ())
    check_metric(Clock, feed, (), ignore={"now"})
    check_metric(functools.partial(Clock), feed, (), ignore=lambda key: key == "now")
