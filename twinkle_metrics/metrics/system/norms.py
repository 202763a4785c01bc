"""``ModelNormMetric``: global parameter and gradient L2 norms, each element counted once."""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from parallel import MeshLike, group_rank
from parallel.groups import ProcessGroup, global_rank, group_ranks
from twinkle_metrics.core import compat as _compat
from twinkle_metrics.core.config import Schema
from twinkle_metrics.core.metric import Metric
from twinkle_metrics.core.state import State
from twinkle_metrics.inputs.data_format import Inputs, Outputs

_NAME = "ModelNormMetric"
_GRAD, _PARAM = "grad_sq/", "param_sq/"
GroupRule = Union[str, Callable[[str, torch.nn.Parameter], bool]]


def _placed(dtype=torch.float64) -> State:
    # Every TP x PP rank holds a disjoint part (scope "model"), the data group too: the
    # sync sums over every rank of the world. "last": the interval reports its last call.
    return State("sum", dtype, scope="model", local="last")


class ModelNormMetric(Metric):
    """L2 norms of the parameters and gradients of a (TP x PP x DP x EP sharded) model.

    Counts every element of the logical model exactly once, with megatron-core's rules
    (``get_grad_norm_fp32`` / ``count_zeros_fp32`` and the grads its optimizer passes
    them), so ``norm/grad`` equals the grad norm Megatron clips with:

    - a parameter not marked ``tensor_model_parallel`` (layer norms, row-parallel
      biases, position embeddings) is a replica on every rank of the TP group it is
      replicated over and counts on rank 0 of that group only; TP shards count on every
      TP rank. For an expert parameter that group is the expert TP group, which need not
      be the dense one (TP4 with expert TP 1): the ``tp_group`` of the innermost module
      holding one (megatron-core's expert layers hold ``pg_collection.expt_tp`` there),
      else the mesh's TP group (experts outside megatron-core's layers, as DeepSpeed's);
      as megatron-core 0.19's ``param_is_not_tensor_parallel_duplicate(expert_tp_group=)``;
    - a parameter marked ``shared`` (the copy of the word embedding on the last
      pipeline stage, tied to the first stage's) does not count;
    - pipeline stages (and the chunks of a virtual pipeline) hold different layers:
      each counts its own;
    - dense gradients are the same on every rank of the data group (DP x CP) after
      DDP's all-reduce, so only data-group rank 0 contributes them; expert parameters
      (``allreduce=False``, i.e. expert parallel) differ across EP ranks and are
      replicas over the expert data-parallel group, so every EP rank contributes its
      own experts from expert-DP rank 0;
    - megatron-core 0.19's GTP weight rematerialisation shards a parameter marked
      ``is_gtp_weight_remat`` over the GTP group, which lies inside the data group: each
      GTP peer counts its own shard (the peers in the GTP group of data-group rank 0),
      every other parameter counts as above (as ``param_is_not_gtp_duplicate``);
    - with megatron-core's distributed optimizer each data-parallel rank owns a
      contiguous part of each grad buffer bucket and holds the reduced gradient only
      there: every rank contributes exactly the part it owns (read from the DDP
      wrapper's buffers), and nothing else.

    Gradients are ``param.main_grad`` when present (megatron-core DDP), else
    ``param.grad``; parameters without either contribute to the parameter norm only.
    Every norm is accumulated in float64 on the device, without host waits.

    Call it where the gradients are final and not yet clipped: after
    ``forward_backward_func`` (whose ``finalize_model_grads`` has reduced them over
    DP x CP and the embedding group) and before ``optimizer.step()`` (which clips). It
    reads the model, not the batch, so every rank calls it, every pipeline stage
    included::

        norms = ModelNormMetric(mesh, model=model_chunks)    # DDP-wrapped chunks
        losses = forward_backward_func(...)
        norms.accumulate(None, None)                          # grads final, not clipped
        optimizer.step()
        ...
        results = metrics.calculate()   # {"norm/grad": ..., "norm/grad/layer01": ...}

    Keys: ``norm/grad`` and ``norm/param`` (global L2 norms), ``norm/grad/{group}`` and
    ``norm/param/{group}`` (per group, below), ``norm/grad_zeros`` (gradient elements
    equal to 0, Megatron's ``num_zeros_in_grad``) and ``norm/zero_grad_fraction`` (that
    count over the number of gradient elements). Grad keys appear once some gradient
    existed; ``{}`` when nothing was accumulated. When ``accumulate`` is called several
    times in one interval (once per step between two ``calculate()``), the interval
    reports the last call's norms, as Twinkle reports ``grad_norm`` per step.

    Args:
        model: the model: a module or a list of modules (virtual pipeline chunks), as
            passed to megatron-core's schedules; may instead be given to each
            ``accumulate(..., model=...)``.
        groups: per-group norms. ``None`` (default): one group per transformer layer,
            ``layer{N}`` with Megatron's global 1-based ``layer_number`` (so layers on
            different pipeline stages do not collide; zero-padded to the width of
            ``config.num_layers``), and every other parameter by its first two module
            names (``embedding.word_embeddings``, ``decoder.final_layernorm``,
            ``output_layer``), wrapper prefixes (``module.``) removed. A mapping ``{name:
            rule}`` instead, where a rule is a parameter-name prefix or a callable
            ``(name, param) -> bool``; the first matching rule wins and parameters no
            rule matches count in the totals only. Names are those of the chunk's
            ``named_parameters()`` without ``module.`` prefixes, so they are local to a
            pipeline stage. ``{}``: totals only.
        distributed_optimizer: whether megatron-core's distributed optimizer shards the
            gradients; ``None`` (default) reads it from the DDP wrappers'
            ``ddp_config.use_distributed_optimizer``. Needs the DDP-wrapped chunks.
        count_zeros: count zero gradient elements (one ``count_nonzero`` per
            parameter); ``False`` drops the two zero-count keys.

    Example:
        >>> import torch
        >>> lin = torch.nn.Linear(2, 1, bias=False)
        >>> with torch.no_grad():
        ...     _ = lin.weight.copy_(torch.tensor([[3.0, 4.0]]))
        >>> lin.weight.grad = torch.tensor([[0.0, 2.0]])
        >>> m = ModelNormMetric(model=lin)
        >>> _ = m.accumulate(None, None)  # after backward, before clipping
        >>> m.calculate()  # doctest: +NORMALIZE_WHITESPACE
        {'norm/param': 5.0, 'norm/grad': 2.0, 'norm/grad_zeros': 1, 'norm/zero_grad_fraction': 0.5,
         'norm/grad/weight': 2.0, 'norm/param/weight': 5.0}
    """

    result_keys = ('norm/param', 'norm/grad', 'norm/grad_zeros', 'norm/zero_grad_fraction', 'norm/param/*',
                   'norm/grad/*')

    unsliceable = "it reads the model, not the batch"
    schema = Schema(exclude=("model",))  # what it reads, not what a state means

    grad_sq = _placed()
    param_sq = _placed()
    grad_zeros = _placed(torch.int64)
    grad_numel = _placed(torch.int64)
    seen = State("max", torch.int64, default=0, scope="model", local="last")  # 1: accumulated

    def __init__(self, device_mesh: MeshLike = None, process_group: ProcessGroup = None, *,
                 model: Union[torch.nn.Module, Sequence[torch.nn.Module], None] = None,
                 groups: Optional[Mapping[str, GroupRule]] = None,
                 distributed_optimizer: Optional[bool] = None, count_zeros: bool = True, **kwargs: Any) -> None:
        super().__init__(device_mesh, process_group, **kwargs)
        if groups is not None:
            if not isinstance(groups, Mapping):
                raise TypeError(f"{_NAME}: groups must be a mapping {{name: prefix or callable}} "
                                f"or None, got {type(groups).__name__}")
            for name, rule in groups.items():
                if not isinstance(name, str) or not name or "/" in name:
                    raise ValueError(f"{_NAME}: group names must be non-empty strings without "
                                     f"'/', got {name!r}")
                if not (isinstance(rule, str) or callable(rule)):
                    raise TypeError(f"{_NAME}: groups[{name!r}] must be a parameter-name prefix "
                                    f"or a callable (name, param) -> bool, got "
                                    f"{type(rule).__name__}")
        if distributed_optimizer is not None and not isinstance(distributed_optimizer, bool):
            raise TypeError(f"{_NAME}: distributed_optimizer must be True, False or None (read "
                            f"from the DDP wrappers), got {distributed_optimizer!r}")
        self.model = _chunks(model) if model is not None else None
        self.groups = dict(groups) if groups is not None else None
        self.distributed_optimizer = distributed_optimizer
        self.count_zeros = bool(count_zeros)
        self._plans: Dict[Tuple[int, ...], "_Plan"] = {}
        # a group's squared-norm states: per-layer groups differ between pipeline stages,
        # so a stage creates the others' at calculate(), holding 0
        self.add_state_family(_GRAD, _placed())
        self.add_state_family(_PARAM, _placed())

    # ----------------------------------------------------------------- update
    def update(self, inputs: Inputs = None, outputs: Outputs = None, *,
               model: Union[torch.nn.Module, Sequence[torch.nn.Module], None] = None, **kwargs: Any) -> Dict[str, Any]:
        chunks = _chunks(model) if model is not None else self.model
        if chunks is None:
            raise ValueError(f"{_NAME}.accumulate: no model; pass model=... to the constructor "
                             "or to accumulate(None, None, model=model_chunks)")
        plan = self._plan(chunks)
        params, grads, param_gids, grad_gids = [], [], [], []
        numel = 0
        for param, gid, span in plan.entries:
            params.append(_part(param.detach(), span))
            param_gids.append(gid)
            grad = getattr(param, "main_grad", None)
            if grad is None:
                grad = param.grad
            if grad is not None:
                grad = _part(grad.detach(), span)
                grads.append(grad)
                grad_gids.append(gid)
                numel += grad.numel()
        out: Dict[str, Any] = {"seen": 1, "grad_numel": numel}
        out["param_sq"], per_param = plan.fold(params, param_gids)
        out["grad_sq"], per_grad = plan.fold(grads, grad_gids)
        for name, p, g in zip(plan.group_names, per_param, per_grad):
            out[_PARAM + name], out[_GRAD + name] = p, g
        if self.count_zeros and grads:
            nonzero = torch.stack([torch.count_nonzero(g) for g in grads]).sum()
            out["grad_zeros"] = numel - nonzero
        else:
            out["grad_zeros"] = 0
        return out

    def compute(self, s: Mapping[str, Any]) -> Dict[str, Any]:
        if not s["seen"]:
            return {}
        out: Dict[str, Any] = {"norm/param": math.sqrt(s["param_sq"])}
        has_grads = s["grad_numel"] > 0
        if has_grads:
            out["norm/grad"] = math.sqrt(s["grad_sq"])
            if self.count_zeros:
                out["norm/grad_zeros"] = s["grad_zeros"]
                out["norm/zero_grad_fraction"] = s["grad_zeros"] / s["grad_numel"]
        for name in sorted(s):
            if name.startswith(_PARAM):  # a group's
                out[f"norm/param/{name[len(_PARAM):]}"] = math.sqrt(s[name])
            elif name.startswith(_GRAD) and has_grads:
                out[f"norm/grad/{name[len(_GRAD):]}"] = math.sqrt(s[name])
        return out

    # ------------------------------------------------------------------- plan
    def _plan(self, chunks: Tuple[torch.nn.Module, ...]) -> "_Plan":
        """Which parameters (or parts) this rank counts, and their groups: attributes
        and ranks only, decided once per model (host-side, no device read)."""
        key = tuple(id(c) for c in chunks)
        plan = self._plans.get(key)
        if plan is not None and all(a is b for a, b in zip(plan.chunks, chunks)):
            return plan
        mesh = self.resolve_mesh()
        tp_rank = mesh.tp_rank
        data_rank = group_rank(self.data_group())
        expert_dp_rank = mesh.get_local_rank("expt_dp")
        gtp = _gtp_rules(mesh, self.data_group())
        dist_opt = self.distributed_optimizer
        if dist_opt is None:
            dist_opt = any(_compat.uses_distributed_optimizer(c) for c in chunks)
        owned: Dict[Any, Tuple[int, int]] = {}
        if dist_opt:
            for c in chunks:
                ranges = _compat.owned_ranges(c)
                if ranges is None:
                    raise ValueError(
                        f"{_NAME}: distributed_optimizer=True needs megatron-core "
                        f"DistributedDataParallel-wrapped chunks (to see which part of each "
                        f"gradient this rank owns), got {type(c).__name__}; pass the DDP-wrapped "
                        "model, or distributed_optimizer=False")
                if _compat.distributed_optimizer_instances(c) > 1:
                    raise ValueError(f"{_NAME}: num_distributed_optimizer_instances > 1 (replicated "
                                     "optimizer shards) is not supported; use one instance")
                owned.update(ranges)
        names = _group_names(chunks, self.groups)
        # Explicit groups are all reported (a group matching nothing shows 0); default ones
        # are those this rank holds (other stages' layers come from dynamic_state).
        group_names = sorted(self.groups if self.groups is not None
                             else set(n for n in names.values() if n is not None))
        index = {n: i for i, n in enumerate(group_names)}
        entries: List[Tuple[torch.nn.Parameter, int, Optional[Tuple[int, int]]]] = []
        experts = False
        layer_groups = _layer_tp_groups(chunks)
        for chunk in chunks:
            for _, param in chunk.named_parameters():
                if getattr(param, "shared", False):
                    continue  # the tied copy of a parameter another stage counts
                expert = not getattr(param, "allreduce", True)
                experts = experts or expert
                if not getattr(param, "tensor_model_parallel", False):
                    # a TP replica: rank 0 of the group it is replicated over counts it; for an
                    # expert that is its layer's expert TP group, not the dense TP group
                    rank = group_rank(layer_groups.get(param, mesh.tp_group)) if expert else tp_rank
                    if rank != 0:
                        continue
                span = owned.get(param) if dist_opt else None
                first_peer, gtp_rank = gtp[expert]
                if getattr(param, "is_gtp_weight_remat", False):  # a GTP shard: each GTP peer its own
                    if span is None and not first_peer:
                        continue  # a replica of the shard that a GTP peer of data rank 0 counts
                elif span is None:  # replicated over the (expert) data group: one rank counts it
                    if (expert_dp_rank if expert else data_rank) != 0:
                        continue
                elif gtp_rank != 0:
                    continue  # owned on every GTP peer alike (megatron-core's param_is_not_gtp_duplicate)
                if span is not None and span[0] == span[1]:
                    continue  # another data-parallel rank owns all of it
                group = names.get(param)
                entries.append((param, index[group] if group is not None else len(group_names), span))
        if experts and not dist_opt:
            _check_expert_groups(mesh)
        plan = _Plan(chunks, entries, group_names)
        self._plans = {key: plan}  # one model at a time: do not keep old models alive
        return plan


class _Plan:
    """The parameters one rank counts, their group indices, and the cached group
    index tensors (one host-to-device copy per device and grad-presence pattern)."""

    def __init__(self, chunks, entries, group_names):
        self.chunks = chunks
        self.entries = entries
        self.group_names = group_names
        self._index: Dict[Tuple[str, Tuple[int, ...]], torch.Tensor] = {}

    def fold(self, tensors: Sequence[torch.Tensor], gids: Sequence[int]):
        """(sum of squares of every tensor, [sum of squares per group]) in float64."""
        n_groups = len(self.group_names)
        if not tensors:
            return 0, [0] * n_groups
        sq = torch.stack(_compat.norms_float64(tensors)).square()
        total = sq.sum()
        if not n_groups:
            return total, []
        key = (str(sq.device), tuple(gids))
        index = self._index.get(key)
        if index is None:
            # Pageable host-to-device copies wait for the stream: make it once per pattern.
            index = self._index[key] = torch.tensor(gids, dtype=torch.long).to(sq.device)
        per_group = torch.zeros(n_groups + 1, dtype=torch.float64, device=sq.device)
        per_group.index_add_(0, index, sq)  # the extra last slot: parameters in no group
        return total, list(per_group[:n_groups].unbind())


# ---------------------------------------------------------------------- helpers
def _chunks(model) -> Tuple[torch.nn.Module, ...]:
    chunks = tuple(model) if isinstance(model, (list, tuple)) else (model,)
    if not chunks or not all(isinstance(c, torch.nn.Module) for c in chunks):
        got = type(model).__name__ if not isinstance(model, (list, tuple)) else \
            f"[{', '.join(type(c).__name__ for c in chunks)}]"
        raise TypeError(f"{_NAME}: model must be a torch.nn.Module or a non-empty list of them "
                        f"(virtual pipeline chunks), got {got}")
    return chunks


def _part(t: torch.Tensor, span: Optional[Tuple[int, int]]) -> torch.Tensor:
    return t if span is None else t.reshape(-1)[span[0]:span[1]]


def _strip(name: str) -> str:
    while name.startswith("module."):  # DDP / Float16Module wrappers
        name = name[len("module."):]
    return name


def _group_names(chunks, rules: Optional[Mapping[str, GroupRule]]) -> Dict[Any, Optional[str]]:
    """``{param: group name or None}`` for every parameter of the chunks."""
    out: Dict[Any, Optional[str]] = {}
    for chunk in chunks:
        named = [(_strip(n), p) for n, p in chunk.named_parameters()]
        if rules is not None:
            for name, param in named:
                out[param] = next((g for g, rule in rules.items()
                                   if (name.startswith(rule) if isinstance(rule, str)
                                       else rule(name, param))), None)
            continue
        for _, module in chunk.named_modules():
            number = getattr(module, "layer_number", None)
            if type(number) is not int:
                continue
            layers = getattr(getattr(module, "config", None), "num_layers", None)
            width = len(str(layers)) if type(layers) is int else 1
            for param in module.parameters():
                out.setdefault(param, f"layer{number:0{width}d}")
        for name, param in named:
            if param not in out:
                path = name.split(".")[:-1] or name.split(".")
                out[param] = ".".join(path[:2])
    return out


def _layer_tp_groups(chunks) -> Dict[Any, Any]:
    """``{param: the tp_group of the innermost module holding one}``: the group a
    megatron-core layer splits its parameters over (the expert TP group in expert layers)."""
    out: Dict[Any, Any] = {}
    if not torch.distributed.is_available():
        return out
    for chunk in chunks:
        for module in chunk.modules():  # parents first: an inner module's group wins
            group = getattr(module, "tp_group", None)
            if isinstance(group, torch.distributed.ProcessGroup):
                for param in module.parameters():
                    out[param] = group
    return out


def _gtp_rules(mesh, data_group) -> Dict[bool, Tuple[bool, int]]:
    """For dense (False) and expert (True) parameters: whether this rank counts its GTP
    shards when they are replicated over the rest of the (expert) data group (it is in the
    GTP group of that group's first rank), and its GTP rank (megatron-core 0.19's
    ``gtp_remat`` groups; without GTP: (True, 0))."""
    out = {}
    for expert, gtp_name, data in ((False, "gtp", data_group), (True, "expt_gtp", mesh.get_group("expt_dp"))):
        group = mesh.get_group(gtp_name)
        if group is None:
            out[expert] = (True, 0)
            continue
        first = min(group_ranks(data)) if data is not None else global_rank()
        out[expert] = (first in group_ranks(group), group_rank(group))
    return out


def _check_expert_groups(mesh) -> None:
    """Expert replicas count once per expert data-parallel group: it must be known."""
    if mesh.get_group("expt_dp") is None and mesh.data_size > max(mesh.ep_size, 1):
        raise ValueError(
            f"{_NAME}: the model has expert-parallel parameters (allreduce=False) but the mesh "
            f"({mesh.describe()}) has no expert data-parallel group, so expert replicas would "
            "count several times; build the mesh with DeviceMesh.from_megatron() or "
            "DeviceMesh.from_sizes(..., ep_size=...)")
