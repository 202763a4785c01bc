"""Fused, generic sync of every state of every metric: at most two collectives.

1. One ``all_gather`` over the data group (DP x CP) of one packed float64 buffer
   holding every state of every metric, plus a header (schema hash, is-last-stage,
   error flag). Each rank then merges the rows locally with each state's declared
   reduction, so sum, max, min and custom merges (top-k) all ride in one collective.
2. Under tensor or pipeline parallelism, one ``all_gather`` over TP x PP (the
   mesh's ``mp`` group) of the merged buffer; every rank keeps the row of the
   result source (last stage, TP rank 0), so all stages and TP replicas return the
   same numbers, wall-clock readings included. Non-last stages (which hold
   nothing) take part with the same buffer shape, so nothing can hang.

Integers travel as float64: exact up to 2**53. The buffer length is padded to a
power of two so that ranks whose metric sets differ slightly still agree on the
collective's size and reach the schema check, which then raises on every rank.
"""
from __future__ import annotations

import hashlib
from typing import Any, Dict, List, Sequence, Tuple

import torch

from parallel import comm_device
from parallel.groups import all_gather_rows, group_ranks

_HEADER = 3  # schema hash, is result source, error flag


class MetricSyncError(RuntimeError):
    """Ranks disagree on which metrics/states they hold; raised on every rank."""


def _schema(metrics: Sequence) -> Tuple[float, str]:
    parts = []
    for m in metrics:
        for name, spec in m._specs.items():
            red = spec.reduce if isinstance(spec.reduce, str) else getattr(spec.reduce, "__name__", "fn")
            parts.append(f"{type(m).__qualname__}.{name}:{red}:{spec.shape}:{spec.dtype}")
    text = "|".join(parts)
    digest = hashlib.blake2b(text.encode(), digest_size=6).digest()
    return float(int.from_bytes(digest, "little")), text  # 48 bits: exact in float64


def _bucket(n: int) -> int:
    size = 16
    while size < n:
        size *= 2
    return size


def _groups_key(metric) -> Tuple:
    mesh = metric.resolve_mesh()
    return (id(metric.data_group()), id(mesh.result_group))


def sync_and_compute(metrics: Sequence, reset: bool = True) -> List[Dict[str, Any]]:
    """Reduce the states of ``metrics`` globally and return each one's results.

    Metrics that share the same data and PP groups sync together in one pass.
    """
    buckets: Dict[Tuple, List[int]] = {}
    for i, m in enumerate(metrics):
        buckets.setdefault(_groups_key(m), []).append(i)
    results: List[Dict[str, Any]] = [{} for _ in metrics]
    for idx in buckets.values():
        group_metrics = [metrics[i] for i in idx]
        reduced = sync_states(group_metrics)
        for i, m, states in zip(idx, group_metrics, reduced):
            results[i] = m.compute(states)
    if reset:  # only once every metric computed: an error above keeps every interval intact
        for m in metrics:
            m.reset()
    return results


def sync_states(metrics: Sequence) -> List[Dict[str, Any]]:
    """Globally reduced states of each metric as plain Python numbers (lists if shaped).

    All ``metrics`` must share one data group and one PP group. Does not change the
    metrics' local states.
    """
    lead = metrics[0]
    mesh = lead.resolve_mesh()
    data_group = lead.data_group()
    share_group, is_source = mesh.result_group, mesh.is_result_source
    comm = data_group if data_group is not None else share_group
    # Pack where the states are (one cat, int64 promoting to float64 in it), then move the
    # one buffer to the collectives' device: never a copy per state.
    device = comm_device(comm) if comm is not None else lead._device
    pack = lead._device
    plan = _merge_plan(metrics, device)
    schema, schema_text = plan.schema

    flat = [torch.tensor([schema, float(is_source), 0.0], dtype=torch.float64).to(pack, non_blocking=True)]
    for m in metrics:
        for name in m._specs:
            t = m._states[name].detach().reshape(-1)
            flat.append(t if t.device == pack else t.to(pack))
    buf = torch.cat(flat).to(device)
    used = buf.numel()
    buf = torch.nn.functional.pad(buf, (0, _bucket(used) - used))

    rows = all_gather_rows(buf, data_group)                     # collective 1
    error = ""
    if rows.shape[0] > 1 and not bool((rows[:, 0] == schema).all()):
        by_hash: Dict[float, List[int]] = {}
        for r, h in zip(group_ranks(data_group), rows[:, 0].tolist()):
            by_hash.setdefault(h, []).append(r)
        sides = " vs ".join(f"ranks {v}" for v in by_hash.values())
        error = (f"the data group's ranks hold different sets of metrics/states ({sides}); build "
                 f"the same metrics, in the same order, with the same arguments on every rank "
                 f"(rank {group_ranks(None)[0]} has: {schema_text[:300]})")

    # Plain sum/max/min states of every metric merge in one reduction per op (the
    # columns are planned once per set of metrics); metrics with their own merge()
    # or a callable reduce get their rows as before.
    vec = rows[0].clone()
    vec[:_HEADER] = torch.tensor([schema, float(is_source), float(bool(error))], dtype=torch.float64,
                                 device=device)
    for op, cols in plan.columns.items():
        sel = rows.index_select(1, cols)
        vec[cols] = sel.sum(0) if op == "sum" else (sel.amax(0) if op == "max" else sel.amin(0))
    for i, offset in plan.custom:
        m = metrics[i]
        per_state, start = {}, offset
        for name, spec in m._specs.items():
            per_state[name] = rows[:, offset:offset + spec.numel].reshape(rows.shape[0], *spec.shape)
            offset += spec.numel
        out = m.merge(per_state)
        vec[start:offset] = torch.cat([out[name].to(torch.float64).reshape(-1) for name in m._specs])

    if share_group is not None:
        stage_rows = all_gather_rows(vec, share_group)          # collective 2
        source = (stage_rows[:, 1] == 1.0).nonzero().flatten().tolist()
        hashes_agree = bool((stage_rows[:, 0] == schema).all())
        if not error and (not hashes_agree or len(source) != 1):
            error = ("pipeline stages or TP ranks hold different metrics/states (or no single "
                     "last stage); build the same metrics on every rank and call calculate() "
                     "on all of them")
        if not error and bool((stage_rows[:, 2] != 0).any()):
            error = "another pipeline stage or TP rank found ranks holding different metrics/states"
        if not error:
            vec = stage_rows[source[0]]
    if error:
        hints = dict.fromkeys(h for h in (getattr(m, "_sync_hint", None) for m in metrics) if h)
        raise MetricSyncError(f"calculate(): {error}" + "".join(f"; hint: {h}" for h in hints))

    return unpack(vec.tolist()[_HEADER:], metrics)  # the one device-to-host copy


def unpack(values: Sequence[float], metrics: Sequence) -> List[Dict[str, Any]]:
    """Split a flat list of state values (metric order, state order) into plain Python
    states per metric: ints for int64 states, nested lists for shaped states."""
    out: List[Dict[str, Any]] = []
    offset = 0
    for m in metrics:
        states = {}
        for name, spec in m._specs.items():
            chunk = list(values[offset:offset + spec.numel])
            offset += spec.numel
            if spec.dtype == torch.int64:
                chunk = [int(v) if v == v and abs(v) != float("inf") else v for v in chunk]
            states[name] = chunk[0] if spec.shape == () else _unflatten(chunk, spec.shape)
        out.append(states)
    return out


class _MergePlan:
    def __init__(self, schema, columns: Dict[str, torch.Tensor], custom: List[Tuple[int, int]]):
        self.schema = schema        # (hash, text) of _schema(metrics)
        self.columns = columns      # op -> column indices of states merged by that op
        self.custom = custom        # (metric index, first column) merged by the metric


_PLANS: Dict[Tuple, _MergePlan] = {}


def _merge_plan(metrics: Sequence, device) -> _MergePlan:
    from .base import Metric

    # Everything _schema() and the plan depend on, so both can be cached under it.
    key = (str(device),) + tuple(
        (type(m), tuple((n, s.reduce if isinstance(s.reduce, str) else getattr(s.reduce, "__name__", "fn"),
                         callable(s.reduce), s.shape, s.dtype) for n, s in m._specs.items()))
        for m in metrics)
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    cols: Dict[str, List[int]] = {"sum": [], "max": [], "min": []}
    custom: List[Tuple[int, int]] = []
    offset = _HEADER
    for i, m in enumerate(metrics):
        plain = type(m).merge is Metric.merge and all(isinstance(s.reduce, str) for s in m._specs.values())
        if not plain:
            custom.append((i, offset))
        for spec in m._specs.values():
            if plain:
                cols[spec.reduce].extend(range(offset, offset + spec.numel))
            offset += spec.numel
    plan = _MergePlan(_schema(metrics),
                      {op: torch.tensor(c, dtype=torch.long, device=device) for op, c in cols.items() if c},
                      custom)
    if len(_PLANS) > 64:  # a process builds few metric sets; bound it anyway
        _PLANS.clear()
    _PLANS[key] = plan
    return plan


def _unflatten(values: List[Any], shape: Tuple[int, ...]):
    if len(shape) == 1:
        return list(values)
    step = len(values) // shape[0]
    return [_unflatten(values[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]
