"""A mesh from sizes (``DeviceMesh.from_sizes``): the layout the sizes give, and the
process groups of a layout, created on every rank in one fixed order
(``create_layout_groups``, also used by the DeepSpeed adapter).
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Dict, Optional

import torch.distributed as dist

from . import groups as G
from .layout import DEFAULT_ORDER, Layout

# Group names a mesh can hold. "dp_cp" is the data group used for metric reduction; "mp" is
# TP x PP (Megatron's model-parallel group), over which reduced results are shared;
# "dp_cp_cpu" is a CPU (gloo) group over the data-group ranks for host-side exchanges;
# "gtp" / "expt_gtp": megatron-core's GTP weight-sharding groups (inside the (expert) data group).
GROUP_NAMES = ("tp", "cp", "dp", "dp_cp", "pp", "mp", "ep", "expt_dp", "dp_cp_cpu", "gtp", "expt_gtp")
#: the layout axes each group spans (``Layout.all_groups``); "dp_cp_cpu" is the data group's gloo twin
LAYOUT_AXES = {"tp": "tp", "cp": "cp", "dp": "dp", "dp_cp": "dp-cp", "pp": "pp", "mp": "tp-pp",
                "ep": "ep", "expt_dp": "expt_dp"}


def from_sizes(cls: Any, *, dp_size: Optional[int] = None, tp_size: Optional[int] = None,
               pp_size: Optional[int] = None, cp_size: Optional[int] = None, ep_size: Optional[int] = None,
               etp_size: Optional[int] = None, vpp_size: Optional[int] = None, world_size: Optional[int] = None,
               order: str = DEFAULT_ORDER, create_groups: Optional[bool] = None, backend: Optional[str] = None,
               fsdp_size: Optional[int] = None, ulysses_size: Optional[int] = None,
               sequence_parallel: bool = False, device_type: Optional[str] = None,
               timeout: Optional[timedelta] = None, unsupported: Optional[dict] = None) -> Any:
    """``cls.from_sizes(...)`` (``cls``: ``DeviceMesh`` or a subclass); see its docstring."""
    if unsupported:
        raise TypeError(f"DeviceMesh.from_sizes: unsupported arguments {sorted(unsupported)}; "
                        "valid: dp_size, tp_size, pp_size, cp_size, ep_size, etp_size, "
                        "vpp_size, fsdp_size, ulysses_size, world_size, order, create_groups, "
                        "backend, sequence_parallel, device_type, timeout")
    del sequence_parallel, device_type  # accepted for Twinkle compatibility
    if ulysses_size and ulysses_size > 1:
        if cp_size and cp_size > 1:
            raise ValueError("DeviceMesh.from_sizes: give cp_size or ulysses_size, not both "
                             "(both split the sequence)")
        cp_size = ulysses_size
    if fsdp_size and fsdp_size > 1:
        if pp_size and pp_size > 1:
            raise ValueError("DeviceMesh.from_sizes: fsdp_size with pp_size > 1 is not "
                             "supported; build the mesh with DeviceMesh.from_torch(...)")
        if dp_size is not None:
            dp_size *= fsdp_size
        elif not (world_size or G.dist_ready()):
            dp_size = fsdp_size  # else inferred from the world size below
    tp, pp, cp = tp_size or 1, pp_size or 1, cp_size or 1
    ready = G.dist_ready()
    world = world_size or (G.world_size() if ready else None)
    if dp_size is None:
        if world is None:
            dp_size = 1
        elif world % (tp * pp * cp):
            raise ValueError(f"DeviceMesh: world size {world} is not divisible by "
                             f"tp x pp x cp = {tp * pp * cp}; change the sizes")
        else:
            dp_size = world // (tp * pp * cp)
    layout = Layout(tp=tp, pp=pp, cp=cp, dp=dp_size, ep=ep_size or 1, etp=etp_size or 0,
                    vpp=vpp_size or 1, order=order)
    if world is not None and layout.world_size != world:
        raise ValueError(f"DeviceMesh: sizes give {layout.describe()} but the world has "
                         f"{world} ranks; make tp x cp x dp x pp equal the world size")
    if create_groups is None:
        create_groups = ready and G.world_size() > 1
    if not create_groups:
        return cls.layout_only(layout)
    if not ready:
        raise RuntimeError("DeviceMesh.from_sizes(create_groups=True) needs torch.distributed "
                           "to be initialised first (init_process_group)")
    found = create_layout_groups(layout, backend, timeout)
    return cls(found, layout=layout, vpp_size=layout.vpp, source="sizes", timeout=timeout)


def create_layout_groups(layout: Layout, backend: Optional[str], timeout: Optional[timedelta] = None
                         ) -> Dict[str, G.ProcessGroup]:
    """Create every group of the layout, on every rank, in one fixed order.

    Returns ``{name: group of this rank}``. Every group takes ``timeout``, by default the
    one given to ``init_process_group``.
    """
    timeout = timeout or G.default_timeout()
    me, world = G.global_rank(), G.world_size()
    if layout.world_size != world:
        raise ValueError(f"DeviceMesh: layout {layout.describe()} does not match the world "
                         f"size {world}")
    out: Dict[str, G.ProcessGroup] = {}
    made: Dict[tuple, G.ProcessGroup] = {}  # dp_cp == dp without CP, expt_dp == dp without EP
    for name in GROUP_NAMES:
        if name not in LAYOUT_AXES:
            continue  # the data group's gloo twin (below); GTP groups: Megatron's only
        mine = None
        for ranks in layout.all_groups(LAYOUT_AXES[name]):
            if len(ranks) == 1:
                continue  # every rank skips it alike: no new_group call needed
            key = tuple(ranks)
            if key not in made:
                made[key] = (dist.group.WORLD if len(ranks) == world
                             else G.held_by_me(dist.new_group(ranks=ranks, backend=backend, timeout=timeout)))
            group = made[key]
            if me in ranks:
                mine = group
        out[name] = mine
    return out
