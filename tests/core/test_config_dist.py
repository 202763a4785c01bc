"""Configuration by construction, across real ranks: ranks that built one metric with
different arguments raise ``MetricSyncError`` together, whatever attribute the metric keeps
them in; equal arguments calculate."""
import pytest
import torch
import torch.distributed as dist

from parallel import DeviceMesh
from twinkle_metrics import Metric, MetricSyncError, State

pytestmark = pytest.mark.xdist_group("dist")


class Thresholded(Metric):
    """A user's metric that keeps its argument under another name."""

    hits = State("sum", torch.int64)
    total = State("sum", torch.int64)

    def __init__(self, device_mesh=None, process_group=None, *, threshold: float = 0.5, weights=None, **kwargs):
        super().__init__(device_mesh, process_group, **kwargs)
        self._threshold = threshold
        self._weights = weights

    def update(self, inputs, outputs, **kwargs):
        v = outputs["values"].double()
        return {"hits": (v > self._threshold).sum(), "total": v.numel()}

    def compute(self, s):
        return {"rate": s["hits"] / s["total"]}


def _run(thresholds, weights=None):
    rank = dist.get_rank()
    w = None if weights is None else weights[rank % len(weights)]
    m = Thresholded(DeviceMesh.from_sizes(dp_size=dist.get_world_size()),
                    threshold=thresholds[rank % len(thresholds)], weights=w)
    m.accumulate(None, {"values": torch.tensor([0.2, 0.6, 0.95])})
    try:
        return "ok", m.calculate()
    except MetricSyncError as e:
        return "MetricSyncError", str(e)


def case_thresholds(thresholds):
    return _run(thresholds)


def case_weights(kind):
    weights = [torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0])]
    if kind == "differ":
        weights[1] = torch.tensor([1.0, 3.0])
    return _run([0.5], weights)


def test_private_attribute_argument_that_differs_raises_on_every_rank(dist_pool):
    results = dist_pool.run(case_thresholds, [0.1, 0.9], timeout=120)
    assert len(results) == 8
    for kind, text in results:
        assert kind == "MetricSyncError"
        assert "threshold=0.1" in text and "threshold=0.9" in text


def test_equal_arguments_calculate_and_an_int_for_a_float_is_the_same(dist_pool):
    for kind, out in dist_pool.run(case_thresholds, [0.5], timeout=120):
        assert kind == "ok" and out == {"rate": pytest.approx(2 / 3)}
    for kind, out in dist_pool.run(case_thresholds, [1, 1.0], timeout=120):
        assert kind == "ok" and out == {"rate": 0.0}


def test_tensor_arguments_enter_the_fingerprint_by_value(dist_pool):
    for kind, _ in dist_pool.run(case_weights, "same", timeout=120):
        assert kind == "ok"
    for kind, text in dist_pool.run(case_weights, "differ", timeout=120):
        assert kind == "MetricSyncError" and "weights=tensor(float32, [2]" in text
