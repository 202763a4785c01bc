"""The per-token policy statistics of the GRPO family in one read of its inputs (Triton, CUDA).

The torch path (``GRPOMetric``'s named steps) issues about seventy small kernels per
microbatch (``benchmarks/launches.py``): masks, float64 casts, differences, ``expm1``, clip compares, one sum per
state. On a GPU that is launch-bound. Here one kernel reads each token's log-prob,
mask and (where given) old log-prob, advantage, reference log-prob and entropy once,
and each program writes one row of float64 partials for a block of one sequence's
tokens; a column sum and a column max finish them. Counts are exact in float64 (below
2**53 tokens per call).

The numbers are the torch path's, with the same rules:

- masked-out positions never enter a value (loaded with the row, then replaced by 0 in
  a select, so NaN/-inf padding there is ignored);
- d = logp - old_logp in float64 (exact for 16/32-bit inputs); k3 = expm1(d) - d is
  computed directly (a series for |d| < 1/2, ``exp(d) - 1 - d`` beyond), so it keeps
  full relative precision where the torch path subtracts two sums;
- a token is non-finite when any of its values is NaN/inf; under ``'skip'`` it is
  dropped from every column, under ``'propagate'`` its values flow (a NaN extreme is
  carried by a NaN flag column added to the extremes at the end, as ``amax`` would);
- clip counts: r < 1 - eps (and A < 0), r > 1 + eps_high (and A > 0), as log-ratio
  bounds passed as ``constexpr``, so they enter the compare as float64 constants (a
  runtime float argument is float32 on the GPU and would move the bound); GSPO's
  per-sequence parts are the per-row sums of the same columns.

``token_stats`` takes all of a call's microbatches: one launch each into one buffer, then
the same few launches to finish, so the count does not grow with the states or inputs.

Used on CUDA unless ``TWINKLE_METRICS_TRITON=0`` (see ``_triton``); tested on CPU under
Triton's interpreter against the torch path, and compiled for sm_80/sm_90 in CI
(``benchmarks/kernel_build.py``).
"""
from __future__ import annotations

import math
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

#: sum columns; the first ``N_COUNTS`` hold counts (int64 states)
SUMS = ("n_tok", "n_ent", "n_adv", "n_ref", "n_old", "clip_n", "clip_low", "clip_high", "n_bad",
        "sum_new", "sum_ent", "sum_adv", "sum_ref_kl", "sum_old", "sum_diff", "sum_kl", "sum_ratio",
        "clip_nan")
N_COUNTS = 9
#: extreme columns, all kept as maxima (minima negated); each has a NaN flag sum column
EXTREMES = ("adv_max", "adv_min", "logr_max", "logr_min")
_N_SUM = len(SUMS)
_N_COLS = _N_SUM + 2 * len(EXTREMES)  # sums, NaN flags of the extremes, extremes
#: tokens of one sequence per program (at most)
BLOCK = 512
#: warps per program
NUM_WARPS = 4

# Column indices the kernel writes, named after the states (taken from the tuples above,
# so the kernel and ``token_stats`` cannot disagree on the layout).
_N_TOK, _N_ENT, _N_ADV, _N_REF, _N_OLD = (tl.constexpr(SUMS.index(c)) for c in
                                          ("n_tok", "n_ent", "n_adv", "n_ref", "n_old"))
_CLIP_N, _CLIP_LOW, _CLIP_HIGH, _N_BAD = (tl.constexpr(SUMS.index(c)) for c in
                                          ("clip_n", "clip_low", "clip_high", "n_bad"))
_SUM_NEW, _SUM_ENT, _SUM_ADV, _SUM_REF_KL = (tl.constexpr(SUMS.index(c)) for c in
                                             ("sum_new", "sum_ent", "sum_adv", "sum_ref_kl"))
_SUM_OLD, _SUM_DIFF, _SUM_KL, _SUM_RATIO, _CLIP_NAN = (tl.constexpr(SUMS.index(c)) for c in
                                                       ("sum_old", "sum_diff", "sum_kl", "sum_ratio", "clip_nan"))
# NaN flag columns (summed, then added to their extreme), then the extremes (as maxima)
_NAN_ADV_MAX, _NAN_ADV_MIN, _NAN_LOGR_MAX, _NAN_LOGR_MIN = (tl.constexpr(_N_SUM + i) for i in range(4))
_ADV_MAX, _NEG_ADV_MIN, _LOGR_MAX, _NEG_LOGR_MIN = (tl.constexpr(_N_SUM + len(EXTREMES) + EXTREMES.index(c))
                                                     for c in EXTREMES)


#: rows of the top-k record buffer, one column per token of every microbatch with old log-probs,
#: in the order of GRPOMetric's record fields: the key (k3 where > 0 and counted, else -inf),
#: the sequence within the call, the position, the token id, the ratio, log-prob, old log-prob
RECORD_ROWS = ("key", "seq", "pos", "token_id", "ratio", "lp", "old")
_REC_KEY, _REC_SEQ, _REC_POS, _REC_TOK, _REC_RATIO, _REC_LP, _REC_OLD = (tl.constexpr(i)
                                                                       for i in range(len(RECORD_ROWS)))


@triton.jit
def _k3_ratio(d):
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
def _counted(ptrs, inside, m):
    """float64 values at ``ptrs`` where ``m`` (the tokens that count), else 0. The load is
    masked by the row's range only, so contiguous rows load in 128-bit vectors (a mask
    that varies token by token forces one load per element); the select then drops
    whatever padding holds (NaN, -inf) before any arithmetic sees it."""
    return tl.where(m, tl.load(ptrs, mask=inside, other=0.0).to(tl.float64), 0.0)


@triton.jit
def _store_sum(out, col: tl.constexpr, x):
    tl.store(out + col, tl.sum(x, 0))


@triton.jit
def _rl_kernel(lp_ptr, m_ptr, old_ptr, adv_ptr, ref_ptr, ent_ptr, tok_ptr, pos_ptr, part_ptr, rec_ptr,
               s, rec_stride, seq0,
               lp_s0, lp_s1, m_s0, m_s1, old_s0, old_s1, adv_s0, adv_s1, ref_s0, ref_s1, ent_s0, ent_s1,
               tok_s0, tok_s1, pos_s0, pos_s1,
               LO: tl.constexpr, HI: tl.constexpr, HAS_TOK: tl.constexpr, HAS_POS: tl.constexpr,
               HAS_OLD: tl.constexpr, HAS_ADV: tl.constexpr, HAS_REF: tl.constexpr, HAS_ENT: tl.constexpr,
               TOKEN_CLIP: tl.constexpr, BY_SIGN: tl.constexpr, SKIP: tl.constexpr, KEY: tl.constexpr,
               N_COLS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    cols = (blk * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    inside = cols < s
    m = (tl.load(m_ptr + row * m_s0 + cols * m_s1, mask=inside, other=0) != 0) & inside
    zero = tl.zeros([BLOCK], tl.float64)
    nan = zero + float("nan")
    # Padding at masked positions never enters (see _counted).
    lp = _counted(lp_ptr + row * lp_s0 + cols * lp_s1, inside, m)
    probe = lp * 0.0  # 0 where every value of the token is finite, NaN where one is not
    old = zero
    adv = zero
    ref = zero
    ent = zero
    if HAS_OLD:
        old = _counted(old_ptr + row * old_s0 + cols * old_s1, inside, m)
        probe += old * 0.0
    if HAS_ADV:
        adv = _counted(adv_ptr + row * adv_s0 + cols * adv_s1, inside, m)
        probe += adv * 0.0
    if HAS_REF:
        ref = _counted(ref_ptr + row * ref_s0 + cols * ref_s1, inside, m)
        probe += ref * 0.0
    if HAS_ENT:
        ent = _counted(ent_ptr + row * ent_s0 + cols * ent_s1, inside, m)
        probe += ent * 0.0
    bad = m & (probe != probe)
    if SKIP:  # the token leaves every column
        m = m & (probe == probe)
        lp = tl.where(m, lp, 0.0)
        old = tl.where(m, old, 0.0)
        adv = tl.where(m, adv, 0.0)
        ref = tl.where(m, ref, 0.0)
        ent = tl.where(m, ent, 0.0)
    one = tl.where(m, 1.0, 0.0).to(tl.float64)
    n = tl.sum(one, 0)
    out = part_ptr + (row * tl.num_programs(1) + blk) * N_COLS
    neg_inf = zero - float("inf")
    # A column whose input is absent holds 0 (an extreme: -inf), so microbatches with
    # other inputs can share the buffer.
    tl.store(out + _N_TOK, n)
    _store_sum(out, _N_BAD, tl.where(bad, 1.0, 0.0).to(tl.float64))
    _store_sum(out, _SUM_NEW, lp)
    if HAS_ENT:
        tl.store(out + _N_ENT, n)
        _store_sum(out, _SUM_ENT, ent)
    else:
        tl.store(out + _N_ENT, 0.0)
        tl.store(out + _SUM_ENT, 0.0)
    if HAS_ADV:
        tl.store(out + _N_ADV, n)
        _store_sum(out, _SUM_ADV, adv)
        adv_nan = tl.sum(tl.where(m & (adv != adv), nan, zero), 0)
        tl.store(out + _NAN_ADV_MAX, adv_nan)
        tl.store(out + _NAN_ADV_MIN, adv_nan)
        tl.store(out + _ADV_MAX, tl.max(tl.where(m & (adv == adv), adv, neg_inf), 0))
        tl.store(out + _NEG_ADV_MIN, tl.max(tl.where(m & (adv == adv), -adv, neg_inf), 0))
    else:
        tl.store(out + _N_ADV, 0.0)
        tl.store(out + _SUM_ADV, 0.0)
        tl.store(out + _NAN_ADV_MAX, 0.0)
        tl.store(out + _NAN_ADV_MIN, 0.0)
        tl.store(out + _ADV_MAX, float("-inf"))
        tl.store(out + _NEG_ADV_MIN, float("-inf"))
    if HAS_REF:
        kr, _ = _k3_ratio(ref - lp)
        tl.store(out + _N_REF, n)
        _store_sum(out, _SUM_REF_KL, tl.where(m, kr, 0.0))
    else:
        tl.store(out + _N_REF, 0.0)
        tl.store(out + _SUM_REF_KL, 0.0)
    if HAS_OLD:
        d = lp - old
        k3, ratio = _k3_ratio(d)
        tl.store(out + _N_OLD, n)
        _store_sum(out, _SUM_OLD, old)
        _store_sum(out, _SUM_DIFF, d)
        _store_sum(out, _SUM_KL, tl.where(m, k3, 0.0))
        _store_sum(out, _SUM_RATIO, tl.where(m, ratio, 0.0))
        d_nan = tl.sum(tl.where(m & (d != d), nan, zero), 0)
        tl.store(out + _NAN_LOGR_MAX, d_nan)
        tl.store(out + _NAN_LOGR_MIN, d_nan)
        tl.store(out + _LOGR_MAX, tl.max(tl.where(m & (d == d), d, neg_inf), 0))
        tl.store(out + _NEG_LOGR_MIN, tl.max(tl.where(m & (d == d), -d, neg_inf), 0))
        if KEY:  # the top-k records' fields of every token (RECORD_ROWS)
            rec = rec_ptr + row * s + cols
            rec_stride = row * 0 + rec_stride  # int64: rows x tokens may pass 2**31
            tl.store(rec + _REC_KEY * rec_stride, tl.where(m & (k3 > 0), k3, neg_inf), mask=inside)
            tl.store(rec + _REC_SEQ * rec_stride, (seq0 + row).to(tl.float64) + zero, mask=inside)
            pos = cols.to(tl.float64)  # the column, unless position ids are given
            if HAS_POS:
                pos = tl.load(pos_ptr + row * pos_s0 + cols * pos_s1, mask=inside, other=0).to(tl.float64)
            tl.store(rec + _REC_POS * rec_stride, pos, mask=inside)
            tok = zero - 1.0  # -1 without labels
            if HAS_TOK:
                tok = tl.load(tok_ptr + row * tok_s0 + cols * tok_s1, mask=inside, other=0).to(tl.float64)
            tl.store(rec + _REC_TOK * rec_stride, tok, mask=inside)
            tl.store(rec + _REC_RATIO * rec_stride, ratio, mask=inside)
            tl.store(rec + _REC_LP * rec_stride, lp, mask=inside)
            tl.store(rec + _REC_OLD * rec_stride, old, mask=inside)
    else:
        d = zero
        tl.store(out + _N_OLD, 0.0)
        tl.store(out + _SUM_OLD, 0.0)
        tl.store(out + _SUM_DIFF, 0.0)
        tl.store(out + _SUM_KL, 0.0)
        tl.store(out + _SUM_RATIO, 0.0)
        tl.store(out + _NAN_LOGR_MAX, 0.0)
        tl.store(out + _NAN_LOGR_MIN, 0.0)
        tl.store(out + _LOGR_MAX, float("-inf"))
        tl.store(out + _NEG_LOGR_MIN, float("-inf"))
    clip_n = 0.0
    clip_nan = 0.0
    if HAS_OLD and HAS_ADV:
        if not SKIP:  # NaN when a gated token holds a NaN/inf d or A (a compare would drop it)
            clip_nan = tl.sum(tl.where(m, (d + adv) * 0.0, 0.0), 0)
        if TOKEN_CLIP:
            low = m & (d < LO)
            high = m & (d > HI)
            if BY_SIGN:
                low = low & (adv < 0)
                high = high & (adv > 0)
            clip_n = n
            _store_sum(out, _CLIP_LOW, tl.where(low, 1.0, 0.0).to(tl.float64))
            _store_sum(out, _CLIP_HIGH, tl.where(high, 1.0, 0.0).to(tl.float64))
        else:
            tl.store(out + _CLIP_LOW, 0.0)
            tl.store(out + _CLIP_HIGH, 0.0)
    else:
        tl.store(out + _CLIP_LOW, 0.0)
        tl.store(out + _CLIP_HIGH, 0.0)
    tl.store(out + _CLIP_N, clip_n)
    tl.store(out + _CLIP_NAN, clip_nan)


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


def _strides(x: Optional[torch.Tensor], like: torch.Tensor):
    if x is None:
        return like, 0, 0
    if x.shape[1] == 1 and like.shape[1] != 1:
        return x, x.stride(0), 0  # one value per sequence, read for each of its tokens
    return x, x.stride(0), x.stride(1)


def token_stats(batches: Sequence[Mapping[str, Optional[torch.Tensor]]], *, lo: float = -math.inf,
                hi: float = math.inf, token_clip: bool = True, by_sign: bool = True, skip: bool = False,
                want_key: bool = False, want_rows: bool = False, block: int = 0) -> Tuple[
                    Dict[str, torch.Tensor], Optional[torch.Tensor], List[Optional[torch.Tensor]]]:
    """The GRPO family's per-token contributions of several microbatches: one kernel per
    microbatch into one buffer of partials, then one program finishing all of them
    (``_totals_kernel``): a fixed number of launches beyond one per microbatch.

    Each of ``batches`` maps ``lp``, ``m`` (bool) and, where given, ``old``, ``ref``,
    ``ent`` to ``[b, s]`` tensors (any strides) and ``adv`` to ``[b, s]`` or ``[b, 1]``
    (one value per sequence); every value counts where ``m``. ``lo``/``hi``: the clip
    bounds on d = logp - old_logp; ``token_clip``: count token clips (False for GSPO,
    which clips sequences from ``rows``); ``by_sign``: gate them by the advantage's sign
    (not CISPO); ``skip``: drop non-finite tokens. With ``want_key``, ``seq0`` (an int) is
    the index of the microbatch's first sequence in the call.

    Returns ``(totals, records, rows)``: 0-d tensors named like the metric's states (counts
    int64, the rest float64; a column whose input no microbatch gave is 0, or -inf/+inf
    for an extreme); with ``want_key``, one float64 ``[len(RECORD_ROWS), tokens]`` buffer
    holding, for every token of every microbatch with old log-probs (in order, row-major),
    the rows of ``RECORD_ROWS`` (the sequence index is ``seq0`` + row; the position the
    column, or ``pos`` ``[b, s]`` where given; the token id ``tok`` ``[b, s]``, or -1) (else
    None); with ``want_rows``, per microbatch its ``[b, 3]`` per-sequence (sum of d, tokens,
    sum of A).
    """
    device = batches[0]["lp"].device
    plans = []
    offset = tokens = 0
    for mb in batches:
        b, s = mb["m"].shape
        # 512 tokens per program: 80 registers a thread on sm_90 with every input given,
        # against 162 at 1024 (ptxas -v, benchmarks/kernel_build.py), so more programs fit an SM
        blk = block or min(BLOCK, triton.next_power_of_2(max(s, 16)))
        n_blk = triton.cdiv(s, blk)
        keyed = want_key and mb.get("old") is not None
        plans.append((offset, b, s, blk, n_blk, tokens if keyed else None))
        offset += b * n_blk
        tokens += b * s if keyed else 0
    part = torch.empty(offset, _N_COLS, dtype=torch.float64, device=device)
    records = torch.empty(len(RECORD_ROWS), tokens, dtype=torch.float64, device=device) if tokens else None
    for mb, (off, b, s, blk, n_blk, tok) in zip(batches, plans):
        lp, m, old = mb["lp"], mb["m"], mb.get("old")
        args = []
        for x in (lp, m.view(torch.uint8) if m.dtype == torch.bool else m, old, mb.get("adv"), mb.get("ref"),
                  mb.get("ent"), mb.get("tok"), mb.get("pos")):
            args.extend(_strides(x, lp))
        ptrs, strides = args[0::3], [v for i, v in enumerate(args) if i % 3]
        rec = part if tok is None else records[:, tok:]
        _rl_kernel[(b, n_blk)](*ptrs, part[off:], rec, s, max(tokens, 1), int(mb.get("seq0", 0)), *strides,
                               LO=float(lo), HI=float(hi), HAS_TOK=mb.get("tok") is not None,
                               HAS_POS=mb.get("pos") is not None, HAS_OLD=old is not None,
                               HAS_ADV=mb.get("adv") is not None, HAS_REF=mb.get("ref") is not None,
                               HAS_ENT=mb.get("ent") is not None,
                               TOKEN_CLIP=token_clip, BY_SIGN=by_sign, SKIP=skip, KEY=tok is not None,
                               N_COLS=_N_COLS, BLOCK=blk, num_warps=NUM_WARPS, enable_fp_fusion=False)
    # one program: column sums, extremes with their NaN flags, minima negated back
    f, i, _ = column_totals(part, ext0=_N_SUM + len(EXTREMES), flag0=_N_SUM, per_ext=True,
                            neg=sum(1 << e for e, name in enumerate(EXTREMES) if name.endswith("_min")))
    # 0-d views, made by two unbinds rather than one indexing call per state
    out = dict(zip(SUMS[:N_COUNTS], i[:N_COUNTS].unbind()))
    out.update(zip(SUMS[N_COUNTS:], f[N_COUNTS:_N_SUM].unbind()))
    out.update(zip(EXTREMES, f[_N_SUM + len(EXTREMES):].unbind()))
    rows: List[Optional[torch.Tensor]] = []
    for off, b, _, _, n_blk, _ in plans:
        if not want_rows:
            rows.append(None)
            continue
        per_row = part[off:off + b * n_blk, :_N_SUM].view(b, n_blk, _N_SUM).sum(1)
        rows.append(torch.stack([per_row[:, SUMS.index(c)] for c in ("sum_diff", "n_old", "sum_adv")], 1))
    return out, records, rows


@triton.jit
def _row_sums_kernel(a_ptr, b_ptr, m_ptr, out_ptr, s, a_s0, a_s1, b_s0, b_s1, m_s0, m_s1,
                     TWO: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    sa = tl.zeros([BLOCK], tl.float64)
    sb = tl.zeros([BLOCK], tl.float64)
    for start in range(0, s, BLOCK):
        cols = (start + tl.arange(0, BLOCK)).to(tl.int64)
        m = (tl.load(m_ptr + row * m_s0 + cols * m_s1, mask=cols < s, other=0) != 0) & (cols < s)
        sa += _counted(a_ptr + row * a_s0 + cols * a_s1, cols < s, m)
        if TWO:
            sb += _counted(b_ptr + row * b_s0 + cols * b_s1, cols < s, m)
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
