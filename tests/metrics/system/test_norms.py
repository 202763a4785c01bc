"""Single-process tests of ModelNormMetric against a plain float64 recomputation."""
import math
from types import SimpleNamespace

import pytest
import torch

from twinkle_metrics import ModelNormMetric
from twinkle_metrics.testing import forbid_device_waits


class Layer(torch.nn.Module):
    """Stands for a transformer layer: Megatron's global 1-based ``layer_number``."""

    def __init__(self, number, num_layers=12):
        super().__init__()
        self.layer_number = number
        self.config = SimpleNamespace(num_layers=num_layers)
        self.fc = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)


class Tiny(torch.nn.Module):
    def __init__(self, first_layer=1):
        super().__init__()
        self.embedding = torch.nn.Embedding(10, 4)
        self.layers = torch.nn.ModuleList([Layer(first_layer), Layer(first_layer + 1)])
        self.head = torch.nn.Linear(4, 3, bias=False)

    def forward(self, x):
        h = self.embedding(x)
        for layer in self.layers:
            h = layer.norm(torch.relu(layer.fc(h)))
        return self.head(h)


def _trained(seed=0, **kw):
    torch.manual_seed(seed)
    model = Tiny(**kw)
    x = torch.randint(0, 10, (5, 3))
    model(x).pow(2).mean().backward()
    return model


def _norm(tensors):
    tensors = list(tensors)
    return math.sqrt(sum(float(torch.linalg.vector_norm(t.detach().double()) ** 2) for t in tensors))


def test_totals_groups_and_zeros_match_plain_recomputation():
    model = _trained()
    with torch.no_grad():
        model.head.weight.grad[0] = 0.0  # some zero gradients to count
    metric = ModelNormMetric(model=model)
    with forbid_device_waits():
        metric.accumulate(None, None)
    got = metric.calculate()
    params = list(model.parameters())
    assert math.isclose(got["norm/grad"], _norm(p.grad for p in params), rel_tol=1e-12)
    assert math.isclose(got["norm/param"], _norm(params), rel_tol=1e-12)
    zeros = sum(int((p.grad == 0).sum()) for p in params)
    assert zeros >= 4 and got["norm/grad_zeros"] == zeros
    assert got["norm/zero_grad_fraction"] == zeros / sum(p.numel() for p in params)
    # default groups: global layer numbers (padded to the width of num_layers), the rest by
    # module path
    expected = {"layer01": model.layers[0], "layer02": model.layers[1],
                "embedding": model.embedding, "head": model.head}
    for name, module in expected.items():
        assert math.isclose(got[f"norm/grad/{name}"], _norm(p.grad for p in module.parameters()),
                            rel_tol=1e-12)
        assert math.isclose(got[f"norm/param/{name}"], _norm(module.parameters()), rel_tol=1e-12)
    assert {k for k in got if k.startswith("norm/grad/")} == {f"norm/grad/{n}" for n in expected}


def test_custom_groups_prefix_and_callable_first_match_wins():
    model = _trained(1)
    groups = {"fc": lambda name, p: name.endswith("fc.weight"), "layers": "layers.", "none": "zzz"}
    got = ModelNormMetric(model=model, groups=groups).accumulate(None, None).calculate()
    fc = [model.layers[i].fc.weight for i in range(2)]
    rest = [p for layer in model.layers for p in layer.parameters() if not any(p is f for f in fc)]
    assert math.isclose(got["norm/grad/fc"], _norm(p.grad for p in fc), rel_tol=1e-12)
    assert math.isclose(got["norm/grad/layers"], _norm(p.grad for p in rest), rel_tol=1e-12)
    assert got["norm/grad/none"] == 0.0
    # parameters in no group still count in the totals
    assert math.isclose(got["norm/grad"], _norm(p.grad for p in model.parameters()), rel_tol=1e-12)
    totals = ModelNormMetric(model=model, groups={}).accumulate(None, None).calculate()
    assert set(totals) == {"norm/grad", "norm/param", "norm/grad_zeros", "norm/zero_grad_fraction"}


def test_megatron_attributes_shared_main_grad_and_virtual_chunks():
    first, second = _trained(2), _trained(3, first_layer=3)  # two virtual-pipeline chunks
    # the tied copy of a weight (Megatron marks it ``shared``) does not count
    second.head.weight.shared = True
    # megatron-core DDP keeps the reduced gradient in ``main_grad``: it wins over ``grad``
    fc = first.layers[0].fc.weight
    fc.main_grad = torch.full_like(fc, 0.5)
    # TP attributes change nothing on TP rank 0 of a single process
    first.head.weight.tensor_model_parallel = True
    got = ModelNormMetric(model=[first, second]).accumulate(None, None).calculate()
    counted = [p for p in list(first.parameters()) + list(second.parameters())
               if p is not second.head.weight]
    grads = [getattr(p, "main_grad", p.grad) for p in counted]
    assert math.isclose(got["norm/grad"], _norm(grads), rel_tol=1e-12)
    assert math.isclose(got["norm/param"], _norm(counted), rel_tol=1e-12)
    assert {"norm/grad/layer01", "norm/grad/layer04"} <= set(got)
    assert math.isclose(got["norm/grad/layer01"],
                        _norm([fc.main_grad] + [p.grad for p in list(first.layers[0].parameters())[1:]]),
                        rel_tol=1e-12)


def test_interval_reports_last_call_and_model_per_call():
    a, b = _trained(4), _trained(5)
    metric = ModelNormMetric()
    metric.accumulate(None, None, model=a)
    metric.accumulate(None, None, model=b)
    got = metric.calculate()
    assert math.isclose(got["norm/grad"], _norm(p.grad for p in b.parameters()), rel_tol=1e-12)
    assert metric.calculate() == {}  # nothing accumulated since


def test_no_grads_reports_param_norm_only_and_bf16():
    torch.manual_seed(6)
    model = Tiny().to(torch.bfloat16)
    got = ModelNormMetric(model=model, count_zeros=False).accumulate(None, None).calculate()
    assert "norm/grad" not in got and not any(k.startswith("norm/grad/") for k in got)
    assert math.isclose(got["norm/param"], _norm(model.parameters()), rel_tol=1e-12)


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="no model"):
        ModelNormMetric().accumulate(None, None)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        ModelNormMetric(model=[torch.nn.Linear(2, 2), "x"])
    with pytest.raises(TypeError, match=r"groups\['a'\] must be"):
        ModelNormMetric(groups={"a": 3})
    with pytest.raises(ValueError, match="without '/'"):
        ModelNormMetric(groups={"a/b": "x"})
    with pytest.raises(TypeError, match="distributed_optimizer must be"):
        ModelNormMetric(distributed_optimizer="yes")
    with pytest.raises(ValueError, match="DistributedDataParallel-wrapped"):
        ModelNormMetric(model=torch.nn.Linear(2, 2), distributed_optimizer=True).accumulate(None, None)


def test_readme_snippet_runs_in_a_collection():
    """The README's ModelNormMetric block, executed as written on a single-rank mesh."""
    import os
    import re

    from twinkle_metrics import Accuracy, DeviceMesh, LossMetric, MetricCollection, TrainMetric

    with open(os.path.join(os.path.abspath(os.path.join(__file__, "../../../..")), "README.md")) as f:
        readme = f.read()
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "ModelNormMetric(mesh" in b)
    model = _trained(7)
    mesh = DeviceMesh.single()
    scope = {"mesh": mesh, "model_chunks": [model], "MetricCollection": MetricCollection,
             "loss_m": LossMetric(mesh), "acc_m": Accuracy(mesh), "train_m": TrainMetric(mesh)}
    exec(block, scope)  # noqa: S102 - the documented example, run as a user would copy it
    scope["norms"].accumulate(None, None)
    got = scope["metrics"].calculate()
    assert math.isclose(got["norm/grad"], _norm(p.grad for p in model.parameters()), rel_tol=1e-12)
