"""Returned keys are checked by the library: a key ``compute`` returns that ``result_keys``
does not name raises at ``calculate()``, at its asynchronous handle and at ``calculate_from``,
naming the metric and the key (``core.interval.results``, where every path goes)."""
import json

import pytest
import torch

from twinkle_metrics import Metric, MetricCollection, State
from twinkle_metrics.testing import merged_results


class Keyed(Metric):
    """Returns ``extra`` (a key of its own choosing) beside its declared ones."""

    n = State("sum", torch.int64)
    result_keys = ("count", "per/*", "{label}_n")

    def __init__(self, device_mesh=None, process_group=None, *, extra=None, label="x", **kwargs):
        super().__init__(device_mesh, process_group, **kwargs)
        self.extra, self.label = extra, label

    def update(self, inputs, outputs, **kwargs):
        return {"n": 1}

    def compute(self, s):
        out = {"count": s["n"], "per/a": 1, f"{self.label}_n": s["n"]}
        if self.extra:
            out[self.extra] = 0
        return out


class Undeclaring(Keyed):
    result_keys = ()


UNDECLARED = (r"Keyed: compute\(\) returned the key 'oops', which its result_keys "
              r"\['count', 'per/\*', 'x_n'\] do not name")


def test_declared_keys_patterns_and_settings_pass():
    assert Keyed(label="y").accumulate().calculate() == {"count": 1, "per/a": 1, "y_n": 1}
    assert Keyed(extra="per/b/c").accumulate().calculate()["per/b/c"] == 0  # "*" matches any text


def test_an_undeclared_key_raises_at_calculate_and_keeps_the_interval():
    m = Keyed(extra="oops").accumulate()
    with pytest.raises(ValueError, match=UNDECLARED):
        m.calculate()
    assert m.n.item() == 1 and m.intervals == 0  # raised before the interval ended


def test_an_undeclared_key_raises_at_the_asynchronous_handle():
    handle = Keyed(extra="oops").accumulate().calculate(async_op=True)
    with pytest.raises(ValueError, match=UNDECLARED):
        handle.wait()


def test_an_undeclared_key_raises_at_calculate_from_and_in_a_collection():
    sent = json.loads(json.dumps(Keyed(extra="oops").accumulate().export()))
    with pytest.raises(ValueError, match=UNDECLARED):
        Keyed(extra="oops").calculate_from([sent])
    with pytest.raises(ValueError, match=UNDECLARED):
        MetricCollection({"k": Keyed(extra="oops")}).accumulate().calculate()
    with pytest.raises(ValueError, match=UNDECLARED):
        merged_results([Keyed(extra="oops").accumulate(), Keyed(extra="oops").accumulate()])


def test_a_slices_key_is_checked_as_its_base_key():
    inputs = {"labels": torch.ones(3, 2), "task": ["math/gsm8k", "code", "math/gsm8k"]}  # a "/" in a slice
    got = Keyed(slice_by="task").accumulate(inputs).calculate()
    assert {"count/math/gsm8k", "per/a/math/gsm8k", "x_n/code"} <= set(got)
    with pytest.raises(ValueError, match=r"returned the key 'oops'"):
        Keyed(slice_by="task", extra="oops").accumulate(inputs).calculate()


def test_a_metric_without_result_keys_may_return_any_key():
    assert Undeclaring(extra="anything").accumulate().calculate()["anything"] == 0
