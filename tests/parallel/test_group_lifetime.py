"""The library keeps no process group alive past ``destroy_process_group()``: the mesh's
groups, its gloo twins and the asynchronous worker's twins are held weakly where torch's
registry holds them (``parallel.groups.GroupTable``), so torch's destroy ends them then,
not interpreter exit; a group torch does not know is held as it is."""
import gc
import weakref

import pytest
import torch.distributed as dist

from parallel import groups as G


@pytest.fixture
def world_of_one():
    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_registered_groups_go_with_destroy_process_group(world_of_one):
    mine = dist.new_group([0])
    table = G.GroupTable({"world": dist.group.WORLD, "mine": mine, "none": None})
    assert table["world"] is dist.group.WORLD and table["mine"] is mine and table["none"] is None
    ref = weakref.ref(mine)
    del mine
    gc.collect()
    assert ref() is not None  # torch's registry holds it: so does the table
    dist.destroy_process_group()
    gc.collect()
    assert ref() is None, "the table kept a destroyed group alive"
    assert table["mine"] is G.DESTROYED and table["world"] is G.DESTROYED and table["none"] is None
    assert not G.group_alive(table["mine"])
    assert dict(table.items()) == {"world": G.DESTROYED, "mine": G.DESTROYED, "none": None}


def test_a_group_torch_does_not_know_is_held(world_of_one):
    class Unregistered:  # stands for a ProcessGroup built directly (not in torch's registry)
        pass

    group = Unregistered()
    ref = weakref.ref(group)
    table = G.GroupTable({"dp": group})
    del group
    gc.collect()
    assert ref() is not None and table["dp"] is ref()

