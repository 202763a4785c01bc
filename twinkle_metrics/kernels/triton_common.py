"""What the Triton kernels share: the ``@triton.jit`` helpers every token kernel calls, the
one-program finishing pass of a buffer of partial rows (``column_totals``), and the views
the kernels read their inputs through.

- ``counted``: a row's values at the tokens that count, as float64, with padding dropped
  by a select before any arithmetic sees it;
- ``k3_ratio``: (k3, r) of a log-ratio d in float64, k3 = expm1(d) - d to full relative
  precision (a series for |d| < 1/2);
- ``store_sum``: one partial column, the sum of a block;
- ``column_totals``: column sums and NaN-aware extremes of every partial row (and per-row
  sums), one launch: the GRPO family's and ``RolloutMismatchMetric``'s kernels finish
  with it;
- ``arg_strides``: (tensor, row stride, column stride) of an optional ``[b, s]`` or
  ``[b, 1]`` input, as the token kernels take them;
- ``rows_view``: logits ``[..., V]`` as the rows the logits kernels index, without a copy
  where strides allow.

Imports triton: only the ``*_triton`` modules import this one (``dispatch`` decides
whether they run).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl


@triton.jit
def k3_ratio(d):
    """(k3, r) of d in float64, r = exp(d) and k3 = expm1(d) - d = d^2 (1/2! + d/3! + ...)."""
    small = tl.abs(d) < 0.5
    ds = tl.where(small, d, 0.0)
    p = 1.0 / 6402373705728000.0  # 1/18!
    p = p * ds + 1.0 / 355687428096000.0
    p = p * ds + 1.0 / 20922789888000.0
    p = p * ds + 1.0 / 1307674368000.0
    p = p * ds + 1.0 / 87178291200.0
    p = p * ds + 1.0 / 6227020800.0
    p = p * ds + 1.0 / 479001600.0
    p = p * ds + 1.0 / 39916800.0
    p = p * ds + 1.0 / 3628800.0
    p = p * ds + 1.0 / 362880.0
    p = p * ds + 1.0 / 40320.0
    p = p * ds + 1.0 / 5040.0
    p = p * ds + 1.0 / 720.0
    p = p * ds + 1.0 / 120.0
    p = p * ds + 1.0 / 24.0
    p = p * ds + 1.0 / 6.0
    p = p * ds + 0.5
    series = ds * ds * p
    e = tl.exp(tl.where(small, 0.0, d))
    em = tl.where(small, series + ds, e - 1.0)
    k3 = tl.where(small, series, em - d)  # no cancellation for |d| >= 1/2; inf - inf is NaN, as in torch
    return k3, tl.where(small, em + 1.0, e)



@triton.jit
def counted(ptrs, inside, m):
    """float64 values at ``ptrs`` where ``m`` (the tokens that count), else 0. The load is
    masked by the row's range only, so contiguous rows load in 128-bit vectors (a mask
    that varies token by token forces one load per element); the select then drops
    whatever padding holds (NaN, -inf) before any arithmetic sees it."""
    return tl.where(m, tl.load(ptrs, mask=inside, other=0.0).to(tl.float64), 0.0)



@triton.jit
def store_sum(out, col: tl.constexpr, x):
    """Column ``col`` of the partial row at ``out``: the sum of ``x`` over the block."""
    tl.store(out + col, tl.sum(x, 0))



@triton.jit
def _totals_kernel(part_ptr, f_ptr, i_ptr, rows_ptr, n_rows, n_blk,
                   W: tl.constexpr, COLS: tl.constexpr, EXT0: tl.constexpr, FLAG0: tl.constexpr,
                   PER_EXT: tl.constexpr, NEG: tl.constexpr, ROWS: tl.constexpr, R0: tl.constexpr,
                   R1: tl.constexpr, R2: tl.constexpr, BLOCK: tl.constexpr):
    """One program finishes a buffer of ``n_rows * n_blk`` partial rows ``[W]``: columns before
    ``EXT0`` are summed, the others are extremes kept as maxima, each with its NaN flag
    column added (``FLAG0 + e`` for extreme ``e`` when ``PER_EXT``, else ``FLAG0``: a NaN
    makes the extreme NaN, as ``amax`` would, which a kernel max does not promise) and
    negated back where bit ``e`` of ``NEG`` is set (minima). Writes every column to
    ``f_ptr`` [W] and the sums as int64 to ``i_ptr`` [W] (the counts' states read theirs).
    With ``ROWS`` (2 or 3), each row's sums of columns ``R0``, ``R1`` (, ``R2``) over its
    ``n_blk`` blocks go to ``rows_ptr`` [n_rows, ROWS]."""
    cols = tl.arange(0, COLS)
    live_c = cols < W
    is_ext = (cols >= EXT0) & live_c
    sums = tl.zeros([COLS], tl.float64)
    ext = tl.zeros([COLS], tl.float64) - float("inf")
    n_parts = n_rows * n_blk
    for start in range(0, n_parts, BLOCK):
        p = start + tl.arange(0, BLOCK)
        live = p < n_parts
        tile = tl.load(part_ptr + p.to(tl.int64)[:, None] * W + cols[None, :],
                       mask=live[:, None] & live_c[None, :], other=0.0)
        sums += tl.sum(tl.where(is_ext[None, :], 0.0, tile), 0)
        ext = tl.maximum(ext, tl.max(tl.where(is_ext[None, :] & live[:, None], tile, float("-inf")), 0))
    if PER_EXT:
        flag_col = cols - EXT0 + FLAG0
    else:
        flag_col = cols * 0 + FLAG0
    flag = tl.sum(tl.where(cols[None, :] == flag_col[:, None], sums[None, :], 0.0), 1)
    neg = ((NEG >> tl.maximum(cols - EXT0, 0)) & 1) == 1
    out = tl.where(is_ext, ext + flag, sums)
    out = tl.where(is_ext & neg, -out, out)
    tl.store(f_ptr + cols, out, mask=live_c)
    tl.store(i_ptr + cols, tl.where(is_ext, 0.0, sums).to(tl.int64), mask=live_c)
    if ROWS:
        for start in range(0, n_rows, BLOCK):
            r = start + tl.arange(0, BLOCK)
            live = r < n_rows
            a = tl.zeros([BLOCK], tl.float64)
            b = tl.zeros([BLOCK], tl.float64)
            c = tl.zeros([BLOCK], tl.float64)
            for j in range(0, n_blk):
                at = part_ptr + (r.to(tl.int64) * n_blk + j) * W
                a += tl.load(at + R0, mask=live, other=0.0)
                b += tl.load(at + R1, mask=live, other=0.0)
                if ROWS == 3:
                    c += tl.load(at + R2, mask=live, other=0.0)
            tl.store(rows_ptr + r * ROWS, a, mask=live)
            tl.store(rows_ptr + r * ROWS + 1, b, mask=live)
            if ROWS == 3:
                tl.store(rows_ptr + r * ROWS + 2, c, mask=live)


def column_totals(part: torch.Tensor, *, ext0: int, flag0: int, per_ext: bool, neg: int, n_rows: int = 0,
                  n_blk: int = 1, rows: Sequence[int] = ()) -> Tuple[torch.Tensor, torch.Tensor,
                                                                     Optional[torch.Tensor]]:
    """``_totals_kernel`` over ``part`` ``[n_rows * n_blk, W]`` (float64, contiguous):
    ``(f [W], i [W], per-row sums [n_rows, len(rows)] or None)``, one launch."""
    w = part.shape[1]
    f = torch.empty(w, dtype=torch.float64, device=part.device)
    i = torch.empty(w, dtype=torch.int64, device=part.device)
    per_row = torch.empty(n_rows, len(rows), dtype=torch.float64, device=part.device) if rows else f
    r = list(rows) + [0] * (3 - len(rows))
    _totals_kernel[(1,)](part, f, i, per_row, n_rows if n_rows else part.shape[0], n_blk if n_rows else 1,
                         W=w, COLS=triton.next_power_of_2(w), EXT0=ext0, FLAG0=flag0, PER_EXT=per_ext, NEG=neg,
                         ROWS=len(rows), R0=r[0], R1=r[1], R2=r[2], BLOCK=64, num_warps=4, enable_fp_fusion=False)
    return f, i, (per_row if rows else None)



def arg_strides(x: Optional[torch.Tensor], like: torch.Tensor) -> Tuple[torch.Tensor, int, int]:
    """``(x, row stride, column stride)`` as a token kernel takes an optional input:
    ``like`` with zero strides where ``x`` is absent, a zero column stride for a
    ``[b, 1]`` input (one value per sequence, read for each of its tokens)."""
    if x is None:
        return like, 0, 0
    if x.shape[1] == 1 and like.shape[1] != 1:
        return x, x.stride(0), 0  # one value per sequence, read for each of its tokens
    return x, x.stride(0), x.stride(1)



def rows_view(x: torch.Tensor) -> Tuple[torch.Tensor, int, int, int]:
    """``x [..., V]`` as rows the kernels index without a copy where strides allow:
    ``(tensor, inner, outer_stride, inner_stride)``; row ``r`` starts at
    ``(r // inner) * outer_stride + (r % inner) * inner_stride`` elements from
    ``tensor``'s data. Covers any 2-D view and 3-D ``[b, s, V]`` views such as a
    transposed Megatron ``[s, b, V]`` or a ``[:, :s]`` slice; other layouts are copied.
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 1:
        x = x.unsqueeze(0)
    if x.dim() > 3:
        try:
            x = x.view(-1, x.shape[-2], x.shape[-1])
        except RuntimeError:
            x = x.reshape(-1, x.shape[-2], x.shape[-1])
    if x.dim() == 2:
        return x, max(x.shape[0], 1), 0, x.stride(0)
    return x, max(x.shape[1], 1), x.stride(0), x.stride(1)
