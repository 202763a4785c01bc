"""``LossMetric``: token-weighted (or per-call mean) loss and the grad norm."""
from __future__ import annotations

import difflib
import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from parallel import MeshLike
from parallel.groups import ProcessGroup
from twinkle_metrics.core.config import Schema
from twinkle_metrics.core.metric import Metric
from twinkle_metrics.core.state import State
from twinkle_metrics.inputs.checks import (
    as_count,
    count,
    f64,
    host_reads,
    int_tensor,
    is_bad,
    negative_count,
    nonfinite,
    pick,
    plus,
    scalar,
)
from twinkle_metrics.inputs.checks import nan_policy as check_nan_policy
from twinkle_metrics.inputs.data_format import Inputs, Outputs
from twinkle_metrics.inputs.fields import Reads
from twinkle_metrics.inputs.microbatch import as_feature_list

_NAME = "LossMetric"
_REDUCTIONS = ("mean", "sum")
# loss, num_tokens (or None), the features to count tokens from, where (for errors), is a Megatron pair
Entry = Tuple[Any, Optional[Any], Sequence[Mapping[str, Any]], str, bool]


class LossMetric(Metric):
    """Loss and grad norm, as Twinkle's ``LossMetric``, reduced exactly over the data group.

    ``loss_reduction`` (constructor default, overridable per ``accumulate`` call as in
    Twinkle) says what a loss value is:

    * ``'sum'``: a sum of token losses; ``loss = sum(loss) / sum(num_tokens)`` over
      every call, microbatch and data-parallel rank. ``num_tokens`` comes from
      ``outputs['num_tokens']`` or, when absent, is counted from the labels as
      ``labels != ignore_index`` (Twinkle counts ``labels >= 0``; the two agree for
      the usual ``-100`` padding, ours also allows other ignore values). This is
      independent of how the batch is split into microbatches and ranks. An interval
      whose tokens were all masked reports no ``loss`` (Twinkle reports 0.0), unless
      a loss sum was NaN/inf.
    * ``'mean'``: an already averaged loss; ``loss`` is the mean over the loss
      entries seen (one per call, or one per microbatch when a list is passed), so it
      depends on how the batch was split. A Megatron pair ``[loss_sum, num_tokens]``
      counts as ``loss_sum / num_tokens`` and is skipped when it has no tokens.

    Accepted outputs (``inputs`` may be ``None`` unless tokens must be counted):

    * Megatron's per-microbatch report, the list ``get_forward_backward_func()``
      returns on the last pipeline stage: ``[{'lm loss': tensor([loss_sum, n])}, ...]``
      (key ``loss_key``); other stages get ``[]`` and add nothing.
    * ``{'loss': x, 'num_tokens': n}`` with scalars, or per-microbatch lists.

    Keys: ``loss``; ``num_tokens`` (total tokens, when any were counted); with
    ``ppl=True``, ``ppl`` = exp(loss) where ``loss`` is the token-weighted mean (an
    interval of ``'sum'`` entries with counted tokens; a ``'mean'`` interval reports
    none: the exp of a mean of means is no perplexity), capped as Megatron-LM's
    ``validation ppl`` is: ``exp(min(20, loss))`` (at most e^20 ~ 4.9e8; a NaN loss
    gives NaN, not the cap);
    ``grad_norm`` (the max over ranks of the last value passed; omitted when never
    passed); ``loss_nonfinite`` (only when > 0: loss entries whose loss or token count
    was NaN/inf). Values are plain numbers (Twinkle returns strings).

    Non-finite values (``nan_policy``): ``'propagate'`` (default) lets a NaN/inf loss
    or token count show as NaN/inf in ``loss`` (and ``num_tokens`` for a count), as
    Megatron's own loss does; a non-finite count never yields a finite loss (x / inf
    is reported as NaN, and a Megatron pair with a NaN count is not dropped as
    "no tokens"). ``'skip'`` drops the whole entry (its loss and its count). Both
    count the entries in ``loss_nonfinite``.

    Args:
        loss_reduction: ``'mean'`` (Twinkle's default) or ``'sum'``.
        loss_key: key of Megatron's report dicts.
        ignore_index: label value of tokens without a target.
        nan_policy: ``'propagate'`` or ``'skip'`` (see above).
        ppl: also report ``ppl`` (off by default, so the keys stay Twinkle's). It changes
            no state: ranks must agree on it, a checkpoint need not.

    Example:
        >>> import torch
        >>> m = LossMetric()  # loss_reduction="mean": one mean loss per call
        >>> _ = m.accumulate({"labels": torch.tensor([[1, 2, -100]])}, {"loss": torch.tensor(1.5)})
        >>> _ = m.accumulate({"labels": torch.tensor([[3, -100, -100]])}, {"loss": torch.tensor(0.5)})
        >>> m.calculate()
        {'loss': 1.0}
        >>> m = LossMetric(loss_reduction="sum", ppl=True)  # token-weighted: Megatron's [sum, count]
        >>> _ = m.accumulate(None, [{"lm loss": torch.tensor([3.0, 2.0])}, {"lm loss": torch.tensor([1.0, 2.0])}])
        >>> out = m.calculate()
        >>> out["loss"], round(out["ppl"], 4)  # exp(4 / 4)
        (1.0, 2.7183)
    """

    reads = (Reads(outputs=("{loss_key}|loss", "num_tokens?"), context=Reads(inputs=("labels?",))),
             Reads(keywords=("grad_norm?",)))
    result_keys = ('loss', 'num_tokens', 'grad_norm', 'loss_nonfinite', 'ppl',)

    # compute-only: a checkpoint written without it (or with the other value) loads alike
    schema = Schema(sync_only=("ppl",))

    loss_total = State("sum")
    entries = State("sum", torch.int64)
    # entries of loss_reduction='sum' (the rest are 'mean'): an interval of them whose
    # tokens were all masked has no loss to report, not 0 / 0 = 0.0
    sum_entries = State("sum", torch.int64)
    num_tokens = State("sum")
    grad_norm = State("max", local="last")
    nonfinite = State("sum", torch.int64)

    def __init__(self, device_mesh: MeshLike = None, process_group: ProcessGroup = None, *,
                 loss_reduction: str = "mean", loss_key: str = "lm loss", ignore_index: int = -100,
                 nan_policy: str = "propagate", ppl: bool = False, **kwargs: Any) -> None:
        super().__init__(device_mesh, process_group, **kwargs)
        self.loss_reduction = _check_reduction(loss_reduction)
        self.loss_key = loss_key
        self.ignore_index = ignore_index
        self.nan_policy = check_nan_policy(_NAME, nan_policy)
        if not isinstance(ppl, bool):
            raise TypeError(f"{_NAME}: ppl must be True or False, got {ppl!r}")
        self.ppl = ppl

    def update(self, inputs: Inputs, outputs: Outputs, *, loss_reduction: Optional[str] = None, grad_norm: Any = None,
               **kwargs: Any) -> Dict[str, Any]:
        reduction = _check_reduction(loss_reduction or self.loss_reduction)
        skip = self.nan_policy == "skip"
        out: Dict[str, Any] = {}
        if grad_norm is not None:
            out["grad_norm"] = f64(scalar(_NAME, "grad_norm", grad_norm))
        loss_total = entries = sum_entries = tokens = bad_total = None
        for loss, n, feats, where, is_pair in self._entries(inputs, outputs, reduction):
            if reduction == "sum" or not is_pair:
                if reduction == "sum" and n is None:
                    n = self._count_tokens(feats, where)
                loss = f64(loss)
                n = None if reduction == "mean" else f64(n)
                n_bad = is_bad(n)
                bad = _or(is_bad(loss), n_bad)
                if skip:
                    loss, one = pick(bad, 0.0, loss), pick(bad, 0, 1, torch.int64)
                    n = None if n is None else pick(bad, 0.0, n)
                else:
                    # sum / inf would be a finite 0: a non-finite count makes the loss NaN
                    loss, one = (loss if n is None else pick(n_bad, math.nan, loss)), 1
                loss_total = plus(loss_total, loss)
                entries = plus(entries, one)
                if n is not None:
                    tokens = plus(tokens, n)
                    sum_entries = plus(sum_entries, one)
            else:  # 'mean' of a Megatron pair: loss_sum / n, entries without tokens skipped
                loss, n = f64(loss), f64(n)
                bad = nonfinite(loss) | nonfinite(n)
                has = n > 0  # False for a NaN count: without the policy it would vanish silently
                use = has & ~bad if skip else has | bad
                value = torch.where(has, loss / torch.where(has, n, 1.0), loss)
                if not skip:  # loss / inf would be a finite 0
                    value = torch.where(torch.isfinite(n), value, math.nan)
                loss_total = plus(loss_total, torch.where(use, value, 0.0))
                entries = plus(entries, use.to(torch.int64))
            bad_total = plus(bad_total, as_count(bad))
        if entries is not None:
            out["loss_total"], out["entries"] = loss_total, entries
            out["nonfinite"] = bad_total
            if tokens is not None:
                out["num_tokens"], out["sum_entries"] = tokens, sum_entries
        return out

    def _entries(self, inputs, outputs, reduction: str) -> List[Entry]:
        feats = as_feature_list(_NAME, inputs)
        if outputs is None:
            return []
        if isinstance(outputs, (list, tuple)):
            if feats and len(feats) != len(outputs):
                raise ValueError(f"{_NAME}: got {len(feats)} input microbatches but {len(outputs)} loss "
                                 "reports; pass one report per microbatch")
            found = []
            for i, o in enumerate(outputs):
                if o is None:
                    continue
                if not isinstance(o, Mapping):
                    raise TypeError(f"{_NAME}: outputs[{i}] is a {type(o).__name__}, expected a dict such "
                                    f"as {{'{self.loss_key}': tensor([loss_sum, num_tokens])}}")
                entry = self._from_dict(o, feats[i:i + 1], f"outputs[{i}]", reduction, report=True)
                if entry is not None:
                    found.append(entry)
            return found
        if not isinstance(outputs, Mapping):
            raise TypeError(f"{_NAME}: outputs must be a dict or a list of dicts, got {type(outputs).__name__}")
        loss, n = outputs.get("loss"), outputs.get("num_tokens")
        if isinstance(n, (list, tuple)) and loss is not None and not isinstance(loss, (list, tuple)):
            raise ValueError(f"{_NAME}: outputs['num_tokens'] is a list of {len(n)} but outputs['loss'] "
                             f"is a single value; pass one loss per microbatch")
        if isinstance(loss, (list, tuple)):
            losses = list(loss)
            if feats and len(feats) != len(losses) and not (len(feats) == 1 and len(losses) == 1):
                raise ValueError(f"{_NAME}: outputs['loss'] has {len(losses)} entries but there are "
                                 f"{len(feats)} input microbatches; pass one loss per microbatch")
            if n is not None:
                counts = list(n) if isinstance(n, (list, tuple)) else None
                if counts is None and isinstance(n, torch.Tensor) and n.dim() == 1:
                    counts = list(n.unbind(0))
                if counts is None or len(counts) != len(losses):
                    got = len(counts) if counts is not None else f"shape {list(getattr(n, 'shape', []))}"
                    raise ValueError(f"{_NAME}: outputs['num_tokens'] has {got} entries but outputs['loss'] "
                                     f"has {len(losses)}; pass one count per microbatch")
            else:
                counts = [None] * len(losses)
            return [(scalar(_NAME, f"outputs['loss'][{i}]", x),
                     None if c is None else count(_NAME, f"outputs['num_tokens'][{i}]", c),
                     feats[i:i + 1] if len(feats) == len(losses) else feats, f"microbatch {i}", False)
                    for i, (x, c) in enumerate(zip(losses, counts)) if x is not None]
        entry = self._from_dict(outputs, feats, "outputs", reduction)
        return [entry] if entry is not None else []

    def _from_dict(self, o: Mapping, feats, where, reduction: str, report: bool = False) -> Optional[Entry]:
        if o.get(self.loss_key) is not None:
            value = o[self.loss_key]
            if isinstance(value, torch.Tensor) and value.numel() > 2:
                raise ValueError(f"{_NAME}: {where}[{self.loss_key!r}] holds {value.numel()} values (shape "
                                 f"{list(value.shape)}); expected one loss, or Megatron's [loss_sum, "
                                 "num_tokens] pair")
            if isinstance(value, torch.Tensor) and value.numel() == 2:
                pair = value.reshape(-1)
                if pair.device.type == "cpu":  # a host pair's count is checked here; a device one's at calculate()
                    with host_reads():
                        values = pair.tolist()
                    n = values[1]
                    if math.isfinite(n) and (n < 0 or not float(n).is_integer()):
                        raise ValueError(f"{_NAME}: {where}[{self.loss_key!r}] is [loss_sum, num_tokens] = "
                                         f"{values}, whose count {n!r} is not a count; pass a "
                                         "non-negative whole number of tokens")
                return pair[0], pair[1], feats, where, True
            n = _opt(o, where)
            if reduction == "sum" and n is None and self.loss_key != "loss":
                # Megatron reports a mean here when it reports one number: summing it as a
                # token-loss sum would divide a mean by the token count.
                raise ValueError(
                    f"{_NAME}: {where}[{self.loss_key!r}] is a single value, but loss_reduction='sum' "
                    f"needs a loss sum and its token count; return (loss_sum, num_tokens, "
                    f"{{{self.loss_key!r}: torch.stack([loss_sum, num_tokens])}}) from Megatron's "
                    f"loss_func (twinkle_metrics.integrations.megatron.loss_func does this from the "
                    f"per-token losses and loss_mask), or add 'num_tokens' to the dict, or use "
                    f"loss_reduction='mean' for an averaged loss")
            return scalar(_NAME, f"{where}[{self.loss_key!r}]", value), n, feats, where, False
        if o.get("loss") is None:
            near = self._near_keys(o, report)
            if near:
                raise ValueError(
                    f"{_NAME}: {where} has no {self.loss_key!r} (got keys {sorted(map(str, o))}); did you "
                    f"mean {near[0]!r}? pass loss_key={near[0]!r} to LossMetric, or report the loss "
                    f"under {self.loss_key!r} (or 'loss')")
            return None  # Twinkle skips outputs without a loss (e.g. {'logits': ...})
        loss = o["loss"]
        if isinstance(loss, torch.Tensor) and loss.numel() == 2 and self.loss_key != "loss":
            raise ValueError(f"{_NAME}: {where}['loss'] holds 2 values (shape {list(loss.shape)}): a "
                             f"[loss_sum, num_tokens] pair belongs under {self.loss_key!r} (loss_key; "
                             f"LossMetric(loss_key=...) reads another key), as Megatron's loss_func reports it; "
                             "or pass {'loss': loss_sum, 'num_tokens': n}")
        return scalar(_NAME, f"{where}['loss']", loss), _opt(o, where), feats, where, False

    def _near_keys(self, o: Mapping, report: bool) -> List[str]:
        """Keys that look like a misspelt ``loss_key``: a close spelling, or (in a report
        list) any key holding a ``[loss_sum, num_tokens]`` pair."""
        def norm(k):
            return "".join(c for c in str(k).lower() if c.isalnum())

        target = norm(self.loss_key)
        near = []
        for k, v in o.items():
            if v is None or k in (self.loss_key, "loss"):
                continue
            close = difflib.SequenceMatcher(None, norm(k), target).ratio() >= 0.8
            pair = report and isinstance(v, torch.Tensor) and v.numel() == 2
            if close or pair:
                near.append(k)
        return near

    def _count_tokens(self, feats, where):
        if not feats or any(f.get("labels") is None for f in feats):
            raise ValueError(f"{_NAME}: loss_reduction='sum' needs the token count of {where}: pass "
                             "outputs['num_tokens'] or inputs with labels (labels missing)")
        total = None
        for f in feats:
            labels = int_tensor(_NAME, "labels", f["labels"])
            total = plus(total, (labels != self.ignore_index).sum())
        return total

    def compute(self, s: Mapping[str, Any]) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        tokens = s["num_tokens"]
        negative_count(_NAME, "num_tokens", tokens, self.intervals)
        total, means = s["loss_total"], s["entries"] - s["sum_entries"]
        if means > 0 and s["sum_entries"] > 0:
            raise ValueError(f"{_NAME}: this interval mixes {int(s['sum_entries'])} loss_reduction='sum' entries "
                             f"with {int(means)} 'mean' ones, whose combination is no loss at all; use one "
                             "loss_reduction per interval (or one LossMetric per reduction), then reset() "
                             "this metric")
        if tokens > 0:
            out["loss"] = total / tokens
            if self.ppl:
                out["ppl"] = _ppl(out["loss"])
        elif means > 0:
            out["loss"] = total / means  # 'mean' entries only
        elif s["entries"] and not math.isfinite(total):
            out["loss"] = total  # a NaN/inf token-loss sum over no tokens still shows
        # else: only 'sum' entries, all of their tokens masked: no loss to report
        if tokens > 0 or not math.isfinite(tokens):
            out["num_tokens"] = int(tokens) if float(tokens).is_integer() else tokens
        if s["grad_norm"] != -float("inf"):
            out["grad_norm"] = s["grad_norm"]
        if s["nonfinite"]:
            out["loss_nonfinite"] = int(s["nonfinite"])
        return out


def _ppl(loss: float) -> float:
    """Megatron-LM's ``math.exp(min(20, loss))`` (``evaluate_and_print_results``), with NaN
    kept: Python's ``min(20, nan)`` is 20, which would show a NaN loss as a finite cap."""
    return loss if math.isnan(loss) else math.exp(min(20.0, loss))


def _opt(o: Mapping, where: str):
    n = o.get("num_tokens")
    return None if n is None else count(_NAME, f"{where}['num_tokens']", n)


def _or(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a | b
    return a or b


def _check_reduction(value: str) -> str:
    if value not in _REDUCTIONS:
        raise ValueError(f"{_NAME}: loss_reduction must be one of {_REDUCTIONS}, got {value!r}")
    return value
