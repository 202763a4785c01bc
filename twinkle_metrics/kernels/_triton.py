"""When the Triton kernels apply, and the ``[rows, V]`` view the logits kernels read.

Triton is optional: it is imported only the first time a CUDA tensor asks, so CPU
runs and machines without it never pay for (or need) the import.

Every launch passes ``enable_fp_fusion=False``: no multiply-add contraction, so each value
rounds as written (as in the torch path's separate kernels; Triton 3.10's default), and no
warning from Triton 3.9 about the default changing.

On by default on CUDA where triton is installed: on one H200 (benchmarks/README.md, "GPU
run, 2026-12-01") every kernel path was faster than its torch path (entropy from logits 15x,
Accuracy 1.5x, the GRPO / Rollout / DPO updates 1.36x / 1.29x / 1.07x), agreed with it, and
never synchronised. ``TWINKLE_METRICS_TRITON=0`` keeps every run on the torch path. With
``TRITON_INTERPRET=1`` and ``TWINKLE_METRICS_TRITON=1`` (both by name), CPU tensors take
the kernel paths too, run by Triton's interpreter: slow, for checking the kernels against
the torch paths on a machine without a GPU::

    TRITON_INTERPRET=1 TWINKLE_METRICS_TRITON=1 python my_metric_check.py
"""
from __future__ import annotations

import importlib.util
import os
import warnings
from typing import Callable, Optional, Tuple, TypeVar

import torch

T = TypeVar("T")
#: logits dtypes the kernels read (they compute in float32; float64 stays on torch)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_available: Optional[bool] = None
_SWITCH = os.environ.get("TWINKLE_METRICS_TRITON", "")
#: whether CUDA runs use the kernels (unless ``TWINKLE_METRICS_TRITON=0``)
ENABLED = _SWITCH != "0"
#: CPU tensors take the kernels, run by Triton's interpreter: only when both are asked for
#: by name (``TRITON_INTERPRET=1 TWINKLE_METRICS_TRITON=1``), never by default
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1" and _SWITCH == "1"


def available() -> bool:
    """Whether ``triton`` can be imported (looked up once)."""
    global _available
    if _available is None:
        _available = importlib.util.find_spec("triton") is not None
    return _available


#: why the kernels were turned off for this process (a launch failed), or None
failed: Optional[str] = None


def device_ok(x: torch.Tensor) -> bool:
    """The kernels run where ``x`` lives: enabled, a CUDA tensor (or a CPU tensor under
    Triton's interpreter), triton installed, and no kernel has failed in this process."""
    return (ENABLED and failed is None and (x.is_cuda or (INTERPRETED and x.device.type == "cpu"))
            and available())


def attempt(what: str, fn: Callable[..., T], *args, **kwargs) -> Optional[T]:
    """``fn(*args, **kwargs)``, a Triton path; if it raises (triton missing a feature, a compile error on
    this GPU or toolchain), warn once, turn the kernels off for the rest of the process and
    return None, so the caller takes the torch path with the same inputs. Callers attempt
    before anything is folded, so nothing is lost or counted twice; both paths issue the
    same collectives (a kernel that runs after one, such as DPO's pair statistics after the
    CP sum, falls back to torch ops that communicate nothing), and every rank of a group
    fails alike (same software), so collectives stay in step."""
    global failed
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - any failure of an optional fast path
        failed = f"{what}: {type(e).__name__}: {e}"
        warnings.warn(f"twinkle_metrics: the Triton kernel path failed ({failed}); the torch path is used "
                      "from now on in this process (TWINKLE_METRICS_TRITON=0 selects it from the start)",
                      RuntimeWarning, stacklevel=3)
        return None


def applies(x: torch.Tensor) -> bool:
    """Use a logits-reading kernel for ``x``: ``device_ok`` and a 16/32-bit float dtype."""
    return x.dtype in DTYPES and device_ok(x)


def rows_view(x: torch.Tensor) -> Tuple[torch.Tensor, int, int, int]:
    """``x [..., V]`` as rows the kernels index without a copy where strides allow:
    ``(tensor, inner, outer_stride, inner_stride)``; row ``r`` starts at
    ``(r // inner) * outer_stride + (r % inner) * inner_stride`` elements from
    ``tensor``'s data. Covers any 2-D view and 3-D ``[b, s, V]`` views such as a
    transposed Megatron ``[s, b, V]`` or a ``[:, :s]`` slice; other layouts are copied.
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 1:
        x = x.unsqueeze(0)
    if x.dim() > 3:
        try:
            x = x.view(-1, x.shape[-2], x.shape[-1])
        except RuntimeError:
            x = x.reshape(-1, x.shape[-2], x.shape[-1])
    if x.dim() == 2:
        return x, max(x.shape[0], 1), 0, x.stride(0)
    return x, max(x.shape[1], 1), x.stride(0), x.stride(1)
