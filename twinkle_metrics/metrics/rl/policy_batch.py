"""``_Microbatch``: one prepared microbatch of the GRPO family's policy sums while they
work through it (``policy_sums``, ``policy_fused`` and ``policy_records`` read it)."""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from twinkle_metrics.inputs.rl import keep_bits, masked

#: the per-sequence token sums and counts a sequence-aggregated loss_agg_mode keeps
SEQ_SUMS = ("new", "ent", "adv", "ref_kl", "old", "diff", "kl", "ratio_m1", "ratio_one", "clip_low", "clip_high")
SEQ_COUNTS = ("n_tok", "n_ent", "n_adv", "n_ref", "n_old", "n_clip")


class _Microbatch:
    """One prepared microbatch's tensors while ``_sums`` works through it: the inputs
    (masks may be narrowed by the NaN policy) and values shared between its steps."""

    def __init__(self, item: Dict[str, Any], logit_ent: Optional[torch.Tensor]):
        self.feat, self.lp, self.m = item["feat"], item["lp"], item["m"]
        self.ent, self.em = (item["ent"], item["em"]) if logit_ent is None else (logit_ent, item["m"])
        self.adv, self.has_adv = item["adv"], item["has_adv"]
        self.ref, self.has_ref = item["ref"], item["has_ref"]
        self.old, self.has_old = item["old"], item["has_old"]
        self.n_tok = self.lpm = self.lp64 = self.d = self.ratio_m1 = None
        self.seq0 = 0  # the index of its first sequence in the call
        self._bits: Dict[tuple, torch.Tensor] = {}
        #: per-sequence token sums and counts (``SEQ_SUMS``, ``SEQ_COUNTS``) under a
        #: sequence-aggregated loss_agg_mode, else None
        self.rows: Optional[Dict[str, torch.Tensor]] = None

    def total(self, key: str, x: torch.Tensor, dtype=None) -> torch.Tensor:
        """``x.sum()``; under a sequence mode also its per-row sums as ``rows[key]``, the
        total taken from them (one [b, s] pass either way)."""
        if self.rows is None:
            return x.sum() if dtype is None else x.sum(dtype=dtype)
        per = x.sum(1) if dtype is None else x.sum(1, dtype=dtype)
        self.rows[key] = per
        return per.sum()

    def same(self, key: str, like: str, value):
        """``value``, a total already taken as ``rows[like]`` (the same mask): its rows too."""
        if self.rows is not None:
            self.rows[key] = self.rows[like]
        return value

    def table(self) -> torch.Tensor:
        """``[b, F + G + 1]`` float64: ``SEQ_SUMS``, ``SEQ_COUNTS`` (0 where an input is
        absent) and the token capacity of each row (the mask's length)."""
        b, s = self.m.shape
        zero = torch.zeros(b, dtype=torch.float64, device=self.m.device)
        cols = [self.rows.get(k, zero).to(torch.float64) for k in SEQ_SUMS + SEQ_COUNTS]
        return torch.stack(cols + [torch.full_like(zero, float(s))], 1)

    def keep(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``x`` with masked-out positions +0.0; one bit mask per (mask, element width)."""
        key = (id(mask), x.element_size())
        if key not in self._bits:
            self._bits[key] = keep_bits(mask, x.dtype)
        return masked(x, self._bits[key])
