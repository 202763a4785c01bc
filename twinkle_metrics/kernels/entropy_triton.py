"""Per-token entropy partials in one read of the logits (Triton, CUDA).

One program per row streams the vocab once with an online softmax, temperature
folded in: with ``y = z / T`` it keeps the running row max ``m`` and, per lane,
``S = sum exp(y - m)`` and ``W = sum exp(y - m) * (y - m)``, rescaling both when
``m`` grows (``W`` also shifts by ``(m_old - m) S``), then sums the lanes.
``H = log S - W / S``. A vocab shard's
``(m, S, W)`` combine exactly with the other shards' (see ``rescale``), so the
vocab-parallel path keeps the torch path's two collectives (``entropy.rescale``).

Two kernels compute them (``VARIANT``): ``_partials_lean_kernel``, the default, and
``_partials_kernel``, the first, which guards every logit with selects and was timed on an
H200 (bound by instruction issue there; see ``VARIANT``'s note). Compute is float32 (the
logits are 16/32-bit); the partials are stored as float64. The torch implementation in
``entropy.py`` stays the path on every other device and for float64 logits.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from twinkle_metrics.kernels.triton_common import rows_view


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
def _partials_lean_kernel(x_ptr, out_ptr, n_cols, inner, outer_stride, inner_stride, inv_t,
                          SCALED: tl.constexpr, BLOCK: tl.constexpr):
    """The same partials in about 9 instructions per logit instead of 24: the lanes' sums
    move to a new row max only when a tile raises it (a branch the whole program takes
    together, rare after the first tiles), and non-finite logits need no selects: -inf
    (and padding) is clamped to a floor whose exp is 0, NaN passes through the clamp into
    S and W, and a +inf max makes ``inf - inf`` = NaN there, as in torch."""
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + (row // inner) * outer_stride + (row % inner) * inner_stride
    cols = tl.arange(0, BLOCK)
    neg_inf = float("-inf")
    floor = -1.0e30  # exp(floor) = 0 and floor * 0 = 0, where -inf would give NaN
    m = tl.max(tl.full([BLOCK], neg_inf, tl.float32), 0)
    s = tl.zeros([BLOCK], tl.float32)
    w = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        idx = start + cols
        y = tl.load(base + idx, mask=idx < n_cols, other=neg_inf).to(tl.float32)
        if SCALED:  # temperature != 1
            y = y * inv_t
        m_new = tl.maximum(m, tl.max(y, 0))
        if m_new > m:  # the lanes' sums move to the new max (never from -inf: they are 0 then)
            if m > neg_inf:
                d = m - m_new
                a = tl.exp(d)
                w = a * (w + d * s)
                s = a * s
            m = m_new
        ref = tl.where(m > neg_inf, m, 0.0)  # no -inf - -inf while the row has only -inf so far
        yd = tl.maximum(y - ref, floor, propagate_nan=tl.PropagateNan.ALL)
        e = tl.exp(yd)
        s += e
        w += e * yd
    out = out_ptr + row * 3
    tl.store(out, m)
    tl.store(out + 1, tl.sum(s, 0))
    tl.store(out + 2, tl.sum(w, 0))


# Which kernel computes the partials: "lean" (above, the default) or "selects" (the first
# one, which guards every logit with selects). "selects" is the one timed on a GPU so far
# (benchmarks/README.md, "GPU run, 2026-12-01"): 1.93x the read ceiling at 1024-wide tiles,
# where its 24 instructions per logit (benchmarks/kernel_build.py counts them) take 1.3x the
# ceiling's time to issue on an H200 before any memory stall: it is bound by instructions, not
# bandwidth. "lean" issues about 9 per logit in the common case; benchmarks/gpu_tune.py times
# both.
VARIANT = "lean"
# The vocab tile and warps per row: on one H200, [16384, 152064] bf16 rows took 1.93x the read
# ceiling at 1024 / 4 warps, against 2.02x at 2048, 2.51x at 4096 and 3.36x at 8192 / 8 warps
# ("selects").
BLOCK, NUM_WARPS = 1024, 4


def _block(n_cols: int, block: int = 0) -> int:
    return block or min(BLOCK, triton.next_power_of_2(max(n_cols, 16)))


def triton_token_partials(logits: torch.Tensor, temperature: float = 1.0, *, block: int = 0,
                          num_warps: int = 0, variant: str = "", out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[rows, 3]`` float64 ``(m, S, W)`` per row of ``logits [..., V]`` (16/32-bit floats,
    strided views read in place): ``m = max(z / T)``, ``S = sum exp(z / T - m)``,
    ``W = sum exp(z / T - m) * (z / T - m)``; the entropy is ``log S - W / S``.

    Example (a row of equal logits has entropy ``log V``)::

        p = triton_token_partials(torch.zeros(1, 8, device="cuda"))
        torch.log(p[:, 1]) - p[:, 2] / p[:, 1]   # tensor([2.0794])  (log 8)

    ``block`` (a power of two), ``num_warps`` and ``variant`` override the launch's tile
    width, warps and kernel (``VARIANT``), for tests and benchmarks. ``out``: a contiguous
    ``[rows, 3]`` float64 tensor to write into (a slice of a buffer shared by several calls).
    """
    x, inner, outer_stride, inner_stride = rows_view(logits)
    n_cols = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    if out is None:
        out = torch.empty(rows, 3, dtype=torch.float64, device=logits.device)
    if rows == 0:
        return out
    blk = _block(n_cols, block)
    if (variant or VARIANT) == "lean":
        # multiply-adds fused: the partials agree with the torch path to float32 rounding
        # either way (it sums in another order), and one instruction in 9 is saved
        _partials_lean_kernel[(rows,)](x, out, n_cols, inner, outer_stride, inner_stride, 1.0 / temperature,
                                       SCALED=temperature != 1.0, BLOCK=blk, num_warps=num_warps or NUM_WARPS)
    else:
        _partials_kernel[(rows,)](x, out, n_cols, inner, outer_stride, inner_stride, 1.0 / temperature,
                                  BLOCK=blk, num_warps=num_warps or NUM_WARPS, enable_fp_fusion=False)
    return out

