"""``MTPMetric``: multi-token prediction (DeepSeek-V3's MTP heads, megatron-core's
``mtp_num_layers``), per depth: the token-weighted loss and the acceptance rate."""
from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Tuple

import torch

from parallel import MeshLike
from parallel.groups import ProcessGroup
from twinkle_metrics.comm import agreement as exchange
from twinkle_metrics.core.config import Schema
from twinkle_metrics.core.metric import Metric
from twinkle_metrics.core.state import State
from twinkle_metrics.inputs.checks import count, f64, floating_tensor, int_tensor, negative_count, plus, scalar
from twinkle_metrics.inputs.data_format import Inputs, Outputs
from twinkle_metrics.inputs.fields import Reads
from twinkle_metrics.inputs.microbatch import as_feature_list, host_array, join
from twinkle_metrics.kernels.argmax import joined_hits, vocab_parallel_argmax
from twinkle_metrics.metrics.vocab import agree_shards, check_reach, reach

_NAME = "MTPMetric"
_DEPTH = Reads(keywords=("depth",))


class MTPMetric(Metric):
    """Per MTP depth ``k``: the loss, token-weighted, and the acceptance rate of the depth's
    argmax, reduced over the data group (DP x CP) in the one fused sync.

    Call once per depth and batch (or list of pipeline microbatches), with ``depth=k`` (1 to
    ``depths``; Megatron's ``mtp_{k}``)::

        m.accumulate({"labels": labels_k, "completion_mask": mask_k},
                     {"mtp_logits": logits_k, "mtp_losses": losses_k}, depth=k)

    ``outputs`` holds any of: ``mtp_logits`` ``[b, s, v]`` (``[b, s, v/tp]`` with
    ``vocab_parallel=True``) and the depth's own targets ``inputs["labels"]`` ``[b, s]``
    aligned to them: the acceptance counts; ``mtp_losses`` ``[b, s]``, the per-token losses;
    or ``mtp_loss`` and ``mtp_num_tokens``, a sum of token losses and its count. The depth-k
    head at position ``i`` predicts token ``i + 1 + k``, so its labels are the main labels
    shifted left by ``k`` (``torch.roll(labels, -k, -1)``) with the last ``k`` positions
    masked, as megatron-core rolls them. ``completion_mask`` (else ``labels != ignore_index``)
    says which positions count; its values weight the losses (megatron-core's
    ``loss_mask * loss``). ``twinkle_metrics.integrations.mtp_hooks`` feeds it from
    megatron-core's own MTP heads.

    Keys, per depth ``k`` that saw tokens: ``mtp/depth{k}/loss`` (``sum(loss * mask) /
    sum(mask)`` over the interval, its microbatches and the data group),
    ``mtp/depth{k}/num_tokens``, ``mtp/depth{k}/acceptance_rate`` (a fraction: correct
    argmax over counted positions), ``mtp/depth{k}/correct_tokens``,
    ``mtp/depth{k}/total_tokens``, and ``mtp/depth{k}/cumulative_acceptance_rate`` over the
    run (kept states: they outlive ``calculate()`` and ride in ``state_dict()``, so a resume
    keeps them). With ``megatron_keys=True`` also megatron-core's names for the same numbers:
    ``mtp_{k} loss``, ``mtp_{k}_acceptance_rate`` and ``mtp_{k}_cumulative_acceptance_rate``
    (in percent, as megatron-core logs them); docs/metrics.md says where they differ from megatron-core's
    tracker. Counts are int64 and exact; TP replicas count once, pipeline stages other
    than the last add nothing.

    Args:
        depths: the number of MTP depths (megatron-core's ``config.mtp_num_layers``).
        vocab_parallel: ``mtp_logits`` are vocab shards over the mesh's TP group: the argmax
            is taken over the whole vocab with one collective over TP per call (as
            ``Accuracy``), after a host-side agreement; every TP rank must make the calls.
        ignore_index: label value of positions without a target (when no mask is given).
        megatron_keys: also report megatron-core's key names (changes no state).

    Example:
        >>> import torch
        >>> m = MTPMetric(depths=2)
        >>> logits = torch.tensor([[[0.1, 2.0, 0.3], [1.0, 0.0, 0.0], [0.0, 0.0, 5.0]]])
        >>> _ = m.accumulate({"labels": torch.tensor([[1, 2, 0]]), "completion_mask": torch.tensor([[1, 1, 0]])},
        ...                  {"mtp_logits": logits, "mtp_losses": torch.tensor([[0.5, 1.5, 9.0]])}, depth=2)
        >>> m.calculate()  # doctest: +NORMALIZE_WHITESPACE
        {'mtp/depth2/loss': 1.0, 'mtp/depth2/num_tokens': 2, 'mtp/depth2/acceptance_rate': 0.5,
         'mtp/depth2/correct_tokens': 1, 'mtp/depth2/total_tokens': 2,
         'mtp/depth2/cumulative_acceptance_rate': 0.5}
    """

    reads = (Reads(outputs=("mtp_logits",), context=Reads(inputs=("labels", "completion_mask?"), keywords=("depth",))),
             Reads(outputs=("mtp_losses",), context=Reads(inputs=("completion_mask|labels",), keywords=("depth",))),
             Reads(outputs=("mtp_loss", "mtp_num_tokens"), context=_DEPTH))
    result_keys = ("mtp/depth*/loss", "mtp/depth*/num_tokens", "mtp/depth*/acceptance_rate",
                   "mtp/depth*/correct_tokens", "mtp/depth*/total_tokens", "mtp/depth*/cumulative_acceptance_rate",
                   "mtp_* loss", "mtp_*_acceptance_rate", "mtp_*_cumulative_acceptance_rate")
    schema = Schema(sync_only=("megatron_keys",))

    label_reach = State("max", torch.int64)  # the largest label id counted (metrics.vocab)
    vocab_width = State("max", torch.int64)  # the logits' last dimension
    unsliced_states = ("label_reach", "vocab_width")

    def __init__(self, device_mesh: MeshLike = None, process_group: ProcessGroup = None, *, depths: int = 1,
                 vocab_parallel: bool = False, ignore_index: int = -100, megatron_keys: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(device_mesh, process_group, **kwargs)
        if isinstance(depths, bool) or not isinstance(depths, numbers.Integral) or depths < 1:
            raise ValueError(f"{_NAME}: depths must be an int >= 1 (megatron-core's mtp_num_layers), got {depths!r}")
        for flag, value in (("vocab_parallel", vocab_parallel), ("megatron_keys", megatron_keys)):
            if not isinstance(value, bool):
                raise TypeError(f"{_NAME}: {flag} must be True or False, got {value!r}")
        self.depths: int = int(depths)
        self.vocab_parallel: bool = vocab_parallel
        self.ignore_index: int = ignore_index
        self.megatron_keys: bool = megatron_keys
        for k in range(1, self.depths + 1):
            self.add_state(f"correct_{k}", State("sum", torch.int64))
            self.add_state(f"total_{k}", State("sum", torch.int64))
            self.add_state(f"loss_sum_{k}", State("sum"))
            self.add_state(f"loss_tokens_{k}", State("sum"))
            self.add_state(f"run_correct_{k}", State("sum", torch.int64, keep=True))  # over the run
            self.add_state(f"run_total_{k}", State("sum", torch.int64, keep=True))
        self.agree_over = ("tp",) if vocab_parallel else ()
        if not vocab_parallel:
            self.tp_mismatch_hint = "mtp_logits look vocab-sharded over the TP group: pass vocab_parallel=True"

    def update(self, inputs: Inputs, outputs: Outputs, *, depth: Optional[int] = None,
               **kwargs: Any) -> Dict[str, Any]:
        with exchange.guard(self):
            work = [w for w in (self._checked(f, o) for f, o in _pairs(inputs, outputs)) if w]
            k = self._depth(depth) if work else 0
            logits = [w["logits"] for w in work if "logits" in w]
            for group in self.exchange_groups():
                agree_shards(self, group, logits)
        if not work:
            return {}
        out: Dict[str, Any] = {}
        if logits:  # the peers agreed: every TP rank holds as many tokens here
            labels = [w["labels"] for w in work if "logits" in w]
            valid = [w["valid"] for w in work if "logits" in w]
            if self.vocab_parallel:
                mesh = self.resolve_mesh()
                preds = vocab_parallel_argmax(logits, mesh.tp_group, mesh.tp_rank, mesh.tp_size)
                hits = join([p == y for p, y in zip(preds, labels)])
            else:
                hits = joined_hits(list(zip(logits, labels)))
            counted = join(valid)
            out[f"correct_{k}"], out[f"total_{k}"] = (hits & counted).sum(), counted.sum()
            out[f"run_correct_{k}"], out[f"run_total_{k}"] = out[f"correct_{k}"], out[f"total_{k}"]
            out.update(reach(labels, valid, [int(x.shape[-1]) for x in logits], self.vocab_parallel) or {})
        loss = tokens = None
        for w in work:
            if "losses" in w:
                loss = plus(loss, (w["losses"].double() * w["weights"]).sum())
                tokens = plus(tokens, w["weights"].sum())
            if "loss" in w:
                loss, tokens = plus(loss, f64(w["loss"])), plus(tokens, f64(w["num_tokens"]))
        if loss is not None:
            out[f"loss_sum_{k}"], out[f"loss_tokens_{k}"] = loss, tokens
        return out

    def _checked(self, inputs: Mapping, outputs: Mapping) -> Dict[str, Any]:
        """One microbatch's tensors, checked; ``{}`` when it holds nothing for this metric."""
        work: Dict[str, Any] = {}
        target = None
        if outputs.get("mtp_logits") is not None:
            logits = floating_tensor(_NAME, "mtp_logits", outputs["mtp_logits"])
            if logits.dim() < 2 or logits.shape[-1] == 0:
                raise ValueError(f"{_NAME}: mtp_logits must be [..., vocab] with a vocab of at least one entry, "
                                 f"got shape {list(logits.shape)}")
            target = list(logits.shape[:-1])
            work["logits"] = logits
        if outputs.get("mtp_losses") is not None:
            losses = floating_tensor(_NAME, "mtp_losses", outputs["mtp_losses"])
            if target is not None and list(losses.shape) != target:
                raise ValueError(f"{_NAME}: mtp_losses {list(losses.shape)} do not line up with mtp_logits "
                                 f"{list(work['logits'].shape)}: expected {target}, one loss per position")
            target = list(losses.shape)
            work["losses"] = losses
        if target is not None:
            device = (work["logits"] if "logits" in work else work["losses"]).device
            labels = self._aligned("labels", inputs.get("labels"), target, device, int_tensor)
            mask = self._aligned("completion_mask", inputs.get("completion_mask"), target, device, host_array)
            if labels is None and (mask is None or "logits" in work):
                what = "mtp_logits" if "logits" in work else "mtp_losses"
                raise ValueError(f"{_NAME}: labels missing: outputs have {what} but the inputs hold no labels "
                                 f"(got keys {sorted(inputs)}); pass the depth's labels of shape {target} "
                                 "aligned to them")
            if mask is not None:
                valid = mask != 0
            elif labels is not None:  # one of the two: the check above raised otherwise
                valid = labels != self.ignore_index
            if "logits" in work:
                work["labels"], work["valid"] = labels, valid
            if "losses" in work:
                work["weights"] = mask.double() if mask is not None else valid.double()
        if outputs.get("mtp_loss") is not None:  # with its count: the call was checked against ``reads``
            work["loss"] = scalar(_NAME, "outputs['mtp_loss']", outputs["mtp_loss"])
            work["num_tokens"] = count(_NAME, "outputs['mtp_num_tokens']", outputs["mtp_num_tokens"])
        return work

    def _depth(self, depth: Any) -> int:
        if isinstance(depth, bool) or not isinstance(depth, numbers.Integral):
            raise TypeError(f"{_NAME}: depth must be the MTP depth as an int from 1 to {self.depths}, got "
                            f"{depth!r}; pass accumulate(..., depth=k)")
        k = int(depth)
        if not 1 <= k <= self.depths:
            raise ValueError(f"{_NAME}: depth {depth} is out of range: this metric has depths={self.depths} "
                             f"(1 to {self.depths}); build it with depths=mtp_num_layers")
        return k

    @staticmethod
    def _aligned(field: str, value, target, device, convert) -> Optional[torch.Tensor]:
        """``value`` (labels or mask) as a tensor on ``device`` of shape ``target``, or None."""
        if value is None:
            return None
        value = convert(_NAME, field, value)
        if value.is_complex():
            raise TypeError(f"{_NAME}: {field} must be bool, integer or float, got {value.dtype}")
        if target is not None and list(value.shape) != target:
            raise ValueError(f"{_NAME}: {field} {list(value.shape)} do not line up with the outputs: expected "
                             f"{target}; pass the depth's {field} aligned position by position (for depth k, "
                             "the main labels rolled left by k, the last k positions masked)")
        return value.to(device, non_blocking=True)

    def compute(self, s: Mapping[str, Any]) -> Dict[str, Any]:
        check_reach(_NAME, s, self.vocab_parallel, self.resolve_mesh().tp_size, "the acceptance rate")
        out: Dict[str, Any] = {}
        for k in range(1, self.depths + 1):
            tokens, total = s[f"loss_tokens_{k}"], s[f"total_{k}"]
            if tokens < 0:  # a negative device count (masks weight the loss: a sum may be fractional)
                negative_count(_NAME, f"depth {k}'s mtp_num_tokens", tokens, self.intervals)
            if tokens > 0 or not math.isfinite(tokens):
                out[f"mtp/depth{k}/loss"] = s[f"loss_sum_{k}"] / tokens
                out[f"mtp/depth{k}/num_tokens"] = int(tokens) if float(tokens).is_integer() else tokens
                if self.megatron_keys:
                    out[f"mtp_{k} loss"] = out[f"mtp/depth{k}/loss"]
            if total:
                out[f"mtp/depth{k}/acceptance_rate"] = s[f"correct_{k}"] / total
                out[f"mtp/depth{k}/correct_tokens"] = s[f"correct_{k}"]
                out[f"mtp/depth{k}/total_tokens"] = total
                if self.megatron_keys:  # megatron-core logs a percentage
                    out[f"mtp_{k}_acceptance_rate"] = 100.0 * s[f"correct_{k}"] / total
            if s[f"run_total_{k}"]:
                out[f"mtp/depth{k}/cumulative_acceptance_rate"] = s[f"run_correct_{k}"] / s[f"run_total_{k}"]
                if self.megatron_keys:
                    out[f"mtp_{k}_cumulative_acceptance_rate"] = 100.0 * s[f"run_correct_{k}"] / s[f"run_total_{k}"]
        return out


def _pairs(inputs, outputs) -> List[Tuple[Mapping, Mapping]]:
    """``(input feature, outputs)`` per microbatch: one dict each, or lists of them (a pipeline
    schedule's; ``[]`` on a stage without the MTP heads)."""
    feats = as_feature_list(_NAME, inputs)
    outs = list(outputs) if isinstance(outputs, (list, tuple)) else [] if outputs is None else [outputs]
    for i, o in enumerate(outs):
        if o is not None and not isinstance(o, Mapping):
            raise TypeError(f"{_NAME}: outputs must be a dict or a list of them, got {type(o).__name__}"
                            + (f" at [{i}]" if isinstance(outputs, (list, tuple)) else ""))
    if not outs:
        return []
    if feats and len(feats) != len(outs):
        raise ValueError(f"{_NAME}: got {len(feats)} input microbatches but {len(outs)} outputs dicts; pass one "
                         "outputs dict per microbatch")
    return [(f, o or {}) for f, o in zip(feats or [{}] * len(outs), outs)]
