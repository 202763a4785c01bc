"""Single-process tests of DeviceMesh.check_live on layout-only and single-rank meshes."""
import pytest

from parallel import DeviceMesh


@pytest.mark.parametrize("sizes", [dict(tp_size=2, dp_size=2), dict(dp_size=2), dict(pp_size=2),
                                   dict(cp_size=2, world_size=2)])
def test_layout_only_mesh_with_more_than_one_rank_raises(sizes):
    mesh = DeviceMesh.from_sizes(create_groups=False, **sizes)
    assert mesh.size("dp") * mesh.size("tp") * mesh.size("pp") * mesh.size("cp") > 1
    with pytest.raises(RuntimeError) as err:
        mesh.check_live("calculate()")
    text = str(err.value)
    assert text.startswith("calculate():")
    assert "layout-only" in text and "init_process_group" in text and "create_groups=False" in text


@pytest.mark.parametrize("mesh", [DeviceMesh.single(), DeviceMesh.from_sizes(create_groups=False),
                                  DeviceMesh.from_sizes(), DeviceMesh.current(), DeviceMesh()],
                         ids=["single", "layout-1", "sizes-1", "current", "empty"])
def test_single_rank_mesh_is_live(mesh):
    mesh.check_live("calculate()")  # no torch.distributed: nothing to reduce, nothing wrong
