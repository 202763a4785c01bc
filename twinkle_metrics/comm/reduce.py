"""The reduce path: data groups of more than ``REDUCE_ABOVE`` ranks all-reduce the packed
buffer instead of gathering every rank's row, so what a rank receives stays flat."""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from twinkle_metrics.comm.order import from_ordered_f64, ordered_f64
from twinkle_metrics.comm.plan import _H_NEED, _H_PLAN, _I64_MIN, _KEYS_HEAD, _merge_own, _Plan


def _reduce_data(plan: Optional[_Plan], metrics, buf: torch.Tensor, sizes: Tuple[int, int, int, int],
                 group, transport) -> torch.Tensor:
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
    4. all_gather of the states with a callable reduction, merged here as the gather
       path does (skipped when there are none).

    ``plan`` is ``None`` when this rank packed no states (it needs a new plan): it
    then contributes identities, and the need flag sends every rank to negotiate.
    """
    top, sums_f, sums_i, own = _reduce_pack(plan, buf, sizes)
    transport.all_reduce(top, group, op=dist.ReduceOp.MAX)
    for t in (sums_f, sums_i):
        if t is not None:
            transport.all_reduce(t, group)
    rows = transport.gather(own, group) if own is not None else None
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
