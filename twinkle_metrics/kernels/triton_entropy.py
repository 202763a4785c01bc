"""Per-token entropy partials in one read of the logits (Triton, CUDA).

One program per row streams the vocab once with an online softmax, temperature
folded in: with ``y = z / T`` it keeps the running row max ``m`` and, per lane,
``S = sum exp(y - m)`` and ``W = sum exp(y - m) * (y - m)``, rescaling both when
``m`` grows (``W`` also shifts by ``(m_old - m) S``), then sums the lanes. ``H = log S - W / S``. A vocab shard's
``(m, S, W)`` combine exactly with the other shards' (see ``rescale``), so the
vocab-parallel path keeps the torch path's two collectives (``entropy.rescale``).

Compute is float32 (the logits are 16/32-bit); the partials are stored as
float64. The torch implementation in ``entropy.py`` stays the path on every other
device and for float64 logits.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._triton import rows_view


@triton.jit
def _partials_kernel(x_ptr, out_ptr, n_cols, inner, outer_stride, inner_stride, inv_t,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # int64: rows x V overflows int32 offsets
    base = x_ptr + (row // inner) * outer_stride + (row % inner) * inner_stride
    cols = tl.arange(0, BLOCK)
    neg_inf = float("-inf")
    # One running max per row (a tile-wide max each step), so each logit costs one
    # exp; per-lane sums keep the adds parallel until the end.
    m = tl.max(tl.full([BLOCK], neg_inf, tl.float32), 0)
    s = tl.zeros([BLOCK], tl.float32)
    w = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        idx = start + cols
        y = tl.load(base + idx, mask=idx < n_cols, other=neg_inf).to(tl.float32) * inv_t
        nan = y != y
        # NaN stays out of the max (tl.max's NaN rule differs by backend) but goes
        # into S and W through e, so the entropy is NaN as in torch; -inf entries (and
        # padding) add nothing, and the selects keep -inf out of every subtraction
        # (no -inf - -inf), as the torch path's clamp keeps 0 * -inf out.
        m_new = tl.maximum(m, tl.max(tl.where(nan, neg_inf, y), 0))
        seen = m > neg_inf          # a finite max so far: S, W > 0 only then
        m_ref = tl.where(m_new > neg_inf, m_new, 0.0)
        d = tl.where(seen, tl.where(seen, m, 0.0) - m_ref, 0.0)
        a = tl.where(seen, tl.exp(d), 0.0)
        fin = (y > neg_inf) | nan
        yd = tl.where(fin, tl.where(fin, y, 0.0) - m_ref, 0.0)
        e = tl.where(fin, tl.exp(yd), 0.0)
        w = a * (w + d * s) + e * yd
        s = a * s + e  # a +inf logit makes inf - inf = NaN here: H is NaN, as in torch
        m = m_new
    out = out_ptr + row * 3
    tl.store(out, m)
    tl.store(out + 1, tl.sum(s, 0))
    tl.store(out + 2, tl.sum(w, 0))


@triton.jit
def _partials_lane_kernel(x_ptr, out_ptr, n_cols, inner, outer_stride, inner_stride, inv_t,
                          BLOCK: tl.constexpr):
    """The same partials with a running max per lane instead of per row: no reduction
    across the tile inside the loop, and still one exp per logit (``exp(-|y - m|)``
    rescales the lane's sums when ``y`` is a new maximum, and weighs ``y`` otherwise).
    The lanes' ``(m, S, W)`` combine at the end as vocab shards do."""
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + (row // inner) * outer_stride + (row % inner) * inner_stride
    cols = tl.arange(0, BLOCK)
    lowest = -3.4028234663852886e38  # a lane's max before any value: -inf - lowest is -inf, not NaN
    floor = -1.0e30                  # gaps below it count as it: exp(floor) = 0, floor * S is finite
    m = tl.full([BLOCK], lowest, tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    w = tl.zeros([BLOCK], tl.float32)
    nan = tl.zeros([BLOCK], tl.int32)
    for start in range(0, n_cols, BLOCK):
        idx = start + cols
        y = tl.load(base + idx, mask=idx < n_cols, other=float("-inf")).to(tl.float32) * inv_t
        nan = nan | (y != y).to(tl.int32)  # NaN adds nothing below, but makes the row NaN
        up = y > m                         # a new lane maximum (never for NaN or -inf)
        top = tl.where(up, y, m)
        gap = tl.maximum(tl.where(up, m, y) - top, floor)  # -|y - m|; -inf and padding: floor
        t = tl.exp(gap)
        w = tl.where(up, t * (w + gap * s), w + t * gap)
        s = tl.where(up, s * t + 1.0, s + t)
        m = top
    row_m = tl.max(m, 0)
    d = tl.maximum(m - row_m, floor)
    a = tl.exp(d)
    total_s = tl.sum(a * s, 0)
    total_w = tl.sum(a * (w + d * s), 0)
    bad = (tl.max(nan, 0) > 0) | (row_m == float("inf"))  # NaN, or inf - inf, in torch
    out = out_ptr + row * 3
    tl.store(out, tl.where(total_s > 0, row_m, float("-inf")))  # no value: the max of nothing
    tl.store(out + 1, tl.where(bad, float("nan"), total_s))
    tl.store(out + 2, tl.where(bad, float("nan"), total_w))


# Which kernel computes the partials ("tile": one running max per row; "lane": one per lane).
# "tile" is the one measured on a GPU (benchmarks/README.md, "GPU run 2026-12-01"); "lane"
# waits for its measurement (benchmarks/gpu_tune.py sweeps both).
VARIANT = "tile"
# The vocab tile and warps per row: on one H200, [16384, 152064] bf16 rows took 1.93x the read
# ceiling at 1024 / 4 warps, against 2.02x at 2048, 2.51x at 4096 and 3.36x at 8192 / 8 warps.
BLOCK, NUM_WARPS = 1024, 4


def _block(n_cols: int, block: int = 0) -> int:
    return block or min(BLOCK, triton.next_power_of_2(max(n_cols, 16)))


def triton_token_partials(logits: torch.Tensor, temperature: float = 1.0, *, block: int = 0,
                          num_warps: int = 0, variant: str = "") -> torch.Tensor:
    """``[rows, 3]`` float64 ``(m, S, W)`` per row of ``logits [..., V]`` (16/32-bit floats,
    strided views read in place): ``m = max(z / T)``, ``S = sum exp(z / T - m)``,
    ``W = sum exp(z / T - m) * (z / T - m)``; the entropy is ``log S - W / S``.

    Example (a row of equal logits has entropy ``log V``)::

        p = triton_token_partials(torch.zeros(1, 8, device="cuda"))
        torch.log(p[:, 1]) - p[:, 2] / p[:, 1]   # tensor([2.0794])  (log 8)

    ``block`` (a power of two), ``num_warps`` and ``variant`` override the launch's tile
    width, warps and kernel (``VARIANT``), for tests and benchmarks.
    """
    x, inner, outer_stride, inner_stride = rows_view(logits)
    n_cols = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    out = torch.empty(rows, 3, dtype=torch.float64, device=logits.device)
    if rows == 0:
        return out
    blk = _block(n_cols, block)
    kernel = _partials_lane_kernel if (variant or VARIANT) == "lane" else _partials_kernel
    kernel[(rows,)](x, out, n_cols, inner, outer_stride, inner_stride, 1.0 / temperature,
                    BLOCK=blk, num_warps=num_warps or NUM_WARPS, enable_fp_fusion=False)
    return out

