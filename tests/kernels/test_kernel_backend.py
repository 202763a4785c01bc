"""``twinkle_metrics.kernels.backend``: the one public switch between the torch paths and the
Triton kernels, as a setter and as a context manager, and what each choice lets through."""
import types
import warnings

import pytest
import torch

from twinkle_metrics import GRPOMetric, kernels
from twinkle_metrics.kernels import backend, dispatch


def _cuda_like(dtype=torch.float32):
    """What ``device_ok`` and ``applies`` read of a CUDA tensor (none exists on a CPU machine)."""
    return types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), dtype=dtype)


@pytest.fixture(autouse=True)
def restored():
    """Each test starts on ``"auto"`` with no failure recorded, and leaves the process as it found it."""
    with backend("auto"):
        yield


def test_the_package_exports_the_switch():
    assert kernels.backend is backend and kernels.BACKENDS == ("auto", "torch", "triton")
    assert "backend" in kernels.__all__


def test_torch_keeps_every_tensor_on_the_torch_path():
    backend("torch")
    assert backend.current() == "torch"
    for x in (torch.zeros(3), _cuda_like()):
        assert not dispatch.device_ok(x) and not dispatch.applies(x)


def test_auto_takes_the_kernels_for_cuda_tensors_only():
    assert backend.current() == "auto"
    assert not dispatch.device_ok(torch.zeros(3))
    assert dispatch.device_ok(_cuda_like()) == dispatch.available()
    assert not dispatch.applies(_cuda_like(torch.float64))  # the logits kernels read 16/32-bit floats


@pytest.mark.skipif(not dispatch.available(), reason="triton is not installed")
def test_triton_takes_the_kernels_for_cpu_tensors_too():
    with backend("triton") as chosen:
        assert chosen.name == "triton" and backend.current() == "triton"
        assert dispatch.device_ok(torch.zeros(3)) and dispatch.device_ok(_cuda_like())
        assert dispatch.applies(torch.zeros(3, dtype=torch.bfloat16))
        assert not dispatch.applies(torch.zeros(3, dtype=torch.float64))
        assert not dispatch.device_ok(torch.zeros(3, device="meta"))
    assert backend.current() == "auto"


def test_triton_without_triton_installed_says_how_to_fix(monkeypatch):
    monkeypatch.setattr(dispatch, "available", lambda: False)
    with pytest.raises(RuntimeError, match=r"backend\('triton'\): triton is not installed"):
        backend("triton")
    assert backend.current() == "auto"  # nothing changed


def test_an_unknown_choice_names_the_choices():
    with pytest.raises(ValueError, match=r"expected one of 'auto', 'torch', 'triton', got 'cuda'"):
        backend("cuda")
    assert backend.current() == "auto"


def test_a_setter_holds_and_a_with_block_restores_the_choice_before():
    backend("torch")
    with backend("auto"):
        assert backend.current() == "auto"
        with backend("torch"):
            assert backend.current() == "torch"
        assert backend.current() == "auto"
        backend("torch")  # a setter inside a block holds until the block ends
        assert backend.current() == "torch"
    assert backend.current() == "torch"
    with pytest.raises(KeyError):
        with backend("auto"):
            raise KeyError("raised inside")
    assert backend.current() == "torch"  # restored on the way out of an exception too


def _fail(what="op"):
    def broken():
        raise RuntimeError("PTX target not supported (simulated)")
    with pytest.warns(RuntimeWarning, match="Triton kernel path failed"):
        assert dispatch.attempt(what, broken) is None


def test_choosing_forgets_a_failure_and_a_with_block_brings_it_back():
    _fail()
    assert dispatch.failed is not None and not dispatch.device_ok(_cuda_like())  # the torch path from now on
    with backend("auto"):
        assert dispatch.failed is None and dispatch.device_ok(_cuda_like()) == dispatch.available()
    assert dispatch.failed is not None and not dispatch.device_ok(_cuda_like())
    backend("auto")  # chosen again for the process: the kernels are tried again
    assert dispatch.failed is None


def test_a_failure_inside_a_with_block_stays_inside():
    with backend("auto"):
        _fail("inside")
        assert "inside" in dispatch.failed
    assert dispatch.failed is None


@pytest.mark.skipif(not dispatch.available(), reason="triton is not installed")
def test_the_choice_decides_whether_a_metric_calls_its_kernel(monkeypatch):
    """GRPO's kernel entry point (``PAIRS``' "rl" row), stood in for by one that cannot
    launch: ``"triton"`` calls it for CPU tensors and falls back to the same numbers;
    ``"torch"`` and ``"auto"`` never call it on CPU."""
    import importlib

    from tests.rlref import make_rl_batch
    pair = next(p for p in kernels.PAIRS if p.op == "rl")
    module, _, name = pair.triton.partition(":")
    calls = []

    def cannot_launch(*a, **k):
        calls.append(1)
        raise ImportError("no driver (stand-in)")
    monkeypatch.setattr(importlib.import_module(module), name, cannot_launch)
    b = make_rl_batch(2, n_seq=3, seq_len=11)
    args = ({"labels": b["labels"]}, {"logps": b["logps"]})
    side = dict(old_logps=b["old"], advantages=b["adv"])
    results = {}
    for choice in ("torch", "auto"):
        with backend(choice), warnings.catch_warnings():
            warnings.simplefilter("error")
            results[choice] = GRPOMetric().accumulate(*args, **side).calculate()
    assert calls == [] and results["torch"] == results["auto"]
    with backend("triton"), pytest.warns(RuntimeWarning, match="no driver"):
        got = GRPOMetric().accumulate(*args, **side).calculate()
    assert calls == [1] and got == results["torch"]
