"""``register_router_hooks``: feeds a ``MoERoutingMetric`` from every megatron-core
``TopKRouter`` of a model in one line (routing map, router entropy, dropped tokens, the aux
and z losses the router computed). megatron-core is imported only when it is called."""
from __future__ import annotations

from typing import Any, Dict, List, Sequence, Union

import torch

from twinkle_metrics.integrations.megatron import Hooks, check_when
from twinkle_metrics.metrics.system.moe import MoERoutingMetric

#: megatron-core's router load-balancing types -> (tracker name, group its value is a part of)
_AUX_TYPES = {"aux_loss": ("load_balancing_loss", "tp_cp_group"),
              "seq_aux_loss": ("seq_load_balancing_loss", "tp_cp_group"),
              "global_aux_loss": ("global_load_balancing_loss", "tp_dp_cp_group")}


class RouterHooks(Hooks):
    """What ``register_router_hooks`` installed; ``remove()`` takes all of it off.

    Attributes:
        layers: the layer index of each hooked router, in module order.
    """

    def __init__(self) -> None:
        super().__init__()
        self.layers: List[int] = []


def register_router_hooks(model: Union[torch.nn.Module, Sequence[torch.nn.Module]], metric: MoERoutingMetric, *,
                          when: str = "train") -> RouterHooks:
    """Feed ``metric`` from every megatron-core ``TopKRouter`` of ``model`` (one line).

    For each router call: the ``routing_map`` it returns (after capacity dropping;
    tokens its ``padding_mask`` marks as padding are left out), the entropy of its
    full score distribution (softmax of the gating logits, or the normalised sigmoid
    scores for ``moe_router_score_function='sigmoid'``, as megatron-core's aux loss
    scores them), the assignments dropped over capacity (``topk x tokens - routed``;
    not reported with ``moe_pad_expert_input_to_capacity``), and the aux and z losses
    the router itself computed (read from megatron-core's aux-loss tracker, unscaled by
    their coefficients; enabled load-balancing types are summed into ``aux_loss``).

    Megatron splits a loss over the ranks that share its tokens (the TP x CP group)
    so that their values add up to the loss; each value is multiplied by that group's
    size here, so that the mean over ranks and calls the metric reports is the loss of
    a microbatch, averaged over microbatches and data-parallel ranks as Megatron logs
    ``load_balancing_loss``. (Megatron's logged ``z_loss`` is the logging rank's value
    divided by TP x CP size; ours is the mean over ranks of the undivided one.)

    The layer index is where megatron-core's tracker records the router:
    ``router.layer_number - 1`` (global over pipeline stages), and for a
    multi-token-prediction router of megatron-core 0.19 (``is_mtp_layer``, numbered from 1
    within the MTP block) ``config.num_layers + layer_number - 1``, so MTP layers follow
    the decoder's (build the metric with ``num_layers = config.num_layers +
    config.mtp_num_layers``); the router's position in ``model`` when no layer number was
    set (global only when ``model`` holds every layer).

    Args:
        model: a module or a list of modules (virtual-pipeline chunks).
        metric: the ``MoERoutingMetric`` to feed; ``num_experts`` must match the routers.
        when: ``'train'`` (default): only calls in training mode with autograd enabled,
            as megatron-core counts its aux losses, so evaluation passes are left out and
            a token is counted once under activation recomputation (the checkpointed
            first pass runs without autograd); ``'always'``: every call.

    Returns:
        ``RouterHooks``; ``.remove()`` takes the hooks off (also as a context manager).
    """
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router import TopKRouter

    if not isinstance(metric, MoERoutingMetric):
        raise TypeError(f"register_router_hooks: metric must be a MoERoutingMetric, got "
                        f"{type(metric).__name__}")
    check_when("register_router_hooks", when)
    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    routers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)]
    if not routers:
        raise ValueError("register_router_hooks: no megatron-core TopKRouter in the model; build it with "
                         "num_moe_experts set (or pass the model chunks that hold the MoE layers)")
    hooks = RouterHooks()
    try:
        for pos, router in enumerate(routers):
            layer = _layer_index(router, pos)
            if not 0 <= layer < metric.num_layers:
                raise ValueError(f"register_router_hooks: a router has layer index {layer} but the metric "
                                 f"has num_layers={metric.num_layers}; build the metric with "
                                 "num_layers = config.num_layers (plus MTP layers)")
            if router.num_experts != metric.num_experts:
                raise ValueError(f"register_router_hooks: router of layer {layer} has "
                                 f"{router.num_experts} experts, the metric num_experts="
                                 f"{metric.num_experts}; build the metric with the model's num_moe_experts")
            _hook_router(router, layer, metric, hooks, when, moe_utils)
            hooks.layers.append(layer)
    except BaseException:
        hooks.remove()
        raise
    return hooks


def _layer_index(router, pos: int) -> int:
    """Where megatron-core's tracker records ``router`` (0-based), ``pos`` without a number."""
    if router.layer_number is None:
        return pos
    if getattr(router, "is_mtp_layer", False):  # 0.19: MTP routers count from 1 after the decoder
        return router.config.num_layers + router.layer_number - 1
    return router.layer_number - 1


def _tracker_values(moe_utils) -> Dict[str, torch.Tensor]:
    """``{name: per-layer values}`` of megatron-core's aux-loss tracker, read in place:
    ``get_moe_metrics_tracker()`` where it exists (0.18+: the older getter warns and
    returns a copy), else ``get_moe_layer_wise_logging_tracker()``."""
    get = getattr(moe_utils, "get_moe_metrics_tracker", None)
    if get is not None:
        return {name: entry.values for name, entry in get().metrics.items()}
    return {name: entry["values"] for name, entry in moe_utils.get_moe_layer_wise_logging_tracker().items()}


def _group_size(group) -> int:
    return group.size() if group is not None else 1


def _hook_router(router, layer: int, metric: MoERoutingMetric, hooks: RouterHooks, when: str,
                 moe_utils) -> None:
    stash: Dict[str, Any] = {}
    cfg = router.config

    def active() -> bool:
        return when == "always" or (router.training and torch.is_grad_enabled())

    def losses():
        """(tracker name, group size, is z) of the losses this call will record."""
        if router.layer_number is None or not (router.training and torch.is_grad_enabled()):
            return []
        out = [(name, _group_size(getattr(router, group)), False)
               for kind, (name, group) in _AUX_TYPES.items() if router.get_aux_loss_coeff(kind) > 0]
        if cfg.moe_z_loss_coeff is not None:
            out.append(("z_loss", _group_size(router.tp_cp_group), True))
        return out

    # The gating logits are not part of the router's output: keep the ones this call makes.
    gating = router.gating

    def keep_logits(*args, **kwargs):
        logits = gating(*args, **kwargs)
        if active():
            stash["logits"] = logits.detach()
        return logits

    router.gating = keep_logits

    def before(module, args, kwargs):
        stash.clear()
        if not active():
            return
        tracker = _tracker_values(moe_utils)
        stash["before"] = {name: tracker[name][layer].detach().clone()
                           for name, _, _ in losses() if name in tracker}

    def after(module, args, kwargs, output):
        if not active():
            return
        _, routing_map = output
        fields: Dict[str, Any] = {"routing_map": routing_map}
        padding = kwargs.get("padding_mask", args[1] if len(args) > 1 else None)
        valid = None
        if padding is not None:  # megatron-core's router: True marks padding
            valid = ~padding.reshape(-1).bool()
            fields["token_mask"] = valid
        logits = stash.pop("logits", None)
        if logits is not None:
            logits = logits.reshape(-1, router.num_experts)
            if router.score_function == "sigmoid":
                fields["router_probs"] = torch.sigmoid(logits.float())
            else:
                fields["router_logits"] = logits
        if cfg.moe_expert_capacity_factor is not None and not cfg.moe_pad_expert_input_to_capacity:
            kept = routing_map if valid is None else routing_map & valid.unsqueeze(-1)
            tokens = routing_map.shape[0] if valid is None else valid.sum()
            fields["tokens_dropped"] = router.topk * tokens - kept.sum()
        tracker = _tracker_values(moe_utils)
        start = stash.pop("before", {})
        aux = None
        for name, size, is_z in losses():
            if name not in tracker:
                continue
            value = tracker[name][layer].detach()
            if name in start:
                value = value - start[name]
            value = value * size
            if is_z:
                fields["z_loss"] = value
            else:
                aux = value if aux is None else aux + value
        if aux is not None:
            fields["aux_loss"] = aux
        metric.accumulate(None, fields, layer=layer)

    pre = router.register_forward_pre_hook(before, with_kwargs=True)
    post = router.register_forward_hook(after, with_kwargs=True)

    def undo():
        pre.remove()
        post.remove()
        if router.__dict__.get("gating") is keep_logits:
            del router.gating

    hooks._undo.append(undo)
