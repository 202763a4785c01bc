"""The GRPO family's top-k KL records: each row a token's k3 value, global sequence
index, position, token id, ratio and log-probs, kept in one fixed ``[k + 1, fields]``
state with its own reduction.

Under the ``k`` record rows, one header row holds what places them: the sequences the
state has counted, and the DP and CP ranks it was accumulated on (``-inf``: nothing
yet). A call's records count sequences from the call's start; folding them in
(``fold_records``) puts them after the sequences already counted, and merging the ranks
(``merge_records``) puts each rank's after those of the DP ranks before it, so the
records carry sequence indices over the whole data group in DP-rank order.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Tuple

import torch

from twinkle_metrics.inputs.checks import as_tensor, from_host

#: columns of one record row
FIELDS = ("kl", "gsi", "pos", "token_id", "ratio", "logp_new", "logp_old")
_INT_FIELDS = ("gsi", "pos", "token_id")


def _top(key: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the ``k`` largest of ``key`` (1-D), largest first; equal keys in
    the order they come (a stable sort: ``torch.topk`` leaves ties to the device and the
    path). Every caller passes keys in token order (sequence, then position), so a tie goes
    to the earlier token, whatever the microbatches, paths or ranks the tokens went through."""
    values, indices = torch.sort(key, descending=True, stable=True)
    return values[:k], indices[:k]


def topk_rows(rows: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` rows with the largest first column (the k3 value); -inf rows are empty.

    Rows come in token order (earlier calls, microbatches and data ranks first, each
    block sorted as ``_top`` leaves it), so equal keys keep the earlier token.
    Always ``k`` rows: fewer candidates (a short batch) are padded with empty rows,
    so the fixed-shape state never sees another shape.
    """
    flat = rows.reshape(-1, rows.shape[-1])
    if flat.shape[0] < k:
        pad = flat.new_full((k - flat.shape[0], flat.shape[1]), -math.inf)
        flat = torch.cat([flat, pad])
    return flat[_top(flat[:, 0], k)[1]]


def pack_records(records: Optional[torch.Tensor], n_seq: int, dp_rank: int, cp_rank: int, k: int,
                 width: int) -> torch.Tensor:
    """One call's contribution: its ``[k, width]`` records (None: none), sequence indices
    from the call's start, above the header of the ``n_seq`` sequences it saw."""
    head = torch.tensor([[n_seq, dp_rank, cp_rank] + [-math.inf] * (width - 3)], dtype=torch.float64)
    if records is None:
        return torch.cat([head.new_full((k, width), -math.inf), head])
    return torch.cat([records.to(torch.float64), from_host(head, records.device)])


def fold_records(old: torch.Tensor, new: torch.Tensor, k: int) -> torch.Tensor:
    """``new`` (one call, or a later interval) folded onto ``old``: its sequences come
    after the ``old`` ones."""
    seen = old[k, 0].clamp(min=0)  # -inf: none yet
    rows = new[:k].clone()
    rows[:, 1] += seen
    head = torch.cat([(seen + new[k, 0].clamp(min=0)).reshape(1), torch.maximum(old[k, 1:], new[k, 1:])])
    return torch.cat([topk_rows(torch.stack([old[:k], rows]), k), head[None]])


def merge_records(rows: torch.Tensor, k: int) -> torch.Tensor:
    """Every rank's ``[ranks, k + 1, width]`` records merged, in data-group order: each
    rank's sequences come after those of every DP rank below it, counted once per CP
    group (CP ranks share sequences)."""
    counts, dp, cp = rows[:, k, 0].clamp(min=0), rows[:, k, 1], rows[:, k, 2]
    first = torch.where(cp == 0, counts, torch.zeros_like(counts))
    offset = ((dp[None, :] < dp[:, None]).to(torch.float64) * first[None, :]).sum(1)
    records = rows[:, :k].clone()
    records[:, :, 1] += offset[:, None]
    head = torch.cat([counts.sum().reshape(1), rows[:, k, 1:].amax(0)])
    return torch.cat([topk_rows(records, k), head[None]])


def as_records(rows: Sequence[Sequence[float]], k: int) -> list:
    """The reduced state's records (plain lists) as dicts, largest k3 first; empty rows left out."""
    out = []
    for row in rows[:k]:  # the last row is the header
        if row[0] != -math.inf:
            rec = dict(zip(FIELDS, row))
            out.append({f: int(v) if f in _INT_FIELDS else v for f, v in rec.items()})
    return out


def candidates(mb: Any, key: torch.Tensor, k: int) -> torch.Tensor:
    """A microbatch's top-``k`` rows [k, fields] in ``FIELDS`` order, with sequence indices
    counted from the call's start (``fold_records`` adds those before it); ``key`` [b, s]:
    each token's k3 where it has an old log-prob and k3 > 0, else -inf. Token and position
    ids where the features give them, else -1 and the column."""
    b, s = mb.m.shape
    val, idx = _top(key.reshape(-1), k)
    i, p = idx.div(s, rounding_mode="floor"), idx.remainder(s)
    labels, positions = feature_view(mb, "labels"), feature_view(mb, "position_ids")
    tok = torch.full_like(p, -1) if labels is None else labels[i, p]
    pos = p if positions is None else positions[i, p]
    gsi = i + mb.seq0  # from the call's start: the fold adds the sequences before it
    lp_k, old_k = mb.lp[i, p].to(torch.float64), mb.old.expand(b, s)[i, p].to(torch.float64)
    # one stack casts the integer columns to float64 (exact below 2**53)
    return torch.stack([val, gsi, pos, tok, torch.exp(lp_k - old_k), lp_k, old_k], 1)


def fused_candidates(records: torch.Tensor, k: int) -> torch.Tensor:
    """The top-``k`` rows of every fused microbatch at once, from the kernel's record buffer
    (``rl_triton.RECORD_ROWS``: the ``FIELDS``, ``gsi`` counted from the call's start as in
    ``candidates``): one sort and one gather however many microbatches."""
    return records[:, _top(records[0], k)[1]].t()


def feature_view(mb: Any, field: str) -> Optional[torch.Tensor]:
    """``field`` of the microbatch's features as a ``[b, s]`` view over its tokens (a 1-D
    one holds for every sequence), or None when absent."""
    x = mb.feat.get(field)
    if x is None:
        return None
    b, s = mb.m.shape
    x = as_tensor(x, mb.m.device)
    x = x.unsqueeze(0) if x.dim() == 1 else x
    return x.expand(b, -1)[:, :s]
