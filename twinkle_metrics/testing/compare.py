"""Comparing results and state dicts: ``assert_results_close``, ``state_dict_differences``,
``merged_results``."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Sequence

import torch


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
    from twinkle_metrics.comm.fused import plain_states
    from twinkle_metrics.core.checkpoint import stage_load
    from twinkle_metrics.core.interval import results
    from twinkle_metrics.core.state import interval_of

    lead = shards[0]
    types = {type(m) for m in shards}
    if len(types) != 1:
        raise ValueError(f"merged_results: shards must be the same metric, got "
                         f"{sorted(t.__name__ for t in types)}")
    # the merge a load of every shard would install, staged only: the shards stay as they are
    _, merged, _ = stage_load(lead, [m.state_dict() for m in shards])
    held = interval_of(lead)
    specs = {name: held.spec_of(name) for name in merged}
    merged_interval = held.copy(states=merged, touched=set(merged))
    merged_interval.specs = specs
    return results(merged_interval, plain_states(merged, specs))
