"""``DPOMetric``: TRL-style preference statistics from per-token log-probs."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from . import exchange
from .base import Metric
from .microbatch import microbatches
from .rl_inputs import common_length, cp_lead, cp_sum, float_tensor, keep_bits, masked, token_mask
from .state import State

_NAME = "DPOMetric"


_LINEAR_KEYS = ("chosen", "rejected", "ref_chosen", "ref_rejected", "reward_chosen", "reward_rejected",
                "margin")


class DPOMetric(Metric):
    """DPO metrics with TRL's keys, exact over the data group.

    Keys: ``logps/chosen``, ``logps/rejected`` (mean sequence log-prob, the sum over
    masked tokens), and with reference log-probs ``logps/ref_chosen``,
    ``logps/ref_rejected``, ``rewards/chosen`` = beta * (chosen - ref_chosen),
    ``rewards/rejected``, ``rewards/margins`` (mean of chosen - rejected reward) and
    ``rewards/accuracies`` (fraction of pairs with chosen reward > rejected reward,
    strictly, in [0, 1]; Twinkle returns a percent string).

    Three ways to pass a batch:

    * interleaved, as Twinkle: ``accumulate(inputs, {'logps': [2n, s]},
      ref_outputs={'logps': [2n, s]})`` with rows ``[c1, r1, c2, r2, ...]``
      (pairs may span microbatches of a ``List[InputFeature]``);
    * separate batches: ``accumulate(chosen=(inputs_c, {'logps': ...}),
      rejected=(inputs_r, {'logps': ...}), ref_chosen={'logps': ...},
      ref_rejected={'logps': ...})``, row i of each forming pair i;
    * sequence log-probs already summed (TRL's concatenated forward):
      ``accumulate(None, {'chosen_logps': [n], 'rejected_logps': [n],
      'ref_chosen_logps': [n], 'ref_rejected_logps': [n]})``. These must be
      whole-sequence sums: under CP they are not summed again, and only CP rank 0's
      count.

    Under context parallelism each rank holds only some tokens of every sequence,
    so ``accumulate`` sums the per-sequence partial log-probs over the CP group
    (one all_reduce on the device) before any comparison: every CP rank must call
    ``accumulate`` the same number of times with the same sequences. The pair
    statistics are then counted on CP rank 0 only. Reference
    statistics divide by the pairs that had reference log-probs (Twinkle divides
    by all pairs).

    Args:
        beta: DPO's beta, scaling the implicit rewards.
        ignore_index: label value of tokens that do not count.
    """

    pairs = State("sum", torch.int64)
    chosen = State("sum")
    rejected = State("sum")
    ref_pairs = State("sum", torch.int64)
    ref_chosen = State("sum")
    ref_rejected = State("sum")
    reward_chosen = State("sum")
    reward_rejected = State("sum")
    margin = State("sum")
    correct = State("sum", torch.int64)

    def __init__(self, device_mesh=None, process_group=None, *, beta: float = 0.1,
                 ignore_index: int = -100):
        super().__init__(device_mesh, process_group)
        self.beta = float(beta)
        self.ignore_index = ignore_index

    def exchange_groups(self):
        """The CP group, over which sequence sums are completed (agreed on in every ``update``)."""
        if self.process_group is not None:
            return []
        mesh = self.resolve_mesh()
        return [mesh.cp_group] if mesh.cp_size > 1 else []

    def update(self, inputs=None, outputs=None, *, ref_outputs=None, chosen=None, rejected=None,
               ref_chosen=None, ref_rejected=None, **kwargs) -> Dict[str, Any]:
        with exchange.guard(self):
            mode, t, split = self._local(inputs, outputs, ref_outputs, chosen, rejected, ref_chosen,
                                         ref_rejected)
            for group in self.exchange_groups():
                # CP peers must complete sums of the same shape (or all hold nothing).
                key = 0 if t is None else (t.shape[0] << 8) | (t.shape[1] << 2) | mode
                high, neg_low = exchange.agree(self, group, values=[key, -key])
                if high != -neg_low:
                    raise ValueError(f"{_NAME}: CP ranks hold different batches ({_describe(-neg_low)} "
                                     f"to {_describe(high)}; this rank {_describe(key)}); every rank of "
                                     "a CP group must pass the same sequences; nothing was accumulated")
        if t is None:
            return {}
        if mode == _PRESUMMED:
            x = t
        else:
            sums = self._complete(t)
            if split is not None:  # separate chosen/rejected
                x = torch.cat([sums[:split], sums[split:]], 1)
            else:
                x = sums.reshape(sums.shape[0] // 2, -1)  # rows [c, r] interleaved: one row per pair
        if not cp_lead(self):
            return {}  # the other CP ranks hold the same completed sums: count pairs once
        return self._stats(x)

    # ----------------------------------------------------------------- pieces
    def _local(self, inputs, outputs, ref_outputs, chosen, rejected, ref_chosen, ref_rejected):
        """(mode, tensor, split) of this call, validated, before any collective: the
        per-sequence sums to complete over CP (``split``: rows of chosen when passed
        separately) or the pre-summed pairs; ``(0, None, None)`` when it holds nothing."""
        if chosen is not None or rejected is not None:
            if chosen is None or rejected is None:
                raise ValueError(f"{_NAME}: got only one of chosen=/rejected=; pass both as "
                                 "(inputs, outputs) pairs")
            c = self._seq_logps("chosen", *_pair("chosen", chosen), ref_chosen)
            r = self._seq_logps("rejected", *_pair("rejected", rejected), ref_rejected)
            if c is None or r is None:
                return 0, None, None
            if c.shape != r.shape:
                raise ValueError(f"{_NAME}: chosen has {c.shape[0]} sequences (ref: {c.shape[1] > 1}) "
                                 f"but rejected has {r.shape[0]} (ref: {r.shape[1] > 1}); pass "
                                 "matching pairs, with reference log-probs for both or neither")
            return _SEPARATE, torch.cat([c, r]), c.shape[0]
        if isinstance(outputs, dict) and outputs.get("chosen_logps") is not None:
            return _PRESUMMED, torch.cat(self._presummed(outputs), 1), None
        sums = self._seq_logps("outputs", inputs, outputs, ref_outputs)
        if sums is None:
            return 0, None, None
        if sums.shape[0] % 2:
            raise ValueError(f"{_NAME}: the batch has {sums.shape[0]} sequences; interleaved "
                             "[chosen, rejected, ...] batches need an even count (or pass "
                             "chosen=/rejected= separately)")
        return _INTERLEAVED, sums, None

    def _seq_logps(self, what: str, inputs, outputs, ref_outputs) -> Optional[torch.Tensor]:
        """``[n, 1]`` (policy) or ``[n, 2]`` (policy, ref) masked token sums of this rank."""
        pairs = microbatches(_NAME, inputs, outputs, ("logps",))
        if not pairs or any("logps" not in o for _, o in pairs):
            return None
        ref_pairs = None
        if ref_outputs is not None:
            ref_pairs = microbatches(_NAME, inputs, ref_outputs, ("logps",))
            if any("logps" not in o for _, o in ref_pairs):
                ref_pairs = None
        rows: List[torch.Tensor] = []
        field = "outputs['logps']" if what == "outputs" else f"{what} outputs['logps']"
        for i, (feat, out) in enumerate(pairs):
            lp = float_tensor(_NAME, field, out["logps"])
            lp = lp.unsqueeze(0) if lp.dim() == 1 else lp
            mask = token_mask(_NAME, feat, self.ignore_index, lp.device)
            lp, mask = common_length(_NAME, field, lp, mask)
            cols = [lp]
            if ref_pairs is not None:
                ref = float_tensor(_NAME, f"reference logps for {what}", ref_pairs[i][1]["logps"], lp.device)
                ref = ref.unsqueeze(0) if ref.dim() == 1 else ref
                if ref.dim() != 2 or ref.shape[0] != lp.shape[0] or ref.shape[1] < lp.shape[1]:
                    raise ValueError(f"{_NAME}: reference logps for {what} have shape "
                                     f"{list(ref.shape)}, expected [{lp.shape[0]}, >= {lp.shape[1]}]; "
                                     "run the reference model on the same batch")
                cols.append(ref if ref.shape[1] == lp.shape[1] else ref[:, :lp.shape[1]])
            # Masked bitwise (NaN/-inf padding at masked positions is dropped; a 0/1 multiplier,
            # as Twinkle uses, would carry it into the sums), summed in float64.
            cols = [c if c.is_floating_point() else c.to(torch.float64) for c in cols]
            bits = {c.element_size(): None for c in cols}
            for width in bits:
                bits[width] = keep_bits(mask, next(c.dtype for c in cols if c.element_size() == width))
            sums = [masked(c, bits[c.element_size()]).sum(-1, dtype=torch.float64) for c in cols]
            rows.append(torch.stack(sums, 1) if len(sums) > 1 else sums[0][:, None])
        return torch.cat(rows) if len(rows) > 1 else rows[0]

    def _complete(self, sums: torch.Tensor) -> torch.Tensor:
        """Whole-sequence totals: one SUM all_reduce of the partial sums over CP."""
        if self.process_group is not None:
            return sums
        return cp_sum(sums, self.resolve_mesh().cp_group)

    def _presummed(self, outputs) -> Tuple[torch.Tensor, torch.Tensor]:
        cols = {}
        for key in ("chosen_logps", "rejected_logps", "ref_chosen_logps", "ref_rejected_logps"):
            v = outputs.get(key)
            if v is None:
                continue
            field = f"outputs[{key!r}]"
            if isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
                v = torch.cat([float_tensor(_NAME, field, x).reshape(-1).to(torch.float64) for x in v])
            cols[key] = float_tensor(_NAME, field, v).reshape(-1).to(torch.float64)
        if "rejected_logps" not in cols:
            raise ValueError(f"{_NAME}: outputs has 'chosen_logps' but no 'rejected_logps'; pass both")
        n = cols["chosen_logps"].shape[0]
        has_ref = "ref_chosen_logps" in cols or "ref_rejected_logps" in cols
        keys = ["chosen_logps", "rejected_logps"] + (["ref_chosen_logps", "ref_rejected_logps"]
                                                    if has_ref else [])
        for key in keys:
            if key not in cols or cols[key].shape[0] != n:
                got = list(cols[key].shape) if key in cols else "nothing"
                raise ValueError(f"{_NAME}: outputs[{key!r}] is {got}, expected [{n}] like "
                                 "chosen_logps; pass one value per pair for each")
        if has_ref:
            return (torch.stack([cols["chosen_logps"], cols["ref_chosen_logps"]], 1),
                    torch.stack([cols["rejected_logps"], cols["ref_rejected_logps"]], 1))
        return cols["chosen_logps"][:, None], cols["rejected_logps"][:, None]

    def _stats(self, x: torch.Tensor) -> Dict[str, Any]:
        """Contributions of ``x`` = [pairs, (chosen, [ref_chosen], rejected, [ref_rejected])]."""
        n = x.shape[0]
        if x.shape[1] == 2:
            chosen, rejected = x.sum(0).unbind()
            return {"pairs": n, "chosen": chosen, "rejected": rejected}
        # Every sum is linear in the four per-pair columns: one matmul, one reduction.
        per_pair = x @ self._linear(x)
        sums = per_pair.sum(0).unbind()
        out: Dict[str, Any] = dict(zip(_LINEAR_KEYS, sums))
        out.update(pairs=n, ref_pairs=n, correct=(per_pair[:, 4] > per_pair[:, 5]).sum())
        return out

    def _linear(self, like: torch.Tensor) -> torch.Tensor:
        """[4, 7]: (chosen, ref_chosen, rejected, ref_rejected) -> the _LINEAR_KEYS columns."""
        key, w = self.__dict__.get("_w", (None, None))
        if key != (self.beta, like.device):
            b = self.beta
            # Filled on the device (fill kernels), not copied from host memory: no sync on CUDA.
            w = torch.zeros(4, 7, dtype=torch.float64, device=like.device)
            for (i, j), v in {(0, 0): 1, (0, 4): b, (0, 6): b, (1, 2): 1, (1, 4): -b, (1, 6): -b,
                              (2, 1): 1, (2, 5): b, (2, 6): -b, (3, 3): 1, (3, 5): -b, (3, 6): b}.items():
                w[i, j] = v
            self._w = ((b, like.device), w)
        return w

    def compute(self, s):
        if not s["pairs"]:
            return {}
        out = {"logps/chosen": s["chosen"] / s["pairs"], "logps/rejected": s["rejected"] / s["pairs"]}
        n = s["ref_pairs"]
        if n:
            out.update({
                "logps/ref_chosen": s["ref_chosen"] / n,
                "logps/ref_rejected": s["ref_rejected"] / n,
                "rewards/chosen": s["reward_chosen"] / n,
                "rewards/rejected": s["reward_rejected"] / n,
                "rewards/margins": s["margin"] / n,
                "rewards/accuracies": s["correct"] / n,
            })
        return out


_INTERLEAVED, _SEPARATE, _PRESUMMED = 1, 2, 3


def _describe(key: int) -> str:
    """A CP agreement key in words."""
    if not key:
        return "nothing"
    mode = {_INTERLEAVED: "interleaved", _SEPARATE: "chosen=/rejected=", _PRESUMMED: "pre-summed"}
    return f"{key >> 8} x {(key >> 2) & 63} {mode.get(key & 3, '?')}"


def _pair(name: str, value):
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(f"{_NAME}: {name}= must be an (inputs, outputs) pair, got "
                        f"{type(value).__name__}")
    return value[0], value[1]
