"""The GRPO family's one-kernel path (``kernels.rl_triton``): which microbatches take it, and
their per-token contributions from one kernel each, folded as the torch path's steps
(``policy_sums``) fold theirs: the same states and values."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Tuple

from twinkle_metrics.core import fold
from twinkle_metrics.kernels import dispatch as _triton

if TYPE_CHECKING:
    from twinkle_metrics.metrics.rl.policy_batch import _Microbatch


class FusedSums:
    """The fused-kernel path of one call (mixed into ``GRPOMetric``)."""

    def _fuses(self, mb: "_Microbatch") -> bool:
        """Whether this microbatch takes the one-kernel path: on CUDA with the kernels enabled,
        no histograms, ``loss_agg_mode='token-mean'``, no dual clip or GSPO token counts, and
        every side input covering exactly the counted tokens (aligned ``[b, s]``, or ``[b, 1]``
        advantages)."""
        m = mb.m
        # the kernel makes no per-sequence table nor verl's extra clip counts: those take the
        # torch path (same states and values, more launches)
        if self._per_sequence or self._clip_needs_torch or self.quantiles or not m.numel() or \
                not _triton.device_ok(mb.lp):
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

    def _fused_sums(self, acc, mbs: List["_Microbatch"]) -> Tuple[Dict["_Microbatch", Any], Any]:
        """Every per-token contribution of ``mbs`` from one kernel each, folded into ``acc``
        once: the same states and values as the torch path's steps. Returns ``({microbatch:
        GSPO rows or None}, the top-k record buffer or None)``."""
        if not mbs:
            return {}, None
        lo, hi = self._log_bounds
        skip = self.nan_policy == "skip"
        both = [mb.old is not None and mb.adv is not None for mb in mbs]

        def launch():
            from twinkle_metrics.kernels import rl_triton as triton_rl
            keyed = bool(self.top_k_kl)
            return triton_rl.token_stats(
                [dict(lp=mb.lp, m=mb.m, old=mb.old, adv=mb.adv, ref=mb.ref, ent=mb.ent, seq0=mb.seq0,
                      tok=self._feature_view(mb, "labels") if keyed else None,
                      pos=self._feature_view(mb, "position_ids") if keyed else None) for mb in mbs],
                lo=lo, hi=hi, token_clip=not self.sequence_level_clip, by_sign=self.clip_by_advantage_sign,
                skip=skip, want_key=bool(self.top_k_kl), want_rows=self.sequence_level_clip and any(both))

        result = _triton.attempt("RL token statistics", launch)
        if result is None:
            return {}, None  # every microbatch takes the torch path
        totals, records, rows = result
        # Every state the kernel writes, by its declared reduction; a column whose input no
        # microbatch gave holds the reduction's identity (0, -inf, +inf) and changes nothing.
        for name, value in totals.items():
            fold.by(acc, name, value, self._specs[name].reduce)
        return {mb: (r if ok else None) for mb, r, ok in zip(mbs, rows, both)}, records
