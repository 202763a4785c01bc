"""``DeviceMesh``: the one place that knows the parallel topology.

Metrics ask the mesh for "the data group" (DP x CP: ranks that hold disjoint
tokens), "am I on the last pipeline stage" and "the PP group" (to share results
with the other stages). They never call Megatron or DeepSpeed themselves.

Constructors, each giving every rank the groups it belongs to::

    DeviceMesh.from_sizes(tp_size=2, pp_size=2, dp_size=2)   # creates groups
    DeviceMesh.from_megatron()           # reuses megatron-core parallel_state groups
    DeviceMesh.from_megatron(pg_collection)  # or a ProcessGroupCollection
    DeviceMesh.from_deepspeed(engine)    # engine, PipelineParallelGrid or ProcessTopology
    DeviceMesh.from_torch(torch_mesh)    # torch.distributed.DeviceMesh with named axes
    DeviceMesh.from_twinkle(tw_mesh)     # ModelScope Twinkle's DeviceMesh
    DeviceMesh.current()                 # Megatron if initialised, else WORLD as pure DP

The framework adapters (from_megatron, from_deepspeed, from_torch, from_twinkle)
live in ``parallel.adapters``, ``from_sizes``' layout and groups in ``parallel.sizes``;
this module holds the mesh.

Without torch.distributed, or with one rank, every size is 1 and no collective runs.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional, Sequence, Union

import torch.distributed as dist

from . import bounded, sizes
from . import groups as G
from .bounded import Timeout, _as_timedelta, _timed
from .layout import DEFAULT_ORDER, Layout
from .sizes import GROUP_NAMES, LAYOUT_AXES, create_layout_groups

__all__ = ["DeviceMesh", "GROUP_NAMES", "LAYOUT_AXES", "create_layout_groups"]

# Twinkle's mesh axis names (create_process_group) -> this mesh's group names
_TWINKLE_DIMS = {frozenset({"dp"}): "dp", frozenset({"dp", "fsdp"}): "dp", frozenset({"tp"}): "tp",
                 frozenset({"pp"}): "pp", frozenset({"cp"}): "cp", frozenset({"ep"}): "ep",
                 frozenset({"dp", "cp"}): "dp_cp", frozenset({"tp", "pp"}): "mp"}


class DeviceMesh(bounded.BoundedWaits):
    """Process groups of the calling rank along each parallel axis.

    Sizes are never 0: an axis without a group has size 1 and rank 0.

    Example (8 ranks, TP2 x PP2 x DP2, Megatron order; what rank 5 sees)::

        mesh = DeviceMesh.from_sizes(tp_size=2, pp_size=2, dp_size=2)
        mesh.tp_rank, mesh.dp_rank, mesh.pp_rank   # (1, 0, 1)
        mesh.is_last_stage                          # True
        dist.get_process_group_ranks(mesh.data_group)  # [5, 7]
    """

    def __init__(self, groups: Optional[Dict[str, G.ProcessGroup]] = None, *,
                 layout: Optional[Layout] = None, vpp_size: int = 1, source: str = "explicit",
                 timeout: Timeout = None) -> None:
        self._layout_only = False
        self.timeout = _as_timedelta(timeout)
        groups = dict(groups or {})
        unknown = set(groups) - set(GROUP_NAMES)
        if unknown:
            raise ValueError(f"DeviceMesh: unknown group names {sorted(unknown)}; valid: {GROUP_NAMES}")
        # held weakly where torch holds them: destroy_process_group() ends them there
        self._groups = G.GroupTable({name: G.normalize(groups.get(name)) for name in GROUP_NAMES})
        if "dp_cp" not in groups:
            # Without CP the data group is the DP group.
            if self.cp_size == 1:
                self._groups["dp_cp"] = self._groups["dp"]
            elif self._groups["dp"] is not None:
                raise ValueError("DeviceMesh: cp > 1 needs the combined 'dp_cp' group; pass it")
            else:
                self._groups["dp_cp"] = self._groups["cp"]
        if groups.get("mp") is None:
            # TP x PP is the TP group without PP and the PP group without TP.
            if self.tp_size == 1:
                self._groups["mp"] = self._groups["pp"]
            elif self.pp_size == 1:
                self._groups["mp"] = self._groups["tp"]
            else:  # results shared over PP only would leave TP ranks apart, unchecked
                raise ValueError("DeviceMesh: tp > 1 and pp > 1 need the model-parallel group 'mp' "
                                 "(TP x PP) too; pass it (Megatron: parallel_state.get_model_parallel_group(), "
                                 "or a ProcessGroupCollection's mp)")
        self._check_orthogonal()
        if self._groups["dp_cp_cpu"] is None and G.is_cpu_group(self._groups["dp_cp"]):
            self._groups["dp_cp_cpu"] = self._groups["dp_cp"]
        self.layout = layout
        self.vpp_size = int(vpp_size or 1)
        self.source = source
        self._name_waits()

    def _check_orthogonal(self) -> None:
        """Groups of different axes meet in this rank only: a data group that shares a
        rank with the TP or PP group would count one replica's tokens twice."""
        if not G.dist_ready():
            return
        me = G.global_rank()
        axes = [("data", "dp_cp"), ("TP", "tp"), ("PP", "pp")]
        ranks = {name: set(G.group_ranks(self._groups[key])) for name, key in axes if self._groups[key] is not None}
        names = list(ranks)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                both = sorted(ranks[a] & ranks[b] - {me})
                if both:
                    raise ValueError(f"DeviceMesh: the {a} group {sorted(ranks[a])[:16]} and the {b} group "
                                     f"{sorted(ranks[b])[:16]} of rank {me} share ranks {both[:16]}; groups "
                                     "of different axes meet in this rank only: pass each axis's own group")

    # ----------------------------------------------------------- constructors
    @classmethod
    def single(cls) -> "DeviceMesh":
        """One rank, no collectives."""
        return cls({}, layout=Layout(), source="single")

    @classmethod
    def from_sizes(cls, *, dp_size: Optional[int] = None, tp_size: Optional[int] = None,
                   pp_size: Optional[int] = None, cp_size: Optional[int] = None,
                   ep_size: Optional[int] = None, etp_size: Optional[int] = None,
                   vpp_size: Optional[int] = None, world_size: Optional[int] = None,
                   order: str = DEFAULT_ORDER, create_groups: Optional[bool] = None,
                   backend: Optional[str] = None, fsdp_size: Optional[int] = None,
                   ulysses_size: Optional[int] = None, sequence_parallel: bool = False,
                   device_type: Optional[str] = None, timeout: Timeout = None, **unsupported: Any) -> "DeviceMesh":
        """Build the layout from sizes (Twinkle's keyword names) and create its groups.

        ``dp_size=None`` is inferred from the world size. Groups are created right
        here, on every rank in the same order (``new_group`` is collective over the
        world), when torch.distributed is initialised; ``create_groups=False`` gives a
        layout-only mesh (sizes and ranks for printing, no collectives).

        Twinkle's other keywords: ``fsdp_size`` ranks hold different data, so they join
        the data axis (outside ``dp``, as in Twinkle's mesh; only without PP);
        ``ulysses_size`` is sequence parallelism, which splits tokens like CP;
        ``sequence_parallel`` (Megatron SP) and ``device_type`` change no group.

        The groups created here take ``timeout`` (default: the timeout given to
        ``init_process_group``, not torch's 30-minute default for new groups).
        """
        mesh = sizes.from_sizes(cls, dp_size=dp_size, tp_size=tp_size, pp_size=pp_size, cp_size=cp_size,
                                ep_size=ep_size, etp_size=etp_size, vpp_size=vpp_size, world_size=world_size,
                                order=order, create_groups=create_groups, backend=backend, fsdp_size=fsdp_size,
                                ulysses_size=ulysses_size, sequence_parallel=sequence_parallel,
                                device_type=device_type, timeout=_as_timedelta(timeout),
                                unsupported=unsupported)
        return _timed(mesh, timeout)

    @classmethod
    def layout_only(cls, layout: Layout, source: str = "layout") -> "DeviceMesh":
        """Sizes and ranks of ``layout`` without process groups (for printing; its
        ``check_live`` raises, so it never reduces)."""
        mesh = cls({}, layout=layout, vpp_size=layout.vpp, source=source)
        mesh._layout_only = True
        return mesh

    @classmethod
    def from_megatron(cls, pg_collection: Any = None, *, timeout: Timeout = None) -> "DeviceMesh":
        """Reuse megatron-core's groups (``parallel.adapters.from_megatron``); ``timeout``
        bounds the library's waits on them (see ``wait_timeout``), whatever
        ``distributed_timeout_minutes`` Megatron gave its groups."""
        from . import adapters

        mesh = adapters.from_megatron(cls, pg_collection)
        return _timed(mesh, timeout)

    @classmethod
    def from_deepspeed(cls, obj: Any = None, *, timeout: Timeout = None) -> "DeviceMesh":
        """From a DeepSpeed engine, grid or topology (``parallel.adapters.from_deepspeed``)."""
        from . import adapters

        mesh = adapters.from_deepspeed(cls, obj, timeout=_as_timedelta(timeout))
        return _timed(mesh, timeout)

    @classmethod
    def from_torch(cls, device_mesh: Any, *, timeout: Timeout = None) -> "DeviceMesh":
        """From a named torch ``DeviceMesh`` (``parallel.adapters.from_torch``)."""
        from . import adapters

        mesh = adapters.from_torch(cls, device_mesh, timeout=_as_timedelta(timeout))
        return _timed(mesh, timeout)

    @classmethod
    def from_twinkle(cls, twinkle_mesh: Any, *, timeout: Timeout = None) -> "DeviceMesh":
        """From ModelScope Twinkle's ``DeviceMesh`` (``parallel.adapters.from_twinkle``)."""
        from . import adapters

        mesh = adapters.from_twinkle(cls, twinkle_mesh, timeout=_as_timedelta(timeout))
        return _timed(mesh, timeout)

    @classmethod
    def current(cls, process_group: G.ProcessGroup = None, *, timeout: Timeout = None) -> "DeviceMesh":
        """The mesh implied by what is initialised: Megatron's groups when
        megatron-core's parallel_state is initialised, else ``process_group`` (default
        WORLD) as pure data parallel, else a single rank.

        A mesh over ``process_group`` is built by its ranks alone, never over WORLD: a
        group of one rank gives a mesh without collectives, as ``single()``.
        """
        if not G.dist_ready() or G.world_size() == 1:
            return cls.single()
        ps = sys.modules.get("megatron.core.parallel_state")
        if ps is not None and ps.model_parallel_is_initialized():
            return cls.from_megatron(timeout=timeout)
        if process_group is None:
            return cls({"dp": dist.group.WORLD}, source="world", timeout=timeout)
        return cls({"dp": process_group}, source="process_group", timeout=timeout)

    # -------------------------------------------------------------- accessors
    def create_process_group(self, dims: Union[str, Sequence[str]]) -> G.ProcessGroup:
        """Twinkle's name for "the group over these mesh axes", e.g. ``["dp"]``.

        Returns the mesh's existing group (``["dp", "cp"]``: DP x CP, ``["tp", "pp"]``:
        TP x PP), or ``None`` when the axes have one rank; Twinkle creates a new group
        on every call, this creates none (so, unlike Twinkle's, it is not collective).
        """
        axes = frozenset([dims] if isinstance(dims, str) else dims)
        name = _TWINKLE_DIMS.get(axes)
        if name is None:
            known = sorted("+".join(sorted(k)) for k in _TWINKLE_DIMS)
            raise ValueError(f"DeviceMesh.create_process_group: no group over axes {sorted(axes)}; "
                             f"known: {known}")
        return self.get_group(name)

    def get_group(self, name: str) -> G.ProcessGroup:
        """The group along ``name`` (one of ``GROUP_NAMES``); ``None`` when it has one rank."""
        if name not in self._groups:
            raise ValueError(f"DeviceMesh: unknown group {name!r}; valid: {GROUP_NAMES}")
        return self._groups[name]

    def __getitem__(self, name: str) -> G.ProcessGroup:
        return self.get_group(name)

    def size(self, name: str) -> int:
        if self._layout_only:
            return _layout_size(self.layout, name)
        return G.group_size(self.get_group(name))

    def get_local_rank(self, name: str) -> int:
        if self._layout_only:
            return 0
        return G.group_rank(self.get_group(name))

    def ranks(self, name: str) -> List[int]:
        """Global ranks of this rank's group along ``name``."""
        return G.group_ranks(self.get_group(name))

    @property
    def data_group(self) -> G.ProcessGroup:
        """DP x CP: the group metric states are reduced over."""
        return self._groups["dp_cp"]

    @property
    def mp_group(self) -> G.ProcessGroup:
        """TP x PP (the model-parallel group): every rank of it holds one rank of each data
        group, and ``calculate()`` shares the result source's numbers over it."""
        return self._groups["mp"]

    @property
    def tp_group(self) -> G.ProcessGroup:
        return self._groups["tp"]

    @property
    def pp_group(self) -> G.ProcessGroup:
        return self._groups["pp"]

    @property
    def cp_group(self) -> G.ProcessGroup:
        return self._groups["cp"]

    @property
    def dp_group(self) -> G.ProcessGroup:
        return self._groups["dp"]

    @property
    def ep_group(self) -> G.ProcessGroup:
        return self._groups["ep"]

    @property
    def tp_size(self) -> int:
        return self.size("tp")

    @property
    def pp_size(self) -> int:
        return self.size("pp")

    @property
    def cp_size(self) -> int:
        return self.size("cp")

    @property
    def dp_size(self) -> int:
        return self.size("dp")

    @property
    def ep_size(self) -> int:
        return self.size("ep")

    @property
    def data_size(self) -> int:
        """Ranks in the data group (DP x CP)."""
        return self.size("dp_cp")

    @property
    def tp_rank(self) -> int:
        return self.get_local_rank("tp")

    @property
    def pp_rank(self) -> int:
        return self.get_local_rank("pp")

    @property
    def cp_rank(self) -> int:
        return self.get_local_rank("cp")

    @property
    def dp_rank(self) -> int:
        return self.get_local_rank("dp")

    @property
    def ep_rank(self) -> int:
        return self.get_local_rank("ep")

    @property
    def data_rank(self) -> int:
        """This rank's index in the data group."""
        return self.get_local_rank("dp_cp")

    @property
    def dp_enabled(self) -> bool:
        return self.dp_size > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp_size > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp_size > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp_size > 1

    @property
    def is_last_stage(self) -> bool:
        """Last physical pipeline stage (Megatron's ``ignore_virtual=True``): it owns the loss."""
        return self.pp_rank == self.pp_size - 1

    @property
    def is_result_source(self) -> bool:
        """Whether this rank's reduced numbers are the ones its ``mp_group`` returns:
        last pipeline stage and, when results are shared over TP x PP, TP rank 0. TP
        replicas agree on every metric value but not on wall-clock readings; one source
        makes every rank return the same dict."""
        if self.mp_group is None:
            return self.is_last_stage
        return self.is_last_stage and self.tp_rank == 0

    def sync_key(self) -> tuple:
        """What a sync over this mesh depends on: the identity of its data, TP x PP, TP and
        PP groups (which rank is the result source, which stage this is) and its bound
        (``timeout=``; the rest of ``wait_timeout()`` is alike for every mesh). Metrics
        whose meshes have equal keys sync as one, also when each built its own mesh over
        the same groups (a ``MetricCollection`` of metrics given no mesh,
        ``DeviceMesh.from_megatron()`` called per metric)."""
        ids = tuple(id(self._groups[n]) for n in ("dp_cp", "mp", "tp", "pp"))
        return ids + (self._layout_only, self.timeout)  # no timeout=: every such mesh reads one bound

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_logging_rank(self) -> bool:
        """The one rank that writes logs: global rank 0.

        ``calculate()`` leaves the same results on every rank, pipeline stages
        included, so rank 0 (where DeepSpeed's monitor lives) has them too.
        """
        return G.global_rank() == 0

    def describe(self) -> str:
        sizes = " x ".join(f"{a}{self.size(a)}" for a in ("tp", "cp", "dp", "pp"))
        extra = f", ep{self.ep_size}" if self.ep_size > 1 else ""
        extra += f", vpp{self.vpp_size}" if self.vpp_size > 1 else ""
        return f"DeviceMesh({sizes}{extra}, from {self.source})"

    __repr__ = describe

    def group_label(self, group: G.ProcessGroup) -> str:
        """A name for ``group`` in messages: ``"TP group [0, 1]"``."""
        names = {"tp": "TP", "cp": "CP", "dp": "DP", "dp_cp": "data (DP x CP)", "pp": "PP",
                 "mp": "TP x PP", "ep": "EP", "expt_dp": "expert DP"}
        label = next((names[n] for n in names if self._groups.get(n) is group and group is not None),
                     "process")
        try:
            ranks = str(G.group_ranks(group))
        except Exception:  # noqa: BLE001 - a label must never raise
            ranks = "?"
        return f"{label} group {ranks}"


def _layout_size(layout: Optional[Layout], name: str) -> int:
    if layout is None:
        return 1
    return {"tp": layout.tp, "cp": layout.cp, "dp": layout.dp, "dp_cp": layout.dp * layout.cp,
            "pp": layout.pp, "ep": layout.ep, "expt_dp": layout.expert_dp}[name]


#: ``device_mesh`` as metrics take it: a ``DeviceMesh``, ModelScope Twinkle's ``DeviceMesh`` (converted
#: by ``as_device_mesh``; the library never imports twinkle, so to a type checker it is ``Any``), or None
MeshLike = Union[DeviceMesh, Any, None]


def as_device_mesh(device_mesh: MeshLike, what: str) -> Optional[DeviceMesh]:
    """``device_mesh`` as a ``DeviceMesh``: ours as it is, Twinkle's converted
    (``DeviceMesh.from_twinkle``), ``None`` kept (the mesh is then resolved at the first
    ``calculate()``). ``what`` names the caller in the error for anything else."""
    from .adapters import is_twinkle_mesh

    if device_mesh is None or isinstance(device_mesh, DeviceMesh):
        return device_mesh
    if is_twinkle_mesh(device_mesh):
        return DeviceMesh.from_twinkle(device_mesh)
    hint = ("DeviceMesh.from_torch(mesh) converts a torch DeviceMesh"
            if hasattr(device_mesh, "mesh_dim_names") else
            "build one with DeviceMesh.from_megatron() or DeviceMesh.from_sizes(...)")
    raise TypeError(f"{what}: device_mesh must be a parallel.DeviceMesh or Twinkle's DeviceMesh, "
                    f"got {type(device_mesh).__name__}; {hint}")
