"""The fingerprint is taken from the constructor's bound arguments, by value."""
import functools

import pytest
import torch

from twinkle_metrics import GRPOMetric, LossMetric, Metric, State
from twinkle_metrics.core import config


class Keeps(Metric):
    n = State("sum", torch.int64)

    def __init__(self, device_mesh=None, process_group=None, *, threshold: float = 0.5, table=None,
                 reader=None, **kwargs):
        super().__init__(device_mesh, process_group, **kwargs)
        self._t, self._table, self._reader = threshold, table, reader

    def update(self, inputs, outputs, **kwargs):
        return {"n": 1}

    def compute(self, s):
        return dict(s)


class Sub(Keeps):
    def __init__(self, *, scale: int = 2, **kwargs):
        super().__init__(**kwargs)
        self.scale = scale


class Excludes(Keeps):
    fingerprint_exclude = ("reader",)


def test_private_attributes_do_not_hide_arguments():
    assert Keeps(threshold=0.1).sync_fingerprint() != Keeps(threshold=0.9).sync_fingerprint()
    assert Keeps(threshold=0.1).sync_fingerprint() == Keeps(threshold=0.1).sync_fingerprint()
    assert "threshold=0.1" in Keeps(threshold=0.1).fingerprint()


def test_defaults_passed_or_left_out_are_one_setting_through_subclasses():
    assert Sub().fingerprint() == Sub(threshold=0.5, scale=2).fingerprint()
    assert Sub(threshold=0.4).fingerprint() != Sub().fingerprint()
    assert LossMetric().fingerprint() == LossMetric(loss_reduction="mean").fingerprint()
    assert GRPOMetric(epsilon=1).fingerprint() == GRPOMetric(epsilon=1.0).fingerprint()


def test_values_are_taken_by_value():
    t = torch.tensor([1.0, 2.0])
    assert Keeps(table=t).fingerprint() == Keeps(table=t.clone()).fingerprint()
    assert Keeps(table=t).fingerprint() != Keeps(table=t + 1).fingerprint()
    assert Keeps(table={"a": [1, 2]}).fingerprint() == Keeps(table={"a": (1, 2)}).fingerprint()
    assert Keeps(table=torch.float32).fingerprint() != Keeps(table=torch.float64).fingerprint()

    def f(x):
        return x

    def g(x):
        return -x

    assert Keeps(reader=f).fingerprint() != Keeps(reader=g).fingerprint()
    assert Keeps(reader=functools.partial(f, 1)).fingerprint() != Keeps(reader=functools.partial(f, 2)).fingerprint()


def test_an_argument_that_cannot_be_compared_is_refused_unless_excluded():
    with pytest.raises(TypeError, match=r"Keeps: argument 'reader' is a Linear.*fingerprint_exclude"):
        Keeps(reader=torch.nn.Linear(2, 2))
    a, b = Excludes(reader=torch.nn.Linear(2, 2)), Excludes(reader=object())
    assert a.fingerprint() == b.fingerprint() and "reader" not in a.fingerprint()


def test_mesh_group_and_max_slices_never_enter_it():
    assert "max_slices" not in LossMetric(max_slices=3).fingerprint()
    assert LossMetric(slice_by="task").fingerprint().endswith("slice_by='task')")
    assert "slice_by" not in LossMetric().fingerprint()


def test_canonical_text():
    assert config.canonical(1, "x") == "1" and config.canonical(1.0, "x") == "1.0"
    assert config.canonical({2, 1}, "x") == "{1, 2}"
    assert config.canonical(float("nan"), "x") == "nan"
