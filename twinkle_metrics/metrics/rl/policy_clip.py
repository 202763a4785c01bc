"""The GRPO family's clip statistics, as verl 0.9.1 defines them
(``verl/trainer/ppo/core_algos.py``: ``compute_policy_loss_vanilla``, ``_gspo``, ``_cispo``):
which tokens (GSPO: sequences) the policy loss clips, where the dual clip applies, and the
``train/clip_ratio*`` keys computed from their counts.

With d = logp - old_logp, r = e^d and advantage A, a token is clipped

* low when r < 1 - epsilon and A < 0, high when r > 1 + epsilon_high and A > 0 (verl's
  ``pg_clipfrac``: -A clip(r) > -A r); CISPO without the sign gates (``ratio != clip(ratio)``);
  GSPO with the sequence's ratio exp(mean d) and the sequence's mean advantage;
* by the dual clip (``clip_ratio_c`` = c > 1) when A < 0 and r > c (verl's
  ``pg_clipfrac_lower``: -A max(r, clip(r)) > -A c, which is r > c since c > 1 > 1 - epsilon).
"""
from __future__ import annotations

import math
from typing import Any, Dict

import torch

from twinkle_metrics.core.state import State


class PolicyClip:
    """The clip counts and keys of one metric (mixed into ``GRPOMetric``)."""

    #: clip counts gated by the advantage sign (GRPO/PPO); CISPO clips the weight itself
    clip_by_advantage_sign = True

    def _init_clip(self, name: str, clip_ratio_c, token_clip_ratio) -> None:
        """Validate verl's extra clip keys' arguments and add their states (none by default,
        so a metric without them keeps the states and checkpoints it had)."""
        if clip_ratio_c is not None:
            if self.sequence_level_clip or not self.clip_by_advantage_sign:
                raise ValueError(f"{name}: clip_ratio_c (dual-clip PPO) applies to GRPOMetric and PPOMetric; "
                                 f"verl's {'GSPO' if self.sequence_level_clip else 'CISPO'} loss has no dual "
                                 "clip (its pg_clipfrac_lower is 0); leave it None")
            if isinstance(clip_ratio_c, bool) or not isinstance(clip_ratio_c, (int, float)) or \
                    not 1 < clip_ratio_c < math.inf:
                raise ValueError(f"{name}: clip_ratio_c must be a finite number > 1 (verl's dual-clip bound, "
                                 f"3.0 in its configs) or None (no dual clip), got {clip_ratio_c!r}")
            clip_ratio_c = float(clip_ratio_c)
            self.add_state("clip_dual", State("sum", torch.int64))
        if not isinstance(token_clip_ratio, bool):
            raise TypeError(f"{name}: token_clip_ratio must be True or False, got {token_clip_ratio!r}")
        if token_clip_ratio and self.sequence_level_clip:  # tokens of clipped sequences, and all tokens
            self.add_state("clip_tok", State("sum", torch.int64))
            self.add_state("clip_tok_n", State("sum", torch.int64))
        self.clip_ratio_c, self.token_clip_ratio = clip_ratio_c, token_clip_ratio

    @property
    def _clip_needs_torch(self) -> bool:
        """The fused kernel has no column for the dual clip or GSPO's token counts: with
        either, every microbatch takes the torch path (the same states and values)."""
        return self.clip_ratio_c is not None or (self.token_clip_ratio and self.sequence_level_clip)

    def _clip_counts(self, d, adv, gate=None, per_row=False):
        """Counts of clipped-low and clipped-high units from log-ratios d (r = e^d):
        r < 1 - epsilon (and A < 0), r > 1 + epsilon_high (and A > 0); ``per_row``: one
        count per row of a ``[b, s]`` d.

        ``d`` is 0 outside the units with an old log-prob and a scattered A is 0
        outside the units that have one, so with epsilons >= 0 no gate is needed;
        ``gate`` is applied when one is.
        """
        lo, hi = self._log_bounds
        low, high = d < lo, d > hi
        if gate is not None:
            low, high = low & gate, high & gate

        def total(x):
            return x.sum(1) if per_row else x.sum()

        if not self.clip_by_advantage_sign:
            return total(low), total(high)
        if adv.dim() == 2 and adv.shape[1] == 1 and d.shape[1] != 1:
            # one advantage per sequence: count per row, then weight rows by the sign
            low, high = low.sum(1) * (adv[:, 0] < 0), high.sum(1) * (adv[:, 0] > 0)
            return (low, high) if per_row else (low.sum(), high.sum())
        return total(low & (adv < 0)), total(high & (adv > 0))

    def _dual_count(self, d, adv, gate=None):
        """Tokens where the dual clip applies: A < 0 and r > ``clip_ratio_c``; d and
        ``gate`` as in ``_clip_counts`` (d = 0 is r = 1 < c: never counted)."""
        over = d > math.log(self.clip_ratio_c)
        if gate is not None:
            over = over & gate
        if adv.dim() == 2 and adv.shape[1] == 1 and d.shape[1] != 1:
            return (over.sum(1) * (adv[:, 0] < 0)).sum()
        return (over & (adv < 0)).sum()

    @property
    def _log_bounds(self):
        """(log(1 - epsilon), log(1 + epsilon_high)): r < 1 - eps <=> d < log(1 - eps)."""
        lo = math.log(1 - self.epsilon) if self.epsilon < 1 else -math.inf
        hi = math.log1p(self.epsilon_high) if self.epsilon_high > -1 else -math.inf
        return lo, hi

    @property
    def _zero_unclipped(self) -> bool:
        """d = 0 (r = 1) is never clipped, so tokens with d = 0 need no gate (epsilons >= 0)."""
        lo, hi = self._log_bounds
        return lo <= 0 <= hi

    def _sequence_clip(self, parts: torch.Tensor) -> Dict[str, Any]:
        """GSPO: gates on exp(mean d) per sequence, from whole-sequence sums (completed over
        CP): ``parts`` ``[B, 3]`` (sum of d, tokens, sum of A), with ``token_clip_ratio`` two
        more columns (tokens with A < 0, with A > 0), each token gated by its own advantage's
        sign as verl's token-weighted ``pg_clipfrac``."""
        n = parts[:, 1]
        valid = n > 0
        safe = torch.where(valid, n, 1.0)
        logr = parts[:, 0] / safe
        adv = parts[:, 2] / safe
        low, high = self._clip_counts(logr, adv, valid)
        out = {"clip_n": valid.sum(), "clip_low": low, "clip_high": high}
        if parts.shape[1] == 5:
            lo, hi = self._log_bounds
            tokens = parts[:, 3] * (logr < lo) + parts[:, 4] * (logr > hi)  # exact integers in float64
            out.update(clip_tok=tokens.sum().to(torch.int64), clip_tok_n=n.sum().to(torch.int64))
        return out

    def _clip_keys(self, s: Dict[str, Any], agg) -> Dict[str, float]:
        """The clip keys from the reduced states; ``agg``: the sequence aggregation of
        ``loss_agg_mode`` (None for token-mean). ``train/clip_ratio*`` follow the mode (GSPO's
        count sequences); verl's ``train/clip_ratio_dual`` and ``train/token_clip_ratio`` are
        token-weighted whatever the mode, as verl logs them (a masked mean over tokens)."""
        if not s["clip_n"]:
            return {}
        poison = s["clip_nan"]  # 0.0, or NaN under 'propagate' when a gated token was non-finite
        if agg is None or self.sequence_level_clip:
            out = {"train/clip_ratio_low": s["clip_low"] / s["clip_n"] + poison,
                   "train/clip_ratio_high": s["clip_high"] / s["clip_n"] + poison,
                   "train/clip_ratio": (s["clip_low"] + s["clip_high"]) / s["clip_n"] + poison}
        else:
            out = {"train/clip_ratio_low": agg("clip_low") + poison,
                   "train/clip_ratio_high": agg("clip_high") + poison,
                   "train/clip_ratio": agg("clip_low", "clip_high") + poison}
        if self.clip_ratio_c is not None:
            out["train/clip_ratio_dual"] = s["clip_dual"] / s["clip_n"] + poison
        if self.token_clip_ratio and not self.sequence_level_clip:
            out["train/token_clip_ratio"] = (s["clip_low"] + s["clip_high"]) / s["clip_n"] + poison
        elif self.token_clip_ratio and s["clip_tok_n"]:
            out["train/token_clip_ratio"] = s["clip_tok"] / s["clip_tok_n"] + poison
        return out
