"""Fused, generic sync of every state of every metric: two collectives in steady state
(up to five on data groups of thousands of ranks).

Data phase, every ``calculate()``:

1. One ``all_gather`` over the data group (DP x CP) of one packed float64 buffer
   holding every state of every metric (int64 states bit-cast, so they travel and
   merge exactly), behind a small header. Each rank merges the rows locally with
   each state's declared reduction, so sum, max, min and custom merges (top-k, Chan's
   moments) all ride in one collective.

   A data group of more than ``REDUCE_ABOVE`` ranks (default 512; environment
   ``TWINKLE_METRICS_REDUCE_ABOVE``) all-reduces instead, so what a rank receives and
   merges stays flat in the group size: one int64 MAX (plan agreement, need flag, and
   every max and min state as an order-preserving integer key, NaN included), one
   float64 SUM, one exact int64 SUM, and an ``all_gather`` of only the states a
   metric merges itself (a callable reduction, an overridden ``merge``); each of the
   last three only when such states exist. Same merged row, up to the order of the
   float sums (``_reduce_data``). The group size is the same on each of its ranks,
   so all take the same path; the negotiation checks that every rank chose alike.
2. Under tensor or pipeline parallelism, one ``all_gather`` over TP x PP (the mesh's
   ``mp`` group) of the merged buffer. Every rank keeps the row of the result source
   (last stage, TP rank 0), so all stages and TP replicas return the same numbers;
   the rows of TP replicas of one stage must agree on every state not declared
   ``per_rank`` (a forgotten ``vocab_parallel=True`` shows up here), else every rank
   raises. States of scope ``"stage"`` (every stage contributes) and ``"model"``
   (every TP x PP rank contributes) are merged over those rows instead, on the host:
   no extra collective.

Then one device-to-host copy of what was gathered; every decision is taken on
those numbers, which are the same on every rank, so every rank decides alike.

Plans. Which states the buffer holds, and where, is a *plan* agreed by every rank of
the mesh; the buffer length of a pair of groups (data group, TP x PP) only grows and
is the same on every rank, so no difference between ranks (other metrics, states
created on the fly, another order) can reach a size-mismatched collective. A plan is
negotiated (two small exchanges over each group: lengths, then bytes) at the first
``calculate()`` of a pair of groups and again only when a rank flags, in the header
of the regular buffer, that it holds states or metrics no agreed plan covers: then
every rank learns it from the same gathered numbers, negotiates, and syncs again.
The negotiation takes the union of the states of every rank (a state created on the
fly on some ranks only, such as a reward name seen on the last pipeline stage, is
created on the others; ranks without it contribute its identity) and raises
``MetricSyncError`` on every rank when ranks hold different metrics or arguments
(their fingerprints differ) or declare a state differently.

Why every rank agrees: a data group's merged row is the same on all its ranks (an
all-reduce hands every rank the same reduced values; flags and hashes travel as
exact integers), and
the TP x PP group of any rank holds one rank of every data group, so what one rank
learns after the second collective (a flag, an error, a disagreement) every rank
learns.

Collectives per ``calculate()``: 1 (pure DP) or 2 (TP or PP) in steady state; the
first one of a pair of groups adds 2 per group for the negotiation, and a change in
the set of states adds one negotiation and one more data phase. On the reduce path
the data phase takes 1 to 4 collectives instead of 1 (3 for sums and extremes of
both dtypes, 4 with self-merged states), plus the one over TP x PP.
"""
from __future__ import annotations

import hashlib
import json
import os
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from parallel import comm_device
from parallel.groups import all_gather_rows, group_ranks, group_size
from twinkle_metrics.core.slicing import held
from twinkle_metrics.inputs.checks import from_host, from_host_all
from twinkle_metrics.sync.order import from_ordered_f64, ordered_f64

_HEADER = 4  # plan hash, needs a new plan, is result source, pipeline rank
_H_PLAN, _H_NEED, _H_SOURCE, _H_PP = 0, 1, 2, 3
#: TP replicas agree when their states are this close (they compute from the same tokens)
_TP_RTOL, _TP_ATOL = 1e-6, 1e-9


def _threshold(default: int) -> int:
    text = os.environ.get("TWINKLE_METRICS_REDUCE_ABOVE", str(default))
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"TWINKLE_METRICS_REDUCE_ABOVE must be a number of ranks, got {text!r}; "
                         "unset it for the default") from None


#: data groups of more ranks than this all-reduce instead of gathering every rank's row:
#: above ~512 the gather's merge costs the host more than the reduce path's pack and
#: unpack (``benchmarks/bench_sync_scaling.py``); set it alike on every rank
REDUCE_ABOVE = _threshold(512)
#: the reduce path's column kinds, in the order its collectives carry them
_REDUCED = (("sum", False), ("sum", True), ("max", False), ("min", False), ("max", True), ("min", True))
_KEYS_HEAD = 3  # the MAX keys start with the plan hash, minus the plan hash, the need flag
_I64_MIN = -(1 << 63)


class MetricSyncError(RuntimeError):
    """Ranks hold different metrics or states, or disagree where they must agree;
    raised on every rank."""


# --------------------------------------------------------------------------- plans
class _Plan:
    """Where every state of every metric sits in the packed buffer."""

    def __init__(self, metrics: Sequence, names: Sequence[Sequence[str]], configs: Sequence[str]):
        self.entries: List[List[Tuple[str, Any, int]]] = []   # per metric: (name, spec, offset)
        self.owner: List[Tuple[int, str]] = []                 # per column: (metric, state)
        # states with a "sum"/"max"/"min" reduction that no metric's own merge() reads are
        # merged column by column, all such columns of one (op, is int64) at once; the
        # others by their metric's merge(), given every rank's rows of them
        cols: Dict[Tuple[str, bool], List[int]] = {}
        check: Dict[bool, List[int]] = {False: [], True: []}
        placed: Dict[Tuple[str, str, bool], List[int]] = {}  # (scope, op, is int) -> columns
        # per metric with such states: (metric, [(state, spec, column in the gathered
        # rows, column in the buffer)]) for the gather path, and for the reduce path
        # (which gathers those columns only)
        self.custom: List[Tuple[int, List[Tuple[str, Any, int, int]]]] = []
        self.gathered: List[Tuple[int, List[Tuple[str, Any, int, int]]]] = []
        own: List[int] = []  # their columns
        offset = 0
        text = []
        for i, (m, metric_names) in enumerate(zip(metrics, names)):
            entries, custom, gathered = [], [], []
            reads = _merge_reads(m, metric_names)
            for name in metric_names:
                spec = _spec(m, name)
                entries.append((name, spec, offset))
                text.append(f"{i}.{name}:{spec.signature}")
                span = range(offset, offset + spec.numel)
                self.owner += [(i, name)] * spec.numel
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
                offset += spec.numel
            if custom:
                self.custom.append((i, custom))
                self.gathered.append((i, gathered))
            self.entries.append(entries)
        self.length = offset
        self._reduced = [cols.get(k, []) for k in _REDUCED] + [own]
        #: what the reduce path's collectives carry: float sums, int sums, extremes, gathered
        self.reduce_sizes = (len(self._reduced[0]), len(self._reduced[1]),
                             sum(len(c) for c in self._reduced[2:6]), len(own))
        self._cols = {k: v for k, v in cols.items() if v}
        self._check = check
        self.placed = {k: torch.tensor(v, dtype=torch.long) + _HEADER for k, v in placed.items()}
        self._by_device: Dict[str, tuple] = {}
        digest = hashlib.blake2b("|".join(list(configs) + text).encode(), digest_size=6).digest()
        self.hash = float(int.from_bytes(digest, "little"))  # 48 bits: exact in float64

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
        for m, entries in zip(metrics, self.entries):
            planned = {name for name, _, _ in entries}
            if not set(m._specs) <= planned:
                return False
            missing = [n for n in planned if n not in m._specs]
            if missing:
                if any(m._new_state_spec(n) is None for n in missing):
                    return False
                m._adopt(sorted(missing))
        return True


def _spec(metric, name: str):
    spec = metric._specs.get(name)
    return spec if spec is not None else metric._new_state_spec(name)


def _merge_reads(metric, names: Sequence[str]) -> set:
    """States merged by the metric's ``merge`` over every rank's rows (the reduce path
    gathers them): those with a callable reduction, and those an overridden ``merge``
    reads (all of them unless the metric names them in ``_merge_reads``)."""
    out = {n for n in names if not isinstance(_spec(metric, n).reduce, str)}
    if type(metric)._own_merge:
        reads = metric._merge_reads()
        out |= set(names) if reads is None else set(reads) & set(names)
    return out


class _Channel:
    """What the ranks agreed on for one pair of groups: plans and the buffer width."""

    def __init__(self):
        self.plans: Dict[Tuple[str, ...], _Plan] = {}
        self.width = 0
        self.reduce_sizes = (0, 0, 0, 0)  # the reduce path's, elementwise max over the plans


_CHANNELS: Dict[Tuple[int, int], Tuple[tuple, _Channel]] = {}  # ids -> (weak refs, channel)
_LOCAL_PLANS: Dict[Tuple, _Plan] = {}


def _channel(data_group, share_group) -> _Channel:
    """The channel of a pair of groups. Holds only weak references to them, so that a
    destroyed group's threads can go (a test session creates hundreds of groups)."""
    groups = (data_group, share_group)
    key = tuple(id(g) for g in groups)
    entry = _CHANNELS.get(key)
    if entry is not None and all((r is None) if g is None else (r is not None and r() is g)
                                 for r, g in zip(entry[0], groups)):
        return entry[1]
    for k in [k for k, (refs, _) in _CHANNELS.items() if any(r is not None and r() is None for r in refs)]:
        del _CHANNELS[k]  # channels of groups that are gone
    ch = _Channel()
    _CHANNELS[key] = (tuple(None if g is None else weakref.ref(g) for g in groups), ch)
    return ch


def _groups_key(metric) -> Tuple:
    mesh = metric.resolve_mesh()
    return (id(metric.data_group()), id(mesh.result_group))


# ---------------------------------------------------------------------- entry points
def sync_and_compute(metrics: Sequence, reset: bool = True, groups=None) -> List[Dict[str, Any]]:
    """Reduce the states of ``metrics`` globally and return each one's results.

    Metrics that share the same data and TP x PP groups sync together in one pass.
    ``groups``: a function mapping ``(data group, TP x PP group)`` to the groups the
    collectives run on instead (an asynchronous calculate uses private twins).
    """
    buckets: Dict[Tuple, List[int]] = {}
    for i, m in enumerate(metrics):
        buckets.setdefault(_groups_key(m), []).append(i)
    results: List[Dict[str, Any]] = [{} for _ in metrics]
    for idx in buckets.values():
        group_metrics = [metrics[i] for i in idx]
        reduced = sync_states(group_metrics, groups)
        for i, m, states in zip(idx, group_metrics, reduced):
            results[i] = m._results(states)
    if reset:  # only once every metric computed: an error above keeps every interval intact
        for m in metrics:
            m._end_interval()
    return results


def sync_states(metrics: Sequence, groups=None) -> List[Dict[str, Any]]:
    """Globally reduced states of each metric as plain Python numbers (lists if shaped).

    All ``metrics`` must share one data group and one TP x PP group. Collective over
    the mesh (or over ``groups(data group, TP x PP group)``). Does not change the
    metrics' local states (it may create states that other ranks created on the fly,
    holding their identity).
    """
    lead = metrics[0]
    mesh = lead.resolve_mesh()
    mesh.check_live("calculate()")
    data_group = lead.data_group()
    share_group = mesh.result_group
    if groups is not None:
        data_group, share_group = groups(data_group, share_group)
    configs = tuple(m.sync_fingerprint() for m in metrics)
    if data_group is None and share_group is None:
        plan = _local_plan(metrics, configs)
        buf = _pack(plan, metrics, plan.length, lead._device, lead._device, need=False,
                    is_source=True, pp_rank=0)
        return _unpack(buf.cpu(), plan, metrics)

    ch = _channel(data_group, share_group)
    for _ in range(2):
        plan = ch.plans.get(configs)
        if plan is None and not ch.plans:  # nothing agreed on these groups yet, on any rank
            plan = _negotiate(metrics, configs, ch, data_group, share_group)
        need = plan is None or not plan.covers(metrics)
        host = _data_phase(metrics, plan, need, ch, data_group, share_group, mesh)
        if host is not None:
            return host
        _negotiate(metrics, configs, ch, data_group, share_group)
    raise MetricSyncError("calculate(): ranks still disagree on the metrics' states after a "
                          "negotiation; a state was added during calculate()")


def _local_plan(metrics, configs) -> _Plan:
    key = (configs,) + tuple(tuple(m._specs) for m in metrics)
    plan = _LOCAL_PLANS.get(key)
    if plan is None:
        if len(_LOCAL_PLANS) > 64:  # a process builds few metric sets; bound it anyway
            _LOCAL_PLANS.clear()
        plan = _LOCAL_PLANS[key] = _Plan(metrics, [sorted(m._specs) for m in metrics], configs)
    return plan


# ------------------------------------------------------------------------ data phase
def _data_phase(metrics, plan: Optional[_Plan], need: bool, ch: _Channel, data_group, share_group,
                mesh) -> Optional[List[Dict[str, Any]]]:
    """Pack, gather (or all-reduce), merge, share; None when some rank asked for a new plan."""
    lead = metrics[0]
    comm = data_group if data_group is not None else share_group
    device = comm_device(comm)
    is_source, pp_rank = mesh.is_result_source, mesh.pp_rank
    usable = plan if plan is not None and not need else None
    buf = _pack(plan, metrics, ch.width, lead._device, device, need=usable is None,
                is_source=is_source, pp_rank=pp_rank)
    if _reduces(data_group):  # the same size on every rank of the group: all take this branch
        vec = _reduce_data(usable, metrics, buf, ch.reduce_sizes, data_group)
    else:
        rows = all_gather_rows(buf, data_group)                  # collective 1
        vec = _merge(usable, metrics, rows) if usable is not None else rows[0].clone()
        vec[_H_NEED] = torch.maximum(rows[:, _H_NEED].amax(),
                                     (rows[:, _H_PLAN] != rows[0, _H_PLAN]).any().to(torch.float64))
    vec[_H_SOURCE] = float(is_source)
    vec[_H_PP] = float(pp_rank)
    if share_group is None:
        host = vec.unsqueeze(0).cpu()                            # the one device-to-host copy
    else:
        host = all_gather_rows(vec, share_group).cpu()           # collective 2, then the copy
    if bool((host[:, _H_NEED] != 0).any()):
        return None
    if share_group is not None:
        source = (host[:, _H_SOURCE] == 1.0).nonzero().flatten().tolist()
        if len(source) != 1:
            raise MetricSyncError(
                f"calculate(): {len(source)} ranks of the TP x PP group "
                f"{group_ranks(share_group)} claim to hold the results (last pipeline stage, TP "
                "rank 0); expected exactly one: check the mesh's pipeline and TP groups")
        _check_tp_agreement(plan, metrics, host, share_group)
        vec_host = _merge_placed(plan, host, host[source[0]])
    else:
        vec_host = host[0]
    return _unpack(vec_host, plan, metrics)


def _pack(plan: Optional[_Plan], metrics, width: int, pack, device, *, need: bool, is_source: bool,
          pp_rank: int) -> torch.Tensor:
    """The header plus every planned state, float64 (int64 bit-cast), padded to ``width``.

    Packs where the states are (one cat), then moves the one buffer to the
    collectives' device: never a copy per state. Where some states are on an
    accelerator, that device packs: pieces on the CPU (the header, metrics fed only
    Python numbers) go over in one non-blocking copy, so that packing never
    waits for the work queued on the device (a blocking copy per CPU state did, once
    each: those were calculate()'s extra synchronisations on a GPU).
    """
    head = [plan.hash if plan is not None else 0.0, float(need), float(is_source), float(pp_rank)]
    flat = [torch.tensor(head, dtype=torch.float64)]
    used = 0
    if plan is not None and not need:
        for m, entries in zip(metrics, plan.entries):
            for name, spec, _ in entries:
                t = m._states.get(name)
                if t is None:
                    t = spec.new(pack)
                t = t.detach().reshape(-1)
                flat.append(t.view(torch.float64) if t.dtype == torch.int64 else t)
        used = plan.length
    pack = next((t.device for t in flat if t.device.type != "cpu"), pack)
    if pack.type != "cpu":
        flat = _host_pieces_to(flat, pack)
    buf = torch.cat([t if t.device == pack else t.to(pack) for t in flat])
    buf = _to_device(buf, device)
    return torch.nn.functional.pad(buf, (0, width - used)) if width > used else buf


def _host_pieces_to(flat: List[torch.Tensor], device: torch.device) -> List[torch.Tensor]:
    """``flat`` with its CPU pieces moved to ``device`` in one copy (order kept)."""
    where = [i for i, t in enumerate(flat) if t.device.type == "cpu"]
    if not where:
        return flat
    out = list(flat)
    for i, piece in zip(where, from_host_all([flat[i] for i in where], device)):
        out[i] = piece
    return out


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t.to(device)``; from the CPU without blocking (``_checks.from_host``: a blocking
    copy waits for the device's queue first)."""
    if t.device == device:
        return t
    if t.device.type == "cpu":
        return from_host(t, device)
    return t.to(device)


def _merge(plan: _Plan, metrics, rows: torch.Tensor) -> torch.Tensor:
    """Merge ``[ranks, header + width]`` rows into one row, state by state."""
    vec = rows[0].clone()
    if rows.shape[0] == 1:
        return vec
    for (op, is_int), cols in plan.columns(rows.device).items():
        sel = rows.index_select(1, cols)
        if is_int:
            sel = sel.view(torch.int64)
        red = sel.sum(0) if op == "sum" else (sel.amax(0) if op == "max" else sel.amin(0))
        vec[cols] = red.view(torch.float64) if is_int else red
    _merge_own(plan.custom, metrics, rows, vec)
    return vec


def _merge_own(custom, metrics, rows: torch.Tensor, vec: torch.Tensor) -> None:
    """Merge states with each metric's own ``merge()`` into ``vec``; ``custom`` lists
    (metric, [(state, spec, column in ``rows``, column in ``vec``)])."""
    for i, entries in custom:
        per_state = {}
        for name, spec, src, _ in entries:
            r = rows[:, src:src + spec.numel]
            if spec.dtype == torch.int64:
                r = r.view(torch.int64)
            per_state[name] = r.reshape(rows.shape[0], *spec.shape)
        out = metrics[i].merge(per_state)
        for name, spec, _, dst in entries:
            v = out[name].to(spec.dtype).reshape(-1).contiguous()
            vec[dst:dst + spec.numel] = v.view(torch.float64) if spec.dtype == torch.int64 else v


# ------------------------------------------------------------------------ reduce path
def _reduces(data_group) -> bool:
    """Whether the data phase all-reduces (a data group of more than ``REDUCE_ABOVE``
    ranks) instead of gathering every rank's row."""
    return data_group is not None and group_size(data_group) > REDUCE_ABOVE


def _reduce_data(plan: Optional[_Plan], metrics, buf: torch.Tensor, sizes: Tuple[int, int, int, int],
                 group) -> torch.Tensor:
    """The merged row ``_merge`` would make of the group's gathered rows, from all-reduces.

    What a rank receives no longer grows with the group: a ring all-reduce moves about
    twice its input, where a gather brings every rank's row and merges them here.
    Collectives over ``group``, in this order, their sizes ``sizes`` (the channel's, the
    same on every rank whatever plan it holds, so a rank without a plan still matches):

    1. int64 MAX: the header's plan hash, minus the hash (every rank holds the same plan
       iff the two maxima agree), the need flag; then an order-preserving key of every
       max column and of every min column negated (``_order``: NaN above +inf, so it
       propagates as ``amax`` does), float64 and int64 (int minima as ``~x``) alike;
    2. float64 SUM of the float sum columns (skipped when there are none);
    3. int64 SUM of the int sum columns, exact (skipped when there are none);
    4. all_gather of the states merged by a metric's own ``merge`` or a callable
       reduction, merged here as the gather path does (skipped when there are none).

    ``plan`` is ``None`` when this rank packed no states (it needs a new plan): it
    then contributes identities, and the need flag sends every rank to negotiate.
    """
    top, sums_f, sums_i, own = _reduce_pack(plan, buf, sizes)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    for t in (sums_f, sums_i):
        if t is not None:
            dist.all_reduce(t, group=group)
    rows = all_gather_rows(own, group) if own is not None else None
    return _reduce_unpack(plan, metrics, buf, top, sums_f, sums_i, rows)


def _reduce_pack(plan: Optional[_Plan], buf: torch.Tensor, sizes: Tuple[int, int, int, int]):
    """What the reduce path sends, from the packed buffer: the MAX keys, the float and
    int sums, the gathered columns (``None`` where the channel has none of a kind)."""
    n_sf, n_si, n_ord, n_g = sizes
    dev = buf.device
    cols = plan.reduce_columns(dev) if plan is not None else None
    ints = buf.view(torch.int64)
    head = buf[_H_PLAN:_H_NEED + 1].to(torch.int64)  # the hash has 48 bits: exact
    keys = [head[:1], -head[:1], head[1:]]
    if cols is not None:
        # signed zeros: a minimum of +0.0 comes back +0.0 after the two negations
        keys += [ordered_f64(buf[cols[2]], True), ordered_f64(-buf[cols[3]], True), ints[cols[4]], ~ints[cols[5]]]
    top = _filled(keys, _KEYS_HEAD + n_ord, _I64_MIN, torch.int64, dev)
    sums_f = _filled([buf[cols[0]]] if cols else [], n_sf, 0, torch.float64, dev) if n_sf else None
    sums_i = _filled([ints[cols[1]]] if cols else [], n_si, 0, torch.int64, dev) if n_si else None
    own = _filled([buf[cols[6]]] if cols else [], n_g, 0, torch.float64, dev) if n_g else None
    return top, sums_f, sums_i, own


def _reduce_unpack(plan: Optional[_Plan], metrics, buf: torch.Tensor, top: torch.Tensor,
                   sums_f: Optional[torch.Tensor], sums_i: Optional[torch.Tensor],
                   rows: Optional[torch.Tensor]) -> torch.Tensor:
    """The merged row (header and states, as ``_merge`` lays it out) from the reduced
    tensors and the gathered ``rows`` of the self-merged states."""
    vec = torch.zeros_like(buf)
    vec[_H_PLAN] = top[0].to(torch.float64)
    vec[_H_NEED] = ((top[2] != 0) | (top[0] != -top[1])).to(torch.float64)
    if plan is None:
        return vec
    cols = plan.reduce_columns(buf.device)
    if sums_f is not None:
        vec[cols[0]] = sums_f[:cols[0].numel()]
    if sums_i is not None:
        vec[cols[1]] = sums_i[:cols[1].numel()].view(torch.float64)
    a, b, c, d = (k.numel() for k in cols[2:6])
    ext = top[_KEYS_HEAD:]
    vec[cols[2]] = from_ordered_f64(ext[:a])
    vec[cols[3]] = -from_ordered_f64(ext[a:a + b])
    vec[cols[4]] = ext[a + b:a + b + c].view(torch.float64)
    vec[cols[5]] = (~ext[a + b + c:a + b + c + d]).view(torch.float64)
    if rows is not None:
        _merge_own(plan.gathered, metrics, rows, vec)
    return vec


def _filled(parts: List[torch.Tensor], n: int, fill, dtype, device) -> torch.Tensor:
    """``parts`` one after the other, then ``fill`` up to ``n`` (the channel's size)."""
    out = torch.full((n,), fill, dtype=dtype, device=device)
    if parts:
        flat = torch.cat(parts)
        out[:flat.numel()] = flat
    return out


def _merge_placed(plan: _Plan, host: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """``row`` with the states of scope ``"stage"`` and ``"model"`` merged over the
    TP x PP rows of ``host``: one row per pipeline stage (its first TP rank) for
    ``"stage"``, every row for ``"model"``. Host-side: the rows are already here."""
    if not plan.placed:
        return row
    out = row.clone()
    firsts: Dict[float, int] = {}
    for r, pp in enumerate(host[:, _H_PP].tolist()):
        firsts.setdefault(pp, r)
    per_stage = host.index_select(0, torch.tensor(sorted(firsts.values()), dtype=torch.long))
    for (scope, op, is_int), cols in plan.placed.items():
        sel = (host if scope == "model" else per_stage).index_select(1, cols)
        if is_int:
            sel = sel.view(torch.int64)
        red = sel.sum(0) if op == "sum" else (sel.amax(0) if op == "max" else sel.amin(0))
        out[cols] = red.view(torch.float64) if is_int else red
    return out


def _check_tp_agreement(plan: _Plan, metrics, host: torch.Tensor, share_group) -> None:
    """Rows of one pipeline stage (TP replicas) must agree on every state not
    declared ``per_rank``; raise on every rank naming the first disagreement."""
    stages: Dict[float, List[int]] = {}
    for r, pp in enumerate(host[:, _H_PP].tolist()):
        stages.setdefault(pp, []).append(r)
    fcols, icols = plan.check_columns(False), plan.check_columns(True)
    ints = host.view(torch.int64)
    ranks = group_ranks(share_group)
    for members in stages.values():
        first = members[0]
        for r in members[1:]:
            bad = (~torch.isclose(host[r, fcols], host[first, fcols], rtol=_TP_RTOL, atol=_TP_ATOL,
                                  equal_nan=True)).nonzero().flatten().tolist()
            col = int(fcols[bad[0]]) if bad else None
            bad_i = (ints[r, icols] != ints[first, icols]).nonzero().flatten().tolist()
            if bad_i and (col is None or int(icols[bad_i[0]]) < col):
                col = int(icols[bad_i[0]])
            if col is None:
                continue
            i, name = plan.owner[col - _HEADER]
            m = metrics[i]
            view = ints if m._specs[name].dtype == torch.int64 else host
            a, b = view[first, col].item(), view[r, col].item()
            hint = getattr(m, "tp_mismatch_hint", None)
            hint = hint() if callable(hint) else hint
            raise MetricSyncError(
                f"calculate(): ranks {ranks[first]} and {ranks[r]} are TP replicas of one pipeline "
                f"stage but disagree on {type(m).__name__}.{name} ({a} vs {b}); TP replicas see the "
                "same tokens and must reduce to the same numbers"
                + (f"; {hint}" if hint else "; check that inputs are not split over the TP group"))


def _unpack(vec: torch.Tensor, plan: _Plan, metrics) -> List[Dict[str, Any]]:
    """Plain Python states per metric from a host row (header included): ints for
    int64 states (bit-exact), floats for float64, nested lists for shaped states."""
    floats = vec[_HEADER:].tolist()
    ints = vec[_HEADER:].view(torch.int64).tolist()
    out: List[Dict[str, Any]] = []
    for entries in plan.entries:
        states = {}
        for name, spec, offset in entries:
            src = ints if spec.dtype == torch.int64 else floats
            chunk = src[offset:offset + spec.numel]
            states[name] = chunk[0] if spec.shape == () else _unflatten(chunk, spec.shape)
        out.append(states)
    return out


def plain_states(states: Dict[str, torch.Tensor], specs: Dict[str, Any]) -> Dict[str, Any]:
    """Local tensors as the plain numbers ``compute`` takes (what ``calculate()`` gives
    it after the sync): ints for int64 states, floats, nested lists for shaped ones."""
    out = {}
    for name, spec in specs.items():
        t = states[name].detach().cpu().to(spec.dtype).reshape(-1)
        chunk = t.tolist()
        out[name] = chunk[0] if spec.shape == () else _unflatten(chunk, spec.shape)
    return out


def _unflatten(values: List[Any], shape: Tuple[int, ...]):
    if len(shape) == 1:
        return list(values)
    step = len(values) // shape[0]
    return [_unflatten(values[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


# ----------------------------------------------------------------------- negotiation
def _negotiate(metrics, configs: Tuple[str, ...], ch: _Channel, data_group, share_group) -> _Plan:
    """Agree with every rank on the plan of ``metrics``; collective over both groups.

    Each rank describes its metrics (fingerprints) and states (name, signature,
    whether it was created on the fly); the descriptions are united over the data
    group, then the unions over TP x PP, which makes them global. Every rank then
    decides on the same union: raise everywhere, or adopt the same plan.
    """
    me = group_ranks(None)[0]
    desc = {"ranks": [me], "configs": {json.dumps(list(configs)): [me]},
            "paths": {"reduce" if _reduces(data_group) else "gather": [me]}, "states": {},
            # each sliced metric's max_slices (ranks may differ; the smallest bounds them all)
            "bounds": {str(i): {str(m.max_slices): [me]} for i, m in enumerate(metrics)
                       if m.slice_by is not None}}
    for i, m in enumerate(metrics):
        for name, spec in m._specs.items():
            dynamic = m._new_state_spec(name) is not None
            desc["states"][f"{i}/{name}"] = {"sig": {spec.signature: [me]}, "dyn": dynamic}
    summary = _unite([json.loads(b) for b in _all_gather_bytes(json.dumps(desc).encode(), data_group)])
    if share_group is not None:
        summary = _unite([json.loads(b) for b in _all_gather_bytes(json.dumps(summary).encode(),
                                                                    share_group)])
    everyone = sorted(summary["ranks"])
    if len(summary["paths"]) > 1:
        sides = "; ".join(f"ranks {_ranges(rs)}: {p}" for p, rs in sorted(summary["paths"].items()))
        raise MetricSyncError(f"calculate(): ranks would sync their data groups differently ({sides}); "
                              "set TWINKLE_METRICS_REDUCE_ABOVE alike on every rank")
    if len(summary["configs"]) > 1:
        sides = []
        for text, ranks in summary["configs"].items():
            sides.append(f"ranks {_ranges(ranks)} hold [{', '.join(json.loads(text))}]")
        raise MetricSyncError("calculate(): ranks hold different metrics or arguments ("
                              + "; ".join(sides)[:1500] + "); build the same metrics, in the same "
                              "order, with the same arguments on every rank")
    names: List[List[str]] = [[] for _ in metrics]
    for key in sorted(summary["states"], key=lambda k: (int(k.split("/", 1)[0]), k.split("/", 1)[1])):
        entry = summary["states"][key]
        i, name = int(key.split("/", 1)[0]), key.split("/", 1)[1]
        holders = sorted({r for rs in entry["sig"].values() for r in rs})
        if len(entry["sig"]) > 1:
            sides = "; ".join(f"ranks {_ranges(rs)}: {sig}" for sig, rs in entry["sig"].items())
            raise MetricSyncError(f"calculate(): ranks declare state {type(metrics[i]).__name__}.{name} "
                                  f"differently ({sides}); every rank must declare it alike")
        if len(holders) < len(everyone) and not entry["dyn"]:
            raise MetricSyncError(
                f"calculate(): state {type(metrics[i]).__name__}.{name} exists on ranks "
                f"{_ranges(holders)} only, and the metric cannot create it on the others; add it on "
                "every rank (add_state in the constructor), or implement dynamic_state()")
        names[i].append(name)
    for i, bounds in summary["bounds"].items():
        m, bound = metrics[int(i)], min(int(b) for b in bounds)
        slices = held(names[int(i)])
        if len(slices) > bound:
            raise MetricSyncError(
                f"calculate(): {type(m).__name__} holds {len(slices)} slices of {m.slice_by!r} over the data "
                f"group ({slices[:20]}), more than max_slices={bound}: each rank stayed within it, their "
                "slices together do not; raise max_slices on every rank, or slice by a field with fewer "
                "values. Nothing was merged or reset")
    for m, metric_names in zip(metrics, names):
        m._adopt([n for n in metric_names if n not in m._specs])
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


def _all_gather_bytes(data: bytes, group) -> List[bytes]:
    """Every rank's ``data`` over ``group``: two collectives (lengths, then bytes)."""
    if group is None:
        return [data]
    device = comm_device(group)
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = all_gather_rows(n, group).flatten().tolist()
    width = max(sizes)
    buf = torch.zeros(width, dtype=torch.uint8)
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[:0]
    rows = all_gather_rows(buf.to(device), group).cpu()
    return [bytes(rows[i, :s].tolist()) for i, s in enumerate(sizes)]


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
