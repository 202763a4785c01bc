"""Merging exports on a driver (``calculate_from``), and results already reduced.

A driver (one process, no process group) builds the metrics with the workers' arguments
and no mesh and hands ``calculate_from`` the workers' ``export()`` values. For each metric:

* the exports that carry it (``Metric.calculate_from``: by class; a collection: by name
  and class, so a reward worker group and an actor group each bring their own metrics);
* their fingerprints equal the driver metric's, and they come from one mesh (the same
  ``data_size``, ``tp_size``, ``pp_size``) and one interval (several with
  ``merge_intervals=True``);
* per interval, what ``calculate()`` would merge: every data shard (DP x CP rank) of the
  last pipeline stage, of every stage for states of scope ``"stage"``, of every TP x PP
  rank for ``"model"``; TP replicas count once (the lowest TP rank given) and must agree
  as the sync demands; an export given twice counts once, two different ones for one
  place raise;
* several intervals fold per place as ``accumulate`` folds (``Interval.fold_under``: each
  state's own local fold), so they merge as one long interval would;
* the rows merge by the sync's own plan and merges (``comm.offline.Rows``) and the result
  is the metric's ``compute`` of them (``core.interval.results``, on a copy numbered as the
  exports' interval, the last with ``merge_intervals=True``): the keys and numbers
  ``calculate()`` returns on the workers, each checked against the metric's ``result_keys``
  as there, and the errors its checks raise there.

Every check comes before any result and the driver metric is never changed: it works on
a copy. Errors are ``TypeError``/``ValueError`` naming the export's index and the field
(``core.export.decode``: a malformed field, a negative count in an int64 ``"sum"`` state).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Dict, List, Optional, Tuple

import torch

from twinkle_metrics.comm.offline import Rows
from twinkle_metrics.core.export import Entry, decl_of, decode
from twinkle_metrics.core.interval import Interval, results
from twinkle_metrics.core.state import interval_of

__all__ = ["merge_exports", "agreed_results", "equal"]


def merge_exports(items: Sequence[Tuple[str, Any]], exports: Any, *, merge_intervals: bool, single: bool,
                  what: str) -> List[Dict[str, Any]]:
    """Each metric's results from ``exports``: see the module docstring."""
    if isinstance(exports, (Mapping, str, bytes)) or not isinstance(exports, Sequence):
        raise TypeError(f"{what}: exports must be a list of export() values, got a {type(exports).__name__}; "
                        "for one export pass [export]")
    if not exports:
        raise ValueError(f"{what}: got an empty list of exports; pass the export() of every worker")
    if not isinstance(merge_intervals, bool):
        raise TypeError(f"{what}: merge_intervals must be a bool, got {merge_intervals!r}")
    decoded = [decode(e, i, what) for i, e in enumerate(exports)]
    carried = _match(items, decoded, single, what)
    return [_merge_metric(m, entries, merge_intervals, what) for (_, m), entries in zip(items, carried)]


def _label(name: str, metric) -> str:
    return f"{name!r} ({type(metric).__name__})" if name else type(metric).__name__


def _match(items, decoded: List[List[Entry]], single: bool, what: str) -> List[List[Entry]]:
    out: List[List[Entry]] = [[] for _ in items]
    if single:
        cls = type(items[0][1]).__name__
        for i, entries in enumerate(decoded):
            hits = [e for e in entries if e.cls == cls]
            if not hits:
                carries = ", ".join(e.label for e in entries)
                raise ValueError(f"{what}: export {i} carries no {cls} (it carries {carries}); pass the exports of "
                                 "this metric, or build the driver metric of the class the workers exported")
            if len(hits) > 1:
                raise ValueError(f"{what}: export {i} carries {len(hits)} metrics of class {cls} ("
                                 + ", ".join(e.label for e in hits) + "); merge it with a MetricCollection of the "
                                 "same names")
            out[0].append(hits[0])
        return out
    keys: Dict[Tuple[str, str], int] = {}
    for k, (name, m) in enumerate(items):
        key = (name, type(m).__name__)
        if key in keys:
            raise ValueError(f"{what}: the collection holds two {type(m).__name__} under the name {name!r}, which "
                             "exports cannot tell apart; build the collections from a dict {name: metric}")
        keys[key] = k
    for i, entries in enumerate(decoded):
        seen = set()
        for e in entries:
            key = (e.name, e.cls)
            if key in seen:
                raise ValueError(f"{what}: export {i} carries {e.label} twice; export it from a collection built "
                                 "from a dict {name: metric}")
            seen.add(key)
            if key not in keys:
                held = ", ".join(_label(n, m) for n, m in items)
                raise ValueError(f"{what}: export {i} ({e.where}) carries {e.label}, which this collection does not "
                                 f"hold (it holds {held}); build the driver's collection with the workers' metrics "
                                 "and names")
            out[keys[key]].append(e)
    for (name, m), got in zip(items, out):
        if not got:
            raise ValueError(f"{what}: no export carries {_label(name, m)}; pass the exports of the workers that "
                             "hold it too (each worker group's)")
    return out


def _merge_metric(metric, entries: List[Entry], merge_intervals: bool, what: str) -> Dict[str, Any]:
    first = entries[0]
    label = first.label
    mine = metric.sync_fingerprint()
    for e in entries:
        if e.fingerprint != mine:
            raise ValueError(f"{what}: export {e.index}: field '{e.where}.fingerprint' is {e.fingerprint} but the "
                             f"driver's metric is {mine}; build the driver metric with the workers' class and "
                             "arguments (twinkle_metrics.from_export does, for the library's metrics)")
    for e in entries[1:]:
        for field in ("data_size", "tp_size", "pp_size"):
            if getattr(e.place, field) != getattr(first.place, field):
                raise ValueError(f"{what}: export {e.index}: field 'place.{field}' of {label} is "
                                 f"{getattr(e.place, field)} but export {first.index}'s is "
                                 f"{getattr(first.place, field)}; the exports of one metric come from one mesh")
    intervals = sorted({e.interval for e in entries})
    if len(intervals) > 1 and not merge_intervals:
        other = next(e for e in entries if e.interval != first.interval)
        raise ValueError(f"{what}: export {other.index}: field '{other.where}.interval' of {label} is "
                         f"{other.interval} but export {first.index}'s is {first.interval}; pass the exports of "
                         "one interval, or merge_intervals=True to merge several as one long interval")
    scratch = _scratch(metric)
    scratch.number = intervals[-1]  # compute's messages name the exports' interval, not the driver's
    config = metric.sync_fingerprint()
    names = _state_names(scratch, entries, what)
    rows = Rows(scratch, names, config)
    table = rows.rows([e.values for e in entries])
    at = {id(e): k for k, e in enumerate(entries)}
    need = _need(scratch)
    selected = [_select([e for e in entries if e.interval == iv], need, first.place, rows, table, at, label, what)
                for iv in intervals]
    keys = sorted(selected[0])
    if len(selected) == 1:
        positions = [(pp, table.index_select(0, torch.tensor([at[id(e)] for e in selected[0][(pp, tp)]])))
                     for pp, tp in keys]
    else:
        positions = [(pp, rows.rows([_fold(scratch, [s[(pp, tp)][d] for s in selected])
                                     for d in range(len(selected[0][(pp, tp)]))])) for pp, tp in keys]
    return results(scratch, rows.merge(positions))


def _scratch(metric) -> Interval:
    """An empty interval of the driver metric to merge in: the driver's own states and
    declarations stay as they are, whatever happens."""
    return interval_of(metric).copy(states={}, device=torch.device("cpu"), touched=set())


def _state_names(scratch, entries: List[Entry], what: str) -> List[str]:
    """Every state of the merge (the driver's and the union of the exports'), each
    declared on the driver as in the exports; the ones created on the fly are created on
    the scratch copy, as the sync creates them on ranks that lack them."""
    known: Dict[str, Dict[str, Any]] = {}  # each state's declaration on the driver
    for e in entries:
        for name, decl in e.decls.items():
            mine = known.get(name)
            if mine is None:
                spec = scratch.spec_of(name)
                if spec is None:
                    raise ValueError(f"{what}: export {e.index}: field '{e.where}.states' holds {e.label}.{name}, "
                                     "which the driver's metric neither declares nor creates on the fly; build the "
                                     "driver metric with the workers' arguments")
                mine = known[name] = decl_of(spec)
            if decl is not mine and decl != mine:
                raise ValueError(f"{what}: export {e.index}: field '{e.where}.decls' declares {e.label}.{name} as "
                                 f"{decl} but the driver's metric as {mine}; run the same version of the "
                                 "library on the workers and the driver")
    names = set(scratch.specs) | set(known)
    if scratch.slice_bound is not None:
        error = scratch.over_bound(sorted(names), scratch.slice_bound)
        if error:
            raise ValueError(f"{what}: {error}")
    scratch.adopt(sorted(names - set(scratch.specs)))
    return sorted(names)


def _need(scratch) -> str:
    """Which ranks' exports the metric's states need: ``"model"`` (every TP x PP rank),
    ``"stage"`` (every stage, TP replicas once) or ``"data"`` (the last stage's)."""
    scopes = {spec.scope for spec in scratch.specs.values()}
    return "model" if "model" in scopes else "stage" if "stage" in scopes else "data"


def _select(group: List[Entry], need: str, sizes, rows: Rows, table: torch.Tensor, at, label: str,
            what: str) -> Dict[Tuple[int, int], List[Entry]]:
    """``{(pp rank, tp rank): [the entry of each data shard]}`` of one interval: the TP x PP
    positions the merge needs, each with every data shard, checked as the sync checks."""
    data_size, tp_size, pp_size = sizes.data_size, sizes.tp_size, sizes.pp_size
    by_place: Dict[Tuple[int, int, int], Entry] = {}
    for e in group:
        key = (e.place.data_rank, e.place.tp_rank, e.place.pp_rank)
        prev = by_place.setdefault(key, e)
        if prev is not e and not equal(prev.values, e.values):
            state = next(n for n in sorted(set(prev.values) | set(e.values))
                         if not equal(prev.values.get(n), e.values.get(n)))
            raise ValueError(f"{what}: exports {prev.index} and {e.index} both hold {label} of data shard {key[0]}, "
                             f"TP rank {key[1]}, stage {key[2]} (field 'place') in interval {e.interval}, and "
                             f"differ on state {state!r}; each worker exports once per interval")
    for d, p in sorted({(k[0], k[2]) for k in by_place}):
        reps = [by_place[(d, t, p)] for t in range(tp_size) if (d, t, p) in by_place]
        for other in reps[1:]:
            found = rows.disagreement(table, at[id(reps[0])], at[id(other)])
            if found is not None:
                hint = rows.metric.tp_mismatch_hint or "check that inputs are not split over the TP group"
                raise ValueError(f"{what}: exports {reps[0].index} and {other.index} are TP replicas of {label} "
                                 f"(data shard {d}, stage {p}, TP ranks {reps[0].place.tp_rank} and "
                                 f"{other.place.tp_rank}) but disagree on state {found[0]!r} ({found[1]} vs "
                                 f"{found[2]}); TP replicas see the same tokens and must hold the same numbers; "
                                 f"{hint}")
    last = pp_size - 1
    out: Dict[Tuple[int, int], List[Entry]] = {}
    for p in (range(pp_size) if need != "data" else [last]):
        for t in (range(tp_size) if need == "model" else [None]):
            shards = []
            for d in range(data_size):
                tps = [t] if t is not None else range(tp_size)
                shard = next((by_place[(d, x, p)] for x in tps if (d, x, p) in by_place), None)
                if shard is None:
                    raise ValueError(_missing(rows.metric, need, label, d, t, p, data_size, group, what))
                shards.append(shard)
            out[(p, 0 if t is None else t)] = shards
    return out


def _missing(metric, need: str, label: str, d: int, t, p: int, data_size: int, group: List[Entry], what: str) -> str:
    interval = group[0].interval
    if need == "data":
        have = sorted({e.place.data_rank for e in group if e.place.pp_rank == p})
        return (f"{what}: no export of interval {interval} holds data shard {d} of {data_size} of {label} (field "
                f"'place.data_rank': the DP x CP rank) on the last pipeline stage (pp_rank {p}); the exports hold "
                f"shards {have[:32]} there; pass the export of every data-parallel and context-parallel rank of the "
                "last stage (or of every rank)")
    scoped = sorted(n for n, s in metric.specs.items() if s.scope == need)[:6]
    where = f"data shard {d}, stage {p}" + (f", TP rank {t}" if t is not None else "")
    whom = "every pipeline stage contributes" if need == "stage" else "every TP x PP rank contributes"
    return (f"{what}: {label} has states of scope {need!r} ({', '.join(scoped)}): {whom}, but no export of interval "
            f"{interval} holds {where} (field 'place'); pass the exports of every "
            + ("stage (one TP rank of each is enough)" if need == "stage" else "rank"))


def _fold(scratch, entries: List[Entry]) -> Dict[str, List[Any]]:
    """One place's intervals folded in order, as one long interval: each later interval
    goes on top of the earlier ones by the metric's own fold (``Interval.fold_under``)."""
    acc: Optional[Interval] = None
    for e in entries:
        snap = scratch.copy(states={}, touched=set(e.touched))
        snap.states = {n: (torch.tensor(e.values[n], dtype=spec.dtype).reshape(spec.shape) if n in e.values
                           else spec.new("cpu")) for n, spec in snap.specs.items()}
        if acc is not None:
            snap.fold_under(acc)
        acc = snap
    return {} if acc is None else {n: t.reshape(-1).tolist() for n, t in acc.states.items()}


# ---------------------------------------------------------------------- already reduced
def equal(a: Any, b: Any) -> bool:
    """``a == b`` for plain results (numbers, strings, lists, dicts), NaN equal to NaN."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, Mapping) or isinstance(b, Mapping):
        return isinstance(a, Mapping) and isinstance(b, Mapping) and a.keys() == b.keys() and all(
            equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(equal(x, y) for x, y in zip(a, b)))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that cannot be compared are not equal
        return False


def agreed_results(results: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """One copy of results every rank of a worker group already reduced (each ran
    ``calculate()``, so each holds the same dict), checked: the same keys and equal
    values (NaN equal to NaN) in every copy.

    Use it when one worker group logs what it calculated itself; use exports and
    ``calculate_from`` when a driver merges several worker groups or several steps.

    Example:
        >>> agreed_results([{"loss": 2.0, "kl": float("nan")}, {"loss": 2.0, "kl": float("nan")}])
        {'loss': 2.0, 'kl': nan}
    """
    what = "agreed_results"
    if isinstance(results, (Mapping, str, bytes)) or not isinstance(results, Sequence):
        raise TypeError(f"{what}: expected a list of result dicts (one per rank), got a {type(results).__name__}")
    if not results:
        raise ValueError(f"{what}: got an empty list; pass every rank's calculate() results")
    for i, r in enumerate(results):
        if not isinstance(r, Mapping):
            raise TypeError(f"{what}: results {i} is a {type(r).__name__}, expected the dict calculate() returned")
    first = results[0]
    for i, r in enumerate(results[1:], 1):
        if r.keys() != first.keys():
            raise ValueError(f"{what}: results {i} hold other keys than results 0 (only in {i}: "
                             f"{sorted(set(r) - set(first))[:10]}, only in 0: {sorted(set(first) - set(r))[:10]}); "
                             "every rank of a worker group that ran calculate() holds the same dict")
        for key in first:
            if not equal(r[key], first[key]):
                raise ValueError(f"{what}: results {i} differ from results 0 at key {key!r} ({r[key]!r} vs "
                                 f"{first[key]!r}); every rank of a worker group that ran calculate() holds the "
                                 "same dict: pass calculate()'s results, or merge exports with calculate_from")
    return dict(first)
