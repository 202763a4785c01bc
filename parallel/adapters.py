"""Build a ``DeviceMesh`` from another framework's view of the topology.

Each function here answers "which groups does this rank belong to" from what the
framework already holds, and hands them to ``DeviceMesh``; nothing else in the
library reads Megatron, DeepSpeed, torch or Twinkle topology objects::

    from_megatron(cls, pg_collection=None)   # megatron-core parallel_state or a ProcessGroupCollection
    from_deepspeed(cls, engine_grid_or_topology)
    from_torch(cls, torch_device_mesh)       # named axes dp/tp/pp/cp/ep (and aliases)
    from_twinkle(cls, twinkle_device_mesh)   # ModelScope Twinkle's DeviceMesh

``DeviceMesh.from_megatron`` / ``from_deepspeed`` / ``from_torch`` / ``from_twinkle``
call these with ``cls``, the mesh class to build (so this module does not import it).
"""
from __future__ import annotations

import inspect
import itertools
from datetime import timedelta
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from . import groups as G
from .bounded import BoundedWaits
from .layout import Layout
from .sizes import create_layout_groups

# ----------------------------------------------------------------- megatron


def from_megatron(cls: Any, pg_collection: Any = None) -> Any:
    """Reuse megatron-core's groups (from ``parallel_state`` or a ``ProcessGroupCollection``).

    Creates no new groups. With megatron-core 0.19's GTP weight rematerialisation
    (``gtp_remat_size > 1``) the GTP peers of a rank hold different tokens, so they join
    the data group: it is Megatron's own DP x CP x GTP group (``dp_cp_gtp_remat``, what
    ``finalize_model_grads`` reduces over), and ``mesh["gtp"]`` is the GTP group. Results
    are then shared over TP x PP at one GTP position, one source in each.
    """
    from megatron.core import parallel_state as ps

    if pg_collection is not None:
        found, vpp = _megatron_collection(pg_collection, ps), 1
    else:
        if not ps.model_parallel_is_initialized():
            raise RuntimeError("DeviceMesh.from_megatron: megatron-core parallel_state is not "
                               "initialised; call initialize_model_parallel(...) first or pass "
                               "a ProcessGroupCollection")
        # By keyword: 0.19 gave get_data_parallel_group's second argument another meaning;
        # with_gtp_remat=True (its default there) spans the GTP peers.
        gtp = _keywords(ps.get_data_parallel_group, with_gtp_remat=True)
        found = {
            "tp": ps.get_tensor_model_parallel_group(),
            "pp": ps.get_pipeline_model_parallel_group(),
            "cp": ps.get_context_parallel_group(),
            "dp": ps.get_data_parallel_group(with_context_parallel=False, **gtp),
            "dp_cp": ps.get_data_parallel_group(with_context_parallel=True, **gtp),
            "mp": ps.get_model_parallel_group(),  # TP x GTP x PP on 0.19
            "ep": ps.get_expert_model_parallel_group(check_initialized=False),
            "expt_dp": ps.get_expert_data_parallel_group(
                check_initialized=False, **_keywords(ps.get_expert_data_parallel_group, with_gtp_remat=True)),
            "gtp": _getter(ps, "get_gtp_weight_remat_group"),
            "expt_gtp": _getter(ps, "get_expert_gtp_weight_remat_group"),
            "tp_ep_pp": _getter(ps, "get_expert_tensor_model_pipeline_parallel_group"),
        }
        gloo = _megatron_gloo_data_group(ps)
        if gloo is not None and G.group_ranks(gloo) == G.group_ranks(found["dp_cp"]):
            found["dp_cp_cpu"] = gloo  # not under GTP: Megatron's gloo group is DP x CP only
        vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    _share_without_gtp(found)
    return cls(found, vpp_size=vpp, source="megatron")


def _megatron_collection(pgc, ps) -> Dict[str, G.ProcessGroup]:
    """The mesh groups of a ``ProcessGroupCollection`` (0.19 returns None for a declared
    field never set, older releases raise AttributeError: both read as None here)."""
    def get(name):
        return getattr(pgc, name, None)

    found = {name: get(name) for name in ("tp", "pp", "cp", "mp", "ep", "tp_ep_pp")}
    found["gtp"], found["expt_gtp"] = get("gtp_remat"), get("expt_gtp_remat")
    # 0.19: dp, dp_cp and expt_dp are the replicate groups; the *_gtp_remat ones span GTP
    data, dp_cp, dp = get("dp_cp_gtp_remat"), get("dp_cp"), get("dp")
    found["dp_cp"] = data if data is not None else dp_cp
    expt = get("expt_dp_gtp_remat")
    found["expt_dp"] = expt if expt is not None else get("expt_dp")
    cp_size = G.group_size(found["cp"])
    if found["dp_cp"] is None and cp_size > 1:
        raise ValueError("DeviceMesh.from_megatron: the ProcessGroupCollection has cp > 1 "
                         "but no 'dp_cp' group; set pg_collection.dp_cp")
    if G.group_size(found["gtp"]) > 1:
        # the DP axis spans the GTP peers too (their tokens differ); without CP that is dp_cp_gtp_remat
        if cp_size <= 1:
            dp = found["dp_cp"]
        elif ps.model_parallel_is_initialized() and G.group_ranks(found["dp_cp"]) == \
                G.group_ranks(ps.get_data_parallel_group(with_context_parallel=True, with_gtp_remat=True)):
            dp = ps.get_data_parallel_group(with_context_parallel=False, with_gtp_remat=True)
        else:
            raise ValueError("DeviceMesh.from_megatron: a ProcessGroupCollection with GTP and cp > 1 "
                             "holds no DP x GTP group (its dp is the replicate group); build the mesh "
                             "from parallel_state (DeviceMesh.from_megatron()) or with DeviceMesh({...}) "
                             "and a 'dp' group over the DP x GTP ranks")
    found["dp"] = dp
    if found["dp_cp"] is None:
        found.pop("dp_cp")
    return found


def _share_without_gtp(found: Dict[str, G.ProcessGroup]) -> None:
    """Under GTP, replace Megatron's model-parallel group (TP x GTP x PP) by TP x PP at this
    rank's GTP position: its GTP peers are in the data group, and a group sharing results
    over both would count their contributions twice (and hold two result sources).
    Megatron's expert TP x EP x PP group is that group when EP is 1 (its ranks are checked)."""
    candidate = found.pop("tp_ep_pp", None)
    if G.group_size(found["gtp"]) <= 1:
        return
    tp, pp = G.group_size(found["tp"]), G.group_size(found["pp"])
    if tp == 1 or pp == 1:
        found["mp"] = None  # the mesh takes the TP group, or the PP group
        return
    ranks = set(G.group_ranks(candidate)) if G.group_size(candidate) == tp * pp else set()
    data = set(G.group_ranks(found["dp_cp"] if found.get("dp_cp") is not None else found["dp"]))
    if not (ranks >= set(G.group_ranks(found["tp"])) | set(G.group_ranks(found["pp"]))
            and ranks & data == {G.global_rank()}):
        raise ValueError("DeviceMesh.from_megatron: GTP with tp > 1, pp > 1 and expert parallelism needs "
                         "a TP x PP group at each GTP position, which megatron-core does not make; build the "
                         "mesh with DeviceMesh({...}) and pass it as 'mp'")
    found["mp"] = candidate


def _keywords(fn, **wanted) -> dict:
    """The keyword arguments of ``wanted`` that ``fn`` takes (newer megatron-core ones)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in wanted.items() if k in params}


def _getter(ps, name):
    """``ps.<name>(check_initialized=False)``; None where this megatron-core lacks it."""
    fn = getattr(ps, name, None)
    return fn(check_initialized=False) if fn is not None else None


def _megatron_gloo_data_group(ps):
    """Megatron's gloo DP x CP group when it created one (create_gloo_process_groups=True)."""
    try:
        return ps.get_data_parallel_group_gloo(with_context_parallel=True)
    except Exception:  # not created: megatron asserts
        return None


# ---------------------------------------------------------------- deepspeed


def from_deepspeed(cls: Any, obj: Any = None, *, timeout: Optional[timedelta] = None) -> Any:
    """From a DeepSpeed engine, ``PipelineParallelGrid`` or ``ProcessTopology``.

    The TP group is the grid's *slice* group (``get_model_parallel_group()`` on a
    grid is pipe x model, not TP). Under Ulysses sequence parallelism the
    sequence group plays the CP role and the data group is sequence x data.
    A bare ``ProcessTopology`` has no groups, so they are created here (collective),
    with ``timeout`` (default: the one given to ``init_process_group``).
    """
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid, ProcessTopology
    from deepspeed.utils import groups as ds_groups

    grid = getattr(obj, "grid", None) if obj is not None else None
    if isinstance(obj, PipelineParallelGrid):
        grid = obj
    if isinstance(obj, ProcessTopology):
        sizes = dict(zip(obj.get_axis_names(), obj.dims))
        unknown = set(sizes) - {"pipe", "data", "model"}
        if unknown:
            raise ValueError(f"DeviceMesh.from_deepspeed: topology axes {sorted(unknown)} are "
                             "not supported; use pipe/data/model")
        layout = Layout(tp=sizes.get("model", 1), dp=sizes.get("data", 1),
                        pp=sizes.get("pipe", 1), order="tp-cp-ep-dp-pp")
        _check_topology(obj, layout)
        return cls(create_layout_groups(layout, None, timeout), layout=layout, source="deepspeed", timeout=timeout)
    # Ulysses sequence parallelism through deepspeed.initialize(config with
    # sequence_parallel_size) keeps a torch DeviceMesh ("data_parallel", "sequence_parallel").
    mesh_device = getattr(obj, "mesh_device", None) or getattr(ds_groups, "mesh_device", None)
    if grid is None and mesh_device is not None:
        mesh = from_torch(cls, mesh_device, timeout=timeout)
        mesh.source = "deepspeed"
        return mesh
    found = {}
    if grid is not None:
        found["dp"] = grid.get_data_parallel_group()
        found["pp"] = grid.get_pipe_parallel_group()
        found["tp"] = grid.get_slice_parallel_group()
        found["mp"] = grid.get_model_parallel_group()  # pipe x model: TP x PP, as wanted here
    else:
        mpu = getattr(obj, "mpu", None)
        if mpu is not None and hasattr(mpu, "get_tensor_model_parallel_group"):
            found["tp"] = mpu.get_tensor_model_parallel_group()
        if mpu is not None and hasattr(mpu, "get_sequence_data_parallel_group"):
            # Ulysses through an mpu: tokens are split over the sequence group, so the
            # data group for token sums is sequence x data.
            found["cp"] = mpu.get_sequence_parallel_group()
            found["dp_cp"] = mpu.get_sequence_data_parallel_group()
            found["dp"] = (mpu.get_data_parallel_group()
                           if hasattr(mpu, "get_data_parallel_group") else None)
        else:
            found["dp"] = ds_groups._get_data_parallel_group()
    return cls(found, source="deepspeed")


def _check_topology(topo, layout: Layout) -> None:
    for axis, ours in (("data", "dp"), ("pipe", "pp"), ("model", "tp")):
        if axis not in topo.get_axis_names():
            continue
        theirs = sorted(sorted(g) for g in topo.get_axis_comm_lists(axis))
        mine = sorted(layout.all_groups(ours))
        if theirs != mine:
            raise ValueError(f"DeviceMesh.from_deepspeed: topology axis order {topo.get_axis_names()} "
                             "is not pipe-data-model; reorder the topology axes")


# -------------------------------------------------------------------- torch

_TORCH_ALIASES = {"dp": "dp", "dp_replicate": "dp", "dp_shard": "dp", "fsdp": "dp", "ddp": "dp",
                  "data_parallel": "dp", "tp": "tp", "tensor_parallel": "tp", "pp": "pp",
                  "cp": "cp", "sequence_parallel": "cp", "ep": "ep"}


def from_torch(cls: Any, device_mesh: Any, *, timeout: Optional[timedelta] = None) -> Any:
    """From a ``torch.distributed.DeviceMesh`` whose axis names include dp/tp/pp/cp/ep.

    ``dp_replicate``/``dp_shard``/``fsdp`` axes all count as data parallel. An ``ep``
    axis is carved out of the data ranks: it gives the EP group and joins the data
    group (its ranks hold different tokens); the dp axes alone are the expert-data group.
    Combined groups (dp x cp) are created here, so every rank must call this; they
    take ``timeout`` (default: the one given to ``init_process_group``).
    """
    names = tuple(device_mesh.mesh_dim_names or ())
    if not names:
        raise ValueError("DeviceMesh.from_torch: the torch DeviceMesh has no mesh_dim_names; "
                         "build it with init_device_mesh(..., mesh_dim_names=('dp', 'tp'))")
    unknown = [n for n in names if n not in _TORCH_ALIASES]
    if unknown:
        raise ValueError(f"DeviceMesh.from_torch: axis names {unknown} are not known; use "
                         f"{sorted(_TORCH_ALIASES)}")
    mesh = device_mesh.mesh
    me = G.global_rank()
    timeout = timeout or G.default_timeout()
    found: Dict[str, G.ProcessGroup] = {}
    for role in ("tp", "pp", "ep"):
        axes = [i for i, n in enumerate(names) if _TORCH_ALIASES[n] == role]
        if axes:
            found[role] = _torch_mesh_group(mesh, axes, me, timeout)
    # Expert parallelism is carved out of the data ranks (as in Megatron and DeepSpeed-MoE):
    # ranks along an ep axis hold different tokens, so the data group spans it; the
    # expert-data group is the dp axes alone.
    ep_axes = [i for i, n in enumerate(names) if _TORCH_ALIASES[n] == "ep"]
    dp_axes = [i for i, n in enumerate(names) if _TORCH_ALIASES[n] == "dp"]
    cp_axes = [i for i, n in enumerate(names) if _TORCH_ALIASES[n] == "cp"]
    if ep_axes:
        found["expt_dp"] = _torch_mesh_group(mesh, dp_axes, me, timeout)
        dp_axes = sorted(dp_axes + ep_axes)
    found["dp"] = _torch_mesh_group(mesh, dp_axes, me, timeout)
    found["cp"] = _torch_mesh_group(mesh, cp_axes, me, timeout)
    found["dp_cp"] = _torch_mesh_group(mesh, dp_axes + cp_axes, me, timeout)
    mp_axes = [i for i, n in enumerate(names) if _TORCH_ALIASES[n] in ("tp", "pp")]
    found["mp"] = _torch_mesh_group(mesh, mp_axes, me, timeout)
    return cls(found, source="torch")


def _torch_mesh_group(mesh, axes, me, timeout=None):
    """Group of ``me`` varying ``axes`` of a torch mesh tensor; created on all ranks in order."""
    if not axes:
        return None
    shape = list(mesh.shape)
    other = [i for i in range(mesh.dim()) if i not in axes]
    perm = mesh.permute(*other, *axes).reshape(-1, _prod(shape[i] for i in axes))
    mine = None
    for row in perm.tolist():
        if len(row) == 1:
            continue
        group = (dist.new_group(ranks=sorted(row), timeout=timeout) if len(row) < G.world_size()
                 else dist.group.WORLD)
        if me in row:
            mine = group
    return mine


def _prod(xs):
    out = 1
    for x in xs:
        out *= x
    return out


# ------------------------------------------------------------------ twinkle

#: Axis names a ModelScope Twinkle ``DeviceMesh`` may carry
TWINKLE_AXES = ("dp", "fsdp", "tp", "pp", "cp", "ep", "ep_fsdp")
_DATA_AXES = ("dp", "fsdp")
# Our group name -> the rank coordinates (see _twinkle_coords) its ranks differ in.
_TWINKLE_VARYING = {"tp": ("tp",), "cp": ("cp", "seq"), "dp": ("block",),
                    "dp_cp": ("cp", "block", "seq"), "pp": ("pp",), "mp": ("tp", "pp"),
                    "ep": ("ep",), "expt_dp": ("ep_fsdp",)}
_CACHE_ATTR = "_twinkle_metrics_mesh"  # converted mesh kept on the Twinkle object


def is_twinkle_mesh(obj: Any) -> bool:
    """Whether ``obj`` looks like ModelScope Twinkle's ``DeviceMesh``.

    Recognised by its fields (a rank array ``mesh``, ``mesh_dim_names`` drawn from
    Twinkle's axis names, a ``create_process_group`` method), so the library never
    imports twinkle, which pulls transformers and modelscope.
    """
    names = getattr(obj, "mesh_dim_names", None)
    return (not isinstance(obj, BoundedWaits) and hasattr(obj, "mesh")  # BoundedWaits: ours
            and callable(getattr(obj, "create_process_group", None))
            and isinstance(names, (tuple, list)) and len(names) > 0
            and all(n in TWINKLE_AXES for n in names))


def from_twinkle(cls: Any, twinkle_mesh: Any, *, timeout: Optional[timedelta] = None) -> Any:
    """From ModelScope Twinkle's ``DeviceMesh`` (its ``mesh`` array of global ranks
    and ``mesh_dim_names``).

    Twinkle gives every rank with the same data rank (its dp and fsdp coordinates)
    the same batch, so the data group (DP x CP) varies ``dp``, ``fsdp`` and ``cp``;
    ``ulysses_size`` splits each batch over consecutive data ranks, as Twinkle's
    sequence-parallel groups do, and those play the CP role. ``tp``, ``pp``, ``ep``
    and ``ep_fsdp`` axes give the TP, PP, EP and expert-DP groups. Twinkle's
    ``ep_size`` field (experts carved out of the data ranks) adds no group.

    The groups are created here (collective: every rank converts the same mesh at
    the same point, as with Twinkle's ``create_process_group``) and kept on the
    Twinkle object, so converting it again (one metric after another) creates none.
    Before ``init_process_group`` the result is layout-only (sizes, no collectives).
    """
    key = _twinkle_key(twinkle_mesh)
    cached = getattr(twinkle_mesh, _CACHE_ATTR, None)
    # a mesh built without torch.distributed holds no groups that could have died
    if cached is not None and cached[0] == key and (not key[-2] or _is_live(cached[1])):
        return cached[1]
    mesh = _build_from_twinkle(cls, twinkle_mesh, key, timeout)
    try:
        setattr(twinkle_mesh, _CACHE_ATTR, (key, mesh))
    except (AttributeError, TypeError):  # a frozen or slotted look-alike: convert each time
        pass
    return mesh


def _twinkle_key(tw) -> tuple:
    """What the conversion depends on: axes, ranks, Ulysses size, and the process world."""
    ranks = torch.as_tensor(tw.mesh).to(torch.int64)
    return (tuple(tw.mesh_dim_names), tuple(ranks.shape), tuple(ranks.flatten().tolist()),
            int(getattr(tw, "ulysses_size", None) or 1), int(getattr(tw, "vpp_size", None) or 1),
            G.dist_ready(), G.world_size())


def _is_live(mesh) -> bool:
    try:
        mesh.check_live("DeviceMesh.from_twinkle")
    except RuntimeError:
        return False
    return True


def _build_from_twinkle(cls, tw, key: tuple, timeout):
    what = "DeviceMesh.from_twinkle"
    names, shape, flat, ulysses, vpp, ready, world = key
    if len(names) != len(shape) or len(set(names)) != len(names):
        raise ValueError(f"{what}: mesh_dim_names {list(names)} do not name the {len(shape)} axes "
                         f"of a mesh of shape {list(shape)} once each; fix the Twinkle DeviceMesh")
    if sorted(flat) != list(range(len(flat))):
        raise ValueError(f"{what}: the mesh must hold the global ranks 0..{len(flat) - 1} once "
                         f"each, got {list(flat)}")
    size = {n: s for n, s in zip(names, shape)}
    data = size.get("dp", 1) * size.get("fsdp", 1)
    if ulysses < 1 or data % ulysses:
        raise ValueError(f"{what}: ulysses_size {ulysses} must divide dp x fsdp = {data}")
    if len(flat) == 1:
        mesh = cls.single()
    elif not ready:
        if size.get("ep", 1) * size.get("ep_fsdp", 1) > 1:
            raise ValueError(f"{what}: a mesh with ep/ep_fsdp axes needs torch.distributed; "
                             "convert it after init_process_group")
        layout = Layout(tp=size.get("tp", 1), pp=size.get("pp", 1), cp=size.get("cp", 1) * ulysses,
                        dp=data // ulysses, vpp=vpp)
        mesh = cls.layout_only(layout, source="twinkle")
    elif world != len(flat):
        raise ValueError(f"{what}: the Twinkle mesh covers {len(flat)} ranks but the world has "
                         f"{world}; build the mesh over every rank of the job")
    else:
        mesh = cls(_twinkle_groups(names, shape, flat, ulysses, timeout), vpp_size=vpp,
                          source="twinkle")
    mesh.source = "twinkle"
    return mesh


def _twinkle_coords(names, index, fsdp_size, ulysses) -> Dict[str, int]:
    """A rank's coordinates on the axes our groups vary: its Twinkle coordinates, with
    the data rank (dp outer, fsdp inner, as Twinkle's ``data_rank``) split into a
    Ulysses ``block`` (ranks given the same batch) and a position ``seq`` in it."""
    c = dict.fromkeys(TWINKLE_AXES, 0)
    c.update(zip(names, index))
    block, seq = divmod(c.pop("dp") * fsdp_size + c.pop("fsdp"), ulysses)
    c.update(block=block, seq=seq)
    return c


def _twinkle_groups(names, shape, flat, ulysses, timeout) -> Dict[str, G.ProcessGroup]:
    """Create every group of the mesh on every rank, in one order; return this rank's."""
    fsdp_size = dict(zip(names, shape)).get("fsdp", 1)
    coords = {r: _twinkle_coords(names, idx, fsdp_size, ulysses)
              for r, idx in zip(flat, itertools.product(*(range(s) for s in shape)))}
    me, world = G.global_rank(), len(flat)
    timeout = timeout or G.default_timeout()
    made: Dict[tuple, G.ProcessGroup] = {}  # the same ranks under two names: one group
    found: Dict[str, G.ProcessGroup] = {}
    for name, varying in _TWINKLE_VARYING.items():
        partition: Dict[tuple, list] = {}
        for rank in range(world):
            c = coords[rank]
            partition.setdefault(tuple(v for k, v in sorted(c.items()) if k not in varying),
                                 []).append(rank)
        found[name] = None
        for ranks in sorted(partition.values()):
            if len(ranks) == 1:
                continue  # every rank skips it alike
            if tuple(ranks) not in made:
                made[tuple(ranks)] = (dist.group.WORLD if len(ranks) == world
                                      else G.held_by_me(dist.new_group(ranks=ranks, timeout=timeout)))
            if me in ranks:
                found[name] = made[tuple(ranks)]
    return found
