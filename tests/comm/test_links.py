"""The library's one registry of what it keeps per group (``twinkle_metrics.comm.links``)
and per world (``parallel.groups.world_state``): held weakly, fresh for a new group."""
import gc

from parallel import groups as G
from twinkle_metrics.comm import links


class _Group:
    """Stands in for a process group: the registry only needs it weakly referenceable."""


def test_a_group_keeps_one_link_held_weakly_and_a_new_group_never_meets_a_freed_ones():
    a = _Group()
    mine = links.link(a)
    mine.channels[links.NO_GROUP] = "plans of (a, no TP x PP group)"
    assert links.link(a) is mine and links.find(a) is mine
    assert links.link(None) is links.link(None) and links.link(None) is not mine
    del a, mine
    gc.collect()
    for _ in range(50):  # new groups, some at a freed group's address: each starts empty
        b = _Group()
        assert links.find(b) is None and not links.link(b).channels and links.link(b).twin is None
        del b
        gc.collect(0)  # the young generation (a full collection a round costs seconds in a big process)


def test_without_a_world_the_world_state_is_fresh_each_time():
    assert not G.dist_ready()
    first = G.world_state()
    first.calls["x"] = 1
    assert G.world_state() is not first and G.world_state().calls == {}
    assert not G.made_here(None)
