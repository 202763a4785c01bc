"""Exports: a worker's local states as plain JSON, with their place in the mesh.

``Metric.export()`` / ``MetricCollection.export()`` return the value this module builds
(``export_metrics``) and ``calculate_from`` on a driver reads it back (``decode``, which
checks every field and raises naming the export's index and the field). The format
(version 1)::

    {"format": "twinkle_metrics.export", "version": 1,
     "place": {"rank": 5, "data_rank": 1, "data_size": 2, "dp_rank": 1, "dp_size": 2,
               "cp_rank": 0, "cp_size": 1, "tp_rank": 1, "tp_size": 2, "pp_rank": 1,
               "pp_size": 2, "last_stage": true, "source": false},
     "metrics": [{"name": "", "class": "LossMetric", "fingerprint": "twinkle_metrics....",
                  "interval": 3, "arguments": {"loss_reduction": "sum"},
                  "decls": [{"reduce": "sum", "dtype": "float64", "shape": [], "scope": "data",
                             "per_rank": false}, ...],
                  "states": {"loss_sum": [0, 12.5], "num_tokens": [1, 40], ...},
                  "touched": ["loss_sum", "num_tokens"]}]}

``data_rank`` is the worker's index in its metric's data group (DP x CP, the order the
sync merges in); ``source``: last pipeline stage and TP rank 0. A metric entry carries its
own ``place`` where it differs from the export's (another ``process_group``). A state is
``[index into decls, value]``; a shaped state's value is its flat (row-major) list. Floats
are JSON numbers, non-finite ones the strings ``"nan"``, ``"inf"``, ``"-inf"`` (so the
value is strict JSON: ``json.dumps(value, allow_nan=False)`` holds); int64 states are JSON
integers, exact at any size, and an int64 ``"sum"`` state is a count: a negative value is
refused, as the workers refuse a negative count. ``arguments``: the constructor arguments a
driver can rebuild the metric from (``twinkle_metrics.from_export``); any that are not plain
JSON are named in ``unexported_arguments``. No tensor, no pickled object: reading an export runs no code.
"""
from __future__ import annotations

import array
import math
from collections.abc import Mapping
from typing import Any, Dict, List, NamedTuple, Sequence, Tuple, Union

import torch

from parallel.groups import global_rank, group_rank, group_size
from twinkle_metrics.comm.offline import local_states
from twinkle_metrics.core.state import State, interval_of

FORMAT = "twinkle_metrics.export"
VERSION = 1
PLACE_INTS = ("rank", "data_rank", "data_size", "dp_rank", "dp_size", "cp_rank", "cp_size",
              "tp_rank", "tp_size", "pp_rank", "pp_size")
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_DTYPES = {"float64": torch.float64, "int64": torch.int64}
_I64 = (-(1 << 63), 1 << 63)


def is_export(value: Any) -> bool:
    """Whether ``value`` is what ``export()`` returns (by its format marker): for code that
    scans a dict of metrics for exports among other values."""
    return isinstance(value, Mapping) and value.get("format") == FORMAT


# ---------------------------------------------------------------------- the worker's side
def place_of(metric: Any) -> Dict[str, Any]:
    """Where ``metric``'s states come from: its data shard, TP/PP position, global rank."""
    mesh = metric.resolve_mesh()
    group = metric.data_group()
    return {"rank": global_rank(), "data_rank": group_rank(group), "data_size": group_size(group),
            "dp_rank": mesh.dp_rank, "dp_size": mesh.dp_size, "cp_rank": mesh.cp_rank, "cp_size": mesh.cp_size,
            "tp_rank": mesh.tp_rank, "tp_size": mesh.tp_size, "pp_rank": mesh.pp_rank, "pp_size": mesh.pp_size,
            "last_stage": mesh.is_last_stage, "source": mesh.is_result_source}


def decl_of(spec: State) -> Dict[str, Any]:
    """A state's declaration as JSON: what merging it takes (``State.signature`` and more)."""
    reduce = spec.reduce if isinstance(spec.reduce, str) else getattr(spec.reduce, "__name__", "fn")
    return {"reduce": reduce, "dtype": str(spec.dtype).replace("torch.", ""), "shape": list(spec.shape),
            "scope": spec.scope, "per_rank": bool(spec.per_rank)}


def encode_float(x: float) -> Union[float, str]:
    return x if math.isfinite(x) else ("nan" if x != x else ("inf" if x > 0 else "-inf"))


def _flat(value) -> List[Any]:
    if not isinstance(value, list):
        return [value]
    return [x for v in value for x in _flat(v)]


def _json_value(value):
    """``value`` as plain JSON, or raise TypeError: None, bools, ints, strings, finite floats,
    and lists (tuples) and str-keyed dicts of them."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return {k: _json_value(v) for k, v in value.items()}
    raise TypeError(type(value).__name__)


def arguments_of(metric: Any) -> Tuple[Dict[str, Any], List[str]]:
    """The constructor arguments that make the fingerprint, as JSON; and the names of
    those that are not plain JSON (a driver must then build the metric itself)."""
    given = metric.__dict__.get("_argument_values", {})
    out, left = {}, []
    for name in metric._arguments:
        try:
            out[name] = _json_value(given[name])
        except (KeyError, TypeError):
            left.append(name)
    return out, left


def export_metrics(items: Sequence[Tuple[str, Any]], what: str) -> Dict[str, Any]:
    """The export of ``[(name, metric)]``; changes nothing (the caller ends the interval).
    Raises ``RuntimeError`` naming a metric whose asynchronous ``calculate()`` is in flight."""
    metrics = [m for _, m in items]
    for m in metrics:
        if interval_of(m).handoffs.in_flight:
            raise RuntimeError(f"{what}: an asynchronous calculate() of {type(m).__name__} is still in "
                               "flight; wait() on its handle before export() (an interval is either "
                               "calculated or exported)")
    places = [place_of(m) for m in metrics]
    states = local_states([interval_of(m) for m in metrics], [m.sync_fingerprint() for m in metrics])  # one copy
    entries = []
    for (name, m), place, plain in zip(items, places, states):
        iv = interval_of(m)
        decls: List[Dict[str, Any]] = []
        index: Dict[str, int] = {}
        encoded = {}
        for state, value in plain.items():
            decl = decl_of(iv.specs[state])
            key = repr(sorted(decl.items()))
            if key not in index:
                index[key] = len(decls)
                decls.append(decl)
            flat = _flat(value)
            if iv.specs[state].dtype == torch.float64:
                flat = [encode_float(x) for x in flat]
            encoded[state] = [index[key], flat if isinstance(value, list) else flat[0]]
        arguments, left = arguments_of(m)
        entry = {"name": name, "class": type(m).__name__, "fingerprint": m.sync_fingerprint(),
                 "interval": iv.number, "arguments": arguments}
        if left:
            entry["unexported_arguments"] = left
        if place != places[0]:
            entry["place"] = place
        entry.update(decls=decls, states=encoded, touched=sorted(iv.touched & set(plain)))
        entries.append(entry)
    return {"format": FORMAT, "version": VERSION, "place": places[0], "metrics": entries}


# ---------------------------------------------------------------------- the driver's side
class Place(NamedTuple):
    rank: int
    data_rank: int
    data_size: int
    dp_rank: int
    dp_size: int
    cp_rank: int
    cp_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int


class Entry(NamedTuple):
    """One metric of one export, checked: ``values`` maps each state to its flat list of
    numbers (floats for float64 states, ints for int64)."""

    index: int  # type: ignore[assignment]  # the export's index; shadows tuple.index, which nothing calls
    where: str  # the field path of this metric in its export: "metrics[k]"
    name: str
    cls: str
    fingerprint: str
    interval: int
    place: Place
    arguments: Dict[str, Any]
    unexported: List[str]
    decls: Dict[str, Dict[str, Any]]
    values: Dict[str, List[Any]]
    touched: frozenset

    @property
    def label(self) -> str:
        return f"{self.name!r} ({self.cls})" if self.name else self.cls


class _Bad:
    """Raises naming the export's index and the field."""

    def __init__(self, what: str, index: int):
        self.what, self.index = what, index

    def type(self, field: str, value, expected: str):
        return TypeError(f"{self.what}: export {self.index}: field {field!r} is a {type(value).__name__}, expected "
                         f"{expected}; pass the value export() returned (through json.dumps/json.loads at most)")

    def value(self, field: str, message: str):
        return ValueError(f"{self.what}: export {self.index}: field {field!r} {message}")


def _field(bad: _Bad, obj: Mapping, key: str, kind, field: str, expected: str):
    if key not in obj:
        raise bad.value(field, "is missing; pass the value export() returned")
    value = obj[key]
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        raise bad.type(field, value, expected)
    return value


def decode(export: Any, index: int, what: str) -> List[Entry]:
    """The metrics of one export, every field checked; ``TypeError``/``ValueError`` naming
    ``index`` and the field otherwise."""
    bad = _Bad(what, index)
    if not isinstance(export, Mapping):
        raise bad.type("export", export, "a dict from export()")
    if export.get("format") != FORMAT:
        raise bad.value("format", f"is {export.get('format')!r}, expected {FORMAT!r}: not a value export() "
                        "returned")
    version = _field(bad, export, "version", int, "version", "an int")
    if version > VERSION:
        raise bad.value("version", f"is {version}, newer than this library reads ({VERSION}); update "
                        "twinkle-metrics on the driver to the workers' version")
    if version < 1:
        raise bad.value("version", f"is {version}; expected {VERSION}")
    top = _place(bad, _field(bad, export, "place", Mapping, "place", "a dict"), "place")
    metrics = _field(bad, export, "metrics", list, "metrics", "a list")
    if not metrics:
        raise bad.value("metrics", "is empty; export() of a metric or a collection holds at least one")
    return [_entry(bad, m, f"metrics[{k}]", top) for k, m in enumerate(metrics)]


def _place(bad: _Bad, obj: Mapping, field: str) -> Place:
    values = {k: _field(bad, obj, k, int, f"{field}.{k}", "an int") for k in PLACE_INTS}
    for axis in ("data", "dp", "cp", "tp", "pp"):
        rank, size = values[f"{axis}_rank"], values[f"{axis}_size"]
        if size < 1 or not 0 <= rank < size:
            raise bad.value(f"{field}.{axis}_rank", f"is {rank} of {axis}_size {size}; expected 0 <= rank < size")
    last = values["pp_rank"] == values["pp_size"] - 1
    for key, want in (("last_stage", last), ("source", last and values["tp_rank"] == 0)):
        if _field(bad, obj, key, bool, f"{field}.{key}", "a bool") != want:
            raise bad.value(f"{field}.{key}", f"is {not want}, but pp_rank {values['pp_rank']} of pp_size "
                            f"{values['pp_size']}, tp_rank {values['tp_rank']} make it {want}")
    return Place(**values)


def _entry(bad: _Bad, obj: Any, field: str, top: Place) -> Entry:
    if not isinstance(obj, Mapping):
        raise bad.type(field, obj, "a dict")
    name = _field(bad, obj, "name", str, f"{field}.name", "a str")
    cls = _field(bad, obj, "class", str, f"{field}.class", "a str")
    fingerprint = _field(bad, obj, "fingerprint", str, f"{field}.fingerprint", "a str")
    interval = _field(bad, obj, "interval", int, f"{field}.interval", "an int")
    if interval < 0:
        raise bad.value(f"{field}.interval", f"is {interval}; expected >= 0")
    arguments = _field(bad, obj, "arguments", Mapping, f"{field}.arguments", "a dict")
    unexported = obj.get("unexported_arguments", [])
    if not isinstance(unexported, list) or not all(isinstance(u, str) for u in unexported):
        raise bad.type(f"{field}.unexported_arguments", unexported, "a list of str")
    place = _place(bad, obj["place"], f"{field}.place") if "place" in obj else top
    decls = _field(bad, obj, "decls", list, f"{field}.decls", "a list")
    checked = [_decl(bad, d, f"{field}.decls[{k}]") for k, d in enumerate(decls)]
    states = _field(bad, obj, "states", Mapping, f"{field}.states", "a dict")
    by_name, values = {}, {}
    for state, pair in states.items():
        where = f"{field}.states[{state!r}]"
        if not isinstance(state, str) or not state:
            raise bad.type(where, state, "a non-empty str state name")
        if (not isinstance(pair, list) or len(pair) != 2 or isinstance(pair[0], bool)
                or not isinstance(pair[0], int) or not 0 <= pair[0] < len(checked)):
            raise bad.value(where, f"is {str(pair)[:80]}; expected [index into decls (0..{len(checked) - 1}), value]")
        decl, numel = checked[pair[0]]
        by_name[state] = decl
        values[state] = _values(bad, where, pair[1], decl, numel)
        if decl["dtype"] == "int64" and decl["reduce"] == "sum" and values[state] and min(values[state]) < 0:
            label = f"{name!r} ({cls})" if name else cls
            raise bad.value(where, f"of {label} holds {min(values[state])}: an int64 'sum' state counts (tokens, "
                            "sequences, histogram buckets) and is never negative; pass the value export() returned")
    touched = _field(bad, obj, "touched", list, f"{field}.touched", "a list")
    if not all(isinstance(t, str) and t in values for t in touched):
        raise bad.value(f"{field}.touched", "names a state the export does not hold")
    return Entry(index=bad.index, where=field, name=name, cls=cls, fingerprint=fingerprint, interval=interval,
                 place=place, arguments=dict(arguments), unexported=list(unexported), decls=by_name, values=values,
                 touched=frozenset(touched))


def _decl(bad: _Bad, obj: Any, field: str) -> Tuple[Dict[str, Any], int]:
    if not isinstance(obj, Mapping):
        raise bad.type(field, obj, "a dict")
    reduce = _field(bad, obj, "reduce", str, f"{field}.reduce", "a str")
    dtype = _field(bad, obj, "dtype", str, f"{field}.dtype", "a str")
    if dtype not in _DTYPES:
        raise bad.value(f"{field}.dtype", f"is {dtype!r}; expected one of {sorted(_DTYPES)}")
    shape = _field(bad, obj, "shape", list, f"{field}.shape", "a list of ints")
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise bad.value(f"{field}.shape", f"is {shape}; expected a list of ints >= 0")
    scope = _field(bad, obj, "scope", str, f"{field}.scope", "a str")
    per_rank = _field(bad, obj, "per_rank", bool, f"{field}.per_rank", "a bool")
    decl = {"reduce": reduce, "dtype": dtype, "shape": list(shape), "scope": scope, "per_rank": per_rank}
    return decl, math.prod(shape)


def _int64s(values: List[int]) -> bool:
    """Whether every int fits int64 (a C loop, as the rows are built)."""
    try:
        array.array("q", values)
    except OverflowError:
        return False
    return True


def _values(bad: _Bad, where: str, value: Any, decl: Dict[str, Any], numel: int) -> List[Any]:
    shaped = bool(decl["shape"])
    flat = value if shaped else [value]
    if shaped and not isinstance(value, list):
        raise bad.type(where, value, f"a flat list of {numel} numbers (shape {decl['shape']})")
    if len(flat) != numel:
        raise bad.value(where, f"holds {len(flat)} numbers; its shape {decl['shape']} needs {numel}")
    kinds = set(map(type, flat))  # one pass in C: histograms hold thousands of numbers
    if decl["dtype"] == "int64":
        if kinds - {int} or not _int64s(flat):
            wrong = next(v for v in flat if type(v) is not int or not _I64[0] <= v < _I64[1])
            raise bad.value(where, f"holds {wrong!r}; an int64 state holds ints in int64 range")
        return flat
    if kinds <= {float}:
        return flat
    out = []
    for v in flat:
        if type(v) is float:
            out.append(v)
        elif type(v) is int:
            try:
                out.append(float(v))
            except OverflowError:
                raise bad.value(where, f"holds {v}, beyond float64") from None
        elif isinstance(v, str) and v in _NONFINITE:
            out.append(_NONFINITE[v])
        else:
            raise bad.value(where, f"holds {str(v)[:40]!r}; a float64 state holds numbers or 'nan', "
                            "'inf', '-inf'")
    return out

