"""PPOValueMetric's token statistics in two launches (Triton, CUDA).

The torch path (``PPOValueMetric.update``) issues about eighty small kernels per call
(``benchmarks/launches.py``): the non-finite probe, float64 casts, the clip compare,
three (count, mean, M2) moments with their Chan merge, one sum per state. Here:

1. ``_tokens_kernel`` reads each token's value, mask, and (where given) old value,
   return and advantage with their masks once; each program writes one row of float64
   partials for a block of one sequence's tokens: the counts and sums, and the
   (count, mean, M2) of the returns, of return - value and of the advantages over its
   block (two passes over the block in registers);
2. ``_finish_kernel`` (one program) adds the sums and merges the moments of every
   block with Chan's formula (``twinkle_metrics.stats.moments``), writing the contributions.

The numbers are the torch path's, with the same rules:

- a token counts where the mask is set; a side input's statistic counts the tokens
  that have its value (its own mask); masked-out positions never enter a value;
- a counted token is non-finite when its value or a side input it has is NaN/inf:
  counted in ``n_bad``; under ``'skip'`` it leaves every statistic, under
  ``'propagate'`` it flows (the clip count gets ``d * 0``, NaN for a NaN/inf d);
- the clip compare ``|v - v_old| > epsilon`` is in float64 with ``epsilon`` a
  ``constexpr`` (a runtime float argument is float32 on the GPU and would move the
  bound).

Used on CUDA unless ``TWINKLE_METRICS_TRITON=0`` (see ``dispatch``); tested on CPU under
Triton's interpreter against the torch path, and compiled for sm_80/sm_90 in CI
(``benchmarks/kernel_build.py``).
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from twinkle_metrics.kernels.triton_common import arg_strides, counted

#: partial columns: sums, then (count, mean, M2) of the returns, of return - value, of the advantages
SUMS = ("n_tok", "sum_value", "n_bad", "n_old", "clipped")
MOMENTS = ("ret_moments", "res_moments", "adv_moments")
_N_COLS = len(SUMS) + 3 * len(MOMENTS)
_W = tl.constexpr(_N_COLS)  # the partials' row width, in the kernels
#: tokens of one sequence per program (at most)
BLOCK = 512
#: where a side input's tokens are: absent, the token mask's, its own mask
ABSENT, ON_MASK, OWN_MASK = 0, 1, 2


@triton.jit
def _side(ptr, has_ptr, row, cols, inside, m, s0, s1, h_s0, h_s1, MODE: tl.constexpr):
    """(float64 values, has) of a side input: values where it has one (else 0), its mask."""
    if MODE == 2:
        has = (tl.load(has_ptr + row * h_s0 + cols * h_s1, mask=inside, other=0) != 0) & m
    else:
        has = m
    return counted(ptr + row * s0 + cols * s1, inside, has), has


@triton.jit
def _moments(x, has):
    """(count, mean, M2) of ``x`` over ``has`` (0 for an empty block)."""
    n = tl.sum(has.to(tl.float64), 0)
    mean = tl.sum(tl.where(has, x, 0.0), 0) / tl.maximum(n, 1.0)
    dev = tl.where(has, x - mean, 0.0)
    return n, mean, tl.sum(dev * dev, 0)


@triton.jit
def _tokens_kernel(v_ptr, m_ptr, old_ptr, oh_ptr, ret_ptr, rh_ptr, adv_ptr, ah_ptr, part_ptr, s,
                   v_s0, v_s1, m_s0, m_s1, old_s0, old_s1, oh_s0, oh_s1, ret_s0, ret_s1, rh_s0, rh_s1,
                   adv_s0, adv_s1, ah_s0, ah_s1,
                   EPS: tl.constexpr, OLD: tl.constexpr, RET: tl.constexpr, ADV: tl.constexpr,
                   SKIP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    cols = (blk * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    inside = cols < s
    m = (tl.load(m_ptr + row * m_s0 + cols * m_s1, mask=inside, other=0) != 0) & inside
    v = counted(v_ptr + row * v_s0 + cols * v_s1, inside, m)
    probe = v * 0.0  # NaN where a value the token has is NaN/inf
    old = v
    ret = v
    adv = v
    has_old = m
    has_ret = m
    has_adv = m
    if OLD != 0:
        old, has_old = _side(old_ptr, oh_ptr, row, cols, inside, m, old_s0, old_s1, oh_s0, oh_s1, OLD)
        probe += old * 0.0
    if RET != 0:
        ret, has_ret = _side(ret_ptr, rh_ptr, row, cols, inside, m, ret_s0, ret_s1, rh_s0, rh_s1, RET)
        probe += ret * 0.0
    if ADV != 0:
        adv, has_adv = _side(adv_ptr, ah_ptr, row, cols, inside, m, adv_s0, adv_s1, ah_s0, ah_s1, ADV)
        probe += adv * 0.0
    bad = m & (probe != probe)
    if SKIP:  # the token leaves every statistic
        m = m & ~bad
        has_old = has_old & ~bad
        has_ret = has_ret & ~bad
        has_adv = has_adv & ~bad
    out = part_ptr + (row * tl.num_programs(1) + blk) * _W
    tl.store(out, tl.sum(m.to(tl.float64), 0))
    tl.store(out + 1, tl.sum(tl.where(m, v, 0.0), 0))
    tl.store(out + 2, tl.sum(bad.to(tl.float64), 0))
    if OLD != 0:
        d = v - old
        hit = tl.where(tl.abs(d) > EPS, 1.0, 0.0).to(tl.float64)
        if not SKIP:
            hit = hit + d * 0.0  # NaN where d is NaN/inf: a NaN comparison must not vanish
        tl.store(out + 3, tl.sum(has_old.to(tl.float64), 0))
        tl.store(out + 4, tl.sum(tl.where(has_old, hit, 0.0), 0))
    else:
        tl.store(out + 3, 0.0)
        tl.store(out + 4, 0.0)
    zero = tl.sum(tl.zeros([BLOCK], tl.float64), 0)
    n_r, mean_r, m2_r = zero, zero, zero
    n_e, mean_e, m2_e = zero, zero, zero
    n_a, mean_a, m2_a = zero, zero, zero
    if RET != 0:
        n_r, mean_r, m2_r = _moments(ret, has_ret)
        n_e, mean_e, m2_e = _moments(ret - v, has_ret)
    if ADV != 0:
        n_a, mean_a, m2_a = _moments(adv, has_adv)
    tl.store(out + 5, n_r)
    tl.store(out + 6, mean_r)
    tl.store(out + 7, m2_r)
    tl.store(out + 8, n_e)
    tl.store(out + 9, mean_e)
    tl.store(out + 10, m2_e)
    tl.store(out + 11, n_a)
    tl.store(out + 12, mean_a)
    tl.store(out + 13, m2_a)


@triton.jit
def _block_rows(part_ptr, start, n_parts, BLOCK: tl.constexpr):
    """(first element of each, in range) of the ``BLOCK`` partial rows from ``start``."""
    rows = start + tl.arange(0, BLOCK)
    return part_ptr + rows.to(tl.int64) * _W, rows < n_parts


@triton.jit
def _load_column(rows_ptr, live, col: tl.constexpr):
    """Column ``col`` of the partial rows starting at ``rows_ptr`` (0 past the last row)."""
    return tl.load(rows_ptr + col, mask=live, other=0.0)


@triton.jit
def _chan(part_ptr, n_parts, col: tl.constexpr, BLOCK: tl.constexpr):
    """Chan's merge of the (count, mean, M2) at columns ``col``, ``col + 1``, ``col + 2`` of
    every block's row: the count-weighted mean, and M2 plus each block's spread about it."""
    n = tl.zeros([BLOCK], tl.float64)
    weighted = tl.zeros([BLOCK], tl.float64)
    m2 = tl.zeros([BLOCK], tl.float64)
    for start in range(0, n_parts, BLOCK):
        base, live = _block_rows(part_ptr, start, n_parts, BLOCK)
        k = _load_column(base, live, col)
        n += k
        weighted += k * _load_column(base, live, col + 1)
        m2 += _load_column(base, live, col + 2)
    total = tl.sum(n, 0)
    mu = tl.sum(weighted, 0) / tl.maximum(total, 1.0)  # 0 when every block is empty
    spread = tl.zeros([BLOCK], tl.float64)
    for start in range(0, n_parts, BLOCK):
        base, live = _block_rows(part_ptr, start, n_parts, BLOCK)
        dev = _load_column(base, live, col + 1) - mu
        spread += _load_column(base, live, col) * dev * dev
    return total, mu, tl.sum(m2, 0) + tl.sum(spread, 0)


@triton.jit
def _finish_kernel(part_ptr, f_ptr, i_ptr, n_parts, RET: tl.constexpr, ADV: tl.constexpr, BLOCK: tl.constexpr):
    """Every block's partials into the contributions: counts (``i_ptr``: n_tok, n_bad, n_old),
    sums (``f_ptr``: sum_value, clipped) and each moment's Chan merge (``f_ptr[2:11]``)."""
    n_tok = tl.zeros([BLOCK], tl.float64)
    sum_value = tl.zeros([BLOCK], tl.float64)
    n_bad = tl.zeros([BLOCK], tl.float64)
    n_old = tl.zeros([BLOCK], tl.float64)
    clipped = tl.zeros([BLOCK], tl.float64)
    for start in range(0, n_parts, BLOCK):
        base, live = _block_rows(part_ptr, start, n_parts, BLOCK)
        n_tok += _load_column(base, live, 0)
        sum_value += _load_column(base, live, 1)
        n_bad += _load_column(base, live, 2)
        n_old += _load_column(base, live, 3)
        clipped += _load_column(base, live, 4)
    tl.store(i_ptr, tl.sum(n_tok, 0).to(tl.int64))
    tl.store(i_ptr + 1, tl.sum(n_bad, 0).to(tl.int64))
    tl.store(i_ptr + 2, tl.sum(n_old, 0).to(tl.int64))
    tl.store(f_ptr, tl.sum(sum_value, 0))
    tl.store(f_ptr + 1, tl.sum(clipped, 0))
    if RET:
        for col in tl.static_range(5, 11, 3):  # returns, then return - value
            n, mu, m2 = _chan(part_ptr, n_parts, col, BLOCK)
            tl.store(f_ptr + col - 3, n)
            tl.store(f_ptr + col - 2, mu)
            tl.store(f_ptr + col - 1, m2)
    if ADV:
        n, mu, m2 = _chan(part_ptr, n_parts, 11, BLOCK)
        tl.store(f_ptr + 8, n)
        tl.store(f_ptr + 9, mu)
        tl.store(f_ptr + 10, m2)


def _side_args(side: Optional[Tuple[torch.Tensor, torch.Tensor]], v: torch.Tensor, m: torch.Tensor,
               mm: torch.Tensor):
    """(values, values strides, has, has strides, mode) of one side input for the kernel
    (``mm``: the mask as the kernel reads it)."""
    if side is None:
        return v, 0, 0, mm, 0, 0, ABSENT
    x, has = side
    x, x0, x1 = arg_strides(x, m)
    if has is m:
        return x, x0, x1, mm, 0, 0, ON_MASK
    has = has.view(torch.uint8) if has.dtype == torch.bool else has
    return x, x0, x1, has, has.stride(0), has.stride(1), OWN_MASK


def token_stats(batches: Sequence[Mapping[str, Any]], *, epsilon: float, skip: bool,
                block: int = 0) -> Dict[str, torch.Tensor]:
    """PPOValueMetric's contributions of a call's microbatches, each a dict with ``x`` (values
    ``[b, s]``), ``m`` (mask) and each side input ``(values, has)`` or None under its name
    (``old_values``, ``returns``, ``advantages``): one launch per microbatch into one buffer
    of partials, then one to finish. Named after the states: sums as 0-d views, each moment
    as a ``[3]`` view."""
    device = batches[0]["x"].device
    shapes = []
    for item in batches:
        b, s = item["m"].shape
        blk = block or min(BLOCK, triton.next_power_of_2(max(s, 16)))
        shapes.append((b, s, blk, triton.cdiv(max(s, 1), blk)))
    n_parts = sum(b * n_blk for b, _, _, n_blk in shapes)
    part = torch.empty(max(n_parts, 1), _N_COLS, dtype=torch.float64, device=device)
    f = torch.empty(2 + 3 * len(MOMENTS), dtype=torch.float64, device=device)
    i = torch.empty(3, dtype=torch.int64, device=device)
    off = 0
    for item, (b, s, blk, n_blk) in zip(batches, shapes):
        if not b:
            continue
        v, m = item["x"], item["m"]
        mm = m.view(torch.uint8) if m.dtype == torch.bool else m
        o, r, a = (_side_args(item[name], v, m, mm) for name in ("old_values", "returns", "advantages"))
        _tokens_kernel[(b, n_blk)](
            v, mm, o[0], o[3], r[0], r[3], a[0], a[3], part[off:], s, v.stride(0), v.stride(1), mm.stride(0),
            mm.stride(1), o[1], o[2], o[4], o[5], r[1], r[2], r[4], r[5], a[1], a[2], a[4], a[5],
            EPS=float(epsilon), OLD=o[6], RET=r[6], ADV=a[6], SKIP=skip, BLOCK=blk, num_warps=4,
            enable_fp_fusion=False)
        off += b * n_blk
    has = {name: any(item[name] is not None for item in batches) for name in ("old_values", "returns", "advantages")}
    _finish_kernel[(1,)](part, f, i, n_parts, RET=has["returns"], ADV=has["advantages"], BLOCK=128,
                         num_warps=4, enable_fp_fusion=False)
    out = {"n_tok": i[0], "sum_value": f[0], "n_bad": i[1]}
    if has["old_values"]:
        out.update(n_old=i[2], clipped=f[1])
    if has["returns"]:
        out.update(ret_moments=f[2:5], res_moments=f[5:8])
    if has["advantages"]:
        out["adv_moments"] = f[8:11]
    return out
