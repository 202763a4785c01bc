"""Topology for twinkle-metrics: rank layout, process groups, pipeline stages."""
from .adapters import is_twinkle_mesh
from .groups import comm_device, dist_ready, group_rank, group_size
from .layout import DEFAULT_ORDER, Layout
from .mesh import GROUP_NAMES, LAYOUT_AXES, DeviceMesh, MeshLike, as_device_mesh

__all__ = ["DeviceMesh", "Layout", "DEFAULT_ORDER", "GROUP_NAMES", "LAYOUT_AXES", "MeshLike", "as_device_mesh",
           "comm_device", "dist_ready", "group_rank", "group_size", "is_twinkle_mesh"]
