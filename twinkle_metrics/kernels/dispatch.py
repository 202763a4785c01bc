"""When the Triton kernels apply, and the fallback to the torch path when one cannot run.

Triton is optional: it is imported only the first time a CUDA tensor asks, so CPU
runs and machines without it never pay for (or need) the import.

Every launch passes ``enable_fp_fusion=False``: no multiply-add contraction, so each value
rounds as written (as in the torch path's separate kernels; Triton 3.10's default), and no
warning from Triton 3.9 about the default changing.

On by default on CUDA where triton is installed: on one H200 (benchmarks/README.md, "GPU
run, 2026-12-01") every kernel path was faster than its torch path (entropy from logits 15x,
Accuracy 1.5x, the GRPO / Rollout / DPO updates 1.36x / 1.29x / 1.07x), agreed with it, and
never synchronised.

Which path runs is one choice, ``backend``: ``"auto"`` (the default: CUDA tensors take the
kernels where triton is installed), ``"torch"`` (every tensor takes the torch path) or
``"triton"`` (CUDA and CPU tensors take the kernels; CPU tensors run under Triton's
interpreter, so ``TRITON_INTERPRET=1`` must be set before triton is first imported). The
environment sets the choice a process starts with: ``TWINKLE_METRICS_TRITON=0`` starts it on
``"torch"``; ``TRITON_INTERPRET=1`` and ``TWINKLE_METRICS_TRITON=1`` (both by name) on
``"triton"``: slow, for checking the kernels against the torch paths on a machine without a
GPU::

    TRITON_INTERPRET=1 TWINKLE_METRICS_TRITON=1 python my_metric_check.py
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import warnings
from typing import Callable, Optional, TypeVar

import torch

T = TypeVar("T")
#: logits dtypes the kernels read (they compute in float32; float64 stays on torch)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_available: Optional[bool] = None
#: the choices ``backend`` takes
BACKENDS = ("auto", "torch", "triton")


def _from_environment() -> str:
    """The choice a process starts with: ``TWINKLE_METRICS_TRITON=0`` the torch path; CPU
    tensors take the kernels only when both variables ask for it by name, so an interpreted
    test process keeps its torch-path references on the torch path."""
    switch = os.environ.get("TWINKLE_METRICS_TRITON", "")
    if switch == "0":
        return "torch"
    if switch == "1" and os.environ.get("TRITON_INTERPRET", "0") == "1":
        return "triton"
    return "auto"


_choice = _from_environment()


def available() -> bool:
    """Whether ``triton`` can be imported (looked up once)."""
    global _available
    if _available is None:
        _available = importlib.util.find_spec("triton") is not None
    return _available


#: why the kernels were turned off for this process (a launch failed), or None
failed: Optional[str] = None


class backend:
    """Choose the compute path of every metric: ``"auto"``, ``"torch"`` or ``"triton"``.

    A call sets the choice for the process; used as a context manager, the choice holds
    inside the ``with`` block and the one before comes back at its end. ``"auto"``: CUDA
    tensors take the Triton kernels where triton is installed, everything else the torch
    path. ``"torch"``: every tensor takes the torch path. ``"triton"``: CUDA and CPU tensors
    take the kernels (CPU tensors run under Triton's interpreter: set ``TRITON_INTERPRET=1``
    before triton is first imported). Choosing starts afresh: a kernel failure recorded
    before (``failed``) is forgotten, and comes back with the earlier choice at the end of a
    ``with`` block. Under ``"auto"`` and ``"triton"`` a kernel that cannot be compiled or
    launched still falls back to the torch path (``attempt``). Example::

        from twinkle_metrics import kernels

        with kernels.backend("torch"):
            want = GRPOMetric().accumulate(inputs, outputs, **side).calculate()
        with kernels.backend("triton"):   # on CPU: under TRITON_INTERPRET=1
            got = GRPOMetric().accumulate(inputs, outputs, **side).calculate()
        kernels.backend.current()         # 'auto' again

    Raises:
        ValueError: ``name`` is not one of ``BACKENDS``.
        RuntimeError: ``"triton"`` where triton is not installed.
    """

    def __init__(self, name: str) -> None:
        global _choice, failed
        if name not in BACKENDS:
            raise ValueError(f"backend: expected one of {', '.join(map(repr, BACKENDS))}, got {name!r}")
        if name == "triton" and not available():
            raise RuntimeError("backend('triton'): triton is not installed; install it (pip install triton) "
                               "or choose 'auto' or 'torch'")
        self.name = name
        self._before = (_choice, failed)
        _choice, failed = name, None

    @staticmethod
    def current() -> str:
        """The choice in force: ``"auto"``, ``"torch"`` or ``"triton"``."""
        return _choice

    def __enter__(self) -> "backend":
        return self

    def __exit__(self, *exc) -> None:
        global _choice, failed
        _choice, failed = self._before

    def __repr__(self) -> str:
        return f"backend({self.name!r})"


def device_ok(x: torch.Tensor) -> bool:
    """The kernels run where ``x`` lives: the choice (``backend``) lets them (under
    ``"auto"`` a CUDA tensor, under ``"triton"`` a CUDA or CPU tensor), triton installed,
    and no kernel has failed in this process."""
    if _choice == "torch" or failed is not None:
        return False
    where = x.is_cuda or (_choice == "triton" and x.device.type == "cpu")
    return where and available()


#: words of the ``RuntimeError``s that triton's compiler, driver and launcher raise when a
#: kernel cannot be built or launched here: a launch's ``Triton Error [CUDA]: ...``, the MLIR
#: pass manager, a missing ``libcuda``, C compiler, ptxas, backend or cache directory, an old
#: CUDA; ``PTX`` covers an unsupported PTX target or version (also as torch reports it)
LAUNCH_ERROR_WORDS = ("Triton Error", "PassManager::run failed", "libcuda", "PTX", "ptxas",
                      "Failed to find C compiler", "Failed to find C++ compiler", "Unknown backend device",
                      "Backend device", "compatible backends", "active drivers", "Cannot find",
                      "Could not create or locate cache dir", "Failed to load newly compiled",
                      "Triton only support CUDA", "not supported in interpreter mode")


def _triton_error_types() -> tuple:
    """triton's own error classes (compile errors, out of resources, ptxas), where importable."""
    types = []
    for module, name in (("triton.errors", "TritonError"), ("triton.compiler.errors", "CompilationError"),
                         ("triton.runtime.errors", "OutOfResources"), ("triton.runtime.errors", "PTXASError"),
                         ("triton.runtime.autotuner", "OutOfResources")):
        try:
            types.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(types)


def is_kernel_failure(e: BaseException) -> bool:
    """Whether ``e`` says a Triton kernel could not be compiled or launched here, so that
    the torch path should run instead: a triton error (``CompilationError``,
    ``OutOfResources``, ``PTXASError``, the interpreter's ``InterpreterError``: all
    ``TritonError``), an ``ImportError`` (triton or its driver missing), a failed build
    of the launcher (``subprocess.CalledProcessError``), or a ``RuntimeError`` whose
    message is one of the compiler's, driver's or launcher's (``LAUNCH_ERROR_WORDS``).
    Anything else (``TypeError``, ``IndexError``, ``ValueError``, a ``RuntimeError`` from a
    torch op of the wrapper) is a bug or a bad input, and is not hidden by a fallback."""
    if isinstance(e, (ImportError, subprocess.CalledProcessError)):
        return True
    if isinstance(e, _triton_error_types()):
        return True
    if isinstance(e, RuntimeError):
        text = str(e)
        return any(word in text for word in LAUNCH_ERROR_WORDS)
    return False


def attempt(what: str, fn: Callable[..., T], *args, **kwargs) -> Optional[T]:
    """``fn(*args, **kwargs)``, a Triton path; if the kernel cannot be compiled or launched
    here (``is_kernel_failure``: triton missing a feature, a compile error on this GPU or
    toolchain, a launch error), warn once, turn the kernels off for the rest of the process
    and return None, so the caller takes the torch path with the same inputs. Any other
    exception propagates: a bug in a wrapper must not turn into a silent, slower torch run.
    Callers attempt before anything is folded, so nothing is lost or counted twice; both
    paths issue the same collectives (a kernel that runs after one, such as DPO's pair
    statistics after the CP sum, falls back to torch ops that communicate nothing), and
    every rank of a group fails alike (same software), so collectives stay in step."""
    global failed
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - filtered: only compile and launch failures fall back
        if not is_kernel_failure(e):
            raise
        failed = f"{what}: {type(e).__name__}: {e}"
        warnings.warn(f"twinkle_metrics: the Triton kernel path failed ({failed}); the torch path is used "
                      "from now on in this process (TWINKLE_METRICS_TRITON=0 or kernels.backend('torch') "
                      "selects it from the start)",
                      RuntimeWarning, stacklevel=3)
        return None


def applies(x: torch.Tensor) -> bool:
    """Use a logits-reading kernel for ``x``: ``device_ok`` and a 16/32-bit float dtype."""
    return x.dtype in DTYPES and device_ok(x)
