"""The device-backend stand-in (``twinkle_metrics.testing.standin``) on real ranks: its groups
are device groups to the library, run collectives as gloo does (and torch's dispatcher sees
them), and every call that can harm a user's communicator, made from the library's code,
fails the job; the same calls made by a user are the user's business."""
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from parallel import groups as G
from twinkle_metrics.testing import CollectiveCounter, standin

pytestmark = pytest.mark.xdist_group("dist")

PACKAGE = os.path.dirname(os.path.abspath(standin.__file__ + "/.."))


def as_library(source: str, **names):
    """Run ``source`` as if it were a line of the library's own code."""
    exec(compile(source, os.path.join(PACKAGE, "comm", "as_library.py"), "exec"), names)


def collectives():
    t = torch.full((3,), float(dist.get_rank() + 1))
    out = torch.empty(3 * dist.get_world_size())
    with CollectiveCounter() as counter:
        dist.all_reduce(t)
        dist.all_gather_into_tensor(out, torch.full((3,), float(dist.get_rank())))
        work = dist.all_reduce(torch.ones(1), async_op=True)
        work.wait(timedelta(seconds=30))  # a user's bounded wait: not the library's
        dist.barrier()
    group = dist.group.WORLD
    return (str(dist.get_backend(group)), G.is_cpu_group(group), t.tolist(), out.tolist(), dict(counter.wire),
            G.group_store(group) is not None, standin.calls())


def test_standin_groups_are_device_groups_that_run_on_gloo(dist_pool):
    n = dist_pool.world
    for backend, is_cpu, reduced, gathered, wire, store, calls in dist_pool.run(collectives, backend="standin"):
        assert (backend, is_cpu, store, calls) == ("standin", False, True, [])
        assert reduced == [n * (n + 1) / 2] * 3
        assert gathered == [float(r) for r in range(n) for _ in range(3)]
        assert wire == {"all_reduce": 2, "all_gather": 1, "barrier": 1}


def library_call(what):
    """Make ``what`` on a new group of the job's backend from a line of the library's code;
    return what the stand-in recorded (and forget it, unless the job must fail)."""
    group = dist.new_group(list(range(dist.get_world_size())), backend=dist.get_backend())
    if what == "wait(timeout)":
        work = dist.all_reduce(torch.ones(1), group=group, async_op=True)
        as_library("work.wait(timedelta(seconds=30))", work=work, timedelta=timedelta)
    elif what == "barrier":
        as_library("dist.barrier(group=group)", dist=dist, group=group)
    elif what == "abort":
        as_library("group.abort()", group=group)
    elif what == "shutdown":
        as_library("dist.destroy_process_group(group)", dist=dist, group=group)
    return [(c.what, c.where) for c in standin.calls()]


def recorded(what):
    got = library_call(what)
    standin.clear()
    return got


def test_each_call_that_can_harm_a_communicator_is_recorded_from_the_library_only(dist_pool):
    calls = ["wait(timeout)", "barrier", "abort", "shutdown"]
    where = "twinkle_metrics/comm/as_library.py:1"
    for what in calls:
        assert dist_pool.run(recorded, what, backend="standin") == [[(what, where)]] * dist_pool.world
        assert dist_pool.run(recorded, what, backend="gloo") == [[]] * dist_pool.world


def test_a_standin_job_with_such_a_call_fails():
    from tests.dist import DistPool

    with DistPool(2, start_method="fork") as pool:
        with pytest.raises(AssertionError, match=r"harm a user's communicator.*'wait\(timeout\)'.*as_library"):
            pool.run(library_call, "wait(timeout)", backend="standin")
