"""The fallback from a Triton kernel path to the torch path (``kernels.dispatch.attempt``)
takes only compile and launch failures; any other exception of a kernel wrapper is a bug
and propagates.

No interpreter needed: the kernel launchers are replaced by ones that raise, so the CPU
can stand in for the GPU up to the launch.
"""
import ast
import importlib.util
import subprocess
import warnings

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from triton.compiler.errors import CompilationError  # noqa: E402
from triton.runtime.errors import OutOfResources, PTXASError  # noqa: E402

from tests.rlref import make_rl_batch  # noqa: E402
from twinkle_metrics import GRPOMetric, RolloutMismatchMetric  # noqa: E402
from twinkle_metrics.kernels import backend, dispatch, rl_triton, rollout_triton  # noqa: E402

COMPILE_AND_LAUNCH_FAILURES = [
    CompilationError(None, ast.Pass(), "unsupported construct (simulated)"),
    OutOfResources(300000, 232448, "shared memory"),
    PTXASError("ptxas fatal (simulated)"),
    RuntimeError("Triton Error [CUDA]: an illegal instruction was encountered"),
    RuntimeError("PassManager::run failed"),
    RuntimeError("Failed to open libcuda.so.1"),
    RuntimeError("PTX target not supported (simulated)"),
    ImportError("No module named 'triton'"),
    subprocess.CalledProcessError(1, ["gcc", "cuda_utils.c"]),
]
BUGS = [
    TypeError("unsupported operand type(s)"),
    IndexError("tuple index out of range"),
    ValueError("not enough values to unpack"),
    KeyError("lp"),
    AttributeError("'NoneType' object has no attribute 'stride'"),
    RuntimeError("The size of tensor a (3) must match the size of tensor b (4) at non-singleton dimension 1"),
    ZeroDivisionError("division by zero"),
]


@pytest.fixture(autouse=True)
def fresh():
    """No failure recorded when a test starts, the choice before back after it."""
    with backend("auto"):
        yield


class _Raising:
    """A ``@triton.jit`` kernel whose launch raises ``error``."""

    def __init__(self, error):
        self.error = error

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise self.error
        return launch


@pytest.mark.parametrize("error", COMPILE_AND_LAUNCH_FAILURES, ids=lambda e: type(e).__name__)
def test_compile_and_launch_failures_fall_back(error):
    assert dispatch.is_kernel_failure(error)

    def kernel():
        raise error

    with pytest.warns(RuntimeWarning, match="Triton kernel path failed"):
        assert dispatch.attempt("op", kernel) is None
    assert dispatch.failed is not None and type(error).__name__ in dispatch.failed


@pytest.mark.parametrize("error", BUGS, ids=lambda e: type(e).__name__)
def test_other_exceptions_propagate(error):
    assert not dispatch.is_kernel_failure(error)

    def kernel():
        raise error

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(type(error)):
            dispatch.attempt("op", kernel)
    assert dispatch.failed is None  # the kernels stay on


def _grpo_call():
    b = make_rl_batch(3, n_seq=4, seq_len=9)
    return ({"labels": b["labels"]}, {"logps": b["logps"]}), dict(old_logps=b["old"], advantages=b["adv"])


def test_a_bug_inside_a_kernel_wrapper_propagates_through_the_metric(monkeypatch):
    args, side = _grpo_call()
    backend("triton")  # CPU tensors reach the (raising) launchers; no interpreter needed
    monkeypatch.setattr(rl_triton, "_rl_kernel", _Raising(IndexError("bad column (simulated bug)")))
    with pytest.raises(IndexError, match="simulated bug"):
        GRPOMetric().accumulate(*args, **side)
    assert dispatch.failed is None
    monkeypatch.setattr(rollout_triton, "_rollout_kernel", _Raising(TypeError("wrong argument (simulated bug)")))
    with pytest.raises(TypeError, match="simulated bug"):
        RolloutMismatchMetric().accumulate(args[0], args[1], rollout_logps=side["old_logps"])
    assert dispatch.failed is None


def test_a_compile_failure_falls_back_to_the_same_numbers(monkeypatch):
    args, side = _grpo_call()
    with backend("torch"):
        want = GRPOMetric().accumulate(*args, **side).calculate()
    backend("triton")
    monkeypatch.setattr(rl_triton, "_rl_kernel", _Raising(CompilationError(None, ast.Pass(), "simulated")))
    with pytest.warns(RuntimeWarning, match="RL token statistics: CompilationError"):
        got = GRPOMetric().accumulate(*args, **side).calculate()
    assert got == want
    assert dispatch.failed is not None and not dispatch.device_ok(args[1]["logps"])  # torch from now on
