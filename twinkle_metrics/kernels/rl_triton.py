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

Used on CUDA unless ``TWINKLE_METRICS_TRITON=0`` (see ``dispatch``); tested on CPU under
Triton's interpreter against the torch path, and compiled for sm_80/sm_90 in CI
(``benchmarks/kernel_build.py``).
"""
from __future__ import annotations

import functools
import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from twinkle_metrics.kernels.triton_common import arg_strides, column_totals, counted, k3_ratio, store_sum

#: one column a caller wants: (name, reduction, dtype)
Column = Tuple[str, str, torch.dtype]

#: the sums the kernel takes over a call's counted tokens (its partials' layout), named as the
#: policy metrics' states (``metrics.rl.policy.table.COLUMNS`` says what each holds): token
#: counts (all, and those with each input), clip counts, non-finite tokens, then sums of values
SUMS = ("n_tok", "n_ent", "n_adv", "n_ref", "n_old", "clip_n", "clip_low", "clip_high", "n_bad", "sum_new",
        "sum_ent", "sum_adv", "sum_ref_kl", "sum_old", "sum_diff", "sum_kl", "sum_ratio", "clip_nan")
#: the extremes the kernel keeps (of the advantage and of d = logp - old logp), all as maxima
#: (minima negated); each has a NaN flag sum column
EXTREMES = ("adv_max", "adv_min", "logr_max", "logr_min")
_N_SUM = len(SUMS)
_N_COLS = _N_SUM + 2 * len(EXTREMES)  # sums, NaN flags of the extremes, extremes
#: tokens of one sequence per program (at most)
BLOCK = 512
#: warps per program
NUM_WARPS = 4

# Column indices the kernel writes, named after the columns (taken from the tuples above,
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
#: named and ordered as the policy metrics' record fields (``records.FIELDS``): k3 (where > 0 and
#: counted, else -inf), the sequence (within the call), the position, the token id, the ratio,
#: the log-prob and the old log-prob
RECORD_ROWS = ("kl", "gsi", "pos", "token_id", "ratio", "logp_new", "logp_old")
_REC_KEY, _REC_SEQ, _REC_POS, _REC_TOK, _REC_RATIO, _REC_LP, _REC_OLD = (tl.constexpr(i)
                                                                       for i in range(len(RECORD_ROWS)))


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
    # Padding at masked positions never enters (see counted).
    lp = counted(lp_ptr + row * lp_s0 + cols * lp_s1, inside, m)
    probe = lp * 0.0  # 0 where every value of the token is finite, NaN where one is not
    old = zero
    adv = zero
    ref = zero
    ent = zero
    if HAS_OLD:
        old = counted(old_ptr + row * old_s0 + cols * old_s1, inside, m)
        probe += old * 0.0
    if HAS_ADV:
        adv = counted(adv_ptr + row * adv_s0 + cols * adv_s1, inside, m)
        probe += adv * 0.0
    if HAS_REF:
        ref = counted(ref_ptr + row * ref_s0 + cols * ref_s1, inside, m)
        probe += ref * 0.0
    if HAS_ENT:
        ent = counted(ent_ptr + row * ent_s0 + cols * ent_s1, inside, m)
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
    store_sum(out, _N_BAD, tl.where(bad, 1.0, 0.0).to(tl.float64))
    store_sum(out, _SUM_NEW, lp)
    if HAS_ENT:
        tl.store(out + _N_ENT, n)
        store_sum(out, _SUM_ENT, ent)
    else:
        tl.store(out + _N_ENT, 0.0)
        tl.store(out + _SUM_ENT, 0.0)
    if HAS_ADV:
        tl.store(out + _N_ADV, n)
        store_sum(out, _SUM_ADV, adv)
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
        kr, _ = k3_ratio(ref - lp)
        tl.store(out + _N_REF, n)
        store_sum(out, _SUM_REF_KL, tl.where(m, kr, 0.0))
    else:
        tl.store(out + _N_REF, 0.0)
        tl.store(out + _SUM_REF_KL, 0.0)
    if HAS_OLD:
        d = lp - old
        k3, ratio = k3_ratio(d)
        tl.store(out + _N_OLD, n)
        store_sum(out, _SUM_OLD, old)
        store_sum(out, _SUM_DIFF, d)
        store_sum(out, _SUM_KL, tl.where(m, k3, 0.0))
        store_sum(out, _SUM_RATIO, tl.where(m, ratio, 0.0))
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
            store_sum(out, _CLIP_LOW, tl.where(low, 1.0, 0.0).to(tl.float64))
            store_sum(out, _CLIP_HIGH, tl.where(high, 1.0, 0.0).to(tl.float64))
        else:
            tl.store(out + _CLIP_LOW, 0.0)
            tl.store(out + _CLIP_HIGH, 0.0)
    else:
        tl.store(out + _CLIP_LOW, 0.0)
        tl.store(out + _CLIP_HIGH, 0.0)
    tl.store(out + _CLIP_N, clip_n)
    tl.store(out + _CLIP_NAN, clip_nan)



def token_stats(batches: Sequence[Mapping[str, Any]], *, columns: Sequence[Column],
                lo: float = -math.inf,
                hi: float = math.inf, token_clip: bool = True, by_sign: bool = True, skip: bool = False,
                want_key: bool = False, want_rows: bool = False, block: int = 0) -> Tuple[
                    Dict[str, torch.Tensor], Optional[torch.Tensor], List[Optional[torch.Tensor]]]:
    """The GRPO family's per-token contributions of several microbatches: one kernel per
    microbatch into one buffer of partials, then one program finishing all of them
    (``triton_common.column_totals``): a fixed number of launches beyond one per microbatch.

    Each of ``batches`` maps ``lp``, ``m`` (bool) and, where given, ``old``, ``ref``,
    ``ent`` to ``[b, s]`` tensors (any strides) and ``adv`` to ``[b, s]`` or ``[b, 1]``
    (one value per sequence); every value counts where ``m``. ``lo``/``hi``: the clip
    bounds on d = logp - old_logp; ``token_clip``: count token clips (False for GSPO,
    which clips sequences from ``rows``); ``by_sign``: gate them by the advantage's sign
    (not CISPO); ``skip``: drop non-finite tokens. With ``want_key``, ``seq0`` (an int) is
    the index of the microbatch's first sequence in the call.

    ``columns``: the caller's states as ``(name, reduction, dtype)`` rows (the fused columns of
    ``metrics.rl.policy.table.COLUMNS``), each a column of ``SUMS`` (``'sum'``) or of
    ``EXTREMES`` (``'max'`` / ``'min'``, as its name ends).

    Returns ``(totals, records, rows)``: ``{name: 0-d tensor}`` in the order of ``columns``
    (int64 for an int64 column, else float64; a column whose input no microbatch gave is 0,
    or -inf/+inf for an extreme); with ``want_key``, one float64 ``[len(RECORD_ROWS), tokens]`` buffer
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
        args: List[Any] = []
        for x in (lp, m.view(torch.uint8) if m.dtype == torch.bool else m, old, mb.get("adv"), mb.get("ref"),
                  mb.get("ent"), mb.get("tok"), mb.get("pos")):
            args.extend(arg_strides(x, lp))
        ptrs, strides = args[0::3], [v for i, v in enumerate(args) if i % 3]
        rec = part if tok is None or records is None else records[:, tok:]  # records: made when a batch is keyed
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
    floats, ints = f.unbind(), i.unbind()
    out = {name: (ints if dtype == torch.int64 else floats)[at] for name, at, dtype in _layout(tuple(columns))}
    rows: List[Optional[torch.Tensor]] = []
    for off, b, _, _, n_blk, _ in plans:
        if not want_rows:
            rows.append(None)
            continue
        per_row = part[off:off + b * n_blk, :_N_SUM].view(b, n_blk, _N_SUM).sum(1)
        rows.append(torch.stack([per_row[:, SUMS.index(c)] for c in ("sum_diff", "n_old", "sum_adv")], 1))
    return out, records, rows


@functools.lru_cache(maxsize=8)
def _layout(columns: Tuple[Column, ...]) -> Tuple[Tuple[str, int, torch.dtype], ...]:
    """``(name, index into the finished totals, dtype)`` of each column; raises ``ValueError``
    naming a column the kernel does not compute."""
    out = []
    for name, reduce, dtype in columns:
        if reduce == "sum" and name in SUMS:
            at = SUMS.index(name)
        elif name in EXTREMES and name.endswith(f"_{reduce}"):
            at = _N_SUM + len(EXTREMES) + EXTREMES.index(name)
        else:
            raise ValueError(f"rl_triton.token_stats: column {name!r} ({reduce}) is not one the kernel computes: "
                             f"sums {SUMS}, extremes {EXTREMES}")
        out.append((name, at, dtype))
    return tuple(out)
