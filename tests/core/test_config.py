"""The fingerprint is taken from the constructor's bound arguments, by value."""
import functools
import os

import pytest
import torch

from twinkle_metrics import Accuracy, GRPOMetric, LossMetric, Metric, Schema, State
from twinkle_metrics.core import config
from twinkle_metrics.core.metric import FINGERPRINT_KEY


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
    schema = Schema(exclude=("reader",))


def test_private_attributes_do_not_hide_arguments():
    assert Keeps(threshold=0.1).sync_fingerprint() != Keeps(threshold=0.9).sync_fingerprint()
    assert Keeps(threshold=0.1).sync_fingerprint() == Keeps(threshold=0.1).sync_fingerprint()
    assert "threshold=0.1" in Keeps(threshold=0.1).fingerprint()


def test_a_kept_fingerprint_follows_the_attributes_it_reads():
    """calculate() takes the fingerprint every time; it is kept only while every attribute it
    reads is the very immutable object it was taken from: a metric reconfigured, or a list
    changed in place, is fingerprinted as it now is."""
    m = Sub(scale=2)
    first = m.sync_fingerprint()
    assert m.sync_fingerprint() is first and "scale=2" in first
    m.scale = 3
    assert "scale=3" in m.sync_fingerprint()
    m.scale = 2
    assert m.sync_fingerprint() == first
    m.scale = [1]
    assert "scale=(1)" in m.sync_fingerprint()
    m.scale.append(2)
    assert "scale=(1, 2)" in m.sync_fingerprint() and "scale=(1, 2)" in m.fingerprint()
    del m.scale  # no attribute: the argument as it was given
    assert m.sync_fingerprint() == first


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
    with pytest.raises(TypeError, match=r"Keeps: argument 'reader' is a Linear.*schema = Schema\(exclude="):
        Keeps(reader=torch.nn.Linear(2, 2))
    a, b = Excludes(reader=torch.nn.Linear(2, 2)), Excludes(reader=object())
    assert a.fingerprint() == b.fingerprint() and "reader" not in a.fingerprint()


def test_mesh_group_and_max_slices_never_enter_it():
    assert "max_slices" not in LossMetric(max_slices=3).fingerprint()
    assert LossMetric(slice_by="task").fingerprint().endswith("slice_by='task')")
    assert LossMetric().fingerprint().endswith("slice_by=None)")


def test_canonical_text():
    assert config.canonical(1, "x") == "1" and config.canonical(1.0, "x") == "1.0"
    assert config.canonical({2, 1}, "x") == "{1, 2}"
    assert config.canonical(float("nan"), "x") == "nan"


# --------------------------------------------------------------------- checkpoints that survive change
DATA = os.path.join(os.path.abspath(os.path.join(__file__, "../..")), "data", "state_dicts_before_schema.pt")


def test_state_dicts_saved_before_the_schema_load_and_give_the_same_numbers():
    """Saved by LossMetric, Accuracy and GRPOMetric at the commit before fingerprints became
    ``Class/vN(...)`` (module paths then; Accuracy had no ``align`` yet)."""
    saved = torch.load(DATA, weights_only=True)
    for cls, kwargs in ((LossMetric, dict(loss_reduction="sum")), (Accuracy, {}),
                        (GRPOMetric, dict(top_k_kl=2, quantiles=(0.5, 0.9)))):
        entry = saved[cls.__name__]
        assert entry["state_dict"][FINGERPRINT_KEY].startswith("twinkle_metrics.metrics.")
        m = cls(**kwargs).load_state_dict(entry["state_dict"])
        assert m.calculate() == entry["results"], cls.__name__
    with pytest.raises(ValueError, match=r"loss_reduction='sum' there, loss_reduction='mean' here"):
        LossMetric().load_state_dict(saved["LossMetric"]["state_dict"])
    with pytest.raises(ValueError, match=r"align='exact' there, align='right' here \(it predates the argument"):
        Accuracy(align="right").load_state_dict(saved["Accuracy"]["state_dict"])


class Counter(Metric):
    total = State("sum")

    def __init__(self, device_mesh=None, process_group=None, *, scale: float = 1.0, **kwargs):
        super().__init__(device_mesh, process_group, **kwargs)
        self.scale = scale

    def update(self, inputs, outputs, *, value=None, **kwargs):
        return {"total": value * self.scale}

    def compute(self, s):
        return {"total": s["total"]}


class CounterLater(Counter):  # the same class a release later: a new argument with a default
    def __init__(self, device_mesh=None, process_group=None, *, clip: bool = False, **kwargs):
        super().__init__(device_mesh, process_group, **kwargs)
        self.clip = clip


def test_a_new_argument_with_its_default_and_a_moved_class_still_load_a_version_bump_does_not():
    saved = Counter(scale=2).accumulate(None, None, value=3.0).state_dict()
    later = CounterLater(scale=2)
    later.__class__.__name__ = "Counter"  # the same name, another module and one more argument
    try:
        later.load_state_dict(saved)
        assert later.calculate() == {"total": 6.0}
        later.clip = True  # a setting the saved states never had
        with pytest.raises(ValueError, match=r"clip=False there, clip=True here"):
            later.load_state_dict(saved)
    finally:
        CounterLater.__name__ = "CounterLater"
    with pytest.raises(ValueError, match=r"scale=2.0 there, scale=3.0 here"):
        Counter(scale=3).load_state_dict(saved)

    class Bumped(Counter):
        schema = Schema(version=2)
    Bumped.__name__ = "Counter"
    with pytest.raises(ValueError, match="saved by version 1 of Counter's states, this is version 2"):
        Bumped(scale=2).load_state_dict(saved)
    with pytest.raises(ValueError, match="holds a Counter's states"):
        Excludes().load_state_dict(saved)


def test_fingerprints_of_either_format_read_back():
    name, version, args = config.parse_fingerprint("pkg.mod.Thing(a='x, y', b=(1, 2), c={'k': [1]})")
    assert (name, version, args) == ("Thing", 1, {"a": "'x, y'", "b": "(1, 2)", "c": "{'k': [1]}"})
    assert config.parse_fingerprint("Thing/v3()") == ("Thing", 3, {})
    assert config.parse_fingerprint("not a fingerprint") is None
