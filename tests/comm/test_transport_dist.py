"""``Transport.meanwhile`` (real gloo ranks and the device stand-in): host work that needs
none of a call's results runs while its first collective is in flight, once; what it
raises comes after that collective, so the group stays in step and the next call works.
``calculate()`` makes the metrics' next intervals there and begins them once every metric
computed; a class with its own ``reset()`` has that called instead."""
import pytest
import torch
import torch.distributed as dist

from parallel import DeviceMesh
from tests.comm.test_foundation_dist import _whole
from tests.refmetric import TokenStats, make_batch, shard_for_rank
from twinkle_metrics import MetricCollection
from twinkle_metrics.comm.transport import Transport
from twinkle_metrics.core.state import interval_of

pytestmark = pytest.mark.xdist_group("dist")


def case_meanwhile(fail_on):
    mesh = DeviceMesh.from_sizes(dp_size=dist.get_world_size())
    t = Transport("calculate()", mesh, mesh.data_group)
    seen = []

    def work():
        seen.append(len(seen))
        if dist.get_rank() == fail_on:
            raise KeyError("prepared work failed")

    t.meanwhile(work)
    buf = torch.full((3,), float(dist.get_rank()), dtype=torch.float64)
    try:
        rows = t.gather(buf, t.data)
        first = ("ok", rows[:, 0].tolist())
    except KeyError as exc:
        first = ("raised", str(exc))
    rows = t.gather(buf + 1, t.data)  # the group is in step: the next call gathers every rank
    return first, seen, rows[:, 0].tolist()


@pytest.mark.parametrize("backend", ["gloo", "standin"])
def test_meanwhile_runs_once_beside_the_first_collective_and_raises_after_it(dist_pool, backend):
    n = dist_pool.world
    for rank, (first, seen, second) in enumerate(dist_pool.run(case_meanwhile, 3, backend=backend)):
        assert seen == [0]  # once, not again at the second collective
        if rank == 3:
            assert first == ("raised", "'prepared work failed'")
        else:
            assert first == ("ok", [float(r) for r in range(n)])
        assert second == [float(r + 1) for r in range(n)]


class Counted(TokenStats):
    """A metric whose class has its own ``reset()``: that one is called, never bypassed."""

    resets = 0

    def reset(self):
        type(self).resets += 1
        return super().reset()


def case_calculate_begins_the_next_interval(n_calls):
    mesh = DeviceMesh.from_sizes(dp_size=dist.get_world_size())
    labels, values = make_batch(3)
    feats, outs = shard_for_rank(labels, values, mesh.dp_size, mesh.dp_rank, 1, 0)
    plain, counted = TokenStats(mesh), Counted(mesh)
    coll = MetricCollection({"plain": plain, "counted": counted})
    Counted.resets = 0
    out = []
    for _ in range(n_calls):
        coll.accumulate(feats, {"values": outs})
        before = [interval_of(m) for m in coll]
        out.append(coll.calculate())
        after = [interval_of(m) for m in coll]
        fresh = all(a is not b and a.number == b.number + 1 and not a.touched for a, b in zip(after, before))
        out.append((fresh, [float(t.sum()) for m in coll for t in interval_of(m).states.values()
                            if t.dtype == torch.int64]))
    return out, Counted.resets


@pytest.mark.parametrize("backend", ["gloo", "standin"])
def test_calculate_begins_the_next_interval_made_while_the_data_travels(dist_pool, backend):
    whole = _whole(3)
    for out, resets in dist_pool.run(case_calculate_begins_the_next_interval, 3, backend=backend):
        assert resets == 3  # the class's own reset(), once per calculate()
        for results, (fresh, counts) in zip(out[::2], out[1::2]):
            assert fresh and counts == [0.0] * len(counts)
            for name in ("plain", "counted"):
                assert results[f"{name}/tokens"] == whole["tokens"]
                assert results[f"{name}/max"] == whole["max"]
