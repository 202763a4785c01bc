"""Fixed-size int64 tables keyed by prompt (and answer) ids, merged by key on the device.

``id_key`` and ``tensor_keys`` turn host ids (ints, strs) and int tensors into the same
int64 keys on every rank (no per-process salted ``hash()``); ``merge_rows`` folds rows of
equal keys into a table of fixed shape with sort, cumsum and index_add only (nothing reads
the device), counting the rows it leaves out; ``fold_tables`` merges tables stacked from
several calls or ranks. ``PassAtKMetric`` keeps its states in these tables.
"""
from __future__ import annotations

import hashlib
from typing import Optional, Union

import torch

_M64 = (1 << 64) - 1
_I64_MAX = (1 << 63) - 1
#: ints in [0, _EXACT) are their own key (2 v + 2): no hash, no collision
_EXACT = (1 << 62) - 1
_MIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)  # splitmix64


# ------------------------------------------------------------------------------ keys
def _signed(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def _splitmix(u: int) -> int:
    z = (u + _MIX[0]) & _M64
    z = ((z ^ (z >> 30)) * _MIX[1]) & _M64
    z = ((z ^ (z >> 27)) * _MIX[2]) & _M64
    return z ^ (z >> 31)


def _blake(tag: bytes, text: str) -> int:
    digest = hashlib.blake2b(tag + text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def id_key(v: Union[int, str]) -> int:
    """The int64 key (> 0) of a host id (an int or a str). Key 0 marks an empty row.

    Ints in [0, 2**62 - 1) map exactly to ``2 v + 2`` (even keys). Other ints in the int64
    range map to ``4 h + 1`` with ``h`` the top 61 bits of splitmix64 (the same on the
    device, ``tensor_keys``), larger ints to ``4 h + 1`` with ``h`` from blake2b of
    ``"int:<v>"``; strings to ``4 h + 3`` with ``h`` from blake2b of ``"str:<s>"``. So
    ``1`` and ``"1"`` never collide, and hashed ids of one kind collide with probability
    about ``m**2 / 2**62`` for ``m`` distinct ids. Python's ``hash()`` is salted per
    process and would differ between ranks.
    """
    if isinstance(v, str):
        return 4 * (_blake(b"str:", v) >> 3) + 3
    v = int(v)
    if 0 <= v < _EXACT:
        return 2 * v + 2
    if -(1 << 63) <= v <= _I64_MAX:
        return 4 * (_splitmix(v & _M64) >> 3) + 1
    return 4 * (_blake(b"int:", str(v)) >> 3) + 1


def _lsr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch shifts signed values arithmetically)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def tensor_keys(ids: torch.Tensor) -> torch.Tensor:
    """``id_key`` of every entry of an integer tensor, on its device (int64 arithmetic
    wraps as the uint64 arithmetic of splitmix64 does)."""
    x = ids.to(torch.int64)
    z = x + _signed(_MIX[0])
    z = (z ^ _lsr(z, 30)) * _signed(_MIX[1])
    z = (z ^ _lsr(z, 27)) * _signed(_MIX[2])
    z = z ^ _lsr(z, 31)
    hashed = _lsr(z, 3) * 4 + 1
    return torch.where((x >= 0) & (x < _EXACT), 2 * x + 2, hashed)


# ---------------------------------------------------------------------------- tables
def merge_rows(entries: torch.Tensor, n_keys: int, rows: int, segment: bool,
               dropped: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``entries`` ([M, C] int64 rows, key columns first, key 0 = empty) as one table of
    ``rows`` rows plus a last row holding the number of rows left out in column 0.

    With ``segment``, rows with equal keys merge into one (their other columns summed);
    without, rows are kept as they are (a multiset). Rows come out sorted by key, empty
    rows last. Fixed output shape; sort, cumsum and index_add only: nothing reads the
    device. ``dropped``: rows already left out before (added to the count).
    """
    m, c = entries.shape
    e = entries
    if n_keys == 2:
        e = e[torch.sort(e[:, 1], stable=True).indices]
    empty = e[:, 0] == 0
    primary = torch.where(empty, torch.full_like(e[:, 0], _I64_MAX), e[:, 0])
    order = torch.sort(primary, stable=True).indices
    e, empty = e[order], empty[order]
    if segment:
        step = (e[1:, :n_keys] != e[:-1, :n_keys]).to(torch.int64).sum(1) > 0
        start = torch.cat([torch.ones(1, dtype=torch.bool, device=e.device), step]) & ~empty
        gid = torch.cumsum(start.to(torch.int64), 0) - 1
        values = torch.cat([torch.where(start[:, None], e[:, :n_keys], 0), e[:, n_keys:]], 1)
        distinct = start.to(torch.int64).sum()
    else:
        gid = torch.arange(m, device=e.device)
        values = e
        distinct = (~empty).to(torch.int64).sum()
    target = torch.where(empty | (gid >= rows), rows, gid)  # row `rows`: a dump, overwritten below
    out = torch.zeros(rows + 1, c, dtype=torch.int64, device=e.device).index_add_(0, target, values)
    drop = (distinct - rows).clamp(min=0)
    if dropped is not None:
        drop = drop + dropped
    last = torch.cat([drop.reshape(1), torch.zeros(c - 1, dtype=torch.int64, device=e.device)])
    return torch.cat([out[:rows], last[None, :]])


def fold_tables(stacked: torch.Tensor, n_keys: int, segment: bool) -> torch.Tensor:
    """Tables stacked as ``[k, rows + 1, C]`` merged into one ``[rows + 1, C]``."""
    rows, c = stacked.shape[1] - 1, stacked.shape[2]
    return merge_rows(stacked[:, :rows].reshape(-1, c), n_keys, rows, segment, stacked[:, rows, 0].sum())
