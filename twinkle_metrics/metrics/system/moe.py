"""``MoERoutingMetric``: MoE routing health per layer (load balance, dead experts,
router entropy, dropped tokens, aux and z losses). ``integrations.router_hooks`` feeds it
from a megatron-core model in one line (``twinkle_metrics.register_router_hooks``)."""
from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any, Dict, Optional, Sequence

import torch

from parallel import MeshLike
from parallel.groups import ProcessGroup
from twinkle_metrics.core.config import Schema
from twinkle_metrics.core.metric import Metric
from twinkle_metrics.core.state import State
from twinkle_metrics.inputs.checks import fits_int64
from twinkle_metrics.inputs.checks import nan_policy as check_nan_policy
from twinkle_metrics.inputs.data_format import Inputs, Outputs
from twinkle_metrics.inputs.fields import Reads
from twinkle_metrics.kernels import dispatch as _triton
from twinkle_metrics.metrics.system.moe_stats import check_percentiles, summarize

_NAME = "MoERoutingMetric"
_FIELDS = ("routing_map", "expert_counts", "router_logits", "router_probs", "token_mask",
           "tokens_dropped", "aux_loss", "z_loss")


class MoERoutingMetric(Metric):
    """MoE routing health over an interval, per MoE layer and over all layers.

    From the count matrix ``c[layer, expert]`` of token-to-expert assignments (a token
    routed to k experts counts k times) accumulated over the interval:

    * ``load_imbalance``: ``max_e c / mean_e c`` (1 is perfect balance, E is one expert
      taking everything);
    * ``cv``: coefficient of variation ``std_e c / mean_e c`` (population std);
    * ``dead_expert_fraction``: share of experts that got no token in the interval;
    * ``router_entropy``: mean over tokens of ``-sum_e p_e log p_e`` (nats), ``p`` the
      softmax of ``router_logits`` or the rows of ``router_probs`` normalised to sum 1
      (pass the router's full scores: megatron-core's ``probs`` output holds only the
      top-k weights, so its entropy is at most ``log k``);
    * ``tokens_dropped`` (token-to-expert assignments dropped over expert capacity; left
      out when no call reported drops: not measured) and ``drop_fraction`` (dropped / assignments before
      dropping);
    * ``aux_loss`` and ``z_loss``: means over the calls that reported them (the values
      as given, e.g. megatron-core's losses unscaled by their coefficients).

    Keys: ``moe/layer{i}/{name}`` for each layer ``i`` that saw data in the interval
    (``i`` is the layer index given to ``accumulate``: 0-based, global over pipeline
    stages; megatron-core's ``layer_number - 1``), and ``moe/{name}`` over layers: the
    mean over those layers of the per-layer values (expert ``e`` of one layer has
    nothing to do with expert ``e`` of another, so counts are never summed across
    layers), except ``tokens_dropped`` (total) and ``drop_fraction`` (total dropped /
    total assignments). ``moe/load_imbalance_max`` is the worst layer's imbalance.
    ``{}`` when nothing was accumulated.

    Distributions (``percentiles=(0, 50, 90, 100)``, say; percentiles in [0, 100]),
    with ``p{q}`` written as ``q`` is (``p0``, ``p50``, ``p99.9``):

    * ``moe/layer{i}/tokens_per_expert_p{q}``: the ``q``-th percentile over the layer's
      experts of their token counts ``c[i, :]`` (``p0`` the least loaded expert, ``p100``
      the most); ``moe/tokens_per_expert_p{q}``: its mean over layers, as the other
      ``moe/{name}`` keys;
    * ``moe/{name}_p{q}`` for every per-layer statistic ``name`` above (``load_imbalance``,
      ``cv``, ``dead_expert_fraction``, ``router_entropy``, ``aux_loss``, ``z_loss``,
      ``drop_fraction``; not ``tokens_per_expert_p{q}``): the percentile across the
      layers that report it, e.g. ``moe/load_imbalance_p90``.

    A percentile is linear interpolation between the two nearest order statistics (as
    ``numpy.percentile``'s and ``torch.quantile``'s default): for sorted ``x[0..n-1]``,
    position ``q / 100 * (n - 1)``. Computed in ``compute`` from the merged counts and
    per-layer values: no state and nothing more to sync.

    Placement: every state is per layer and layers live on different pipeline stages,
    so every stage contributes (``State(scope="stage")``); TP ranks route the same
    tokens without sequence parallelism (replicas, counted once, checked to agree) and
    disjoint tokens with it (``sequence_parallel=True``: every TP rank contributes,
    ``scope="model"``). Data-parallel and context-parallel ranks route disjoint tokens
    and add up; expert parallelism does not change where routing happens (the router
    runs on every data-parallel rank for its own tokens).

    Input (``accumulate(inputs, outputs, layer=i)``, or ``observe(i, **fields)``);
    ``inputs`` is not read. ``outputs`` is a dict (or a list of them) with any of:

    * ``routing_map`` ``[..., E]`` bool/0-1 (needs ``layer``): counted per expert;
    * ``expert_counts`` ``[E]`` (with ``layer``) or ``[L, E]`` (without): integer counts;
    * ``router_logits`` / ``router_probs`` ``[..., E]`` float (need ``layer``): entropy;
      probs rows that sum to 0 (a token every expert dropped) are left out;
    * ``token_mask`` ``[...]`` (the leading dims of the tensors above): tokens to count
      (False: padding);
    * ``tokens_dropped``: a number or 0-d tensor (with ``layer``) or ``[L]`` (without);
    * ``aux_loss``, ``z_loss``: a number or 0-d tensor (need ``layer``), one call each.

    Without ``layer``, keys other than these are ignored (a ``MetricCollection`` passes
    the same outputs to every metric); with ``layer`` they raise.

    Example:
        >>> import torch
        >>> m = MoERoutingMetric(num_layers=1, num_experts=4, per_layer=False)
        >>> routing_map = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
        >>> _ = m.observe(0, routing_map=routing_map)  # counts 3, 2, 1, 0: one dead expert
        >>> {k: round(v, 4) for k, v in m.calculate().items()}  # doctest: +NORMALIZE_WHITESPACE
        {'moe/load_imbalance': 2.0, 'moe/cv': 0.7454, 'moe/dead_expert_fraction': 0.25,
         'moe/load_imbalance_max': 2.0}

    With a megatron-core model::

        moe = MoERoutingMetric(mesh, num_layers=4, num_experts=8, sequence_parallel=True)
        hooks = register_router_hooks(model, moe)      # megatron-core TopKRouter modules
        ...                                            # train as usual
        results = moe.calculate()                      # {'moe/load_imbalance': ..., ...}

    Args:
        num_layers: number of layer slots (megatron-core's ``config.num_layers``; dense
            layers simply stay empty and report nothing).
        num_experts: experts per MoE layer.
        sequence_parallel: TP ranks route disjoint tokens (Megatron sequence
            parallelism, required by megatron-core for MoE training with TP > 1).
        per_layer: also report the ``moe/layer{i}/...`` keys.
        nan_policy: ``'propagate'`` (default): a non-finite router logit/prob or loss
            shows as NaN/inf in the keys it feeds; ``'skip'``: that token's entropy or
            that loss value is left out. Both report ``moe/nonfinite`` (tokens + losses)
            when > 0.
        percentiles: percentiles in [0, 100] to report (see above); None (default): none.
    """

    reads = Reads(outputs=("routing_map?", "router_logits?", "router_probs?", "token_mask?", "aux_loss?",
                           "z_loss?", "tokens_dropped?"))
    result_keys = ('moe/load_imbalance', 'moe/cv', 'moe/dead_expert_fraction', 'moe/router_entropy', 'moe/aux_loss',
                   'moe/z_loss', 'moe/tokens_per_expert_p*', 'moe/*_p*', 'moe/load_imbalance_max',
                   'moe/tokens_dropped', 'moe/drop_fraction', 'moe/nonfinite', 'moe/layer*/*')

    unsliceable = "router statistics are per token of a layer, not per sequence"

    # percentiles are compute-only: ranks must agree on the keys, a checkpoint loads whatever it was
    schema = Schema(exclude=("per_layer",), sync_only=("percentiles",))

    def __init__(self, device_mesh: MeshLike = None, process_group: ProcessGroup = None, *, num_layers: int,
                 num_experts: int, sequence_parallel: bool = False, per_layer: bool = True,
                 nan_policy: str = "propagate", percentiles: Optional[Sequence[float]] = None,
                 **kwargs: Any) -> None:
        super().__init__(device_mesh, process_group, **kwargs)
        for name, value in (("num_layers", num_layers), ("num_experts", num_experts)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{_NAME}: {name} must be a positive int, got {value!r}")
        self.num_layers, self.num_experts = num_layers, num_experts
        self.sequence_parallel = bool(sequence_parallel)
        self.per_layer = bool(per_layer)
        self.nan_policy = check_nan_policy(_NAME, nan_policy)
        self.percentiles = check_percentiles(_NAME, percentiles)
        # Declared per instance: the scope depends on sequence_parallel.
        scope = "model" if self.sequence_parallel else "stage"
        L, E = num_layers, num_experts
        for name, dtype, shape in (("counts", torch.int64, (L, E)), ("dropped", torch.int64, (L,)),
                                   ("entropy_sum", torch.float64, (L,)),
                                   ("entropy_tokens", torch.int64, (L,)),
                                   ("aux_sum", torch.float64, (L,)), ("aux_calls", torch.int64, (L,)),
                                   ("z_sum", torch.float64, (L,)), ("z_calls", torch.int64, (L,)),
                                   ("nonfinite", torch.int64, (L,))):
            self.add_state(name, State("sum", dtype, shape=shape, scope=scope))
        # calls that reported drops: without one, drops were not measured (not "0 dropped")
        if not self.sequence_parallel:  # why TP replicas could disagree
            self.tp_mismatch_hint = ("TP ranks routed different tokens: under sequence parallelism build the "
                                     "metric with sequence_parallel=True")
        self.add_state("drop_reports", State("sum", torch.int64, scope=scope))

    # ------------------------------------------------------------------ input
    def observe(self, layer: int, **fields: Any) -> "MoERoutingMetric":
        """One layer's routing: ``observe(3, routing_map=m, router_logits=x, aux_loss=a)``."""
        return self.accumulate(None, fields, layer=layer)

    def update(self, inputs: Inputs, outputs: Outputs, layer: Optional[int] = None, **kwargs: Any) -> Dict[str, Any]:
        if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int)
                                  or not 0 <= layer < self.num_layers):
            raise ValueError(f"{_NAME}: layer must be an int in [0, {self.num_layers}), got {layer!r}; "
                             "pass the global 0-based MoE layer index (megatron-core: "
                             "layer_number - 1) and size num_layers to the whole model")
        if outputs is None:
            return {}
        items = outputs if isinstance(outputs, (list, tuple)) else [outputs]
        out: Dict[str, torch.Tensor] = {}
        for i, item in enumerate(items):
            where = f"outputs[{i}]" if isinstance(outputs, (list, tuple)) else "outputs"
            if not isinstance(item, Mapping):
                raise TypeError(f"{_NAME}: {where} must be a dict of routing fields {list(_FIELDS)}, "
                                f"got {type(item).__name__}")
            for name, value in self._one(item, layer, where).items():
                out[name] = value if name not in out else out[name] + value
        return out

    def _one(self, o: Mapping, layer: Optional[int], where: str) -> Dict[str, Any]:
        f = self._fields(o, layer, where)
        if f is None:
            return {}
        out: Optional[Dict[str, Any]] = None
        if self._fuses(f, layer):
            out = _triton.attempt("MoE routing statistics", self._fused, f, layer)
        out = self._torch(f, layer) if out is None else out
        if "tokens_dropped" in f:
            out = {**out, "drop_reports": 1}
        return out

    def _fields(self, o: Mapping, layer: Optional[int], where: str) -> Optional[Dict[str, Any]]:
        """The call's fields, validated (nothing is computed): tensors detached, the router
        tensors as given, the losses as 0-d float tensors, the dropped count as an int or
        an int64 tensor; ``device``: where the contributions go. None when it has none."""
        if layer is not None:
            unknown = [k for k in o if k not in _FIELDS]
            if unknown:
                close = difflib.get_close_matches(str(unknown[0]), _FIELDS, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"{_NAME}: unknown field {unknown[0]!r} in {where}{hint}; expected "
                                 f"any of {list(_FIELDS)}")
        fields = {k: o[k] for k in _FIELDS if o.get(k) is not None}
        if not fields:
            return None
        if layer is None:
            per_layer = [k for k in fields if k in ("routing_map", "router_logits", "router_probs",
                                                    "token_mask", "aux_loss", "z_loss")]
            if per_layer:
                raise ValueError(f"{_NAME}: {where}[{per_layer[0]!r}] belongs to one layer but no layer "
                                 "was given; pass accumulate(..., layer=i) or observe(i, ...)")
        L, E = self.num_layers, self.num_experts
        fields["device"] = next((v.device for v in fields.values() if isinstance(v, torch.Tensor)), self.device)
        lead = None  # leading (token) dims shared by routing_map, logits, probs, mask
        for key in ("routing_map", "router_logits", "router_probs"):
            if key in fields:
                t = _tensor(key, fields[key], where)
                if t.dim() < 1 or t.shape[-1] != E:
                    raise ValueError(f"{_NAME}: {where}[{key!r}] must be [..., num_experts={E}], got "
                                     f"shape {list(t.shape)}; pass the router's [tokens, experts] "
                                     "tensor of this layer")
                if lead is not None and tuple(t.shape[:-1]) != lead[1]:
                    raise ValueError(f"{_NAME}: {where}[{key!r}] has tokens {list(t.shape[:-1])} but "
                                     f"{lead[0]} has {list(lead[1])}; pass tensors of the same tokens")
                lead = lead or (key, tuple(t.shape[:-1]))
                fields[key] = t
        if "token_mask" in fields:
            mask = _tensor("token_mask", fields["token_mask"], where)
            if mask.is_floating_point() or mask.is_complex():
                raise TypeError(f"{_NAME}: {where}['token_mask'] must be bool or integer (True: count "
                                f"the token), got {mask.dtype}")
            if lead is None or tuple(mask.shape) != lead[1]:
                want = list(lead[1]) if lead else "the tokens of routing_map/router_logits/router_probs"
                raise ValueError(f"{_NAME}: {where}['token_mask'] has shape {list(mask.shape)}, expected "
                                 f"{want}; pass one flag per routed token")
            fields["token_mask"] = mask
        m = fields.get("routing_map")
        if m is not None and (m.is_floating_point() or m.is_complex()):
            raise TypeError(f"{_NAME}: {where}['routing_map'] must be bool or integer 0/1, got "
                            f"{m.dtype}; pass the router's boolean routing_map")
        if "expert_counts" in fields:
            c = _tensor("expert_counts", fields["expert_counts"], where)
            counts_shape = (E,) if layer is not None else (L, E)
            if c.is_floating_point() or c.is_complex() or tuple(c.shape) != counts_shape:
                raise ValueError(f"{_NAME}: {where}['expert_counts'] must be an integer tensor of shape "
                                 f"{list(counts_shape)} ({'one layer' if layer is not None else 'every layer'}), "
                                 f"got {c.dtype} {list(c.shape)}")
            fields["expert_counts"] = c
        if "router_logits" in fields and "router_probs" in fields:
            raise ValueError(f"{_NAME}: {where} has both router_logits and router_probs; pass one "
                             "(the entropy is taken from it)")
        for key in ("router_logits", "router_probs"):
            if key in fields and not fields[key].is_floating_point():
                raise TypeError(f"{_NAME}: {where}[{key!r}] must be a floating tensor, got {fields[key].dtype}")
        if "tokens_dropped" in fields:
            d = fields["tokens_dropped"]
            if isinstance(d, torch.Tensor):
                drop_shape = () if layer is not None else (L,)
                if d.is_floating_point() or d.is_complex() or tuple(d.shape) != drop_shape:
                    raise ValueError(f"{_NAME}: {where}['tokens_dropped'] must be an integer "
                                     f"{'scalar' if layer is not None else f'tensor [{L}]'}, got "
                                     f"{d.dtype} {list(d.shape)}")
                fields["tokens_dropped"] = d.detach().to(torch.int64)
            elif isinstance(d, bool) or not isinstance(d, int) or layer is None:
                raise TypeError(f"{_NAME}: {where}['tokens_dropped'] must be an int (with layer) or an "
                                f"integer tensor [{L}] (without), got {d!r}")
            else:
                fits_int64(_NAME, f"{where}['tokens_dropped']", d)
        for key in ("aux_loss", "z_loss"):
            if key in fields:
                fields[key] = self._loss(fields[key], key, where, fields["device"])
        return fields

    def _fuses(self, f: Dict[str, Any], layer: Optional[int]) -> bool:
        """Whether one layer's call takes the two-kernel path (``kernels.triton_moe``): on
        CUDA with the kernels enabled, every tensor on one device, no ``expert_counts``."""
        if layer is None or "expert_counts" in f:
            return False
        tensors = [v for k, v in f.items() if k != "device" and isinstance(v, torch.Tensor)]
        scores = f.get("router_logits", f.get("router_probs"))
        return (bool(tensors) and all(t.device == f["device"] for t in tensors) and _triton.device_ok(tensors[0])
                and (scores is None or scores.dtype in _triton.DTYPES + (torch.float64,)))

    def _fused(self, f: Dict[str, Any], layer: int) -> Dict[str, torch.Tensor]:
        from twinkle_metrics.kernels import moe_triton as triton_moe
        return triton_moe.layer_rows(
            layers=self.num_layers, layer=layer, experts=self.num_experts, device=f["device"],
            routing_map=f.get("routing_map"), scores=f.get("router_logits", f.get("router_probs")),
            from_logits="router_logits" in f, token_mask=f.get("token_mask"), aux=f.get("aux_loss"),
            z=f.get("z_loss"), dropped=f.get("tokens_dropped"), skip=self.nan_policy == "skip")

    def _torch(self, fields: Dict[str, Any], layer: Optional[int]) -> Dict[str, torch.Tensor]:
        """The contributions of validated ``fields`` (``_fields``), in torch."""
        L, E = self.num_layers, self.num_experts
        device = fields["device"]
        out: Dict[str, torch.Tensor] = {}

        # This layer's scalar contributions, placed into [L] rows at the end: one
        # stack, one zeros and one copy per dtype instead of two launches per state.
        ints: Dict[str, torch.Tensor] = {}
        floats: Dict[str, torch.Tensor] = {}

        def row(values: torch.Tensor, dtype) -> torch.Tensor:
            """A [L, ...] contribution with ``values`` in the row of ``layer``."""
            full = torch.zeros((L,) + tuple(values.shape), dtype=dtype, device=values.device)
            full[layer] = values.to(dtype)
            return full

        mask = fields.get("token_mask")
        if mask is not None:
            mask = (mask != 0).reshape(-1).to(device)
        if "routing_map" in fields:
            m = (fields["routing_map"] != 0).reshape(-1, E)
            if mask is not None:
                m = m & mask.unsqueeze(-1)
            out["counts"] = row(m.sum(0, dtype=torch.int64), torch.int64)
        if "expert_counts" in fields:
            c = fields["expert_counts"].to(torch.int64)
            c = row(c, torch.int64) if layer is not None else c
            out["counts"] = c if "counts" not in out else out["counts"] + c
        for key in ("router_logits", "router_probs"):
            if key not in fields:
                continue
            h, valid, bad = _entropy(fields[key].reshape(-1, E), key == "router_logits")
            keep = valid if mask is None else valid & mask
            ints["nonfinite"] = (bad & keep).sum()
            if self.nan_policy == "skip":
                keep = keep & ~bad
            h = torch.where(keep, h, torch.zeros((), dtype=h.dtype, device=h.device))
            floats["entropy_sum"] = h.sum(dtype=torch.float64)
            ints["entropy_tokens"] = keep.sum()
        if "tokens_dropped" in fields:
            d = fields["tokens_dropped"]
            if not isinstance(d, torch.Tensor):
                d = torch.full((), d, dtype=torch.int64, device=device)  # a fill: no host copy
            if layer is not None:
                ints["dropped"] = d
            else:
                out["dropped"] = d
        losses = [(key, fields[key].to(torch.float64)) for key in ("aux_loss", "z_loss") if key in fields]
        if losses:
            # both losses at once: one finiteness probe for the pair
            v = torch.stack([x for _, x in losses]) if len(losses) > 1 else losses[0][1].reshape(1)
            bad = torch.isnan(v * 0.0)  # NaN or inf
            if self.nan_policy == "skip":
                v = torch.where(bad, 0.0, v)
                calls = (~bad).to(torch.int64)
            else:
                calls = torch.ones(len(losses), dtype=torch.int64, device=v.device)
            n_bad = bad.sum()
            ints["nonfinite"] = n_bad + ints["nonfinite"] if "nonfinite" in ints else n_bad
            for j, (key, _) in enumerate(losses):
                prefix = "aux" if key == "aux_loss" else "z"
                floats[prefix + "_sum"] = v[j]
                ints[prefix + "_calls"] = calls[j]
        for values, dtype in ((ints, torch.int64), (floats, torch.float64)):
            if values:
                full = row(torch.stack([x.to(device=device, dtype=dtype, non_blocking=True)
                                        for x in values.values()]), dtype)
                out.update({name: full[:, j] for j, name in enumerate(values)})
        return out

    @staticmethod
    def _loss(v, key: str, where: str, device) -> torch.Tensor:
        """One layer's aux or z loss as a 0-d float tensor (a number: float64, on ``device``)."""
        if isinstance(v, torch.Tensor):
            if v.numel() != 1 or not v.is_floating_point():
                raise ValueError(f"{_NAME}: {where}[{key!r}] must be one float value (a number or a "
                                 f"0-d tensor), got {v.dtype} {list(v.shape)}")
            return v.detach().reshape(())
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{_NAME}: {where}[{key!r}] must be a number or a 0-d tensor, got "
                            f"{type(v).__name__}")
        return torch.full((), float(v), dtype=torch.float64, device=device)

    # ---------------------------------------------------------------- results
    def compute(self, s: Mapping[str, Any]) -> Dict[str, Any]:
        return summarize(s, self.num_layers, self.num_experts, self.percentiles, self.per_layer)


def _tensor(key: str, value, where: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{_NAME}: {where}[{key!r}] must be a tensor, got {type(value).__name__}")
    return value.detach()


def _entropy(x: torch.Tensor, from_logits: bool):
    """Per-token entropy (nats) of ``[tokens, E]`` logits or probabilities, with a
    mask of tokens that have a distribution and one of non-finite results."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    if from_logits:
        logp = torch.log_softmax(x, dim=-1)
        p = logp.exp()
        # 0 * log 0 = 0 for experts masked with -inf logits; NaN stays NaN (NaN != 0)
        h = -torch.where(p == 0, torch.zeros((), dtype=p.dtype, device=p.device), p * logp).sum(-1)
        valid = torch.ones(h.shape, dtype=torch.bool, device=h.device)
    else:
        total = x.sum(-1, keepdim=True)
        valid = total.squeeze(-1) != 0
        p = x / torch.where(total == 0, torch.ones_like(total), total)
        h = -torch.special.xlogy(p, p).sum(-1)
    return h, valid, torch.isnan(h * 0.0)  # NaN or inf: two kernels, isfinite takes five

