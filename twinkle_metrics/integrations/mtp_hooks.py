"""``register_mtp_hooks``: feeds an ``MTPMetric`` from megatron-core's own multi-token
prediction heads (``GPTModel`` / ``HybridModel`` with ``config.mtp_num_layers``), on every
rank, active only where the MTP losses are computed. megatron-core is imported only when it
is called."""
from __future__ import annotations

import inspect
from typing import Any, Dict, Sequence, Union

import torch

from twinkle_metrics.integrations.megatron import Hooks, _mtp_calls, _unwrap, check_when
from twinkle_metrics.metrics.lm.mtp import MTPMetric

_NAME = "register_mtp_hooks"


class MTPHooks(Hooks):
    """What ``register_mtp_hooks`` installed; ``remove()`` takes all of it off.

    Set ``hooks.enabled = False`` around forwards that must not count.
    """

    def __init__(self) -> None:
        super().__init__()
        self.enabled = True

    @property
    def active(self) -> bool:
        """Whether this rank computes MTP losses (the last pipeline stage of an MTP model)."""
        return bool(self._undo)


def register_mtp_hooks(model: Union[torch.nn.Module, Sequence[torch.nn.Module]], metric: MTPMetric, *,
                       when: str = "train") -> MTPHooks:
    """Feed ``metric`` from every MTP depth of ``model``'s forwards (one line, every rank).

    megatron-core computes the MTP losses on the last pipeline stage (``process_mtp_loss``):
    for depth ``k`` it calls the output layer, rolls the labels and the loss mask left by
    one more position (over CP with ``roll_tensor``, packed sequences respected), then
    ``model.compute_language_model_loss(labels_k, logits_k)``. The hook wraps that method
    on the model (an instance attribute; ``remove()`` deletes it): its first
    ``mtp_num_layers`` calls of a forward are depths 1, 2, ...; each feeds ``metric`` the
    depth's logits (a detached ``[b, s, v/tp]`` view, read before the cross entropy, which
    overwrites fp32 logits in place) with megatron-core's own depth-k labels and the loss
    mask rolled by megatron-core's ``roll_tensor`` (its values weight the loss, as
    megatron-core's ``loss_mask * loss``; nonzero positions are the acceptance
    denominator), then the per-token losses the cross entropy returned. The main head's
    call that follows is left alone. Under TP, ``MTPMetric(mesh, vocab_parallel=True)``
    takes the argmax over the vocab shards with one collective over TP inside the forward,
    so every TP rank runs the same forwards (Megatron does).

    Forwards without ``labels`` count only where megatron-core 0.19 derives them from
    ``input_ids`` (``labels=None``, RL); inference forwards (``InferenceMode``) never.
    On stages without the MTP losses nothing is registered (``hooks.active`` is False);
    ``calculate()``, called on every rank, gives them the last stage's numbers.

    Args:
        model: a ``GPTModel`` or ``HybridModel``, a wrapped one (``.module``), or the list of
            model chunks.
        metric: the ``MTPMetric``; its ``depths`` must be ``config.mtp_num_layers``.
        when: ``'train'`` (default): forwards in training mode only, as megatron-core's
            tracker counts (``is_training=self.training``); ``'always'``: evaluation too.

    Returns:
        ``MTPHooks``; ``.remove()`` takes the hooks off (also as a context manager).
    """
    from megatron.core.transformer.multi_token_prediction import roll_tensor

    if not isinstance(metric, MTPMetric):
        raise TypeError(f"{_NAME}: metric must be an MTPMetric, got {type(metric).__name__}")
    check_when(_NAME, when)
    hooks = MTPHooks()
    try:
        for chunk in model if isinstance(model, (list, tuple)) else [model]:
            gpt = _unwrap(chunk)
            configured = getattr(getattr(gpt, "config", None), "mtp_num_layers", None)
            if not configured:
                raise ValueError(f"{_NAME}: the model has no multi-token prediction (config.mtp_num_layers "
                                 f"is {configured!r}); build it with mtp_num_layers and an MTP block spec")
            if configured != metric.depths:
                raise ValueError(f"{_NAME}: the model has mtp_num_layers={configured} but the metric "
                                 f"depths={metric.depths}; build MTPMetric(mesh, depths=config.mtp_num_layers)")
            if getattr(gpt, "output_layer", None) is None or not getattr(gpt, "post_process", True):
                continue  # not the last pipeline stage: no MTP loss here
            if _mtp_calls(gpt):  # HybridModel: only where it runs MTP (mtp_process)
                _hook_model(gpt, metric, hooks, when, roll_tensor)
    except BaseException:
        hooks.remove()
        raise
    return hooks


def _inference_active() -> bool:
    """megatron-core 0.19's process-wide inference flag (absent before: False)."""
    try:
        from megatron.core.inference.utils import InferenceMode
    except ImportError:
        return False
    return InferenceMode.is_active()


def _hook_model(gpt, metric: MTPMetric, hooks: MTPHooks, when: str, roll_tensor) -> None:
    depths = metric.depths
    shard = getattr(gpt.output_layer, "output_size_per_partition", None)
    cp_group = getattr(gpt, "cp_group", None)
    sig = inspect.signature(gpt.forward)
    state: Dict[str, Any] = {}  # this forward's: depths seen, the rolled mask, packed sequences

    def before(module, args, kwargs):
        state.clear()
        if not hooks.enabled or (when == "train" and not module.training) or _inference_active():
            return
        bound = sig.bind_partial(*args, **kwargs).arguments
        labels, ids = bound.get("labels"), bound.get("input_ids")
        tokens = labels if labels is not None else ids
        if tokens is None:
            return  # megatron-core computes no MTP loss
        mask = bound.get("loss_mask")
        mask = torch.ones_like(tokens) if mask is None else mask
        packed = bound.get("packed_seq_params")
        if labels is None:  # labels rolled from input_ids (0.19): their last one is masked too
            mask, _ = roll_tensor(mask, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed)
        state.update(depth=0, mask=mask, packed=packed)

    real = gpt.compute_language_model_loss

    def compute_language_model_loss(labels, logits, *args, **kwargs):
        if not state or state["depth"] >= depths:
            return real(labels, logits, *args, **kwargs)  # the main head, or not counted
        k = state["depth"] = state["depth"] + 1
        mask, _ = roll_tensor(state["mask"], shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=state["packed"])
        state["mask"] = mask
        if metric.vocab_parallel and shard is not None and logits.shape[-1] != shard:
            raise ValueError(f"{_NAME}: MTPMetric(vocab_parallel=True) needs the local vocab shard ({shard} wide) "
                             f"but depth {k}'s logits are {logits.shape[-1]} wide (gathered); use "
                             "vocab_parallel=False for gathered output")
        inputs = {"labels": labels, "completion_mask": mask}
        metric.accumulate(inputs, {"mtp_logits": logits.detach().transpose(0, 1)}, depth=k)  # [s, b, v]: a view
        loss = real(labels, logits, *args, **kwargs)
        metric.accumulate(inputs, {"mtp_losses": loss.detach()}, depth=k)
        return loss

    pre = gpt.register_forward_pre_hook(before, with_kwargs=True)
    earlier = gpt.__dict__.get("compute_language_model_loss")  # another wrapper's, kept on removal
    gpt.compute_language_model_loss = compute_language_model_loss

    def undo():
        pre.remove()
        if gpt.__dict__.get("compute_language_model_loss") is compute_language_model_loss:
            if earlier is None:
                del gpt.compute_language_model_loss
            else:
                gpt.compute_language_model_loss = earlier
        state.clear()

    hooks._undo.append(undo)
