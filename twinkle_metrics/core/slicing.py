"""Sliced metrics: one call split into the calls of each slice of its sequences.

A metric built with ``slice_by="data_source"`` reads, from every input feature, a
per-sequence field of that name (a list of strings or ints, or a host int tensor;
one entry per sequence) and, besides its usual ``update`` of the whole call, runs
``update`` once per slice value on the rows of that slice. Those contributions go to
states named ``"{state}@{slice}"`` (created on the fly, and so united across ranks
like any dynamic state: a slice seen on only some ranks, stages or intervals is
created on the others), and ``calculate()`` reports each slice's keys as
``"{key}/{slice}"``.

How a call is split (``split``), per microbatch of ``b`` sequences (``b`` = the length
of the slice field):

* input features and outputs: tensors of ``[b, ...]`` (2-D or more; and, in features,
  lists of length ``b``) keep the slice's rows; a microbatch entirely in the slice is passed as it is;
  a microbatch with none of its rows is left out; any other value of a microbatch
  that mixes slices (a scalar loss report) cannot be split and raises. A feature that
  holds only the slice field (no per-token field: sequences already summed, such as
  DPO's per-pair log-probs) has one sequence per entry, and outputs of ``b`` values
  (1-D tensors, lists) are then one per sequence too;
* keyword arguments: tensors whose first dim is the call's total number of sequences
  ``N``, and lists of length ``N``, keep the slice's rows; lists with one entry per
  microbatch are split like outputs; dicts are split per key; strings and bools
  (settings such as ``loss_reduction``) go to every slice as they are; numbers and
  0-d tensors (per-call readings such as ``generate_time``) go to the whole call only;
* side batches: a call without inputs whose keyword arguments hold ``(inputs, outputs)``
  pairs (DPO's ``chosen=`` and ``rejected=``) splits each pair by its own inputs, with
  its reference outputs ``ref_<name>``; row i of every side is one item (a pair), so the
  sides must carry the same slice names.

The base reaches this module through four calls: ``check_config`` (construction),
``contributions`` (each ``accumulate``), ``state_spec`` (the per-slice copy of a state)
and ``results`` (each ``calculate``); ``over_bound`` is the one check of ``max_slices``
(in ``accumulate``, across ranks in the sync, and at ``load_state_dict``).

Rows are picked with host-known indices (``index_select`` with an index built on the
host and copied without waiting): nothing reads the device.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from twinkle_metrics.comm.agreement import begin
from twinkle_metrics.core.state import State, interval_of
from twinkle_metrics.inputs.checks import from_host
from twinkle_metrics.inputs.microbatch import BATCH_KEYS, as_feature_list, split_by_sizes

SEP = "@"  # state name separator: "{state}@{slice}"


def check_config(metric: Any, slice_by: Optional[str], max_slices: int) -> None:
    """Raise on a ``slice_by`` / ``max_slices`` the metric cannot take."""
    name = type(metric).__name__
    if slice_by is not None:
        if not isinstance(slice_by, str) or not slice_by:
            raise TypeError(f"{name}: slice_by must be the name of a per-sequence input field "
                            f"(e.g. 'data_source'), got {slice_by!r}")
        if metric.unsliceable:
            raise ValueError(f"{name}: slice_by is not supported: {metric.unsliceable}")
    if isinstance(max_slices, bool) or not isinstance(max_slices, int) or max_slices < 1:
        raise ValueError(f"{name}: max_slices must be an int >= 1, got {max_slices!r}")


def over_bound(metric: Any, slices: Iterable[str], bound: int, where: str) -> Optional[str]:
    """Why ``slices`` (names) are more than ``bound`` allows, said for ``where``
    (``"accumulate"``, ``"sync"``, ``"load"``); None when within it. The one check of
    ``max_slices``."""
    names = sorted(slices)
    if len(names) <= bound:
        return None
    name, field = type(metric).__name__, metric.slice_by
    if where == "accumulate":
        return (f"{name}: {len(names)} slices of {field!r} ({names[:20]}) exceed max_slices={bound}; "
                "raise max_slices, or slice by a field with fewer values")
    if where == "load":
        return (f"{name}.load_state_dict: the state dicts hold {len(names)} slices of {field!r} "
                f"({names[:20]}), more than max_slices={bound}; build the metric with a larger max_slices")
    return (f"calculate(): {name} holds {len(names)} slices of {field!r} over the data group "
            f"({names[:20]}), more than max_slices={bound}: each rank stayed within it, their slices "
            "together do not; raise max_slices on every rank, or slice by a field with fewer values. "
            "Nothing was merged or reset")


def state_spec(metric: Any, name: str) -> Optional[State]:
    """The declaration of ``"{state}@{slice}"``: a copy of the state's, or None (not a
    sliced state's name, or a state kept for the whole call only)."""
    base = name.rpartition(SEP)[0]
    if base in metric.unsliced_states:
        return None
    spec = interval_of(metric).specs.get(base) or metric.dynamic_state(base)
    return None if spec is None else dataclasses.replace(spec)


def contributions(metric: Any, whole: Optional[Mapping[str, Any]], inputs: Any, outputs: Any,
                  kwargs: Mapping[str, Any]) -> Dict[str, Any]:
    """The whole call's contributions plus each slice's, under ``"{state}@{slice}"``."""
    name = type(metric).__name__
    out = dict(whole or {})
    parts = split(name, metric.slice_by, inputs, outputs, kwargs)
    reads = [v for k, v in kwargs.items() if k in metric._update_reads]
    if not parts and whole and inputs is None and (holds_data(outputs) or any(map(is_data, reads))):
        raise ValueError(f"{name}: slice_by={metric.slice_by!r}, but this call has data and no inputs to read "
                         f"the slices from; pass inputs (an InputFeature or a list of them) with "
                         f"{metric.slice_by!r}, one entry per sequence")
    known = set(held(interval_of(metric).specs))
    error = over_bound(metric, known | {s for s, *_ in parts}, metric.max_slices, "accumulate")
    if error:
        raise ValueError(error)
    for value, s_inputs, s_outputs, s_kwargs in parts:
        begin(metric)  # each update agrees anew over its groups (agreement.guard)
        for key, v in (metric.update(s_inputs, s_outputs, **s_kwargs) or {}).items():
            if key not in metric.unsliced_states:
                out[f"{key}{SEP}{value}"] = v
    return out


def results(metric: Any, states: Mapping[str, Any], defaults: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
    """``compute`` of the reduced states, with each slice's keys as ``"{key}/{slice}"``;
    ``defaults()``: every unsliced state at its identity, as plain values."""
    whole = {k: v for k, v in states.items() if SEP not in k}
    out = dict(metric.compute(whole))
    per_slice: Dict[str, Dict[str, Any]] = {}
    for key, value in states.items():
        if SEP in key:
            base, _, s = key.rpartition(SEP)
            per_slice.setdefault(s, {})[base] = value
    if per_slice:  # states a slice does not carry (unsliced ones) at their identity
        base_values = defaults()
    for s in sorted(per_slice):
        for key, value in metric.compute({**base_values, **per_slice[s]}).items():
            if not key.startswith("_"):  # records with global indices stay whole-call only
                out[f"{key}/{s}"] = value
    return out


def held(state_names: Iterable[str]) -> List[str]:
    """The slice values a metric's states hold (``"{state}@{slice}"`` names), sorted."""
    return sorted({n.rpartition(SEP)[2] for n in state_names if SEP in n})


def slice_values(metric: str, field: str, feats: List[Dict[str, Any]]) -> List[List[str]]:
    """Per microbatch, the slice name of each sequence: as many as the feature has
    sequences (the rows of its labels / input_ids / ...; a single name is the whole
    microbatch's), or, for a feature without such a field, one per entry."""
    out = []
    for i, feat in enumerate(feats):
        rows = _rows_in(feat)
        value = feat.get(field)
        if value is None:
            raise ValueError(f"{metric}: slice_by={field!r} but input feature {i} has no {field!r}; pass "
                             f"one {field} per sequence (a list of strings or ints); got keys {sorted(feat)}")
        if isinstance(value, torch.Tensor):
            if value.device.type != "cpu" or value.dim() != 1 or value.is_floating_point():
                raise TypeError(f"{metric}: slice_by field {field!r} must be host data, one entry per "
                                f"sequence (a list, or a 1-D int tensor on the CPU), got a {value.dtype} "
                                f"tensor of shape {list(value.shape)} on {value.device}")
            value = _host_list(value)
        elif isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            value = [value] * (rows or 1)  # one name for the whole microbatch
        if rows is not None and len(value) != rows:
            raise ValueError(f"{metric}: slice_by field {field!r} of input feature {i} has {len(value)} "
                             f"entries but the feature holds {rows} sequences; pass one {field} per "
                             "sequence, or a single one for the whole microbatch")
        names = []
        for v in value:
            if isinstance(v, bool) or not isinstance(v, (str, int)):
                raise TypeError(f"{metric}: slice_by field {field!r} holds {type(v).__name__} values; "
                                "expected strings or ints, one per sequence")
            name = str(v)
            if not name or SEP in name:
                raise ValueError(f"{metric}: slice name {name!r} of field {field!r} must be non-empty and "
                                 f"must not contain {SEP!r}")
            names.append(name)
        out.append(names)
    return out


def _rows_in(feat: Dict[str, Any]):
    """The feature's number of sequences, or None when it holds no per-token field."""
    for key in BATCH_KEYS:
        value = feat.get(key)
        if isinstance(value, torch.Tensor) and key != "position_ids":  # position ids may be shared
            return 1 if value.dim() <= 1 else int(value.shape[0])
    return None


def _host_list(t: torch.Tensor) -> list:
    from twinkle_metrics.inputs.checks import host_reads

    with host_reads():  # a CPU tensor of host-known ids: no device involved
        return t.tolist()


def split(metric: str, field: str, inputs: Any, outputs: Any, kwargs: Mapping[str, Any]
          ) -> List[Tuple[str, Any, Any, Dict[str, Any]]]:
    """``[(slice name, inputs, outputs, kwargs)]`` of one call, slices in order of first
    appearance."""
    single = isinstance(inputs, Mapping)
    feats = as_feature_list(metric, inputs)
    if not feats:
        return _split_sides(metric, field, kwargs)
    names = slice_values(metric, field, feats)
    sizes = [len(n) for n in names]
    summed = [_rows_in(f) is None for f in feats]  # sequences already summed: 1-D outputs per sequence
    out_parts = _output_parts(metric, outputs, feats, sizes)
    flat = [n for per in names for n in per]
    order = list(dict.fromkeys(flat))
    result: List[Tuple[str, Any, Any, Dict[str, Any]]] = []
    for s in order:
        rows = [[r for r, n in enumerate(per) if n == s] for per in names]
        keep = [i for i, r in enumerate(rows) if r]
        s_feats = [_select_mb(metric, f"inputs[{i}]", feats[i], rows[i], sizes[i], True) for i in keep]
        s_outs = [_select_mb(metric, f"outputs of microbatch {i}", out_parts[i], rows[i], sizes[i], False,
                             summed[i]) for i in keep] if out_parts is not None else None
        global_rows = [g for g, n in enumerate(flat) if n == s]
        s_kwargs = {}
        for key, value in kwargs.items():
            part = _select_kwarg(metric, key, value, rows, keep, global_rows, sizes)
            if part is not _DROP:
                s_kwargs[key] = part
        if single:
            result.append((s, s_feats[0], s_outs[0] if s_outs is not None else outputs, s_kwargs))
        else:
            result.append((s, s_feats, s_outs if s_outs is not None else outputs, s_kwargs))
    return result


def _split_sides(metric: str, field: str, kwargs: Mapping[str, Any]) -> List[tuple]:
    """The slices of a call made of side batches (keyword ``(inputs, outputs)`` pairs, each
    with its reference outputs ``ref_<name>``), or [] when it has none."""
    pairs = [k for k, v in kwargs.items() if _is_batch(v)]
    sides = [k for k in pairs if not (k.startswith("ref_") and k[4:] in pairs)]  # not a side's references
    if not sides:
        return []
    split_sides: Dict[str, Dict[str, tuple]] = {}
    order: List[str] = []
    for side in sides:
        s_in, s_out = kwargs[side]
        names = sum(slice_values(metric, field, as_feature_list(metric, s_in)), [])
        if side == sides[0]:
            order = names
        elif names != order:
            raise ValueError(f"{metric}: slice_by={field!r}: the {sides[0]} sequences are in slices {order[:8]} "
                             f"but the {side} ones in {names[:8]}; row i of each side is one pair, so both "
                             f"sides of a pair must carry the same {field}")
        ref = f"ref_{side}"
        refs = {ref: kwargs[ref]} if ref in kwargs else {}
        split_sides[side] = {name: (i, o, kw) for name, i, o, kw in split(metric, field, s_in, s_out, refs)}
    settings = {k: v for k, v in kwargs.items() if is_setting(v)}
    out = []
    for name in dict.fromkeys(order):
        s_kwargs = dict(settings)
        for side, parts in split_sides.items():
            s_in, s_out, refs = parts[name]
            s_kwargs[side] = (s_in, s_out)
            s_kwargs.update(refs)
        out.append((name, None, None, s_kwargs))
    return out


def _is_batch(value) -> bool:
    """Whether a keyword value is an ``(inputs, outputs)`` pair: a feature (or a list of
    them) and its outputs."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        return False
    feats = value[0] if isinstance(value[0], (list, tuple)) else [value[0]]
    return bool(feats) and all(isinstance(f, Mapping) for f in feats)


def _output_parts(metric, outputs, feats, sizes):
    """Outputs as one dict per microbatch (every key), or None when there are none."""
    if outputs is None:
        return None
    if isinstance(outputs, (list, tuple)):
        if len(outputs) != len(feats):
            raise ValueError(f"{metric}: got {len(feats)} input microbatches but {len(outputs)} output dicts")
        return [dict(o or {}) for o in outputs]
    if not isinstance(outputs, Mapping):
        raise TypeError(f"{metric}: outputs must be a ModelOutput dict or a list of them, got "
                        f"{type(outputs).__name__}")
    parts: List[Dict[str, Any]] = [{} for _ in feats]
    for key, value in outputs.items():
        if value is None:
            continue
        for part, piece in zip(parts, split_by_sizes(metric, key, value, sizes)):
            part[key] = piece
    return parts


def _rows_of(value, rows: List[int], device=None):
    idx = from_host(torch.tensor(rows, dtype=torch.long), device)
    return value.index_select(0, idx)


def _select_mb(metric: str, where: str, mb: Dict[str, Any], rows: List[int], b: int,
               lists_per_sequence: bool, summed: bool = False) -> Dict[str, Any]:
    """The slice's rows of one microbatch's dict (a feature or its outputs): tensors of
    ``[b, ...]`` (2-D or more: a 1-D tensor of length ``b`` may as well be one value
    per microbatch, such as a ``[sum, count]`` loss report, unless ``summed``: the
    feature has no per-token field, so its sequences come one per value), and, in
    features, lists of length ``b`` (per-sequence fields such as the slice field itself)."""
    if len(rows) == b:
        return mb
    out = {}
    for key, value in mb.items():
        if isinstance(value, torch.Tensor) and value.dim() >= (1 if summed else 2) and value.shape[0] == b:
            out[key] = _rows_of(value, rows, value.device)
        elif (lists_per_sequence or summed) and isinstance(value, (list, tuple)) and len(value) == b:
            out[key] = [value[r] for r in rows]
        elif value is None or (isinstance(value, torch.Tensor) and value.dim() == 1 and key == "position_ids"):
            out[key] = value  # shared by every sequence
        else:
            raise ValueError(f"{metric}: {where}[{key!r}] ({_describe(value)}) is one value for a microbatch "
                             f"whose {b} sequences belong to several slices, so it cannot be split; give it "
                             "per sequence, or make each microbatch hold one slice")
    return out


_DROP = object()


def _select_kwarg(metric, key, value, rows, keep, global_rows, sizes):
    n, n_micro = sum(sizes), len(sizes)
    if is_setting(value):
        return value  # each slice is read the same way
    if isinstance(value, Mapping):
        return {k: v for k, v in ((k, _select_kwarg(metric, f"{key}[{k!r}]", v, rows, keep, global_rows, sizes))
                                  for k, v in value.items()) if v is not _DROP}
    if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == n:
        return _rows_of(value, global_rows, value.device)
    if isinstance(value, (list, tuple)):
        if len(value) == n:
            return [value[g] for g in global_rows]
        if len(value) == n_micro:  # one entry per microbatch
            return [_select_entry(metric, key, value[i], rows[i], sizes[i]) for i in keep]
        raise ValueError(f"{metric}: {key} has {len(value)} entries; with slice_by it must have one per "
                         f"sequence ({n}) or one per microbatch ({n_micro})")
    if is_reading(value):
        return _DROP  # a per-call reading: the whole call's only
    raise ValueError(f"{metric}: {key} ({_describe(value)}) cannot be split into slices; give one entry per "
                     f"sequence ({n})")


def is_reading(value: Any) -> bool:
    """Whether a keyword value is a per-call reading (a number, a 0-d tensor; or None),
    which belongs to the whole call, not to its slices."""
    if isinstance(value, bool):
        return False
    return value is None or isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.dim() == 0)


def holds_data(outputs: Any) -> bool:
    """Whether outputs (a dict or a list of them) hold a value: not None, not empty."""
    items = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    return any(isinstance(o, Mapping) and any(_full(v) for v in o.values()) for o in items)


def _full(v) -> bool:
    if v is None:
        return False
    if isinstance(v, torch.Tensor):
        return v.numel() > 0
    if isinstance(v, (list, tuple)):
        return any(map(_full, v))
    return True


def is_setting(value: Any) -> bool:
    """Whether a keyword value is a setting of the call (a string or a bool, such as
    ``loss_reduction``), which goes to every slice as it is."""
    return isinstance(value, (str, bool))


def is_data(value: Any) -> bool:
    """Whether a keyword value holds per-sequence data: neither a reading nor a setting."""
    return not (is_reading(value) or is_setting(value))


def _select_entry(metric, key, entry, rows, b):
    if len(rows) == b:
        return entry
    if isinstance(entry, Mapping):  # one microbatch's dict (reference outputs): each field split
        return {k: _select_entry(metric, f"{key}[{k!r}]", v, rows, b) for k, v in entry.items() if v is not None}
    if isinstance(entry, torch.Tensor) and entry.dim() >= 1 and entry.shape[0] == b:
        return _rows_of(entry, rows, entry.device)
    if isinstance(entry, (list, tuple)) and len(entry) == b:
        return [entry[r] for r in rows]
    raise ValueError(f"{metric}: an entry of {key} ({_describe(entry)}) does not hold one row per sequence "
                     f"of its microbatch ({b}); it cannot be split into slices")


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)}"
    return type(value).__name__
