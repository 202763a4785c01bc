"""Every exported metric's class hierarchy stays in its own module, the modules of other
exported metrics and ``twinkle_metrics.core``: no mixins spread over other files."""
from __future__ import annotations

import inspect

import pytest

import twinkle_metrics
from twinkle_metrics.core.metric import Metric

EXPORTED = [getattr(twinkle_metrics, n) for n in twinkle_metrics.__all__
            if inspect.isclass(getattr(twinkle_metrics, n)) and issubclass(getattr(twinkle_metrics, n), Metric)]
MODULES = {cls.__module__ for cls in EXPORTED}


def allowed(cls: type, klass: type) -> bool:
    module = klass.__module__
    return (module in (cls.__module__, "builtins") or module in MODULES
            or module == "twinkle_metrics.core" or module.startswith("twinkle_metrics.core."))


def test_every_exported_metric_is_checked():
    names = {cls.__name__ for cls in EXPORTED}
    assert {"GRPOMetric", "GSPOMetric", "CISPOMetric", "PPOMetric", "RolloutMismatchMetric", "DPOMetric",
            "PPOValueMetric", "LossMetric", "Accuracy"} <= names


@pytest.mark.parametrize("cls", EXPORTED, ids=lambda c: c.__name__)
def test_mro_spans_its_own_module_exported_metrics_and_core(cls):
    strays = [f"{k.__module__}.{k.__qualname__}" for k in cls.__mro__ if not allowed(cls, k)]
    assert not strays, f"{cls.__name__} inherits from {strays}"


def test_the_check_catches_a_mixin_from_another_module():
    mixin = type("Helper", (), {"__module__": "twinkle_metrics.metrics.rl.elsewhere"})
    cls = type("Mixed", (mixin, Metric), {"__module__": "twinkle_metrics.metrics.rl.mine",
                                          "update": lambda self, i, o, **k: {}, "compute": lambda self, s: {}})
    assert [k for k in cls.__mro__ if not allowed(cls, k)] == [mixin]
