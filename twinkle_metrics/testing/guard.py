"""The device-wait guard: ``forbid_device_waits()`` and ``intercept_device_waits()``."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from twinkle_metrics.inputs.checks import host_reads_active


class DeviceWaitError(RuntimeError):
    """A call that waits for the device happened where none is allowed."""


_TENSOR_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__",
                   "__index__", "nonzero", "masked_select", "unique", "any", "all", "is_nonzero",
                   "bincount")
# equal(): a bool on the host; bincount(): an output size read from the data
_TORCH_FUNCS = ("nonzero", "masked_select", "unique", "argwhere", "any", "all", "equal", "bincount")


def _names_host(device) -> bool:
    """Whether a ``.to()`` target is the host spelled out: ``"cpu"`` or ``"cpu:0"``."""
    return isinstance(device, str) and device.split(":")[0] == "cpu"


@contextlib.contextmanager
def intercept_device_waits(on_wait: Callable[[str], None]) -> Iterator[None]:
    """Call ``on_wait(label)`` before every Python-level call that waits for the device.

    ``label`` names the call (``item``, ``bool``, ``nonzero``, ``bool_mask_index``, ...).
    Calls made inside an intercepted call (``bool(t)`` calling ``.item()``) are not
    reported again. ``on_wait`` may raise to forbid the call.
    """
    saved = []
    depth = [0]

    def report(label):
        if depth[0] == 0:
            on_wait(label)

    def wrap(owner, name, original, label):
        def wrapped(*args, **kwargs):
            report(label)
            depth[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1
        saved.append((owner, name, vars(owner).get(name)))
        setattr(owner, name, wrapped)

    def bool_mask(index) -> bool:
        parts = index if isinstance(index, tuple) else (index,)
        return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)

    indexing = (torch.Tensor.__getitem__, torch.Tensor.__setitem__)

    class MaskIndexing(TorchFunctionMode):
        """x[mask] and x[mask] = v find the masked positions on the host. Seen through a
        torch-function mode: assigning Tensor.__getitem__ (even when restored or deleted
        afterwards) would give torch.Tensor a sequence slot for good."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in indexing and len(args) > 1 and bool_mask(args[1]):
                report("bool_mask_index")
            return func(*args, **(kwargs or {}))

    def conditional(owner, name, waits, label):
        """Wrap a call that waits only for some arguments (``waits(*args, **kwargs)``)."""
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            if waits(*args, **kwargs):
                report(label)
            return original(*args, **kwargs)
        saved.append((owner, name, vars(owner).get(name)))
        setattr(owner, name, wrapped)

    # where(cond) is nonzero(cond, as_tuple=True); repeat_interleave with tensor repeats and
    # no output_size reads the total length from the data
    conditional(torch, "where", lambda *a, **k: len(a) + len(k) == 1, "where")
    for owner, first in ((torch, 1), (torch.Tensor, 1)):
        conditional(owner, "repeat_interleave",
                    lambda *a, _i=first, **k: isinstance(k.get("repeats", a[_i] if len(a) > _i else None),
                                                         torch.Tensor) and k.get("output_size") is None,
                    "repeat_interleave")

    # .to("cpu") says "to the host" in any test; copy_ into a host tensor from a device one
    conditional(torch.Tensor, "to", lambda *a, **k: _names_host(k.get("device", a[1] if len(a) > 1 else None)),
                "to_cpu")
    conditional(torch.Tensor, "copy_", lambda dst, src, *a, **k: isinstance(src, torch.Tensor)
                and dst.device.type == "cpu" and src.device.type != "cpu", "copy_to_host")
    for name in _TENSOR_METHODS:
        wrap(torch.Tensor, name, getattr(torch.Tensor, name), name.strip("_"))
    for name in _TORCH_FUNCS:
        wrap(torch, name, getattr(torch, name), name)
    try:
        with MaskIndexing():
            yield
    finally:
        # Put back exactly what the owner's own namespace held: an attribute it only
        # inherited is deleted, not set.
        for owner, name, original in reversed(saved):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


@contextlib.contextmanager
def forbid_device_waits() -> Iterator[None]:
    """Make every host-device synchronising Python call raise ``DeviceWaitError``."""
    def forbid(label):
        if host_reads_active():  # a CPU tensor of host-known values: no device involved
            return
        if label == "bool_mask_index":
            raise DeviceWaitError("boolean-mask indexing has a data-dependent shape and waits "
                                  "for the device; use torch.where / masked arithmetic")
        raise DeviceWaitError(f"{label}() waits for the device; use masked arithmetic on tensors")

    with intercept_device_waits(forbid):
        yield
