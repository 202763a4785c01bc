"""RolloutMismatchMetric's per-token statistics in one read of its inputs (Triton, CUDA).

The torch path (``RolloutMismatchMetric._token_sums``) issues a few dozen small kernels
per microbatch: the non-finite probe, float64 casts, d = logp_train - logp_rollout,
two ``expm1``, threshold compares, one sum or extreme per state. On a GPU that is
launch-bound. Here one kernel reads each token's trainer log-prob, rollout log-prob and
mask once, and each program writes one row of float64 partials for a block of one
sequence's tokens into one buffer shared by every microbatch of the call; one column
sum and one column max finish them. Counts are exact in float64 (below 2**53 tokens
per call).

The numbers are the torch path's, with the same rules:

- only tokens that count and have a rollout log-prob enter a value (rows are loaded
  whole and the rest replaced by 0 in a select, ``triton_common.counted``: NaN/-inf padding
  elsewhere is ignored);
- d = logp_train - logp_rollout in float64 (exact for 16/32-bit inputs); w - 1 =
  expm1(d) and the k3 term expm1(-d) + d come from ``triton_common.k3_ratio``, which
  keeps full relative precision without ``libdevice``;
- a token is non-finite when either log-prob is NaN/inf: counted in ``n_bad``; under
  ``'skip'`` it leaves every column, under ``'propagate'`` its values flow: the
  threshold counts get the torch path's poison (the sum of d * 0, NaN when a counted d
  is NaN/inf), and a NaN d makes the extremes NaN as ``amax`` would (a NaN flag column
  added to them at the end; kernel maxima do not promise to keep NaN);
- threshold counts compare d with the log-thresholds, passed as ``constexpr`` so they
  enter the compare as float64 constants (a runtime float argument is float32 on the
  GPU and would move the bound);
- minima are kept as maxima of -d; each sequence's (sum of d, tokens) are the first
  two columns, summed over its blocks for ``_sequence_sums``.

``token_stats`` takes all of a call's microbatches: one launch each into one buffer,
every row with the same number of blocks, then one program (``triton_common.column_totals``)
finishes them: the column sums and maxima, the counts, and each row's (sum of d, tokens). So the
count does not grow with the microbatches. ``sequence_stats`` makes the sequence
statistics of those rows (completed over CP first) in one more launch.

Used on CUDA unless ``TWINKLE_METRICS_TRITON=0`` (see ``dispatch``); tested on CPU under
Triton's interpreter against the torch path, and compiled for sm_80/sm_90 in CI
(``benchmarks/kernel_build.py``).
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Sequence, Tuple, cast

import torch
import triton
import triton.language as tl

from twinkle_metrics.kernels.triton_common import column_totals, counted, k3_ratio, store_sum

#: partial columns: per-sequence (sum of d, tokens) first, then sums, the NaN flag of the
#: extremes, and the extremes (as maxima; d_min negated)
SUMS = ("sum_d", "n_tok", "n_bad", "n_high", "n_low", "sum_abs", "sum_em", "sum_em2", "sum_k3", "sum_lp_train",
        "sum_lp_rollout")
EXTREMES = ("abs_max", "d_max", "d_min")
_FLAG = len(SUMS)
_N_COLS = _FLAG + 1 + len(EXTREMES)
#: tokens of one sequence per program (at most)
BLOCK = 512

# Column indices the kernel writes, named after the states (taken from the tuples above).
_SUM_D, _N_TOK, _N_BAD, _N_HIGH, _N_LOW, _SUM_ABS, _SUM_EM, _SUM_EM2, _SUM_K3, _SUM_LP_TRAIN, _SUM_LP_ROLLOUT = (
    tl.constexpr(SUMS.index(c)) for c in ("sum_d", "n_tok", "n_bad", "n_high", "n_low", "sum_abs", "sum_em",
                                          "sum_em2", "sum_k3", "sum_lp_train", "sum_lp_rollout"))
_NAN_FLAG = tl.constexpr(_FLAG)
_ABS_MAX, _D_MAX, _NEG_D_MIN = (tl.constexpr(_FLAG + 1 + EXTREMES.index(c)) for c in EXTREMES)


@triton.jit
def _rollout_kernel(lp_ptr, roll_ptr, has_ptr, part_ptr, s, lp_s0, lp_s1, roll_s0, roll_s1, has_s0, has_s1,
                    LO: tl.constexpr, HI: tl.constexpr, SKIP: tl.constexpr, N_COLS: tl.constexpr,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    cols = (blk * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    inside = cols < s
    m = (tl.load(has_ptr + row * has_s0 + cols * has_s1, mask=inside, other=0) != 0) & inside
    # Only counted tokens with a rollout log-prob enter: padding elsewhere never does.
    lp = counted(lp_ptr + row * lp_s0 + cols * lp_s1, inside, m)
    roll = counted(roll_ptr + row * roll_s0 + cols * roll_s1, inside, m)
    probe = lp * 0.0 + roll * 0.0  # NaN where either log-prob is NaN/inf
    bad = m & (probe != probe)
    if SKIP:  # the token leaves every column
        m = m & (probe == probe)
        lp = tl.where(m, lp, 0.0)
        roll = tl.where(m, roll, 0.0)
    d = lp - roll  # 0 off ``m``
    k3, w = k3_ratio(d)
    em = tl.where(tl.abs(d) < 0.5, k3 + d, w - 1.0)  # expm1(d), as k3_ratio forms it
    kr, _ = k3_ratio(-d)  # expm1(-d) + d: k3 of r = -d, the rollout-side log-ratio
    em = tl.where(m, em, 0.0)
    kr = tl.where(m, kr, 0.0)
    # 0, or NaN when a counted d is NaN/inf: the torch path's (d * 0).sum(); a compare alone would drop it
    poison = tl.sum(tl.where(m, d * 0.0, 0.0), 0)
    ok = m & (d == d)
    zero = tl.zeros([BLOCK], tl.float64)
    neg_inf = zero - float("inf")
    out = part_ptr + (row * tl.num_programs(1) + blk) * N_COLS
    # column order: SUMS, the NaN flag, EXTREMES (as maxima)
    store_sum(out, _SUM_D, d)
    store_sum(out, _N_TOK, tl.where(m, 1.0, 0.0).to(tl.float64))
    store_sum(out, _N_BAD, tl.where(bad, 1.0, 0.0).to(tl.float64))
    tl.store(out + _N_HIGH, tl.sum(tl.where(m & (d > HI), 1.0, 0.0).to(tl.float64), 0) + poison)
    tl.store(out + _N_LOW, tl.sum(tl.where(m & (d < LO), 1.0, 0.0).to(tl.float64), 0) + poison)
    store_sum(out, _SUM_ABS, tl.abs(d))
    store_sum(out, _SUM_EM, em)
    store_sum(out, _SUM_EM2, em * em)
    store_sum(out, _SUM_K3, kr)
    store_sum(out, _SUM_LP_TRAIN, lp)
    store_sum(out, _SUM_LP_ROLLOUT, roll)
    store_sum(out, _NAN_FLAG, tl.where(m & (d != d), zero + float("nan"), zero))
    tl.store(out + _ABS_MAX, tl.max(tl.where(ok, tl.abs(d), neg_inf), 0))
    tl.store(out + _D_MAX, tl.max(tl.where(ok, d, neg_inf), 0))
    tl.store(out + _NEG_D_MIN, tl.max(tl.where(ok, -d, neg_inf), 0))


@triton.jit
def _sequences(parts_ptr, start, n, p_s0, p_s1, BLOCK: tl.constexpr):
    """(sum of d, tokens, has a token) of the ``BLOCK`` sequences from ``start``."""
    r = (start + tl.arange(0, BLOCK)).to(tl.int64)
    live = r < n
    sd = tl.load(parts_ptr + r * p_s0, mask=live, other=0.0)
    k = tl.load(parts_ptr + r * p_s0 + p_s1, mask=live, other=0.0)
    return sd, k, live & (k > 0)


@triton.jit
def _sequence_kernel(parts_ptr, f_ptr, i_ptr, n, p_s0, p_s1, BLOCK: tl.constexpr):
    """One program over the ``[n, 2]`` (sum of d, tokens) per sequence: sequences with a
    token (``n_seq`` into ``i_ptr``), the sum of |mean d| over them, and the ESS triple
    (shift, sum e^(s - shift), sum e^(2 (s - shift))) with the largest s as the shift, as
    ``RolloutMismatchMetric._sequence_sums`` makes them (into ``f_ptr``)."""
    top = tl.zeros([BLOCK], tl.float64) - float("inf")
    nan = tl.zeros([BLOCK], tl.float64)
    n_seq = tl.zeros([BLOCK], tl.int64)
    abs_sum = tl.zeros([BLOCK], tl.float64)
    for start in range(0, n, BLOCK):
        sd, k, valid = _sequences(parts_ptr, start, n, p_s0, p_s1, BLOCK)
        top = tl.maximum(top, tl.where(valid, sd, float("-inf")))
        nan += tl.where(valid & (sd != sd), 1.0, 0.0)  # a kernel max need not keep NaN
        n_seq += valid.to(tl.int64)
        abs_sum += tl.where(valid, tl.abs(sd / tl.where(valid, k, 1.0)), 0.0)
    shift = tl.max(top, 0)
    shift = tl.where(tl.sum(nan, 0) > 0, float("nan"), shift)
    a = tl.zeros([BLOCK], tl.float64)
    b = tl.zeros([BLOCK], tl.float64)
    for start in range(0, n, BLOCK):
        sd, k, valid = _sequences(parts_ptr, start, n, p_s0, p_s1, BLOCK)
        e = tl.where(valid, tl.exp(tl.where(valid, sd, shift) - shift), 0.0)
        a += e
        b += e * e
    a_tot = tl.sum(a, 0)
    tl.store(i_ptr, tl.sum(n_seq, 0))
    tl.store(f_ptr, tl.sum(abs_sum, 0))
    tl.store(f_ptr + 1, tl.where(a_tot != 0, shift, 0.0))
    tl.store(f_ptr + 2, a_tot)
    tl.store(f_ptr + 3, tl.sum(b, 0))


def sequence_stats(parts: torch.Tensor, *, block: int = 0) -> Dict[str, torch.Tensor]:
    """``RolloutMismatchMetric``'s sequence contributions (``n_seq``, ``sum_seq_abs``,
    ``seq_ess``) of float64 ``[n, 2]`` (sum of d, tokens) per sequence, in one launch."""
    f = torch.empty(4, dtype=torch.float64, device=parts.device)
    i = torch.empty(1, dtype=torch.int64, device=parts.device)
    block = block or min(256, triton.next_power_of_2(max(parts.shape[0], 16)))
    _sequence_kernel[(1,)](parts, f, i, parts.shape[0], parts.stride(0), parts.stride(1), BLOCK=block, num_warps=4,
                           enable_fp_fusion=False)
    return {"n_seq": i[0], "sum_seq_abs": f[0], "seq_ess": f[1:]}


def token_stats(batches: Sequence[Mapping[str, torch.Tensor]], *, lo: float, hi: float, skip: bool = False,
                block: int = 0) -> Tuple[Dict[str, torch.Tensor], List[torch.Tensor]]:
    """RolloutMismatchMetric's per-token contributions of several microbatches: one
    kernel per microbatch into one buffer of partials, then a fixed few launches for all.

    Each of ``batches`` maps ``lp`` (trainer log-probs), ``roll`` (rollout log-probs)
    and ``has`` (bool: the token counts and has a rollout log-prob) to ``[b, s]``
    tensors with any strides, at least one token in all. ``lo``/``hi``: the
    log-thresholds d is compared with (``lo`` may be -inf); ``skip``: drop non-finite
    tokens; ``block``: tokens per program (0: fitted to the longest row, up to ``BLOCK``).

    Returns ``(totals, rows)``: 0-d tensors named like the metric's states (``n_tok``,
    ``n_bad`` int64, the rest float64; an extreme with no token is -inf, or +inf for
    ``d_min``), and per microbatch its ``[b, 2]`` float64 per-sequence (sum of d,
    tokens), views into one tensor.
    """
    device = batches[0]["lp"].device
    longest = max(mb["has"].shape[1] for mb in batches)
    # at most 512 tokens per program: 90-96 registers a thread on sm_90, against 148-202
    # at 1024 (ptxas -v, benchmarks/kernel_build.py), so more programs fit an SM
    blk = block or min(BLOCK, triton.next_power_of_2(max(longest, 16)))
    # Every row gets the same number of blocks (those past a shorter row write neutral
    # partials), so the per-sequence parts of all microbatches are one reduction.
    n_blk = triton.cdiv(longest, blk)
    offsets = [0]
    for mb in batches:
        offsets.append(offsets[-1] + mb["has"].shape[0])
    part = torch.empty(offsets[-1], n_blk, _N_COLS, dtype=torch.float64, device=device)
    lo, hi = float(lo), float(hi)
    for mb, off in zip(batches, offsets):
        lp, roll, has = mb["lp"], mb["roll"], mb["has"]
        b, s = has.shape
        if b == 0:
            continue
        has = has.view(torch.uint8) if has.dtype == torch.bool else has
        _rollout_kernel[(b, n_blk)](lp, roll, has, part[off:], s, lp.stride(0), lp.stride(1), roll.stride(0),
                                    roll.stride(1), has.stride(0), has.stride(1), LO=lo, HI=hi, SKIP=skip,
                                    N_COLS=_N_COLS, BLOCK=blk, num_warps=4, enable_fp_fusion=False)
    # one program: column sums, extremes with the NaN flag, d_min negated back, and each
    # row's (sum of d, tokens) over its blocks
    f, i, per_row = column_totals(part.view(-1, _N_COLS), ext0=_FLAG + 1, flag0=_FLAG, per_ext=False,
                                  neg=1 << EXTREMES.index("d_min"), n_rows=offsets[-1], n_blk=n_blk,
                                  rows=(SUMS.index("sum_d"), SUMS.index("n_tok")))
    out = dict(zip(SUMS, f[:len(SUMS)].unbind()))
    out.update(zip(EXTREMES, f[_FLAG + 1:].unbind()))
    out.update(n_tok=i[SUMS.index("n_tok")], n_bad=i[SUMS.index("n_bad")])
    rows = cast(torch.Tensor, per_row)  # rows= asked for them
    return out, [rows[a:z] for a, z in zip(offsets, offsets[1:])]
