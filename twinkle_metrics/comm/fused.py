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
   metric merges itself (a callable reduction); each of the
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

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from parallel.groups import group_ranks, group_size
from twinkle_metrics.comm import links
from twinkle_metrics.comm.plan import (  # noqa: F401 - the plan's names, used here and by tests
    _H_NEED,
    _H_PLAN,
    _H_PP,
    _H_SOURCE,
    _HEADER,
    _KEYS_HEAD,
    _REDUCED,
    _TP_ATOL,
    _TP_RTOL,
    MetricSyncError,
    _merge,
    _merge_reads,
    _negotiate,
    _Plan,
    _spec,
)
from twinkle_metrics.comm.reduce import _filled, _reduce_data, _reduce_pack, _reduce_unpack  # noqa: F401
from twinkle_metrics.comm.transport import Transport
from twinkle_metrics.inputs.checks import from_host, from_host_all


def env_threshold(default: int) -> int:
    """``TWINKLE_METRICS_REDUCE_ABOVE`` as a number of ranks, else ``default``."""
    text = os.environ.get("TWINKLE_METRICS_REDUCE_ABOVE", str(default))
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"TWINKLE_METRICS_REDUCE_ABOVE must be a number of ranks, got {text!r}; "
                         "unset it for the default") from None


#: data groups of more ranks than this all-reduce instead of gathering every rank's row.
#: On host (gloo) groups, above ~512 the gather's merge costs the host more than the
#: reduce path's pack and unpack (``benchmarks/bench_sync_scaling.py``); on device groups
#: the merge is the device's, and what decides is the collectives' depth: NCCL's
#: all_gather is a ring (N - 1 dependent steps) where its all-reduce takes a tree (about
#: 2 log2 N), so the reduce path's three or four all-reduces win above a few dozen ranks
#: (benchmarks/README.md, the cost model). ``TWINKLE_METRICS_REDUCE_ABOVE`` sets both;
#: set it alike on every rank.
REDUCE_ABOVE = env_threshold(512)
DEVICE_REDUCE_ABOVE = env_threshold(64)
#: the reduce path's column kinds, in the order its collectives carry them
class _Channel:
    """What the ranks agreed on for one pair of groups: plans and the buffer width."""

    def __init__(self):
        self.plans: Dict[Tuple[str, ...], _Plan] = {}
        self.width = 0
        self.reduce_sizes = (0, 0, 0, 0)  # the reduce path's, elementwise max over the plans


def _channel(data_group, mp_group) -> _Channel:
    """The channel of a pair of groups (``links.Link.channels`` of the data group), made the
    first time they sync together."""
    with links.LOCK:
        channels = links.link(data_group).channels
        key = links.NO_GROUP if mp_group is None else mp_group
        ch = channels.get(key)
        if ch is None:
            ch = channels[key] = _Channel()
        return ch


# ---------------------------------------------------------------------- entry point
def sync_states(intervals: Sequence, transport: Transport, configs: Sequence[str]) -> List[Dict[str, Any]]:
    """Globally reduced states of each interval as plain Python numbers (lists if shaped).

    ``intervals``: the metrics' intervals (``core.interval.Interval``), all reduced over
    ``transport``'s data group and shared over its TP x PP group; ``configs``: each
    metric's sync fingerprint, which every rank must share. Collective over both groups.
    Does not change the intervals' states (it may create states that other ranks created
    on the fly, holding their identity).
    """
    metrics = intervals
    lead = metrics[0]
    transport.mesh.check_live("calculate()")
    configs = tuple(configs)
    if transport.data is None and transport.mp is None:
        local = _local_plan(metrics, configs)
        buf = _pack(local, metrics, local.length, lead.device, lead.device, need=False,
                    is_source=True, pp_rank=0)
        return _unpack(buf.cpu(), local, metrics)

    ch = _channel(transport.data, transport.mp)
    path = _path(transport)
    for _ in range(2):
        plan = ch.plans.get(configs)
        if plan is None and not ch.plans:  # nothing agreed on these groups yet, on any rank
            plan = _negotiate(metrics, configs, ch, transport, path)
        need = plan is None or not plan.covers(metrics)
        host = _data_phase(metrics, plan, need, ch, transport)
        if host is not None:
            return host
        _negotiate(metrics, configs, ch, transport, path)
    raise MetricSyncError("calculate(): ranks still disagree on the metrics' states after a "
                          "negotiation; a state was added during calculate()")


def _local_plan(metrics, configs) -> _Plan:
    key = (configs,) + tuple(tuple(m.specs) for m in metrics)
    plans = links.link(None).plans
    plan = plans.get(key)
    if plan is None:
        if len(plans) > 64:  # a process builds few metric sets; bound it anyway
            plans.clear()
        plan = plans[key] = _Plan(metrics, [sorted(m.specs) for m in metrics], configs)
    return plan


# ------------------------------------------------------------------------ data phase
def _data_phase(metrics, plan: Optional[_Plan], need: bool, ch: _Channel,
                transport: Transport) -> Optional[List[Dict[str, Any]]]:
    """Pack, gather (or all-reduce), merge, share, read once; None when some rank asked for
    a new plan. Every wait is bounded and named by ``transport``."""
    lead = metrics[0]
    data, mp = transport.data, transport.mp
    mesh = transport.mesh
    is_source, pp_rank = mesh.is_result_source, mesh.pp_rank
    usable = plan if plan is not None and not need else None
    buf = _pack(plan, metrics, ch.width, lead.device, transport.device, need=usable is None,
                is_source=is_source, pp_rank=pp_rank)
    if _reduces(transport):  # the same size on every rank of the group: all take this branch
        vec = _reduce_data(usable, metrics, buf, ch.reduce_sizes, data, transport)
    else:
        rows = transport.gather(buf, data)                        # collective 1
        vec = _merge(usable, metrics, rows) if usable is not None else rows[0].clone()
        if rows.device.type == "cpu":  # host rows: the flags in Python, no kernels
            head = rows[:, :_H_NEED + 1].tolist()
            vec[_H_NEED] = float(max(r[1] for r in head) or any(r[0] != head[0][0] for r in head))
        else:
            vec[_H_NEED] = torch.maximum(rows[:, _H_NEED].amax(),
                                         (rows[:, _H_PLAN] != rows[0, _H_PLAN]).any().to(torch.float64))
    vec[_H_SOURCE] = float(is_source)
    vec[_H_PP] = float(pp_rank)
    host = transport.host(transport.gather(vec, mp))          # collective 2, the one read
    needs = host[0, _H_NEED].item() != 0 if mp is None else bool((host[:, _H_NEED] != 0).any())
    if needs or usable is None:  # a rank without a plan asked for one
        return None
    plan = usable
    if mp is not None:
        source = (host[:, _H_SOURCE] == 1.0).nonzero().flatten().tolist()
        if len(source) != 1:
            raise MetricSyncError(
                f"calculate(): {len(source)} ranks of the TP x PP group "
                f"{group_ranks(mp)} claim to hold the results (last pipeline stage, TP "
                "rank 0); expected exactly one: check the mesh's pipeline and TP groups")
        _check_tp_agreement(plan, metrics, host, mp)
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
        flat += plan.pieces(metrics, pack)  # the buffer's order (``_Plan``: kind by kind)
        used = plan.length
    pack = next((t.device for t in flat if t.device.type != "cpu"), pack)
    if pack.type != "cpu":
        flat = host_pieces_to(flat, pack)
    buf = torch.cat([t if t.device == pack else t.to(pack) for t in flat]).detach()
    buf = _to_device(buf, device)
    return torch.nn.functional.pad(buf, (0, width - used)) if width > used else buf


def host_pieces_to(flat: List[torch.Tensor], device: torch.device) -> List[torch.Tensor]:
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




# ------------------------------------------------------------------------ reduce path
def _path(transport: Transport) -> str:
    return "reduce" if _reduces(transport) else "gather"


def _reduces(transport: Transport) -> bool:
    """Whether the data phase all-reduces (a data group of more than ``REDUCE_ABOVE``
    ranks, ``DEVICE_REDUCE_ABOVE`` on a device) instead of gathering every rank's row."""
    above = REDUCE_ABOVE if transport.device.type == "cpu" else DEVICE_REDUCE_ABOVE
    return transport.data is not None and group_size(transport.data) > above




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
    ranks = group_ranks(share_group)
    for members in stages.values():
        first = members[0]
        for r in members[1:]:
            found = first_disagreement(plan, metrics, host, first, r)
            if found is None:
                continue
            m, name, a, b = found
            hint = m.tp_mismatch_hint
            raise MetricSyncError(
                f"calculate(): ranks {ranks[first]} and {ranks[r]} are TP replicas of one pipeline "
                f"stage but disagree on {m.name}.{name} ({a} vs {b}); TP replicas see the "
                "same tokens and must reduce to the same numbers"
                + (f"; {hint}" if hint else "; check that inputs are not split over the TP group"))


def first_disagreement(plan: _Plan, metrics: Sequence[Any], rows: torch.Tensor, first: int,
                       other: int) -> Optional[tuple]:
    """``(metric, state, value in row first, value in row other)`` of the first state, in
    buffer order, on which two rows of TP replicas differ beyond the replicas' tolerance
    (states declared ``per_rank`` or of scope ``"model"`` left out); None when they agree."""
    fcols, icols = plan.check_columns(False), plan.check_columns(True)
    ints = rows.view(torch.int64)
    bad = (~torch.isclose(rows[other, fcols], rows[first, fcols], rtol=_TP_RTOL, atol=_TP_ATOL,
                          equal_nan=True)).nonzero().flatten().tolist()
    col = int(fcols[bad[0]]) if bad else None
    bad_i = (ints[other, icols] != ints[first, icols]).nonzero().flatten().tolist()
    if bad_i and (col is None or plan.rank[int(icols[bad_i[0]]) - _HEADER] < plan.rank[col - _HEADER]):
        col = int(icols[bad_i[0]])
    if col is None:
        return None
    i, name = plan.owner[col - _HEADER]
    m = metrics[i]
    view = ints if _spec(m, name).dtype == torch.int64 else rows
    return m, name, view[first, col].item(), view[other, col].item()


def _unpack(vec: torch.Tensor, plan: _Plan, metrics) -> List[Dict[str, Any]]:
    """Plain Python states per metric from a host row (header included): ints for
    int64 states (bit-exact), floats for float64, nested lists for shaped states."""
    body = vec[_HEADER:_HEADER + plan.length]
    values = body.tolist() + body.view(torch.int64).tolist()  # ``plan.decoders`` index both
    out: List[Dict[str, Any]] = []
    for names, get, shaped in plan.decoders:
        states = dict(zip(names, get(values)))
        for name, a, b, shape in shaped:
            states[name] = values[a:b] if len(shape) == 1 else _unflatten(values[a:b], shape)
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
