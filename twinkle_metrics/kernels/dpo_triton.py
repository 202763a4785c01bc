"""DPOMetric's statistics in two launches (Triton, CUDA).

The torch path (``DPOMetric``'s sequence sums and pair statistics in
``metrics/rl/dpo.py``) issues a masked sum per column and a dozen small kernels for the
pair statistics. Here ``masked_row_sums`` reads each row of the policy's (and the
reference's) per-token log-probs once, masked-out positions never entering, and
``pair_stats`` turns the ``[pairs, 2 or 4]`` sequence log-probs into every contribution
(column sums, rewards, margin, non-finite and winning pairs) in one program, ``beta``
passed as a ``constexpr`` so it enters as a float64 constant.

Used on CUDA unless ``TWINKLE_METRICS_TRITON=0`` (see ``dispatch``); tested on CPU under
Triton's interpreter against the torch path, and compiled for sm_80/sm_90 in CI
(``benchmarks/kernel_build.py``).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
import triton
import triton.language as tl

from twinkle_metrics.kernels.triton_common import counted


@triton.jit
def _row_sums_kernel(a_ptr, b_ptr, m_ptr, out_ptr, s, a_s0, a_s1, b_s0, b_s1, m_s0, m_s1,
                     TWO: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    sa = tl.zeros([BLOCK], tl.float64)
    sb = tl.zeros([BLOCK], tl.float64)
    for start in range(0, s, BLOCK):
        cols = (start + tl.arange(0, BLOCK)).to(tl.int64)
        m = (tl.load(m_ptr + row * m_s0 + cols * m_s1, mask=cols < s, other=0) != 0) & (cols < s)
        sa += counted(a_ptr + row * a_s0 + cols * a_s1, cols < s, m)
        if TWO:
            sb += counted(b_ptr + row * b_s0 + cols * b_s1, cols < s, m)
    if TWO:
        tl.store(out_ptr + row * 2, tl.sum(sa, 0))
        tl.store(out_ptr + row * 2 + 1, tl.sum(sb, 0))
    else:
        tl.store(out_ptr + row, tl.sum(sa, 0))


def masked_row_sums(a: torch.Tensor, m: torch.Tensor, b: Optional[torch.Tensor] = None, *,
                    block: int = 0) -> torch.Tensor:
    """``[rows, 1 or 2]`` float64 sums over ``m`` of each row of ``a`` (and ``b``), all
    ``[rows, s]`` with any strides, in one read; masked-out positions never enter the sums
    (DPOMetric's sequence log-probs and their references)."""
    rows, s = m.shape
    out = torch.empty(rows, 1 if b is None else 2, dtype=torch.float64, device=a.device)
    if rows == 0:
        return out
    block = block or min(1024, triton.next_power_of_2(max(s, 16)))
    mm = m.view(torch.uint8) if m.dtype == torch.bool else m
    other = a if b is None else b
    _row_sums_kernel[(rows,)](a, other, mm, out, s, a.stride(0), a.stride(1), other.stride(0), other.stride(1),
                              mm.stride(0), mm.stride(1), TWO=b is not None, BLOCK=block, num_warps=4,
                              enable_fp_fusion=False)
    return out



#: DPOMetric's pair statistics: the float64 and the int64 outputs of ``pair_stats``, in order
PAIR_SUMS = ("chosen", "rejected", "ref_chosen", "ref_rejected", "reward_chosen", "reward_rejected", "margin")
PAIR_COUNTS = ("n_bad", "pairs", "correct")


@triton.jit
def _column(tile, cols, k: tl.constexpr):
    """Column ``k`` of a ``[BLOCK, W]`` tile (a select, so NaN/inf elsewhere in the row stays out)."""
    return tl.sum(tl.where(cols[None, :] == k, tile, 0.0), 1)


@triton.jit
def _pair_kernel(x_ptr, f_ptr, i_ptr, n, BETA: tl.constexpr, W: tl.constexpr, SKIP: tl.constexpr,
                 BLOCK: tl.constexpr):
    """One program over all pairs of a contiguous float64 ``[n, W]``: rows ``(chosen,
    rejected)`` (W = 2) or ``(chosen, ref_chosen, rejected, ref_rejected)`` (W = 4), read
    as whole rows (vector loads)."""
    cols = tl.arange(0, W)
    sums = tl.zeros([BLOCK, W], tl.float64)
    n_bad = tl.zeros([BLOCK], tl.int64)
    n_won = tl.zeros([BLOCK], tl.int64)
    for start in range(0, n, BLOCK):
        rows = (start + tl.arange(0, BLOCK)).to(tl.int64)
        inside = rows < n
        tile = tl.load(x_ptr + rows[:, None] * W + cols[None, :], mask=inside[:, None], other=0.0)
        probe = tl.sum(tile * 0.0, 1)  # NaN where a sequence log-prob of the pair is NaN/inf
        bad = probe != probe
        if SKIP:  # the pair leaves every statistic
            tile = tl.where(bad[:, None], 0.0, tile)
        sums += tile
        n_bad += bad.to(tl.int64)
        if W == 4:
            c = _column(tile, cols, 0)
            r = _column(tile, cols, 2)
            # chosen reward > rejected reward; False for a NaN pair, as in torch
            won = BETA * (c - _column(tile, cols, 1)) > BETA * (r - _column(tile, cols, 3))
            if SKIP:
                won = won & (probe == probe)
            n_won += won.to(tl.int64)
    tot = tl.sum(sums, 0)
    bad_tot = tl.sum(n_bad, 0)
    c_tot = _column(tot[None, :], cols, 0)
    tl.store(i_ptr, bad_tot)
    if SKIP:
        tl.store(i_ptr + 1, n - bad_tot)
    else:
        tl.store(i_ptr + 1, bad_tot * 0 + n)
    tl.store(f_ptr, tl.sum(c_tot, 0))
    if W == 4:
        rc_tot = _column(tot[None, :], cols, 1)
        r_tot = _column(tot[None, :], cols, 2)
        rr_tot = _column(tot[None, :], cols, 3)
        gap_c = c_tot - rc_tot
        gap_r = r_tot - rr_tot
        tl.store(f_ptr + 1, tl.sum(r_tot, 0))
        tl.store(f_ptr + 2, tl.sum(rc_tot, 0))
        tl.store(f_ptr + 3, tl.sum(rr_tot, 0))
        tl.store(f_ptr + 4, tl.sum(BETA * gap_c, 0))
        tl.store(f_ptr + 5, tl.sum(BETA * gap_r, 0))
        tl.store(f_ptr + 6, tl.sum(BETA * (gap_c - gap_r), 0))
        tl.store(i_ptr + 2, tl.sum(n_won, 0))
    else:
        tl.store(f_ptr + 1, tl.sum(_column(tot[None, :], cols, 1), 0))


def pair_stats(x: torch.Tensor, *, beta: float, skip: bool, block: int = 0) -> Dict[str, torch.Tensor]:
    """DPOMetric's contributions of ``x`` = float64 ``[pairs, (chosen, [ref_chosen], rejected,
    [ref_rejected])]`` in one launch: the column sums, the rewards and margin formed from
    them, the non-finite pairs, the pairs counted and (with references) the pairs whose
    chosen reward beats the rejected one; named after the states, each a 0-dim view."""
    ref = x.shape[1] == 4
    x = x.contiguous()
    f = torch.empty(len(PAIR_SUMS) if ref else 2, dtype=torch.float64, device=x.device)
    i = torch.empty(len(PAIR_COUNTS) if ref else 2, dtype=torch.int64, device=x.device)
    block = block or min(1024, triton.next_power_of_2(max(x.shape[0], 16)))
    _pair_kernel[(1,)](x, f, i, x.shape[0], BETA=float(beta), W=x.shape[1], SKIP=skip, BLOCK=block,
                       num_warps=4, enable_fp_fusion=False)
    out = dict(zip(PAIR_SUMS, f.unbind()))
    out.update(zip(PAIR_COUNTS, i.unbind()))
    if ref:
        out["ref_pairs"] = out["pairs"]
    return out
