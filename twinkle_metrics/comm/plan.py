"""The plan of a sync: where every state of every metric sits in the packed buffer, how
the ranks agree on it, and how every rank's rows merge by it.

Ranks negotiate a plan (``_negotiate``, one gather of small descriptions over the data
group and one over TP x PP) the first time a set of metrics syncs, and whenever a rank
holds states the plan lacks; afterwards the plan's hash rides in the buffer's header,
so the steady state needs no negotiation.
"""
from __future__ import annotations

import hashlib
import json
import operator
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch

from parallel.groups import group_ranks

_HEADER = 4  # plan hash, needs a new plan, is result source, pipeline rank
_H_PLAN, _H_NEED, _H_SOURCE, _H_PP = 0, 1, 2, 3
#: TP replicas agree when their states are this close (they compute from the same tokens)
_TP_RTOL, _TP_ATOL = 1e-6, 1e-9


_REDUCED = (("sum", False), ("sum", True), ("max", False), ("min", False), ("max", True), ("min", True))
#: the order of those kinds in the buffer: float64 ones, then int64 ones, so that their
#: scalars lie in long runs of one dtype (one ``torch.stack`` each, ``_Plan.pieces``)
_LAYOUT = tuple(k for k in _REDUCED if not k[1]) + tuple(k for k in _REDUCED if k[1])
_KEYS_HEAD = 3  # the MAX keys start with the plan hash, minus the plan hash, the need flag
_I64_MIN = -(1 << 63)


class MetricSyncError(RuntimeError):
    """Ranks hold different metrics or states, or disagree where they must agree;
    raised on every rank."""


class _Plan:
    """Where every state of every metric sits in the packed buffer."""

    def __init__(self, metrics: Sequence, names: Sequence[Sequence[str]], configs: Sequence[str]):
        self.entries: List[List[Tuple[str, Any, int]]] = []   # per metric: (name, spec, offset)
        self.owner: List[Tuple[int, str]]                      # per column: (metric, state)
        # states with a "sum"/"max"/"min" reduction are merged column by column, all such
        # columns of one (op, is int64) at once; the others by their own callable
        # reduction, given every rank's rows of them
        cols: Dict[Tuple[str, bool], List[int]] = {}
        check: Dict[bool, List[int]] = {False: [], True: []}
        placed: Dict[Tuple[str, str, bool], List[int]] = {}  # (scope, op, is int) -> columns
        # per metric with such states: (metric, [(state, spec, column in the gathered
        # rows, column in the buffer)]) for the gather path, and for the reduce path
        # (which gathers those columns only)
        self.custom: List[Tuple[int, List[Tuple[str, Any, int, int]]]] = []
        self.gathered: List[Tuple[int, List[Tuple[str, Any, int, int]]]] = []
        own: List[int] = []  # their columns
        # The buffer holds the states kind by kind (``_LAYOUT``'s order, then the states
        # merged by their own reduction), each kind's scalars first, in metric and state
        # order: every kind is one contiguous span, merged by slicing, with no index tensors.
        text = []
        kinds: List[List[Tuple[int, str, Any]]] = [[] for _ in range(len(_LAYOUT) + 1)]
        for i, (m, metric_names) in enumerate(zip(metrics, names)):
            reads = _merge_reads(m, metric_names)
            for name in metric_names:
                spec = _spec(m, name)
                text.append(f"{i}.{name}:{spec.signature}")
                at = len(_LAYOUT) if name in reads else _LAYOUT.index((spec.reduce, spec.dtype == torch.int64))
                kinds[at].append((i, name, spec))
        for kind in kinds:
            kind.sort(key=lambda entry: entry[2].shape != ())  # stable
        offsets: Dict[Tuple[int, str], int] = {}
        #: (metric, state, spec) in buffer order
        self.order: List[Tuple[int, str, Any]] = [entry for kind in kinds for entry in kind]
        #: what ``pieces`` packs: runs of scalars of one dtype, each shaped state alone, as
        #: (scalars, int64, [(metric, state, spec)])
        self._runs: List[Tuple[bool, bool, List[Tuple[int, str, Any]]]] = []
        for i, name, spec in self.order:
            scalar, is_int = spec.shape == (), spec.dtype == torch.int64
            if scalar and self._runs and self._runs[-1][:2] == (True, is_int):
                self._runs[-1][2].append((i, name, spec))
            else:
                self._runs.append((scalar, is_int, [(i, name, spec)]))
        self.slices: Dict[Tuple[str, bool], Tuple[int, int]] = {}  # kind -> buffer columns, header included
        offset = 0
        for k, kind in enumerate(kinds):
            start = offset
            for i, name, spec in kind:
                offsets[(i, name)] = offset
                offset += spec.numel
            if k < len(_LAYOUT) and offset > start:
                self.slices[_LAYOUT[k]] = (_HEADER + start, _HEADER + offset)
        self.owner = [(i, name) for i, name, spec in self.order for _ in range(spec.numel)]  # buffer order
        for i, (m, metric_names) in enumerate(zip(metrics, names)):
            entries, custom, gathered = [], [], []
            reads = _merge_reads(m, metric_names)
            for name in metric_names:
                spec = _spec(m, name)
                offset = offsets[(i, name)]
                entries.append((name, spec, offset))
                span = range(offset, offset + spec.numel)
                is_int = spec.dtype == torch.int64
                if not spec.per_rank and spec.scope != "model":
                    check[is_int].extend(span)
                if spec.scope != "data":
                    placed.setdefault((spec.scope, spec.reduce, is_int), []).extend(span)
                if name in reads:
                    custom.append((name, spec, _HEADER + offset, _HEADER + offset))
                    gathered.append((name, spec, len(own), _HEADER + offset))
                    own.extend(span)
                else:
                    cols.setdefault((spec.reduce, is_int), []).extend(span)
            if custom:
                self.custom.append((i, custom))
                self.gathered.append((i, gathered))
            self.entries.append(entries)
        #: per column: its place in metric and state order (what was the buffer order)
        self.rank = [0] * len(self.owner)
        for n, col in enumerate(c for entries in self.entries for _, spec, off in entries
                                for c in range(off, off + spec.numel)):
            self.rank[col] = n
        self.length = len(self.owner)
        self._reduced = [cols.get(k, []) for k in _REDUCED] + [own]
        #: what the reduce path's collectives carry: float sums, int sums, extremes, gathered
        self.reduce_sizes = (len(self._reduced[0]), len(self._reduced[1]),
                             sum(len(c) for c in self._reduced[2:6]), len(own))
        self._cols = {k: v for k, v in cols.items() if v}
        self._names = [frozenset(name for name, _, _ in entries) for entries in self.entries]
        #: per metric, what ``_unpack`` reads: its state names in order, the index of each
        #: (``offset`` in the float64 values, ``length + offset`` in the int64 ones), and the
        #: shaped states' spans (which replace their first value) with their shapes
        self.decoders: List[Tuple[List[str], Any, List[Tuple[str, int, int, Tuple[int, ...]]]]] = []
        for entries in self.entries:
            index = [offset + (self.length if spec.dtype == torch.int64 else 0) for _, spec, offset in entries]
            shaped = [(name, i, i + spec.numel, spec.shape) for (name, spec, _), i in zip(entries, index)
                      if spec.shape != ()]
            self.decoders.append(([name for name, _, _ in entries], _getter(index), shaped))
        self._check = check
        self.placed = {k: torch.tensor(v, dtype=torch.long) + _HEADER for k, v in placed.items()}
        self._by_device: Dict[Any, Any] = {}  # the columns' index tensors, per (use and) device
        digest = hashlib.blake2b("|".join(list(configs) + text).encode(), digest_size=6).digest()
        self.hash = float(int.from_bytes(digest, "little"))  # 48 bits: exact in float64

    def pieces(self, intervals, device) -> List[torch.Tensor]:
        """The states of ``intervals`` (each metric's) as flat float64 pieces (int64 bit-cast) in buffer
        order. Where every metric's states are on one device, one ``torch.stack`` per run of
        scalars of one dtype (``_LAYOUT`` makes them long) and each shaped state as it is:
        a handful of tensor calls, not several per state; else one piece per state, on its
        own device. ``device``: where a state an interval lacks is made."""
        states = [iv.states for iv in intervals]
        if len({iv.device for iv in intervals}) != 1:
            runs = [(False, entry[2].dtype == torch.int64, [entry]) for entry in self.order]
        else:
            runs = self._runs
        out = []
        for scalars, is_int, run in runs:
            try:
                ts = [states[i][name] for i, name, _ in run]
            except KeyError:
                ts = [states[i].get(name, None) for i, name, _ in run]
                ts = [spec.new(device) if t is None else t for t, (_, _, spec) in zip(ts, run)]
            piece = torch.stack(ts) if scalars else ts[0] if ts[0].dim() == 1 else ts[0].reshape(-1)
            out.append(piece.view(torch.float64) if is_int else piece)
        return out

    def columns(self, device) -> Dict[Tuple[str, bool], torch.Tensor]:
        """Buffer columns (header included) of the states merged column by column, by
        (reduction, is int64); cached per device."""
        key = str(device)
        if key not in self._by_device:
            self._by_device[key] = {k: torch.tensor(v, dtype=torch.long, device=device) + _HEADER
                                    for k, v in self._cols.items()}
        return self._by_device[key]

    def reduce_columns(self, device) -> List[torch.Tensor]:
        """Buffer columns (header included) of each kind in ``_REDUCED``, then of the
        gathered states, for the reduce path; cached per device."""
        key = ("reduce", str(device))
        if key not in self._by_device:
            self._by_device[key] = [torch.tensor(v, dtype=torch.long, device=device) + _HEADER
                                    for v in self._reduced]
        return self._by_device[key]

    def check_columns(self, is_int: bool) -> torch.Tensor:
        return torch.tensor(self._check[is_int], dtype=torch.long) + _HEADER

    def covers(self, metrics: Sequence) -> bool:
        """Whether every state the metrics hold has a place in this plan (states the
        plan has and a metric lacks are created first, when the metric can)."""
        for m, planned in zip(metrics, self._names):
            if not m.specs.keys() <= planned:
                return False
            if len(m.specs) == len(planned):
                continue
            missing = [n for n in planned if n not in m.specs]
            if missing:
                if any(m.dynamic_spec(n) is None for n in missing):
                    return False
                m.adopt(sorted(missing))
        return True


def _spec(interval, name: str):
    return interval.spec_of(name)


def _merge_reads(metric, names: Sequence[str]) -> set:
    """States merged by their own callable reduction over every rank's rows (the reduce
    path gathers them)."""
    return {n for n in names if not isinstance(_spec(metric, n).reduce, str)}


def _getter(index: List[int]):
    """``values -> tuple of values[i] for i in index`` (``operator.itemgetter``, which
    returns a bare value for one index)."""
    if len(index) == 1:
        return lambda values, i=index[0]: (values[i],)
    return operator.itemgetter(*index) if index else lambda values: ()


#: a kind's reduction over the rows, written into the merged row (``out=``)
_REDUCE_INTO: Dict[str, Callable[..., torch.Tensor]] = {"sum": torch.sum, "max": torch.amax, "min": torch.amin}


def _merge(plan: _Plan, metrics, rows: torch.Tensor) -> torch.Tensor:
    """Merge ``[ranks, header + width]`` rows into one row: each kind by one reduction into
    its span of the row (``out=``: no copy), then each self-merged state by its own. (Cutting
    the rows into their spans with one ``split`` makes fewer ops but more views, and costs
    more: 44 against 32 us for the core metrics.)"""
    vec = rows[0].clone()
    if rows.shape[0] == 1:
        return vec
    ints, vec_ints = rows.view(torch.int64), vec.view(torch.int64)
    for (op, is_int), (a, b) in plan.slices.items():
        if is_int:
            _REDUCE_INTO[op](ints[:, a:b], 0, out=vec_ints[a:b])
        else:
            _REDUCE_INTO[op](rows[:, a:b], 0, out=vec[a:b])
    _merge_own(plan.custom, metrics, rows, vec)
    return vec


def _merge_own(custom, metrics, rows: torch.Tensor, vec: torch.Tensor) -> None:
    """Merge the states with a callable reduction into ``vec``, each by its own; ``custom``
    lists (metric, [(state, spec, column in ``rows``, column in ``vec``)])."""
    for _, entries in custom:
        for _, spec, src, dst in entries:
            is_int = spec.dtype == torch.int64
            r = rows[:, src:src + spec.numel]
            r = r.view(torch.int64) if is_int else r
            v = spec.merge(r if len(spec.shape) == 1 else r.reshape(rows.shape[0], *spec.shape)).to(spec.dtype)
            v = v if v.dim() == 1 else v.reshape(-1)
            vec[dst:dst + spec.numel] = v.view(torch.float64) if is_int else v


def _negotiate(metrics, configs: Tuple[str, ...], ch, transport, path: str) -> _Plan:
    """Agree with every rank on the plan of ``metrics``; collective over both groups of
    ``transport`` (``comm.transport.Transport``).

    Each rank describes its metrics (fingerprints) and states (name, signature,
    whether it was created on the fly); the descriptions are united over the data
    group, then the unions over TP x PP, which makes them global. Every rank then
    decides on the same union: raise everywhere, or adopt the same plan.
    """
    me = group_ranks(None)[0]
    desc: Dict[str, Any] = {"ranks": [me], "configs": {json.dumps(list(configs)): [me]},
            "paths": {path: [me]}, "states": {},
            # each sliced metric's max_slices (ranks may differ; the smallest bounds them all)
            "bounds": {str(i): {str(m.slice_bound): [me]} for i, m in enumerate(metrics)
                       if m.slice_bound is not None}}
    for i, m in enumerate(metrics):
        for name, spec in m.specs.items():
            dynamic = m.dynamic_spec(name) is not None
            desc["states"][f"{i}/{name}"] = {"sig": {spec.signature: [me]}, "dyn": dynamic}
    summary = _unite([json.loads(b) for b in transport.gather_bytes(json.dumps(desc).encode(), transport.data)])
    if transport.mp is not None:
        summary = _unite([json.loads(b) for b in transport.gather_bytes(json.dumps(summary).encode(),
                                                                         transport.mp)])
    everyone = sorted(summary["ranks"])
    if len(summary["paths"]) > 1:
        paths = "; ".join(f"ranks {_ranges(rs)}: {p}" for p, rs in sorted(summary["paths"].items()))
        raise MetricSyncError(f"calculate(): ranks would sync their data groups differently ({paths}); "
                              "set TWINKLE_METRICS_REDUCE_ABOVE alike on every rank")
    if len(summary["configs"]) > 1:
        holds = [f"ranks {_ranges(ranks)} hold [{', '.join(json.loads(text))}]"
                 for text, ranks in summary["configs"].items()]
        raise MetricSyncError("calculate(): ranks hold different metrics or arguments ("
                              + "; ".join(holds)[:1500] + "); build the same metrics, in the same "
                              "order, with the same arguments on every rank")
    names: List[List[str]] = [[] for _ in metrics]
    for key in sorted(summary["states"], key=lambda k: (int(k.split("/", 1)[0]), k.split("/", 1)[1])):
        entry = summary["states"][key]
        i, name = int(key.split("/", 1)[0]), key.split("/", 1)[1]
        holders = sorted({r for rs in entry["sig"].values() for r in rs})
        if len(entry["sig"]) > 1:
            sides = "; ".join(f"ranks {_ranges(rs)}: {sig}" for sig, rs in entry["sig"].items())
            raise MetricSyncError(f"calculate(): ranks declare state {metrics[i].name}.{name} "
                                  f"differently ({sides}); every rank must declare it alike")
        if len(holders) < len(everyone) and not entry["dyn"]:
            raise MetricSyncError(
                f"calculate(): state {metrics[i].name}.{name} exists on ranks "
                f"{_ranges(holders)} only, and the metric cannot create it on the others; add it on "
                "every rank (add_state in the constructor), or declare its family (add_state_family)")
        names[i].append(name)
    for i, bounds in summary["bounds"].items():
        error = metrics[int(i)].over_bound(names[int(i)], min(int(b) for b in bounds))
        if error:
            raise MetricSyncError(error)
    for m, metric_names in zip(metrics, names):
        m.adopt([n for n in metric_names if n not in m.specs])
    plan = _Plan(metrics, names, configs)
    ch.plans[configs] = plan
    ch.width = max(ch.width, plan.length)
    ch.reduce_sizes = tuple(max(a, b) for a, b in zip(ch.reduce_sizes, plan.reduce_sizes))
    return plan


def _unite(parts: List[Dict[str, Any]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {"ranks": [], "configs": {}, "paths": {}, "states": {}, "bounds": {}}
    for p in parts:
        out["ranks"] = sorted(set(out["ranks"]) | set(p["ranks"]))
        for field in ("configs", "paths"):
            for text, ranks in p[field].items():
                out[field][text] = sorted(set(out[field].get(text, [])) | set(ranks))
        for i, bounds in p["bounds"].items():
            mine = out["bounds"].setdefault(i, {})
            for bound, ranks in bounds.items():
                mine[bound] = sorted(set(mine.get(bound, [])) | set(ranks))
        for key, entry in p["states"].items():
            mine = out["states"].setdefault(key, {"sig": {}, "dyn": False})
            mine["dyn"] = mine["dyn"] or entry["dyn"]
            for sig, ranks in entry["sig"].items():
                mine["sig"][sig] = sorted(set(mine["sig"].get(sig, [])) | set(ranks))
    return out


def _ranges(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return "[" + ", ".join(out) + "]"
