"""Metrics in a megatron-core training script: a logits hook and a ``loss_func`` helper.

With ``GPTModel(..., labels=labels)`` the model returns per-token losses ``[b, s]``, not
logits, so the logits a metric such as ``Accuracy`` needs never reach ``loss_func``.
Two additions to a Megatron script (see the README's "Megatron" section)::

    from twinkle_metrics.integrations import megatron as tm_megatron

    hook = tm_megatron.LogitsHook(model, acc_m)        # after building the model
    ...
    def forward_step(data_iterator, model):
        ...
        output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
        return output_tensor, partial(tm_megatron.loss_func, loss_mask, metric=loss_m)

Nothing here imports megatron: the helpers work on the modules and tensors they are given.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar, Union

import torch

from twinkle_metrics.core.collection import MetricCollection
from twinkle_metrics.core.metric import Metric

#: what the hooks feed: a metric, or a collection of them
Accumulates = Union[Metric, MetricCollection]

_HOOK = "LogitsHook"
_LOSS = "twinkle_metrics.integrations.megatron.loss_func"


def _unwrap(chunk):
    """The GPTModel / HybridModel inside Megatron's wrappers (DDP, Float16Module: ``.module``)."""
    module = chunk
    while not hasattr(module, "output_layer") and hasattr(module, "module"):
        module = module.module
    return module


def _mtp_calls(model) -> int:
    """Output-layer calls of the MTP heads before the main one in each forward."""
    depth = getattr(getattr(model, "config", None), "mtp_num_layers", None) or 0
    if any(c.__name__ == "HybridModel" for c in type(model).__mro__):
        return depth if getattr(model, "mtp_process", False) else 0  # MTP on this stage, or none
    return depth


_H = TypeVar("_H", bound="Hooks")
#: the ``when=`` of the hook installers: forwards in training mode only, or every forward
WHEN = ("train", "always")


def check_when(installer: str, when: str) -> str:
    """``when`` if it is one of ``WHEN``, else ``ValueError`` naming ``installer``."""
    if when not in WHEN:
        raise ValueError(f"{installer}: when must be one of {list(WHEN)}, got {when!r}")
    return when


class Hooks:
    """What a hook installer put on a model (``LogitsHook``, ``register_router_hooks``,
    ``register_mtp_hooks``): ``remove()``, or the end of a ``with`` block, takes all of it
    off, the last installed first."""

    def __init__(self) -> None:
        self._undo: List[Callable[[], None]] = []

    def remove(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def __enter__(self: _H) -> _H:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


class LogitsHook(Hooks):
    """Feeds metrics the output layer's logits inside the model's forward, without a copy.

    megatron-core's ``GPTModel.output_layer`` (a ``ColumnParallelLinear``) returns
    ``(logits, bias)`` with logits ``[s, b, v/tp]`` (the local vocab shard; ``[s, b, v]``
    when the output is gathered). When the model is called with ``labels``, it computes
    the cross entropy right after, and ``vocab_parallel_cross_entropy`` overwrites fp32
    logits in place (max-shifted, then softmax). So a reference kept for ``loss_func``
    would read softmax values; this hook instead feeds each metric at once, from the
    output layer's forward hook, with a detached ``[b, s, v/tp]`` view of the logits
    (``transpose(0, 1)``: no copy) and the ``labels`` and ``loss_mask`` of the same forward
    call (read by a forward pre-hook on the model; ``loss_mask``, when passed to the model
    as ``pretrain_gpt.py`` does, becomes the metric's ``completion_mask``, else labels equal
    to ``ignore_index`` are not counted). Nothing is kept after the hook returns.

    Only the last pipeline stage has an output layer: on other stages (and model chunks)
    nothing is registered and the metrics are never fed there, which is what the
    metrics expect (TP ranks of a stage all feed or all do not). Forward calls without
    ``labels`` are skipped (the model returns the logits then; feed them yourself).
    Multi-token-prediction calls of the output layer (the first ``mtp_num_layers`` of each
    forward) are skipped: ``GPTModel`` makes them whenever ``config.mtp_num_layers`` is set,
    ``HybridModel`` (megatron-core 0.19's recommended model class) only where it runs MTP
    (``mtp_process``). Under TP, a metric with ``vocab_parallel=True`` communicates
    over TP inside the hook, so every TP rank must run the same forwards (Megatron does).

    Args:
        model: a ``GPTModel`` or ``HybridModel``, a wrapped one (``.module``), or the list of
            model chunks.
        *metrics: metrics taking ``(inputs, {'logits': logits})``, e.g. ``Accuracy``
            (``Accuracy(mesh, vocab_parallel=True)`` for TP-sharded logits).

    Set ``hook.enabled = False`` around evaluation forwards that must not count;
    ``hook.remove()`` (or ``with LogitsHook(...)``) removes the hooks.
    """

    def __init__(self, model: Union[torch.nn.Module, Sequence[torch.nn.Module]], *metrics: Accumulates) -> None:
        for m in metrics:
            if not callable(getattr(m, "accumulate", None)):
                raise TypeError(f"{_HOOK}: expected metrics with accumulate(inputs, outputs), got "
                                f"{type(m).__name__}; pass e.g. Accuracy(mesh, vocab_parallel=True)")
        super().__init__()
        self.metrics = list(metrics)
        self.enabled = True
        self._pending: Optional[Dict[str, Any]] = None
        chunks = model if isinstance(model, (list, tuple)) else [model]
        for chunk in chunks:
            gpt = _unwrap(chunk)
            layer = getattr(gpt, "output_layer", None)
            if layer is None or not getattr(gpt, "post_process", True):
                continue  # not the last pipeline stage
            sig = inspect.signature(gpt.forward)
            self._undo.append(gpt.register_forward_pre_hook(self._pre_hook(sig, _mtp_calls(gpt)),
                                                            with_kwargs=True).remove)
            self._undo.append(layer.register_forward_hook(self._on_logits(layer)).remove)

    @property
    def active(self) -> bool:
        """Whether this rank holds an output layer (the last pipeline stage)."""
        return bool(self._undo)

    def _pre_hook(self, sig, mtp_calls):
        def hook(module, args, kwargs):
            self._pending = None
            if not self.enabled:
                return None
            bound = sig.bind_partial(*args, **kwargs).arguments
            labels = bound.get("labels")
            if labels is not None:
                self._pending = {"labels": labels, "loss_mask": bound.get("loss_mask"),
                                 "skip": mtp_calls}
            return None
        return hook

    def _on_logits(self, layer):
        def hook(module, args, output):
            pending = self._pending
            if pending is None:
                return None
            if pending["skip"]:  # an MTP head's logits: the main head comes last
                pending["skip"] -= 1
                return None
            self._pending = None  # release the labels: one main output call per forward
            logits = output[0] if isinstance(output, (tuple, list)) else output
            self._feed(layer, logits, pending["labels"], pending["loss_mask"])
            return None
        return hook

    def _feed(self, layer, logits: torch.Tensor, labels, loss_mask) -> None:
        if logits.dim() != 3:
            raise ValueError(f"{_HOOK}: the output layer returned logits of shape {list(logits.shape)}; "
                             "expected [s, b, vocab] (megatron-core GPTModel)")
        shard = getattr(layer, "output_size_per_partition", None)
        for m in self.metrics:
            if getattr(m, "vocab_parallel", False) and shard is not None and logits.shape[-1] != shard:
                raise ValueError(f"{_HOOK}: {type(m).__name__}(vocab_parallel=True) needs the local vocab "
                                 f"shard ({shard} wide) but the output layer returned {logits.shape[-1]} "
                                 "(gathered) logits; use vocab_parallel=False for gathered output")
        view = logits.detach().transpose(0, 1)  # [s, b, v] -> [b, s, v]: a view, no copy
        inputs = {"labels": labels}
        if loss_mask is not None:
            inputs["completion_mask"] = loss_mask
        for m in self.metrics:
            m.accumulate(inputs, {"logits": view})

    def remove(self) -> None:
        super().remove()
        self._pending = None


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, *, metric: Optional[Accumulates] = None,
              key: str = "lm loss") -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
    """Megatron's ``loss_func`` for per-token losses, optionally feeding a ``LossMetric``.

    Returns what megatron-core 0.16's schedules expect from a token-summed loss:
    ``(loss_sum, num_tokens, {key: tensor([loss_sum, num_tokens])})``, computed as
    ``pretrain_gpt.py`` does (``sum(losses * loss_mask)``, ``num_tokens = loss_mask.sum()``
    as int). With ``config.calculate_per_token_loss=True`` the schedule backpropagates
    ``loss_sum`` and Megatron divides the gradients by the global token count; otherwise
    the schedule divides ``loss_sum`` by ``num_tokens`` and the number of microbatches.
    The report pair is what Megatron's ``train_step`` sums over microbatches and DP x CP,
    and what ``LossMetric(loss_reduction='sum')`` reduces.

    Args:
        loss_mask: ``[b, s]`` (1 for counted tokens), bound with ``functools.partial``.
        output_tensor: the per-token losses ``[b, s]`` returned by ``GPTModel(..., labels=)``.
        metric: a ``LossMetric`` fed with this microbatch's report (then do not also feed it
            the list ``forward_backward_func`` returns, or the loss counts twice).
        key: the report key (``LossMetric``'s ``loss_key``).

    Example::

        return output_tensor, functools.partial(loss_func, loss_mask, metric=loss_m)
    """
    if not isinstance(output_tensor, torch.Tensor) or not isinstance(loss_mask, torch.Tensor):
        raise TypeError(f"{_LOSS}: expected tensors (loss_mask, per-token losses), got "
                        f"{type(loss_mask).__name__} and {type(output_tensor).__name__}")
    if output_tensor.numel() != loss_mask.numel():
        raise ValueError(f"{_LOSS}: per-token losses {list(output_tensor.shape)} do not match loss_mask "
                         f"{list(loss_mask.shape)}; call the model with labels= so that it returns the "
                         "[b, s] per-token losses, and pass that microbatch's loss_mask")
    losses = output_tensor.reshape(-1).float()
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().detach().to(torch.int)
    report = {key: torch.stack([loss.detach(), num_tokens.to(loss.dtype)])}
    if metric is not None:
        metric.accumulate(None, [report])
    return loss, num_tokens, report
