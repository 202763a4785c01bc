"""The per-call work of the policy family: pure functions over one call's prepared inputs
(``batch.Batch``, its ``Microbatch``es) and the metric's ``Config``, filling the states of the
``table``'s columns. Nothing here reads a metric: ``update`` hands in the groups and ranks.

The clip statistics are verl 0.9.1's (``verl/trainer/ppo/core_algos.py``:
``compute_policy_loss_vanilla``, ``_gspo``, ``_cispo``). With d = logp - old_logp, r = e^d and
advantage A, a token is clipped low when r < 1 - epsilon and A < 0, high when r > 1 +
epsilon_high and A > 0 (CISPO without the sign gates; GSPO with the sequence's ratio exp(mean
d) and mean advantage), and by the dual clip (``clip_ratio_c`` = c > 1) when A < 0 and r > c.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Tuple, cast

import torch

from parallel import group_rank
from parallel.groups import ProcessGroup
from twinkle_metrics.core import fold
from twinkle_metrics.inputs.rl import cp_sum, nonfinite_tokens
from twinkle_metrics.kernels import dispatch
from twinkle_metrics.metrics.rl.loss_agg import sequence_table
from twinkle_metrics.metrics.rl.policy import records
from twinkle_metrics.metrics.rl.policy.batch import Batch, Microbatch
from twinkle_metrics.metrics.rl.policy.table import (
    ENTROPY_HISTOGRAM,
    KERNEL_COLUMNS,
    KL_HISTOGRAM,
    RATIO_HISTOGRAM,
    SEQ_COUNT_OF,
    SEQ_COUNTS,
    SEQ_SUMS,
    Config,
)


# -------------------------------------------------------------------- sums
def call_sums(cfg: Config, batch: Batch, logit_ents: Mapping[int, torch.Tensor], dp_rank: int, cp_rank: int
              ) -> Tuple[Dict[str, Any], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(contributions, GSPO's per-sequence parts or None, the per-sequence table of a
    sequence ``loss_agg_mode`` or None) of a prepared call; masked arithmetic only, nothing
    raises. ``logit_ents``: entropies computed from logits, by microbatch; ``dp_rank`` /
    ``cp_rank`` place the top-k records. Both per-sequence results are this rank's part of
    each sequence, to be completed over CP (``sequence_stats``).

    Per-token values stay in the input dtype where that is exact: masking (a bitwise select,
    so NaN/-inf padding at masked positions is dropped rather than multiplied into the sums)
    and sums (accumulated in float64). Log-ratios and k3 = expm1(d) - d are float64: d =
    logp - old_logp is exact there, and k3 ~ d^2/2 needs d's low bits."""
    acc: Dict[str, Any] = {}
    seq_parts: List[torch.Tensor] = []
    candidates: List[torch.Tensor] = []
    mbs = [Microbatch(item, logit_ents.get(i)) for i, item in enumerate(batch.items)]
    start = 0
    for mb in mbs:  # each microbatch's first sequence in the call
        mb.seq0, start = start, start + mb.m.shape[0]
    fused, found = fused_sums(cfg, acc, [mb for mb in mbs if fuses(cfg, mb)])
    if found is not None:  # every fused microbatch's candidates at once
        candidates.append(records.fused_candidates(found, cfg.top_k_kl))
    tables: List[torch.Tensor] = []
    for mb in mbs:
        if mb in fused:  # the one-kernel path: GSPO's rows, in microbatch order
            if fused[mb] is not None:
                seq_parts.append(fused[mb])
            continue
        if cfg.per_sequence:
            mb.rows = {}
        count_nonfinite(cfg, acc, mb)
        token_sums(acc, mb)
        if mb.m.numel():
            if mb.adv is not None:
                advantage_sums(acc, mb)
            if mb.ref is not None:
                ref_sums(acc, mb)
            if mb.old is not None:
                ratio_sums(cfg, acc, mb, seq_parts)
                if cfg.top_k_kl:
                    k3 = mb.ratio_m1 - mb.d
                    key = torch.where(mb.has_old & (k3 > 0), k3, -math.inf)
                    candidates.append(records.candidates(mb, key, cfg.top_k_kl))
        if cfg.quantiles:
            quantile_counts(acc, mb)
        if cfg.per_sequence:
            tables.append(mb.table())
    if cfg.top_k_kl:  # the call's records under their header
        k = cfg.top_k_kl
        top = None
        if len(candidates) == 1 and candidates[0].shape[0] == k:
            top = candidates[0]  # a sort's rows, largest first: the top k already
        elif candidates:
            top = records.topk_rows(torch.cat(candidates), k)
        acc["topk"] = records.pack_records(top, sum(batch.sizes), dp_rank, cp_rank, k, len(records.FIELDS))
    parts = torch.cat(seq_parts) if cfg.sequence_level_clip and seq_parts else None
    rows = torch.cat(tables) if cfg.per_sequence and sum(batch.sizes) > 0 else None
    return acc, parts, rows


def count_nonfinite(cfg: Config, acc: Dict[str, Any], mb: Microbatch) -> None:
    """Count the tokens that count and hold a NaN/inf in any input (padding at masked
    positions is not counted: every term is gated by the tokens the value belongs to);
    under ``nan_policy='skip'`` drop them from every mask and zero their values."""
    m = mb.m
    present = [(x, has) for x, has in ((mb.adv, mb.has_adv), (mb.ref, mb.has_ref), (mb.old, mb.has_old),
                                       (mb.ent, mb.em)) if x is not None]
    bad = nonfinite_tokens(mb.lp, m, present)
    fold.add(acc, "n_bad", bad.sum())
    if cfg.nan_policy == "skip":  # no NaN * 0 below
        ok = ~bad
        mb.m = m & ok

        def drop(has):
            return has if has is None else mb.m if has is m else has & ok[:, :has.shape[1]]

        mb.has_adv, mb.has_ref, mb.has_old, mb.em = drop(mb.has_adv), drop(mb.has_ref), drop(mb.has_old), \
            drop(mb.em)
        mb.lp, mb.adv, mb.ref, mb.old, mb.ent = (x if x is None else x.nan_to_num(0.0, 0.0, 0.0)
                                                 for x in (mb.lp, mb.adv, mb.ref, mb.old, mb.ent))


def token_sums(acc: Dict[str, Any], mb: Microbatch) -> None:
    """Token count, sum of new log-probs, entropy."""
    m = mb.m
    mb.n_tok = mb.total("n_tok", m)
    mb.lpm = mb.keep(mb.lp, m)
    fold.add(acc, "n_tok", mb.n_tok)
    fold.add(acc, "sum_new", mb.total("sum_new", mb.lpm, torch.float64))
    if mb.ent is not None:
        if mb.em is m:
            fold.add(acc, "n_ent", mb.same("n_ent", "n_tok", mb.n_tok))
            fold.add(acc, "sum_ent", mb.total("sum_ent", mb.keep(mb.ent, m), torch.float64))
        else:
            fold.add(acc, "n_ent", mb.total("n_ent", mb.em))
            fold.add(acc, "sum_ent", mb.total("sum_ent", torch.where(mb.em, mb.ent, 0.0), torch.float64))


def advantage_sums(acc: Dict[str, Any], mb: Microbatch) -> None:
    """Advantage count, sum, extremes: per token, or one value per sequence."""
    adv, has_adv = mb.adv, mb.has_adv
    fold.add(acc, "n_adv", mb.same("n_adv", "n_tok", mb.n_tok) if has_adv is mb.m else
             mb.total("n_adv", has_adv))
    if adv.shape[1] == 1 and mb.m.shape[1] != 1:  # one value per sequence: per-row counts
        rows = has_adv.sum(1, dtype=torch.float64)
        # where: the value of a row without tokens (maybe NaN) must not count
        per_row = torch.where(rows > 0, adv[:, 0].to(torch.float64) * rows, 0.0)
        fold.add(acc, "sum_adv", per_row.sum())
        if mb.rows is not None:
            mb.rows["sum_adv"] = per_row
        lo, hi = _extremes(adv[:, 0], rows > 0)
    else:
        mb.adv = adv = mb.keep(adv, has_adv)  # aligned values may be NaN where masked
        fold.add(acc, "sum_adv", mb.total("sum_adv", adv, torch.float64))
        lo, hi = _extremes(adv, has_adv)
    fold.minimum(acc, "adv_min", lo)
    fold.maximum(acc, "adv_max", hi)


def ref_sums(acc: Dict[str, Any], mb: Microbatch) -> None:
    """k3 KL to the reference policy: sum of expm1(ref - logp) - (ref - logp)."""
    if mb.has_ref is mb.m:
        n_ref = mb.same("n_ref", "n_tok", mb.n_tok)
        mb.lp64 = lpr = mb.lpm.to(torch.float64)
    else:
        n_ref = mb.total("n_ref", mb.has_ref)
        lpr = mb.keep(mb.lp, mb.has_ref).to(torch.float64)
    dr = mb.keep(mb.ref, mb.has_ref).to(torch.float64)
    dr.sub_(lpr)  # 0 outside has_ref
    sum_dr = mb.total("ref_d", dr)
    fold.add(acc, "n_ref", n_ref)
    fold.add(acc, "sum_ref_kl", mb.total("ref_e", dr.expm1_()) - sum_dr)
    if mb.rows is not None:
        mb.rows["sum_ref_kl"] = mb.rows["ref_e"] - mb.rows["ref_d"]


def ratio_sums(cfg: Config, acc: Dict[str, Any], mb: Microbatch, seq_parts: List[torch.Tensor]) -> None:
    """Log-ratio d = logp - old_logp: its sums and extremes, clip counts (or GSPO's
    per-sequence parts), ratio and k3 KL sums."""
    m, adv, has_adv, has_old = mb.m, mb.adv, mb.has_adv, mb.has_old
    if has_old is m:
        n_old = mb.same("n_old", "n_tok", mb.n_tok)
        lpo = mb.lp64 if mb.lp64 is not None else mb.lpm.to(torch.float64)
    else:
        n_old = mb.total("n_old", has_old)
        lpo = mb.keep(mb.lp, has_old).to(torch.float64)
    oldm = mb.keep(mb.old, has_old)
    d = lpo.clone() if lpo is mb.lp64 else lpo
    d.sub_(oldm)  # exact in float64; 0 outside has_old
    sum_d = mb.total("sum_diff", d)
    rows = mb.rows
    fold.add(acc, "n_old", n_old)
    fold.add(acc, "sum_old", mb.total("sum_old", oldm, torch.float64))
    fold.add(acc, "sum_diff", sum_d)
    # exp is monotone and k3 convex with its minimum at d = 0: the extremes of
    # d give ratio_min/max and kl_max (in compute), with no [b, s] r or k3.
    lo, hi = _extremes(d, has_old)
    fold.minimum(acc, "logr_min", lo)
    fold.maximum(acc, "logr_max", hi)
    if adv is not None:
        gate = has_old if has_adv is m else has_old & has_adv
        if cfg.nan_policy != "skip":
            # Under 'propagate' a NaN/inf d or A must not vanish in a comparison
            # (NaN < x is False): 0, or NaN when a gated token holds one.
            # (d + A is NaN/inf iff either is; * 0 turns inf into NaN)
            fold.add(acc, "clip_nan", torch.where(gate, d + adv, 0.0).sum() * 0.0)
        if cfg.sequence_level_clip:
            g = gate.to(torch.float64)
            cols = [(d * g).sum(1), g.sum(1), torch.where(gate, adv.to(torch.float64), 0.0).sum(1)]
            if cfg.token_clip_ratio:  # each token's own advantage sign (verl's token-weighted clip)
                cols += [(gate & (adv < 0)).sum(1, dtype=torch.float64),
                         (gate & (adv > 0)).sum(1, dtype=torch.float64)]
            seq_parts.append(torch.stack(cols, 1))
        else:
            # d = 0 outside the tokens with an old log-prob and a scattered A is 0 outside those
            # with one, so with lo <= 0 <= hi (epsilons >= 0) no gate is needed there
            lo_b, hi_b = cfg.log_bounds
            extra = None if lo_b <= 0 <= hi_b else has_old
            if has_adv is not m:
                extra = has_adv if extra is None else extra & has_adv
            if rows is None:
                low, high = clip_counts(cfg, d, adv, extra)
            else:  # per sequence; the totals are their (exact, integer) sums
                low, high = clip_counts(cfg, d, adv, extra, per_row=True)
                rows["clip_low"], rows["clip_high"] = low, high
                low, high = low.sum(), high.sum()
            fold.add(acc, "clip_n", mb.same("clip_n", "n_old", n_old) if gate is has_old else
                     mb.total("clip_n", gate))
            fold.add(acc, "clip_low", low)
            fold.add(acc, "clip_high", high)
            if cfg.clip_ratio_c is not None:
                fold.add(acc, "clip_dual", dual_count(cfg, d, adv, extra))
    # r - 1, in place unless the top-k records or the histograms still need d
    em = torch.expm1(d) if cfg.top_k_kl or cfg.quantiles else d.expm1_()
    sum_em = mb.total("sum_ratio_m1", em)
    fold.add(acc, "sum_kl", sum_em - sum_d)  # sum of k3 = (r - 1) - d
    fold.add(acc, "sum_ratio", sum_em + n_old)
    if rows is not None:
        rows["sum_kl"] = rows["sum_ratio_m1"] - rows["sum_diff"]
    mb.d, mb.ratio_m1 = d, em


def quantile_counts(acc: Dict[str, Any], mb: Microbatch) -> None:
    """Histogram counts of the per-token ratio r = 1 + (r - 1) and k3 = (r - 1) - d over
    the tokens with an old log-prob (after ``ratio_sums``), and of the entropy."""
    if mb.ratio_m1 is not None:
        fold.add(acc, "hist_ratio", RATIO_HISTOGRAM.counts(mb.ratio_m1 + 1.0, mb.has_old))
        fold.add(acc, "hist_kl", KL_HISTOGRAM.counts(mb.ratio_m1 - mb.d, mb.has_old))
    if mb.ent is not None:
        fold.add(acc, "hist_entropy", ENTROPY_HISTOGRAM.counts(mb.ent, mb.em))


# -------------------------------------------------------------------- clips
def clip_counts(cfg: Config, d: torch.Tensor, adv: torch.Tensor, gate: Optional[torch.Tensor] = None,
                per_row: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Counts of clipped-low and clipped-high units from log-ratios d (r = e^d): r < 1 -
    epsilon (and A < 0), r > 1 + epsilon_high (and A > 0); ``per_row``: one count per row of
    a ``[b, s]`` d; ``gate`` applied when given."""
    lo, hi = cfg.log_bounds
    low, high = d < lo, d > hi
    if gate is not None:
        low, high = low & gate, high & gate

    def total(x):
        return x.sum(1) if per_row else x.sum()

    if not cfg.clip_by_advantage_sign:
        return total(low), total(high)
    if adv.dim() == 2 and adv.shape[1] == 1 and d.shape[1] != 1:
        # one advantage per sequence: count per row, then weight rows by the sign
        low, high = low.sum(1) * (adv[:, 0] < 0), high.sum(1) * (adv[:, 0] > 0)
        return (low, high) if per_row else (low.sum(), high.sum())
    return total(low & (adv < 0)), total(high & (adv > 0))


def dual_count(cfg: Config, d: torch.Tensor, adv: torch.Tensor, gate: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Tokens where the dual clip applies: A < 0 and r > ``clip_ratio_c`` (verl's
    ``pg_clipfrac_lower``); d and ``gate`` as in ``clip_counts`` (d = 0 is r = 1 < c)."""
    over = d > math.log(cast(float, cfg.clip_ratio_c))  # set: only a dual-clip config counts it
    if gate is not None:
        over = over & gate
    if adv.dim() == 2 and adv.shape[1] == 1 and d.shape[1] != 1:
        return (over.sum(1) * (adv[:, 0] < 0)).sum()
    return (over & (adv < 0)).sum()


def sequence_clip(cfg: Config, parts: torch.Tensor) -> Dict[str, Any]:
    """GSPO: gates on exp(mean d) per sequence, from whole-sequence sums (completed over
    CP): ``parts`` ``[B, 3]`` (sum of d, tokens, sum of A), with ``token_clip_ratio`` two
    more columns (tokens with A < 0, with A > 0), each token gated by its own advantage's
    sign as verl's token-weighted ``pg_clipfrac``."""
    n = parts[:, 1]
    valid = n > 0
    safe = torch.where(valid, n, 1.0)
    logr = parts[:, 0] / safe
    adv = parts[:, 2] / safe
    low, high = clip_counts(cfg, logr, adv, valid)
    out = {"clip_n": valid.sum(), "clip_low": low, "clip_high": high}
    if parts.shape[1] == 5:
        lo, hi = cfg.log_bounds
        tokens = parts[:, 3] * (logr < lo) + parts[:, 4] * (logr > hi)  # exact integers in float64
        out.update(clip_tok=tokens.sum().to(torch.int64), clip_tok_n=n.sum().to(torch.int64))
    return out


def sequence_stats(cfg: Config, parts: Optional[torch.Tensor], rows: Optional[torch.Tensor],
                   group: ProcessGroup) -> Dict[str, Any]:
    """GSPO's clip counts and the sequence-aggregated sums, from this rank's parts of each
    sequence completed over the CP ``group``: one all_reduce for both (none without CP).
    Every CP rank then holds the same totals: only CP rank 0 returns them."""
    if parts is not None and rows is not None and group is not None:
        both = cp_sum(torch.cat([parts.reshape(-1), rows.reshape(-1)]), group)
        parts, rows = both[:parts.numel()].view(parts.shape), both[parts.numel():].view(rows.shape)
    else:
        parts = None if parts is None else cp_sum(parts, group)
        rows = None if rows is None else cp_sum(rows, group)
    if group is not None and group_rank(group) != 0:
        return {}
    out = {} if parts is None else sequence_clip(cfg, parts)
    if rows is not None:
        f, g = len(SEQ_SUMS), len(SEQ_COUNTS)
        values, seqs = sequence_table(rows[:, :f], rows[:, f:f + g], rows[:, f + g], SEQ_COUNT_OF,
                                      cfg.loss_agg_mode, cfg.loss_agg_norm)
        out.update({"seq_sums": values, "seq_counts": seqs})
    return out


# --------------------------------------------------------------- fused path
def fuses(cfg: Config, mb: Microbatch) -> bool:
    """Whether this microbatch takes the one-kernel path (``kernels.rl_triton``): on CUDA with
    the kernels enabled, ``cfg.fusable``, and every side input covering exactly the counted
    tokens (aligned ``[b, s]``, or ``[b, 1]`` advantages)."""
    m = mb.m
    if not cfg.fusable or not m.numel() or not dispatch.device_ok(mb.lp):
        return False
    b, s = m.shape
    if mb.lp.shape != m.shape:
        return False
    for x, has, widths in ((mb.old, mb.has_old, (s,)), (mb.ref, mb.has_ref, (s,)), (mb.ent, mb.em, (s,)),
                           (mb.adv, mb.has_adv, (1, s))):
        if x is not None and (has is not m or x.dim() != 2 or x.shape[0] != b or x.shape[1] not in widths
                              or x.device != m.device):
            return False
    return True


def fused_sums(cfg: Config, acc: Dict[str, Any], mbs: List[Microbatch]) -> Tuple[Dict[Microbatch, Any], Any]:
    """Every per-token contribution of ``mbs`` from one kernel each, folded into ``acc``
    once by each column's declared reduction: the same states and values as the torch path.
    Returns ``({microbatch: GSPO rows or None}, the top-k record buffer or None)``."""
    if not mbs:
        return {}, None
    lo, hi = cfg.log_bounds
    both = [mb.old is not None and mb.adv is not None for mb in mbs]
    keyed = bool(cfg.top_k_kl)

    def launch():
        from twinkle_metrics.kernels import rl_triton
        return rl_triton.token_stats(
            [dict(lp=mb.lp, m=mb.m, old=mb.old, adv=mb.adv, ref=mb.ref, ent=mb.ent, seq0=mb.seq0,
                  tok=records.feature_view(mb, "labels") if keyed else None,
                  pos=records.feature_view(mb, "position_ids") if keyed else None) for mb in mbs],
            columns=KERNEL_COLUMNS, lo=lo, hi=hi, token_clip=not cfg.sequence_level_clip,
            by_sign=cfg.clip_by_advantage_sign, skip=cfg.nan_policy == "skip", want_key=keyed,
            want_rows=cfg.sequence_level_clip and any(both))

    result = dispatch.attempt("RL token statistics", launch)
    if result is None:
        return {}, None  # every microbatch takes the torch path
    totals, found, rows = result
    # a column whose input no microbatch gave holds the reduction's identity: changes nothing
    for name, reduce, _ in KERNEL_COLUMNS:
        fold.by(acc, name, totals[name], reduce)
    return {mb: (r if ok else None) for mb, r, ok in zip(mbs, rows, both)}, found


def _extremes(x: torch.Tensor, has: torch.Tensor):
    """(min, max) of x over ``has`` (+inf, -inf when empty), without a host read."""
    x = x.to(torch.float64)
    buf = torch.where(has, x, math.inf)
    lo = buf.amin()
    return lo, torch.where(has, x, x.new_full((), -math.inf), out=buf).amax()  # one buffer for both
