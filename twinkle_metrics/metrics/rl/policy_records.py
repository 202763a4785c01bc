"""The GRPO family's top-k KL records: each row a token's k3 value, global sequence
index, position, token id, ratio and log-probs, kept in a fixed ``[k, fields]`` state."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional, Tuple

import torch

from twinkle_metrics.inputs.checks import as_tensor

if TYPE_CHECKING:
    from twinkle_metrics.metrics.rl.policy_sums import _Microbatch


def _top(key: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the ``k`` largest of ``key`` (1-D), largest first; equal keys in
    the order they come (a stable sort: ``torch.topk`` leaves ties to the device and the
    path). Every caller passes keys in token order (sequence, then position), so a tie goes
    to the earlier token, whatever the microbatches, paths or ranks the tokens went through."""
    values, indices = torch.sort(key, descending=True, stable=True)
    return values[:k], indices[:k]


def _topk_rows(rows: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` rows with the largest first column (the k3 value); -inf rows are empty.

    Rows come in token order (earlier calls, microbatches and data ranks first, each
    block sorted as ``_top`` leaves it), so equal keys keep the earlier token.
    Always ``k`` rows: fewer candidates (a short batch) are padded with empty rows,
    so the fixed-shape state never sees another shape.
    """
    flat = rows.reshape(-1, rows.shape[-1])
    if flat.shape[0] < k:
        pad = flat.new_full((k - flat.shape[0], flat.shape[1]), -math.inf)
        flat = torch.cat([flat, pad])
    return flat[_top(flat[:, 0], k)[1]]


class TopKRecords:
    """The candidates of one call for the top-k records (mixed into ``GRPOMetric``)."""

    def _candidates(self, mb: "_Microbatch", key: torch.Tensor, seq_start: int) -> torch.Tensor:
        """This microbatch's top-k rows [k, fields] in ``_FIELDS`` order, with sequence indices
        counted from the call's start (the fold adds those before it: ``offset_by``); ``key``
        [b, s]: each token's k3 where it has an old log-prob and k3 > 0,
        else -inf. Token and position ids where the features give them, else -1 and the column."""
        b, s = mb.m.shape
        val, idx = _top(key.reshape(-1), self.top_k_kl)
        i, p = idx.div(s, rounding_mode="floor"), idx.remainder(s)
        labels, positions = self._feature_view(mb, "labels"), self._feature_view(mb, "position_ids")
        tok = torch.full_like(p, -1) if labels is None else labels[i, p]
        pos = p if positions is None else positions[i, p]
        gsi = i + seq_start  # from the call's start: the fold adds the sequences before it
        lp_k, old_k = mb.lp[i, p].to(torch.float64), mb.old.expand(b, s)[i, p].to(torch.float64)
        # one stack casts the integer columns to float64 (exact below 2**53)
        return torch.stack([val, gsi, pos, tok, torch.exp(lp_k - old_k), lp_k, old_k], 1)

    def _fused_candidates(self, records: torch.Tensor) -> torch.Tensor:
        """The top-k rows of every fused microbatch at once, from the kernel's record buffer
        (``triton_rl.RECORD_ROWS``, in ``_FIELDS`` order with the sequence within the call in
        place of the global one; the fold adds those before it): one top-k and one gather however
        many microbatches."""
        idx = _top(records[0], self.top_k_kl)[1]
        rows = records[:, idx]
        return rows.t()

    @staticmethod
    def _feature_view(mb: "_Microbatch", field: str) -> Optional[torch.Tensor]:
        """``field`` of the microbatch's features as a ``[b, s]`` view over its tokens (a 1-D
        one holds for every sequence), or None when absent."""
        x = mb.feat.get(field)
        if x is None:
            return None
        b, s = mb.m.shape
        x = as_tensor(x, mb.m.device)
        x = x.unsqueeze(0) if x.dim() == 1 else x
        return x.expand(b, -1)[:, :s]
