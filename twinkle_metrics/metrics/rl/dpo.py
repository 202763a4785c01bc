"""``DPOMetric``: TRL-style preference statistics from per-token log-probs."""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from parallel import MeshLike
from parallel.groups import ProcessGroup
from twinkle_metrics.comm import agreement as exchange
from twinkle_metrics.core.metric import Metric
from twinkle_metrics.core.state import State
from twinkle_metrics.inputs.checks import float_tensor
from twinkle_metrics.inputs.checks import nan_policy as check_nan_policy
from twinkle_metrics.inputs.data_format import Inputs, Outputs
from twinkle_metrics.inputs.fields import Reads
from twinkle_metrics.inputs.microbatch import has_field, microbatches
from twinkle_metrics.inputs.rl import common_length, cp_lead, cp_sum, keep_bits, masked, token_mask
from twinkle_metrics.kernels import dispatch as _triton
from twinkle_metrics.stats.histogram import Histogram, check_quantiles, quantile_keys

_NAME = "DPOMetric"
#: per-pair reward margins, either sign
MARGIN_HISTOGRAM = Histogram(1e-6, 1e9)


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
    (one host-side agreement, then one all_reduce on the device) before any
    comparison: every CP rank must call ``accumulate`` the same number of times with
    the same sequences. The pair
    statistics are then counted on CP rank 0 only. Reference
    statistics divide by the pairs that had reference log-probs (Twinkle divides
    by all pairs).

    An empty batch (no sequences, or an empty microbatch list) adds nothing. Per-token
    ``logps`` need ``inputs`` (labels or completion_mask give the token mask); only the
    pre-summed form works without them.

    Non-finite values (``nan_policy``): a pair counts as non-finite when one of its
    sequence log-probs (chosen, rejected, and their references when given; sums over
    the masked tokens, completed over CP) is NaN/inf; NaN/-inf padding at masked
    positions does not count. ``'propagate'`` (default): the value flows into every
    key it feeds, ``rewards/accuracies`` included (NaN, not a comparison that is
    silently False). ``'skip'``: the pair is dropped from every statistic. Both report
    ``logps/nonfinite_pairs`` when > 0.

    Args:
        beta: DPO's beta, scaling the implicit rewards.
        ignore_index: label value of tokens that do not count.
        nan_policy: ``'propagate'`` or ``'skip'`` (see above).
        quantiles: e.g. ``(0.5, 0.9, 0.99)``: also report ``rewards/margins_p50`` ...
            (``p99.9`` for 0.999), quantiles of the per-pair margin
            beta * (chosen - ref_chosen) - beta * (rejected - ref_rejected) over the pairs
            of the whole data group (pairs with reference log-probs). Nearest-rank from a
            histogram (``twinkle_metrics.histogram``), within 1% relative error of the true
            margin for magnitudes in [1e-6, 1e9) (0 exact; outside, clamped to the bound);
            under ``'propagate'`` a non-finite pair makes them NaN. Adds one int64 state of
            3,478 buckets (27 KiB) to the sync buffer. None (default): no histogram.

    Example:
        >>> import torch
        >>> m = DPOMetric(beta=0.1)  # rows: chosen, rejected
        >>> _ = m.accumulate({"labels": torch.tensor([[1, 2], [1, 3]])},
        ...                  {"logps": torch.tensor([[-1.0, -1.0], [-2.0, -2.0]])},
        ...                  ref_outputs={"logps": torch.tensor([[-1.5, -1.5], [-1.5, -1.5]])})
        >>> m.calculate()  # doctest: +NORMALIZE_WHITESPACE
        {'logps/chosen': -2.0, 'logps/rejected': -4.0, 'logps/ref_chosen': -3.0, 'logps/ref_rejected': -3.0,
         'rewards/chosen': 0.1, 'rewards/rejected': -0.1, 'rewards/margins': 0.2, 'rewards/accuracies': 1.0}
    """

    reads = (Reads(outputs=("logps",), keywords=("ref_outputs?",), context=Reads(inputs=("labels|completion_mask",))),
             Reads(outputs=("chosen_logps", "rejected_logps", "ref_chosen_logps?", "ref_rejected_logps?")),
             Reads(keywords=("chosen", "rejected", "ref_chosen?", "ref_rejected?")))
    result_keys = ('logps/nonfinite_pairs', 'logps/chosen', 'logps/rejected', 'logps/ref_chosen', 'logps/ref_rejected',
                   'rewards/chosen', 'rewards/rejected', 'rewards/margins', 'rewards/margins_p*',
                   'rewards/accuracies')

    agree_over = ("cp",)  # sequence sums are completed over CP, agreed on in every update

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
    n_bad = State("sum", torch.int64)  # non-finite pairs

    def __init__(self, device_mesh: MeshLike = None, process_group: ProcessGroup = None, *, beta: float = 0.1,
                 ignore_index: int = -100, nan_policy: str = "propagate",
                 quantiles: Optional[Sequence[float]] = None, **kwargs: Any) -> None:
        super().__init__(device_mesh, process_group, **kwargs)
        self.beta = float(beta)
        self.ignore_index = ignore_index
        self.nan_policy = check_nan_policy(_NAME, nan_policy)
        self.quantiles = check_quantiles(_NAME, quantiles)
        if self.quantiles:
            self.add_state("hist_margin", MARGIN_HISTOGRAM.state())

    def update(self, inputs: Inputs = None, outputs: Outputs = None, *, ref_outputs: Outputs = None,
               chosen: Optional[Tuple[Inputs, Outputs]] = None, rejected: Optional[Tuple[Inputs, Outputs]] = None,
               ref_chosen: Outputs = None, ref_rejected: Outputs = None, **kwargs: Any) -> Dict[str, Any]:
        with exchange.guard(self):
            mode, t, split = self._local(inputs, outputs, ref_outputs, chosen, rejected, ref_chosen,
                                         ref_rejected)
            for group in self.exchange_groups():
                # CP peers must complete sums of the same shape (or all hold nothing).
                key = 0 if t is None else (t.shape[0] << 8) | (t.shape[1] << 2) | mode
                low, high = exchange.agree_same(self, group, key)
                if low != high:
                    raise ValueError(f"{_NAME}: CP ranks hold different batches ({_describe(low)} "
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
                # rows [c, r] interleaved: one row per pair (explicit width: an empty batch is [0, w])
                x = sums.reshape(sums.shape[0] // 2, 2 * sums.shape[1])
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
            if inputs is not None or outputs is not None or ref_outputs is not None:
                raise ValueError(f"{_NAME}: got chosen=/rejected= and also inputs/outputs/ref_outputs, "
                                 "which would be ignored; pass either separate batches (chosen=, "
                                 "rejected=, ref_chosen=, ref_rejected=) or one interleaved batch")
            c = self._seq_logps("chosen", *_pair("chosen", chosen), ref_chosen)
            r = self._seq_logps("rejected", *_pair("rejected", rejected), ref_rejected)
            if c is None or r is None:
                return 0, None, None
            if c.shape != r.shape:
                raise ValueError(f"{_NAME}: chosen has {c.shape[0]} sequences (ref: {c.shape[1] > 1}) "
                                 f"but rejected has {r.shape[0]} (ref: {r.shape[1] > 1}); pass "
                                 "matching pairs, with reference log-probs for both or neither")
            return _SEPARATE, torch.cat([c, r]), c.shape[0]
        if isinstance(outputs, (list, tuple)) and any(isinstance(o, dict) and any(k in o for k in _PRESUMMED_KEYS)
                                                      for o in outputs):
            raise ValueError(f"{_NAME}: per-pair sums came as a list of dicts; pass one dict "
                             "{'chosen_logps': [n], 'rejected_logps': [n], ...} per call")
        if ref_chosen is not None or ref_rejected is not None:
            raise ValueError(f"{_NAME}: got ref_chosen=/ref_rejected= without chosen=/rejected=, so they "
                             "would be ignored; pass chosen= and rejected= too, or ref_outputs= with an "
                             "interleaved batch")
        if isinstance(outputs, dict) and (outputs.get("chosen_logps") is not None
                                          or outputs.get("rejected_logps") is not None):
            if outputs.get("chosen_logps") is None:
                raise ValueError(f"{_NAME}: outputs has 'rejected_logps' but no 'chosen_logps'; pass both")
            _check_presummed_call(outputs, ref_outputs)
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
        field = "outputs['logps']" if what == "outputs" else f"{what} outputs['logps']"
        if inputs is None and has_field(outputs, "logps"):
            where = "inputs" if what == "outputs" else f"the inputs of {what}="
            raise ValueError(f"{_NAME}: {field} given but {where} is None; per-token log-probs need the "
                             "token mask: pass the InputFeature (or list of them) with labels or "
                             "completion_mask, or pass per-pair sequence sums as outputs={'chosen_logps': "
                             "[n], 'rejected_logps': [n]}, which need no inputs")
        if outputs is None:
            return None  # nothing to add, as with an empty microbatch list
        pairs = microbatches(_NAME, inputs, outputs, ("logps",))
        if not pairs:
            return None
        for i, (_, o) in enumerate(pairs):
            if "logps" not in o:
                raise ValueError(f"{_NAME}: {what} of microbatch {i} have no 'logps'; pass per-token "
                                 "log-probs [batch, seq] (or per-pair sums as 'chosen_logps'/"
                                 f"'rejected_logps'); got fields {sorted(_fields(outputs, i))}")
        ref_pairs = None
        if ref_outputs is not None:
            ref_pairs = microbatches(_NAME, inputs, ref_outputs, ("logps",))
            for i, (_, o) in enumerate(ref_pairs):
                if "logps" not in o:
                    raise ValueError(f"{_NAME}: reference outputs for {what} of microbatch {i} have no "
                                     "'logps'; pass {'logps': [batch, seq]} from the reference model, or "
                                     "no reference outputs at all")
        rows: List[torch.Tensor] = []
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
            if _triton.device_ok(lp) and all(c.is_floating_point() for c in cols):
                sums = _triton.attempt("DPO sequence sums", _row_sums, cols, mask)  # one kernel
                if sums is not None:
                    rows.append(sums)
                    continue
            # Masked bitwise (NaN/-inf padding at masked positions is dropped; a 0/1 multiplier,
            # as Twinkle uses, would carry it into the sums), summed in float64.
            cols = [c if c.is_floating_point() else c.to(torch.float64) for c in cols]
            bits: Dict[int, torch.Tensor] = {}  # per element width: the mask as bits of that width
            for c in cols:
                if c.element_size() not in bits:
                    bits[c.element_size()] = keep_bits(mask, c.dtype)
            col_sums = [masked(c, bits[c.element_size()]).sum(-1, dtype=torch.float64) for c in cols]
            rows.append(torch.stack(col_sums, 1) if len(col_sums) > 1 else col_sums[0][:, None])
        return torch.cat(rows) if len(rows) > 1 else rows[0]

    def _complete(self, sums: torch.Tensor) -> torch.Tensor:
        """Whole-sequence totals: one SUM all_reduce of the partial sums over CP."""
        return cp_sum(sums, self.sequence_group())

    def _presummed(self, outputs) -> Tuple[torch.Tensor, torch.Tensor]:
        cols = _presummed_columns(outputs)
        if "ref_chosen_logps" in cols:
            return (torch.stack([cols["chosen_logps"], cols["ref_chosen_logps"]], 1),
                    torch.stack([cols["rejected_logps"], cols["ref_rejected_logps"]], 1))
        return cols["chosen_logps"][:, None], cols["rejected_logps"][:, None]

    def _stats(self, x: torch.Tensor) -> Dict[str, Any]:
        """Contributions of ``x`` = [pairs, (chosen, [ref_chosen], rejected, [ref_rejected])]."""
        if _triton.device_ok(x) and x.dtype == torch.float64:
            fused = _triton.attempt("DPO pair statistics", _pair_stats, x, self.beta, self.nan_policy == "skip")
            if fused is not None:  # one kernel for every state; the histogram (if any) on torch
                if self.quantiles and x.shape[1] == 4:
                    fused["hist_margin"] = self._margin_counts(x)
                return fused
        n = x.shape[0]
        bad = torch.isnan((x * 0.0).sum(1))  # a pair with a NaN/inf sequence log-prob (inf * 0 is NaN)
        out: Dict[str, Any] = {"n_bad": bad.sum()}
        if self.nan_policy == "skip":
            x = torch.where(bad[:, None], 0.0, x)
            n = n - out["n_bad"]
        if x.shape[1] == 2:
            chosen, rejected = x.sum(0).unbind()
            out.update(pairs=n, chosen=chosen, rejected=rejected)
            return out
        # Every statistic but the accuracy is linear in the four column sums. Formed from
        # the sums directly, not by a matrix product: 0 * inf would turn a non-finite
        # reference into NaN in the policy's own keys.
        sums = x.sum(0)
        c, rc, r, rr = sums.unbind()
        b = self.beta
        gap = sums[0::2] - sums[1::2]  # (c - rc, r - rr): both rewards in one op
        rewards = b * gap
        out.update(pairs=n, ref_pairs=n, chosen=c, rejected=r, ref_chosen=rc, ref_rejected=rr,
                   reward_chosen=rewards[0], reward_rejected=rewards[1], margin=b * (gap[0] - gap[1]))
        pair_rewards = b * (x[:, 0::2] - x[:, 1::2])  # [pairs, (chosen reward, rejected reward)]
        won = pair_rewards[:, 0] > pair_rewards[:, 1]
        out["correct"] = (won & ~bad).sum() if self.nan_policy == "skip" else won.sum()
        if self.quantiles:
            out["hist_margin"] = self._margin_counts(x, pair_rewards, bad)
        return out

    def _margin_counts(self, x: torch.Tensor, pair_rewards: Optional[torch.Tensor] = None,
                       bad: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Histogram counts of TRL's margin (chosen reward - rejected reward) per pair of
        ``x`` (the raw pairs: under 'skip', the non-finite ones are left out here)."""
        if bad is None:
            bad = torch.isnan((x * 0.0).sum(1))
        if pair_rewards is None:
            pair_rewards = self.beta * (x[:, 0::2] - x[:, 1::2])
        margins = pair_rewards[:, 0] - pair_rewards[:, 1]
        return MARGIN_HISTOGRAM.counts(margins, ~bad if self.nan_policy == "skip" else None)

    def compute(self, s: Mapping[str, Any]) -> Dict[str, Any]:
        out: Dict[str, Any] = {"logps/nonfinite_pairs": int(s["n_bad"])} if s["n_bad"] else {}
        if not s["pairs"]:
            return out
        out.update({"logps/chosen": s["chosen"] / s["pairs"], "logps/rejected": s["rejected"] / s["pairs"]})
        n = s["ref_pairs"]
        if n:
            out.update({
                "logps/ref_chosen": s["ref_chosen"] / n,
                "logps/ref_rejected": s["ref_rejected"] / n,
                "rewards/chosen": s["reward_chosen"] / n,
                "rewards/rejected": s["reward_rejected"] / n,
                "rewards/margins": s["margin"] / n,
                **(quantile_keys("rewards/margins", MARGIN_HISTOGRAM, s["hist_margin"], self.quantiles,
                                 self.nan_policy == "propagate") if self.quantiles else {}),
                # margin * 0 is 0, or NaN when a pair was non-finite ('propagate'): a NaN
                # comparison is False and would give a finite, wrong fraction
                "rewards/accuracies": s["correct"] / n + s["margin"] * 0.0,
            })
        return out


def _row_sums(cols: List[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    from twinkle_metrics.kernels import dpo_triton as triton_rl
    return triton_rl.masked_row_sums(cols[0], mask, *cols[1:])


def _pair_stats(x: torch.Tensor, beta: float, skip: bool) -> Dict[str, torch.Tensor]:
    from twinkle_metrics.kernels import dpo_triton as triton_rl
    return triton_rl.pair_stats(x, beta=beta, skip=skip)


def _fields(outputs, i) -> List[str]:
    if isinstance(outputs, (list, tuple)):
        o = outputs[i] if i < len(outputs) else None
        return [str(k) for k in o] if isinstance(o, dict) else []
    return [str(k) for k in outputs] if isinstance(outputs, dict) else []


_INTERLEAVED, _SEPARATE, _PRESUMMED = 1, 2, 3


def _describe(key: int) -> str:
    """A CP agreement key in words."""
    if not key:
        return "nothing"
    mode = {_INTERLEAVED: "interleaved", _SEPARATE: "chosen=/rejected=", _PRESUMMED: "pre-summed"}
    return f"{key >> 8} x {(key >> 2) & 63} {mode.get(key & 3, '?')}"


_PRESUMMED_KEYS = ("chosen_logps", "rejected_logps", "ref_chosen_logps", "ref_rejected_logps")


def _spelling(key) -> str:
    text = "".join(c for c in str(key).lower() if c.isalnum())
    for long, short in (("logprobs", "logps"), ("logprob", "logps")):
        text = text.replace(long, short)
    return text + "s" if text.endswith("logp") else text


_SPELLINGS = {_spelling(k): k for k in _PRESUMMED_KEYS}


def _check_presummed_call(outputs, ref_outputs) -> None:
    """Per-pair sums come alone: whatever else the call holds for DPO would be ignored."""
    if ref_outputs is not None:
        raise ValueError(f"{_NAME}: got per-pair sums (outputs['chosen_logps']) and ref_outputs=, which would "
                         "be ignored; put the reference sums in outputs as 'ref_chosen_logps' and "
                         "'ref_rejected_logps'")
    if outputs.get("logps") is not None:
        raise ValueError(f"{_NAME}: outputs holds both per-pair sums ('chosen_logps') and per-token 'logps'; "
                         "pass one form per call")
    for key in outputs:
        # another spelling of a per-pair key (ref_chosen_logp, refChosenLogprobs); other outputs
        # (chosen_logits, mean_chosen_logps, a loss) are not DPO's to read
        near = _SPELLINGS.get(_spelling(key))
        if near is not None and key != near:
            raise ValueError(f"{_NAME}: outputs has {key!r} beside per-pair sums; did you mean {near!r}? "
                             f"(the per-pair keys are {list(_PRESUMMED_KEYS)})")


def _presummed_columns(outputs) -> Dict[str, torch.Tensor]:
    """The per-pair sums as float64 ``[n]`` columns, checked: one value per pair each."""
    cols = {}
    for key in _PRESUMMED_KEYS:
        v = outputs.get(key)
        if v is None:
            continue
        field = f"outputs[{key!r}]"
        if isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
            v = torch.cat([_pair_column(field, x) for x in v])
        cols[key] = _pair_column(field, v)
    if "rejected_logps" not in cols:
        raise ValueError(f"{_NAME}: outputs has 'chosen_logps' but no 'rejected_logps'; pass both")
    n = cols["chosen_logps"].shape[0]
    has_ref = "ref_chosen_logps" in cols or "ref_rejected_logps" in cols
    for key in _PRESUMMED_KEYS[:4 if has_ref else 2]:
        if key not in cols or cols[key].shape[0] != n:
            got = list(cols[key].shape) if key in cols else "nothing"
            raise ValueError(f"{_NAME}: outputs[{key!r}] is {got}, expected [{n}] like "
                             "chosen_logps; pass one value per pair for each")
    return cols


def _pair_column(field: str, value) -> torch.Tensor:
    t = float_tensor(_NAME, field, value)
    if t.dim() == 2 and t.shape[1] == 1:
        t = t[:, 0]  # [n, 1]: one value per pair too
    if t.dim() > 1:
        raise ValueError(f"{_NAME}: {field} has shape {list(t.shape)}; per-pair sums are one value per pair "
                         "([n]); for per-token log-probs pass outputs={'logps': [batch, seq]} with the inputs")
    return t.reshape(-1).to(torch.float64)


def _pair(name: str, value: Any) -> Tuple[Any, Any]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(f"{_NAME}: {name}= must be an (inputs, outputs) pair, got "
                        f"{type(value).__name__}")
    return value[0], value[1]
