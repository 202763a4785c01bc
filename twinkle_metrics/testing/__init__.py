"""Test helpers that ship with the package: use them on your own metrics too.

* ``forbid_device_waits()``: inside it, any Python-level call that would make the
  host wait for the device (``.item()``, ``.tolist()``, ``.cpu()``, ``float(t)``,
  ``bool(t)``, ``nonzero``, ``torch.equal``, ``is_nonzero``, ``bincount``,
  ``repeat_interleave`` without ``output_size``, one-argument ``torch.where``,
  boolean-mask indexing and assignment, ...) raises ``DeviceWaitError``. Not caught:
  ``.to("cpu")`` and device-to-host ``copy_`` (on a CPU-only machine every tensor is a
  host tensor, so they cannot be told from harmless calls).
  On CUDA, ``torch.cuda.set_sync_debug_mode("error")`` is the ground-truth check;
  this guard gives the same verdict on a CPU-only machine.
* ``assert_results_close(got, want)``: same keys, numbers equal to a tolerance.
* ``state_dict_differences(a, b)``: the keys where two ``state_dict()`` results differ
  (of a metric or a collection; NaN equals NaN), e.g. to show a rejected call changed
  nothing: ``assert not state_dict_differences(before, metric.state_dict())``.
* ``CollectiveCounter``: counts the torch.distributed collectives made inside it.
* ``merged_results(shards)``: the single-process conformance check of a metric's merge:
  metrics that each accumulated one shard, merged as ``calculate()`` merges the ranks of
  a data group; compare with one metric that accumulated everything.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Dict, List, Mapping, Sequence

import torch
from torch.overrides import TorchFunctionMode

from twinkle_metrics.sync.host import host_reads_active


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
def intercept_device_waits(on_wait: Callable[[str], None]):
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
def forbid_device_waits():
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


def assert_results_close(got: Dict[str, Any], want: Dict[str, Any], rel: float = 1e-9,
                         abs_tol: float = 1e-12) -> None:
    """Same keys; numbers (and lists of numbers) equal within tolerance; NaN equals NaN."""
    if set(got) != set(want):
        raise AssertionError(f"keys differ: only in got {sorted(set(got) - set(want))}, "
                             f"only in want {sorted(set(want) - set(got))}")
    for key in want:
        _close(key, got[key], want[key], rel, abs_tol)


def _close(key, a, b, rel, abs_tol):
    if isinstance(b, (list, tuple)):
        if not isinstance(a, (list, tuple)) or len(a) != len(b):
            raise AssertionError(f"{key}: {a!r} != {b!r}")
        for i, (x, y) in enumerate(zip(a, b)):
            _close(f"{key}[{i}]", x, y, rel, abs_tol)
        return
    if isinstance(b, dict):
        assert_results_close(a, b, rel, abs_tol)
        return
    if isinstance(b, (int, float)) and not isinstance(b, bool):
        if not isinstance(a, (int, float)) or isinstance(a, bool):
            raise AssertionError(f"{key}: got {type(a).__name__} {a!r}, expected a number")
        if math.isnan(b) and math.isnan(a):
            return
        if not math.isclose(a, b, rel_tol=rel, abs_tol=abs_tol):
            raise AssertionError(f"{key}: {a!r} != {b!r}")
        return
    if a != b:
        raise AssertionError(f"{key}: {a!r} != {b!r}")


def state_dict_differences(a: Mapping[str, Any], b: Mapping[str, Any], prefix: str = "") -> List[str]:
    """Keys (``"0:/total"`` for a collection's) whose values differ between two state
    dicts; ``[]`` when they are the same. Tensors must match in dtype, shape and every
    element (NaN equal to NaN); other values (the fingerprint) must be equal."""
    out = [f"{prefix}{k}" for k in sorted(set(a) ^ set(b), key=str)]
    for k in a.keys() & b.keys():
        x, y = a[k], b[k]
        if isinstance(x, Mapping) and isinstance(y, Mapping):
            out += state_dict_differences(x, y, f"{prefix}{k}/")
        elif isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            same = x.dtype == y.dtype and x.shape == y.shape and bool(
                ((x == y) | (x.isnan() & y.isnan()) if x.is_floating_point() else x == y).all())
            if not same:
                out.append(f"{prefix}{k}")
        elif isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor) or x != y:
            out.append(f"{prefix}{k}")
    return out


def merged_results(shards: Sequence) -> Dict[str, Any]:
    """Results of metrics that each accumulated one shard, merged like the ranks of one
    data group in ``calculate()`` (same ``merge``, same conversion to plain numbers).

    Example::

        whole = MyMetric().accumulate(batch_inputs, batch_outputs).calculate()
        parts = [MyMetric().accumulate(i, o) for i, o in shards_of(batch)]
        assert_results_close(merged_results(parts), whole)
    """
    import copy

    from twinkle_metrics.sync.fused import plain_states

    lead = shards[0]
    types = {type(m) for m in shards}
    if len(types) != 1:
        raise ValueError(f"merged_results: shards must be the same metric, got "
                         f"{sorted(t.__name__ for t in types)}")
    merged = copy.copy(lead)  # a shallow copy holding the merge: the shards stay as they are
    merged._specs, merged._states = dict(lead._specs), dict(lead._states)
    merged.load_state_dict([m.state_dict() for m in shards])
    return merged.compute(plain_states(merged._states, merged._specs))


_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
                "_all_gather_base", "all_gather_object", "all_gather_coalesced", "reduce",
                "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "gather",
                "gather_object", "scatter", "scatter_object_list", "reduce_scatter",
                "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send", "recv",
                "isend", "irecv", "all_reduce_coalesced", "batch_isend_irecv")


class CollectiveCounter:
    """Counts torch.distributed collectives by wrapping the c10d functions.

    Both namespaces are patched (``torch.distributed.X`` and
    ``torch.distributed.distributed_c10d.X``), so helpers built from other
    collectives (``all_gather_object`` = an all_gather of sizes + one of data)
    count their inner collectives too. ``wire`` counts only the innermost calls
    (those that issue no further wrapped collective): what goes over the network.
    ``api`` counts the outermost calls a library made.
    """

    def __init__(self):
        self.wire: Dict[str, int] = {}
        self.api: Dict[str, int] = {}
        self._stack: List[List[bool]] = []
        self._saved = []

    def __enter__(self):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        originals = {}
        for name in _COLLECTIVES:
            fn = getattr(c10d, name, None) or getattr(dist, name, None)
            if fn is not None:
                originals[name] = fn
        for name, fn in originals.items():
            wrapped = self._wrap(name, fn)
            for mod in (dist, c10d):
                if hasattr(mod, name):
                    self._saved.append((mod, name, getattr(mod, name)))
                    setattr(mod, name, wrapped)
        return self

    def __exit__(self, *exc):
        for mod, name, fn in reversed(self._saved):
            setattr(mod, name, fn)
        self._saved = []

    def _wrap(self, name, fn):
        counter = self

        def wrapper(*args, **kwargs):
            top = not counter._stack
            if counter._stack:
                counter._stack[-1][0] = True  # the caller has an inner collective
            counter._stack.append([False])
            try:
                return fn(*args, **kwargs)
            finally:
                had_inner = counter._stack.pop()[0]
                if not had_inner:
                    counter.wire[name] = counter.wire.get(name, 0) + 1
                if top:
                    counter.api[name] = counter.api.get(name, 0) + 1

        wrapper.__wrapped__ = fn
        return wrapper

    def reset(self):
        self.wire.clear()
        self.api.clear()

    @property
    def total(self) -> int:
        return sum(self.wire.values())
