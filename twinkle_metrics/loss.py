"""``LossMetric``: token-weighted (or per-call mean) loss and the grad norm."""
from __future__ import annotations

from typing import Any, List, Mapping, Optional, Tuple

import torch

from ._checks import add, f64, int_tensor, scalar
from .base import Metric
from .microbatch import as_feature_list
from .state import State

_NAME = "LossMetric"
_REDUCTIONS = ("mean", "sum")
# loss, num_tokens (or None), the features to count tokens from, where (for errors), is a Megatron pair
Entry = Tuple[Any, Optional[Any], List[Mapping[str, Any]], str, bool]


class LossMetric(Metric):
    """Loss and grad norm, as Twinkle's ``LossMetric``, reduced exactly over the data group.

    ``loss_reduction`` (constructor default, overridable per ``accumulate`` call as in
    Twinkle) says what a loss value is:

    * ``'sum'``: a sum of token losses; ``loss = sum(loss) / sum(num_tokens)`` over
      every call, microbatch and data-parallel rank. ``num_tokens`` comes from
      ``outputs['num_tokens']`` or, when absent, is counted from the labels as
      ``labels != ignore_index`` (Twinkle counts ``labels >= 0``; the two agree for
      the usual ``-100`` padding, ours also allows other ignore values). This is
      independent of how the batch is split into microbatches and ranks.
    * ``'mean'``: an already averaged loss; ``loss`` is the mean over the loss
      entries seen (one per call, or one per microbatch when a list is passed), so it
      depends on how the batch was split. A Megatron pair ``[loss_sum, num_tokens]``
      counts as ``loss_sum / num_tokens`` and is skipped when it has no tokens.

    Accepted outputs (``inputs`` may be ``None`` unless tokens must be counted):

    * Megatron's per-microbatch report, the list ``get_forward_backward_func()``
      returns on the last pipeline stage: ``[{'lm loss': tensor([loss_sum, n])}, ...]``
      (key ``loss_key``); other stages get ``[]`` and add nothing.
    * ``{'loss': x, 'num_tokens': n}`` with scalars, or per-microbatch lists.

    Keys: ``loss``; ``num_tokens`` (total tokens, when any were counted);
    ``grad_norm`` (the max over ranks of the last value passed; omitted when never
    passed). Values are plain numbers (Twinkle returns strings).

    Args:
        loss_reduction: ``'mean'`` (Twinkle's default) or ``'sum'``.
        loss_key: key of Megatron's report dicts.
        ignore_index: label value of tokens without a target.
    """

    loss_total = State("sum")
    entries = State("sum", torch.int64)
    num_tokens = State("sum")
    grad_norm = State("max", local="last")

    def __init__(self, device_mesh=None, process_group=None, *, loss_reduction: str = "mean",
                 loss_key: str = "lm loss", ignore_index: int = -100, **kwargs):
        super().__init__(device_mesh, process_group, **kwargs)
        self.loss_reduction = _check_reduction(loss_reduction)
        self.loss_key = loss_key
        self.ignore_index = ignore_index

    def update(self, inputs, outputs, *, loss_reduction: Optional[str] = None, grad_norm=None, **kwargs):
        reduction = _check_reduction(loss_reduction or self.loss_reduction)
        out = {}
        if grad_norm is not None:
            out["grad_norm"] = f64(scalar(_NAME, "grad_norm", grad_norm))
        loss_total = entries = tokens = None
        for loss, n, feats, where, is_pair in self._entries(inputs, outputs):
            if reduction == "sum":
                if n is None:
                    n = self._count_tokens(feats, where)
                loss_total = add(loss_total, f64(loss))
                tokens = add(tokens, f64(n))
                entries = add(entries, 1)
            elif is_pair:
                n = f64(n)
                has = n > 0
                loss_total = add(loss_total, torch.where(has, f64(loss) / torch.where(has, n, 1.0), 0.0))
                entries = add(entries, has.to(torch.int64))
            else:
                loss_total = add(loss_total, f64(loss))
                entries = add(entries, 1)
        if entries is not None:
            out["loss_total"], out["entries"] = loss_total, entries
            if tokens is not None:
                out["num_tokens"] = tokens
        return out

    def _entries(self, inputs, outputs) -> List[Entry]:
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
                entry = self._from_dict(o, feats[i:i + 1], f"outputs[{i}]")
                if entry is not None:
                    found.append(entry)
            return found
        if not isinstance(outputs, Mapping):
            raise TypeError(f"{_NAME}: outputs must be a dict or a list of dicts, got {type(outputs).__name__}")
        loss, n = outputs.get("loss"), outputs.get("num_tokens")
        if isinstance(loss, (list, tuple)) or (isinstance(n, (list, tuple)) and loss is not None):
            losses = list(loss) if isinstance(loss, (list, tuple)) else None
            if losses is None:
                raise ValueError(f"{_NAME}: outputs['num_tokens'] is a list of {len(n)} but outputs['loss'] "
                                 f"is a single value; pass one loss per microbatch")
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
                     None if c is None else scalar(_NAME, f"outputs['num_tokens'][{i}]", c),
                     feats[i:i + 1] if len(feats) == len(losses) else feats, f"microbatch {i}", False)
                    for i, (x, c) in enumerate(zip(losses, counts)) if x is not None]
        entry = self._from_dict(outputs, feats, "outputs")
        return [entry] if entry is not None else []

    def _from_dict(self, o: Mapping, feats, where) -> Optional[Entry]:
        if o.get(self.loss_key) is not None:
            value = o[self.loss_key]
            if isinstance(value, torch.Tensor) and value.numel() == 2:
                pair = value.reshape(-1)
                return pair[0], pair[1], feats, where, True
            return scalar(_NAME, f"{where}[{self.loss_key!r}]", value), _opt(o, where), feats, where, False
        if o.get("loss") is None:
            return None  # Twinkle skips outputs without a loss
        return scalar(_NAME, f"{where}['loss']", o["loss"]), _opt(o, where), feats, where, False

    def _count_tokens(self, feats, where):
        if not feats or any(f.get("labels") is None for f in feats):
            raise ValueError(f"{_NAME}: loss_reduction='sum' needs the token count of {where}: pass "
                             "outputs['num_tokens'] or inputs with labels (labels missing)")
        total = None
        for f in feats:
            labels = int_tensor(_NAME, "labels", f["labels"])
            total = add(total, (labels != self.ignore_index).sum())
        return total

    def compute(self, s):
        out = {}
        tokens = s["num_tokens"]
        if s["entries"]:
            out["loss"] = s["loss_total"] / tokens if tokens > 0 else s["loss_total"] / s["entries"]
        if tokens > 0:
            out["num_tokens"] = int(tokens) if float(tokens).is_integer() else tokens
        if s["grad_norm"] != -float("inf"):
            out["grad_norm"] = s["grad_norm"]
        return out


def _opt(o: Mapping, where: str):
    n = o.get("num_tokens")
    return None if n is None else scalar(_NAME, f"{where}['num_tokens']", n)


def _check_reduction(value: str) -> str:
    if value not in _REDUCTIONS:
        raise ValueError(f"{_NAME}: loss_reduction must be one of {_REDUCTIONS}, got {value!r}")
    return value
