"""The per-token sums of the GRPO family's ``update``: what one call contributes.

``PolicySums`` holds the computations ``GRPOMetric.update`` composes (inputs aligned per
microbatch, token, advantage, reference and ratio sums, the per-sequence tables of
``loss_agg_mode``), with the clip counts (``policy_clip``), the fused-kernel path
(``policy_fused``) and the top-k records (``policy_records``) mixed in, so that ``grpo.py``
reads as the metric: its states, ``update``, ``merge`` and ``compute``. They read the call's
inputs and the metric's configuration only.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Dict, List, Optional

import torch

from parallel import group_rank
from twinkle_metrics.core import fold
from twinkle_metrics.inputs.checks import as_tensor, float_tensor, floating_tensor
from twinkle_metrics.inputs.microbatch import has_field, microbatches
from twinkle_metrics.inputs.rl import (
    common_length,
    cp_sum,
    float_dtype,
    nonfinite_tokens,
    per_token,
    split_side_input,
    token_mask,
)
from twinkle_metrics.kernels import entropy
from twinkle_metrics.metrics.rl.loss_agg import LOSS_AGG_MODES, sequence_table
from twinkle_metrics.metrics.rl.policy_batch import SEQ_COUNTS, SEQ_SUMS, _Microbatch
from twinkle_metrics.metrics.rl.policy_clip import PolicyClip
from twinkle_metrics.metrics.rl.policy_fused import FusedSums
from twinkle_metrics.metrics.rl.policy_records import TopKRecords, _topk_rows
from twinkle_metrics.stats.histogram import Histogram

#: per-token ratio exp(d), k3 KL (often ~1e-9 on policy) and entropy (<= log vocab)
RATIO_HISTOGRAM = Histogram(1e-6, 1e6, signed=False)
KL_HISTOGRAM = Histogram(1e-15, 1e6, signed=False)
ENTROPY_HISTOGRAM = Histogram(1e-12, 1e3, signed=False)

#: per-sequence columns of the sequence-aggregated modes: token sums, then token counts
#: (then the sequence's token capacity); ``SEQ_COUNT_OF[f]`` is the count column of sum ``f``
SEQ_COUNT_OF = (0, 1, 2, 3, 4, 4, 4, 4, 4, 5, 5)


class PolicySums(PolicyClip, FusedSums, TopKRecords):
    """The GRPO family's per-call computations (mixed into ``GRPOMetric``)."""

    def _prepare(self, name, inputs, outputs, old_logps, advantages, ref_logps, ref_outputs):
        """This call's inputs, validated and aligned per microbatch; communicates nothing.

        ``{'items': [per microbatch: feat, o, lp, m, full_len, ent, em, adv, has_adv, ref,
        has_ref, old, has_old], 'sizes': sequences per microbatch, 'n_seq_parts': GSPO's
        sequences to complete over CP}``.
        """
        if ref_outputs is not None:
            if ref_logps is not None:
                raise ValueError(f"{name}: got both ref_logps= and ref_outputs=; pass one")
            if not isinstance(ref_outputs, Mapping) or ref_outputs.get("logps") is None:
                got = sorted(map(str, ref_outputs)) if isinstance(ref_outputs, Mapping) else \
                    type(ref_outputs).__name__
                raise ValueError(f"{name}: ref_outputs must be a dict with 'logps' (the reference model's "
                                 f"per-token log-probs), got {got}; or pass ref_logps= directly")
            ref_logps = ref_outputs["logps"]
        empty = {"items": [], "sizes": [], "n_seq_parts": 0}
        if outputs is None:
            return empty
        if inputs is None and has_field(outputs, "logps"):
            raise ValueError(f"{name}: outputs['logps'] given but inputs is None; per-token log-probs need "
                             "the token mask: pass the InputFeature (or list of them) with labels or "
                             "completion_mask")
        pairs = microbatches(name, inputs, outputs, ("logps", "entropies", "logits"))
        if not pairs:
            return empty
        for i, (_, o) in enumerate(pairs):
            if "logps" not in o:
                raise ValueError(f"{name}: outputs of microbatch {i} have no 'logps'; pass per-token "
                                 f"log-probs [batch, seq] (got fields {sorted(o)})")
        lps, masks, full_lens = [], [], []
        for feat, o in pairs:
            lp = float_tensor(name, "outputs['logps']", o["logps"])
            lp = lp.unsqueeze(0) if lp.dim() == 1 else lp
            mask = token_mask(name, feat, self.ignore_index, lp.device)
            full_lens.append(mask.shape[1])
            lp, mask = common_length(name, "outputs['logps']", lp, mask)
            lps.append(lp.to(float_dtype(lp.dtype)))
            masks.append(mask)
        sizes = [m.shape[0] for m in masks]
        olds = split_side_input(name, "old_logps", old_logps, sizes)
        advs = split_side_input(name, "advantages", advantages, sizes)
        refs = split_side_input(name, "ref_logps", ref_logps, sizes)

        items, n_parts = [], 0
        for i, ((feat, o), lp, m) in enumerate(zip(pairs, lps, masks)):
            ent = em = None  # entropies and the tokens that have one
            if "entropies" in o:
                ent = float_tensor(name, "outputs['entropies']", o["entropies"], lp.device)
                ent = ent.unsqueeze(0) if ent.dim() == 1 else ent
                if ent.dim() == 2 and ent.shape == m.shape:
                    em = m
                else:
                    ent, em = common_length(name, "outputs['entropies']", ent, m)
                ent = _floating(ent)
            elif self.entropy_from_logits and o.get("logits") is not None:
                logits = floating_tensor(name, "logits", o["logits"])
                if logits.dim() < 2 or logits.shape[-1] == 0:
                    raise ValueError(f"{name}: outputs['logits'] must be [..., vocab] with a vocab of at least "
                                     f"one entry for entropy_from_logits, got shape {list(logits.shape)}")
            adv = has_adv = ref = has_ref = old = has_old = None
            if m.numel():
                if advs[i] is not None:
                    adv, has_adv = per_token(name, "advantages", advs[i], m, full_lens[i], per_sequence=True)
                if refs[i] is not None:
                    ref, has_ref = per_token(name, "ref_logps", refs[i], m, full_lens[i])
                if olds[i] is not None:
                    old, has_old = per_token(name, "old_logps", olds[i], m, full_lens[i])
                if self.sequence_level_clip and old is not None and adv is not None:
                    n_parts += m.shape[0]
            items.append(dict(feat=feat, o=o, lp=lp, m=m, ent=ent, em=em, adv=adv, has_adv=has_adv,
                              ref=ref, has_ref=has_ref, old=old, has_old=has_old))
        return {"items": items, "sizes": sizes, "n_seq_parts": n_parts}

    def _sums(self, batch, logit_ents):
        """(contributions, GSPO's per-sequence parts or None, the per-sequence table of a
        sequence-aggregated ``loss_agg_mode`` or None) of a prepared call; masked
        arithmetic only, nothing raises. ``logit_ents``: entropies computed from logits,
        by microbatch. Both per-sequence results are this rank's part of each sequence,
        to be completed over CP (``_sequence_stats``)."""
        # Per-token values stay in the input dtype (float32 usually) where that is exact:
        # masking (a bitwise select, so NaN/-inf padding at masked positions, common for prompt
        # tokens, is dropped rather than multiplied into the sums) and sums (accumulated in
        # float64). Log-ratios and k3 = expm1(d) - d are float64: d = logp - old_logp is
        # exact there, and k3 ~ d^2/2 needs d's low bits.
        acc: Dict[str, Any] = {}
        seq_parts: List[torch.Tensor] = []
        candidates: List[torch.Tensor] = []
        mbs = [_Microbatch(item, logit_ents.get(i)) for i, item in enumerate(batch["items"])]
        per_seq = self._per_sequence
        tables: List[torch.Tensor] = []
        starts = [0]  # each microbatch's first sequence in the call
        for mb in mbs:
            starts.append(starts[-1] + mb.m.shape[0])
        for mb, start in zip(mbs, starts):
            mb.seq0 = start
        fused, records = self._fused_sums(acc, [mb for mb in mbs if self._fuses(mb)])
        if records is not None:  # every fused microbatch's candidates at once
            candidates.append(self._fused_candidates(records))
        for mb in mbs:
            seq_start = mb.seq0
            if mb in fused:  # the one-kernel path: GSPO's rows, in microbatch order
                if fused[mb] is not None:
                    seq_parts.append(fused[mb])
                continue
            if per_seq:
                mb.rows = {}
            self._count_nonfinite(acc, mb)
            self._token_sums(acc, mb)
            if mb.m.numel():
                if mb.adv is not None:
                    self._advantage_sums(acc, mb)
                if mb.ref is not None:
                    self._ref_sums(acc, mb)
                if mb.old is not None:
                    self._ratio_sums(acc, mb, seq_parts)
                    if self.top_k_kl:
                        k3 = mb.ratio_m1 - mb.d
                        key = torch.where(mb.has_old & (k3 > 0), k3, -math.inf)
                        candidates.append(self._candidates(mb, key, seq_start))
            if self.quantiles:
                self._quantile_counts(acc, mb)
            if per_seq:
                tables.append(mb.table())

        if self.top_k_kl:
            mesh = self.resolve_mesh()
            # a process_group without CP stands for the data group: its rank orders the sequences
            by_mesh = self.process_group is None or self.sequence_group() is not None
            cp_rank = mesh.cp_rank if by_mesh else 0
            dp_rank = mesh.dp_rank if by_mesh else group_rank(self.process_group)
            acc["n_seq"] = sum(batch["sizes"])
            acc["dp_index"] = dp_rank
            acc["cp_index"] = cp_rank
            if len(candidates) == 1 and candidates[0].shape[0] == self.top_k_kl:
                acc["topk"] = candidates[0]  # torch.topk's rows, largest first: the top k already
            elif candidates:
                acc["topk"] = _topk_rows(torch.cat(candidates), self.top_k_kl)
        parts = torch.cat(seq_parts) if self.sequence_level_clip and seq_parts else None
        rows = torch.cat(tables) if per_seq and sum(batch["sizes"]) else None
        return acc, parts, rows

    def _count_nonfinite(self, acc, mb: "_Microbatch") -> None:
        """Count the tokens that count and hold a NaN/inf in any input (padding at masked
        positions is not counted: every term is gated by the tokens the value belongs
        to); under ``nan_policy='skip'`` drop them from every mask and zero their values."""
        m = mb.m
        present = [(x, has) for x, has in ((mb.adv, mb.has_adv), (mb.ref, mb.has_ref), (mb.old, mb.has_old),
                                           (mb.ent, mb.em)) if x is not None]
        bad = nonfinite_tokens(mb.lp, m, present)
        fold.add(acc, "n_bad", bad.sum())
        if self.nan_policy == "skip":  # no NaN * 0 below
            ok = ~bad
            mb.m = m & ok

            def drop(has):
                return has if has is None else mb.m if has is m else has & ok[:, :has.shape[1]]

            mb.has_adv, mb.has_ref, mb.has_old, mb.em = drop(mb.has_adv), drop(mb.has_ref), drop(mb.has_old), \
                drop(mb.em)
            mb.lp, mb.adv, mb.ref, mb.old, mb.ent = (x if x is None else x.nan_to_num(0.0, 0.0, 0.0)
                                                     for x in (mb.lp, mb.adv, mb.ref, mb.old, mb.ent))

    def _token_sums(self, acc, mb: "_Microbatch") -> None:
        """Token count, sum of new log-probs, entropy."""
        m = mb.m
        mb.n_tok = mb.total("n_tok", m)
        mb.lpm = mb.keep(mb.lp, m)
        fold.add(acc, "n_tok", mb.n_tok)
        fold.add(acc, "sum_new", mb.total("new", mb.lpm, torch.float64))
        if mb.ent is not None:
            if mb.em is m:
                fold.add(acc, "n_ent", mb.same("n_ent", "n_tok", mb.n_tok))
                fold.add(acc, "sum_ent", mb.total("ent", mb.keep(mb.ent, m), torch.float64))
            else:
                fold.add(acc, "n_ent", mb.total("n_ent", mb.em))
                fold.add(acc, "sum_ent", mb.total("ent", torch.where(mb.em, mb.ent, 0.0), torch.float64))

    def _advantage_sums(self, acc, mb: "_Microbatch") -> None:
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
                mb.rows["adv"] = per_row
            lo, hi = _extremes(adv[:, 0], rows > 0)
        else:
            mb.adv = adv = mb.keep(adv, has_adv)  # aligned values may be NaN where masked
            fold.add(acc, "sum_adv", mb.total("adv", adv, torch.float64))
            lo, hi = _extremes(adv, has_adv)
        fold.minimum(acc, "adv_min", lo)
        fold.maximum(acc, "adv_max", hi)

    def _ref_sums(self, acc, mb: "_Microbatch") -> None:
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
            mb.rows["ref_kl"] = mb.rows["ref_e"] - mb.rows["ref_d"]

    def _ratio_sums(self, acc, mb: "_Microbatch", seq_parts: List[torch.Tensor]) -> None:
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
        sum_d = mb.total("diff", d)
        rows = mb.rows
        fold.add(acc, "n_old", n_old)
        fold.add(acc, "sum_old", mb.total("old", oldm, torch.float64))
        fold.add(acc, "sum_diff", sum_d)
        # exp is monotone and k3 convex with its minimum at d = 0: the extremes of
        # d give ratio_min/max and kl_max (in compute), with no [b, s] r or k3.
        lo, hi = _extremes(d, has_old)
        fold.minimum(acc, "logr_min", lo)
        fold.maximum(acc, "logr_max", hi)
        if adv is not None:
            gate = has_old if has_adv is m else has_old & has_adv
            if self.nan_policy != "skip":
                # Under 'propagate' a NaN/inf d or A must not vanish in a comparison
                # (NaN < x is False): 0, or NaN when a gated token holds one.
                # (d + A is NaN/inf iff either is; * 0 turns inf into NaN)
                fold.add(acc, "clip_nan", torch.where(gate, d + adv, 0.0).sum() * 0.0)
            if self.sequence_level_clip:
                g = gate.to(torch.float64)
                cols = [(d * g).sum(1), g.sum(1), torch.where(gate, adv.to(torch.float64), 0.0).sum(1)]
                if self.token_clip_ratio:  # each token's own advantage sign (verl's token-weighted clip)
                    cols += [(gate & (adv < 0)).sum(1, dtype=torch.float64),
                             (gate & (adv > 0)).sum(1, dtype=torch.float64)]
                seq_parts.append(torch.stack(cols, 1))
            else:
                extra = None if self._zero_unclipped else has_old
                if has_adv is not m:
                    extra = has_adv if extra is None else extra & has_adv
                if rows is None:
                    low, high = self._clip_counts(d, adv, extra)
                else:  # per sequence; the totals are their (exact, integer) sums
                    low, high = self._clip_counts(d, adv, extra, per_row=True)
                    rows["clip_low"], rows["clip_high"] = low, high
                    low, high = low.sum(), high.sum()
                fold.add(acc, "clip_n", mb.same("n_clip", "n_old", n_old) if gate is has_old else
                         mb.total("n_clip", gate))
                fold.add(acc, "clip_low", low)
                fold.add(acc, "clip_high", high)
                if self.clip_ratio_c is not None:
                    fold.add(acc, "clip_dual", self._dual_count(d, adv, extra))
        # r - 1, in place unless the top-k records or the histograms still need d
        em = torch.expm1(d) if self.top_k_kl or self.quantiles else d.expm1_()
        sum_em = mb.total("ratio_m1", em)
        fold.add(acc, "sum_kl", sum_em - sum_d)  # sum of k3 = (r - 1) - d
        fold.add(acc, "sum_ratio", sum_em + n_old)
        if rows is not None:
            rows["kl"] = rows["ratio_m1"] - rows["diff"]
            rows["ratio_one"] = rows["n_old"]
        mb.d, mb.ratio_m1 = d, em

    def _quantile_counts(self, acc, mb: "_Microbatch") -> None:
        """Histogram counts of the per-token ratio r = 1 + (r - 1) and k3 = (r - 1) - d over
        the tokens with an old log-prob (after ``_ratio_sums``), and of the entropy."""
        if mb.ratio_m1 is not None:
            fold.add(acc, "hist_ratio", RATIO_HISTOGRAM.counts(mb.ratio_m1 + 1.0, mb.has_old))
            fold.add(acc, "hist_kl", KL_HISTOGRAM.counts(mb.ratio_m1 - mb.d, mb.has_old))
        if mb.ent is not None:
            fold.add(acc, "hist_entropy", ENTROPY_HISTOGRAM.counts(mb.ent, mb.em))

    @property
    def _per_sequence(self) -> bool:
        """Whether ``loss_agg_mode`` aggregates over sequences (anything but token-mean)."""
        return self.loss_agg_mode != LOSS_AGG_MODES[0]

    def _sequence_stats(self, parts: Optional[torch.Tensor], rows: Optional[torch.Tensor]) -> Dict[str, Any]:
        """GSPO's clip counts and the sequence-aggregated sums, from this rank's parts of each
        sequence completed over CP: one all_reduce for both (none without CP)."""
        group = self.sequence_group()
        if parts is not None and rows is not None and group is not None:
            both = cp_sum(torch.cat([parts.reshape(-1), rows.reshape(-1)]), group)
            parts, rows = both[:parts.numel()].view(parts.shape), both[parts.numel():].view(rows.shape)
        else:
            parts = None if parts is None else cp_sum(parts, group)
            rows = None if rows is None else cp_sum(rows, group)
        if group is not None and group_rank(group) != 0:
            return {}  # every CP rank now holds the same totals; count each sequence once
        out = {} if parts is None else self._sequence_clip(parts)
        if rows is not None:
            f, g = len(SEQ_SUMS), len(SEQ_COUNTS)
            values, seqs = sequence_table(rows[:, :f], rows[:, f:f + g], rows[:, f + g], SEQ_COUNT_OF,
                                          self.loss_agg_mode, self.loss_agg_norm)
            out.update({"seq_sums": values, "seq_counts": seqs})
        return out

    def _entropy_chunks(self, name, jobs):
        """(row chunks of every job's logits, job shapes): validated, no collective."""
        blocks, shapes = [], []
        for i, logits, m in jobs:
            z = as_tensor(logits, m.device)
            if z.dim() == 2:
                z = z.unsqueeze(0)
            if z.dim() != 3 or z.shape[0] != m.shape[0] or z.shape[1] < m.shape[1]:
                raise ValueError(f"{name}: outputs['logits'] of microbatch {i} has shape "
                                 f"{list(z.shape)}; expected [{m.shape[0]}, >= {m.shape[1]}, vocab] "
                                 "aligned with the log-probs")
            blocks.append(entropy.row_blocks(z[:, :m.shape[1]]))
            shapes.append(m.shape)
        chunks = [c for job in blocks for block in job
                  for c in torch.split(block, entropy.rows_per_chunk(
                      block, sum(b.shape[0] for b in job), self.entropy_chunk_bytes, self.entropy_chunk_size))]
        return chunks, shapes


def _floating(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_floating_point() else x.to(torch.float64)


def _extremes(x: torch.Tensor, has: torch.Tensor):
    """(min, max) of x over ``has`` (+inf, -inf when empty), without a host read."""
    x = x.to(torch.float64)
    buf = torch.where(has, x, math.inf)
    lo = buf.amin()
    return lo, torch.where(has, x, x.new_full((), -math.inf), out=buf).amax()  # one buffer for both


def _exp(d: float) -> float:
    try:
        return math.exp(d)
    except OverflowError:
        return math.inf


def _k3(d: float) -> float:
    """k3 = r - log r - 1 with r = e^d, as expm1(d) - d (accurate for small d)."""
    try:
        return math.expm1(d) - d if d != math.inf else math.inf
    except OverflowError:
        return math.inf


def _nan_first(v: float):
    return (v != v, v)  # max() picks a NaN if there is one
