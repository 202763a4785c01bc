"""Multi-rank tests of the mesh and the fused sync on 8 real gloo ranks."""
import math

import pytest
import torch
import torch.distributed as dist

from parallel import GROUP_NAMES, DeviceMesh, Layout
from tests.dist import sync_error
from tests.refmetric import TokenStats, make_batch, shard_for_rank
from twinkle_metrics import Metric, MetricCollection, State
from twinkle_metrics.core.compat import skip_deepspeed_shm_op
from twinkle_metrics.testing import CollectiveCounter

pytestmark = pytest.mark.xdist_group("dist")

NAMES = ("tp", "cp", "dp", "dp_cp", "pp", "mp")
LAYOUT_AXES = {"tp": "tp", "cp": "cp", "dp": "dp", "dp_cp": "dp-cp", "pp": "pp", "mp": "tp-pp"}


def _expected(lay, rank):
    return {n: lay.group_ranks(LAYOUT_AXES[n], rank) for n in NAMES}


def _ranks(mesh):
    return {n: mesh.ranks(n) for n in NAMES}


def case_layouts(sizes):
    """from_sizes and from_megatron give the same groups, and both match Layout."""
    from megatron.core import parallel_state as ps

    me = dist.get_rank()
    mesh = DeviceMesh.from_sizes(**{f"{k}_size": v for k, v in sizes.items()})
    lay = Layout(**sizes)
    expected = _expected(lay, me)
    ps.initialize_model_parallel(tensor_model_parallel_size=sizes.get("tp", 1),
                                 pipeline_model_parallel_size=sizes.get("pp", 1),
                                 context_parallel_size=sizes.get("cp", 1),
                                 create_gloo_process_groups=False)
    try:
        meg = DeviceMesh.from_megatron()
        from megatron.core.process_groups_config import ProcessGroupCollection

        pgc = DeviceMesh.from_megatron(ProcessGroupCollection.use_mpu_process_groups())
        return (_ranks(mesh), _ranks(meg), _ranks(pgc), expected, mesh.is_last_stage,
                meg.is_last_stage, ps.is_pipeline_last_stage(ignore_virtual=True))
    finally:
        ps.destroy_model_parallel()


@pytest.mark.megatron
@pytest.mark.parametrize("sizes", [dict(tp=2, pp=2, dp=2), dict(tp=2, cp=2, dp=2)])
def test_layouts_match_megatron(dist_pool, sizes):
    for ours, meg, pgc, expected, last, meg_last, ps_last in dist_pool.run(case_layouts, sizes):
        assert ours == expected
        assert meg == expected
        assert pgc == expected
        assert last == meg_last == ps_last


def case_deepspeed_and_torch():
    import deepspeed
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid, PipeModelDataParallelTopology
    from torch.distributed.device_mesh import init_device_mesh

    skip_deepspeed_shm_op()
    deepspeed.init_distributed(dist_backend="gloo")  # wraps the existing process group
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    grid = PipelineParallelGrid(topology=topo)
    from_grid = DeviceMesh.from_deepspeed(grid)
    from_topo = DeviceMesh.from_deepspeed(topo)
    tm = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    from_torch = DeviceMesh.from_torch(tm)
    return (_ranks(from_grid), _ranks(from_topo), _ranks(from_torch), grid.is_last_stage,
            from_grid.is_last_stage, from_torch.is_last_stage)


def test_deepspeed_and_torch_meshes(dist_pool):
    lay = Layout(tp=2, pp=2, dp=2)
    for rank, (grid, topo, tmesh, ds_last, last, t_last) in enumerate(dist_pool.run(case_deepspeed_and_torch)):
        expected = _expected(lay, rank)
        assert grid == topo == tmesh == expected
        assert ds_last == last == t_last == (rank >= 4)


def case_explicit_groups_are_checked():
    """Misbuilt meshes raise on every rank; an ep axis of a torch mesh joins the data group."""
    from torch.distributed.device_mesh import init_device_mesh

    lay = Layout(tp=2, pp=2, dp=2)
    me = dist.get_rank()
    groups = {}
    for axis in ("tp", "pp", "dp"):
        for ranks in lay.all_groups(axis):
            g = dist.new_group(ranks)
            if me in ranks:
                groups[axis] = g
    errors = []
    for bad in (groups, {"dp": dist.group.WORLD, "tp": groups["tp"]}):  # no 'mp'; dp overlapping tp
        try:
            DeviceMesh(bad)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    tm = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "ep"))
    mesh = DeviceMesh.from_torch(tm)
    return errors, mesh.ranks("dp_cp"), mesh.ranks("expt_dp"), mesh.ranks("ep")


def test_explicit_groups_are_checked(dist_pool):
    for rank, (errors, data, expt_dp, ep) in enumerate(dist_pool.run(case_explicit_groups_are_checked)):
        assert "need the model-parallel group 'mp'" in errors[0], errors
        assert "groups of different axes meet in this rank only" in errors[1], errors
        assert sorted(data) == [r for r in range(8) if r // 4 == rank // 4]  # dp x ep of its stage
        assert sorted(expt_dp) == [r for r in range(8) if r // 4 == rank // 4 and r % 2 == rank % 2]
        assert sorted(ep) == [rank - rank % 2, rank - rank % 2 + 1]


def _whole(seed):
    labels, values = make_batch(seed)
    m = TokenStats(DeviceMesh.single())
    m.accumulate({"labels": labels}, {"values": values})
    return m.calculate()


def case_sharded_equals_whole(sizes, seed):
    mesh = DeviceMesh.from_sizes(**{f"{k}_size": v for k, v in sizes.items()})
    labels, values = make_batch(seed)
    metric = TokenStats(mesh)
    if mesh.is_last_stage:
        feats, outs = shard_for_rank(labels, values, mesh.dp_size, mesh.dp_rank, mesh.cp_size,
                                     mesh.cp_rank)
        # uneven number of accumulate calls per rank: one call per microbatch on dp rank 0,
        # one call with the whole microbatch list elsewhere
        if mesh.dp_rank == 0:
            for f, o in zip(feats, outs):
                metric.accumulate(f, {"values": o})
        else:
            metric.accumulate(feats, {"values": outs})
    else:
        metric.accumulate([], {})  # what a non-last stage gets from the schedule
    return metric.calculate()


@pytest.mark.parametrize("sizes,backend", [
    (dict(tp=2, pp=2, dp=2), "gloo"), (dict(tp=2, cp=2, dp=2), "gloo"), (dict(dp=8), "gloo"),
    (dict(cp=2, dp=4), "gloo"), (dict(pp=4, dp=2), "gloo"),
    # the device path (the job's own groups, waits kept from the host): the same numbers
    (dict(tp=2, pp=2, dp=2), "standin"), (dict(cp=2, dp=4), "standin")])
def test_sharded_equals_whole(dist_pool, sizes, backend):
    whole = _whole(7)
    for got in dist_pool.run(case_sharded_equals_whole, sizes, 7, backend=backend):
        assert got.keys() == whole.keys()
        assert got["tokens"] == whole["tokens"]
        assert math.isclose(got["mean"], whole["mean"], rel_tol=1e-12)
        assert got["max"] == whole["max"] and got["min"] == whole["min"]


def case_collective_count(sizes, n_metrics):
    mesh = DeviceMesh.from_sizes(**{f"{k}_size": v for k, v in sizes.items()})
    labels, values = make_batch(3)
    coll = MetricCollection({f"m{i}": TokenStats() for i in range(n_metrics)}, device_mesh=mesh)
    feats, outs = shard_for_rank(labels, values, mesh.dp_size, mesh.dp_rank, mesh.cp_size, mesh.cp_rank)
    counts, results = [], []
    for _ in range(3):  # the first calculate() on these groups agrees on the plan once
        if mesh.is_last_stage:
            coll.accumulate(feats, {"values": outs})
        with CollectiveCounter() as c:
            results.append(coll.calculate())
        counts.append(c.total)
    # another metric set on the same groups: one more negotiation
    single = MetricCollection([TokenStats(mesh) for _ in range(n_metrics + 1)])
    single_counts = []
    for _ in range(2):
        with CollectiveCounter() as c1:
            single.calculate()
        single_counts.append(c1.total)
    with CollectiveCounter() as c2:  # back to the first set: its plan is known
        results.append(coll.calculate())
    # metrics that each built their own mesh over the same groups still sync as one
    groups = {name: mesh.get_group(name) for name in GROUP_NAMES}
    apart = MetricCollection([TokenStats(DeviceMesh(groups)) for _ in range(n_metrics + 1)])
    for _ in range(2):
        with CollectiveCounter() as c3:
            apart.calculate()
        single_counts.append(c3.total)
    return counts + [c2.total], single_counts, results


@pytest.mark.parametrize("sizes,limit,backend", [
    (dict(tp=2, pp=2, dp=2), 2, "gloo"), (dict(dp=8), 1, "gloo"), (dict(tp=2, cp=2, dp=2), 2, "gloo"),
    (dict(cp=2, dp=4), 1, "gloo"), (dict(tp=2, pp=2, dp=2), 2, "standin")])
def test_collective_count_is_fixed(dist_pool, sizes, limit, backend):
    for n_metrics in (1, 12):
        out = dist_pool.run(case_collective_count, sizes, n_metrics, backend=backend)
        for counts, single_counts, res in out:
            # first use of the groups: handshake (lengths + bytes over each group), then the
            # data phase; on groups that carried other sets before (WORLD for dp=8) one data
            # phase flags the new set first, or the set's plan is known already
            assert counts[0] in (limit, 3 * limit, 4 * limit) and counts[1:] == [limit] * 3
            # another set: a data phase that flags it, the negotiation, the data phase again
            assert single_counts[0] in (limit, 4 * limit) and single_counts[1] == limit
            assert single_counts[2:] == [limit, limit]  # the same set as ``single``: its plan is known
            assert all(len(r) == 4 * n_metrics for r in res[:3]) and res[3] == {}, res
            assert res[0] == res[1] == res[2]
        assert all(o[2] == out[0][2] for o in out)  # identical results on every rank


def case_schema_mismatch():
    mesh = DeviceMesh.from_sizes(tp_size=2, pp_size=2, dp_size=2)
    metrics = [TokenStats(mesh)]
    if dist.get_rank() == 3:  # a non-last-stage rank built one metric more
        metrics.append(TokenStats(mesh))
    return sync_error(MetricCollection(metrics).calculate)


def test_schema_mismatch_raises_on_every_rank(dist_pool):
    # Rank 3 reduces with data group [1, 3], then shares results over TP x PP [2, 3, 6, 7];
    # rank 1 shares over [0, 1, 4, 5]. Every rank must raise the same error, none may hang.
    errors = dist_pool.run(case_schema_mismatch, timeout=120)
    assert all(e is not None for e in errors), errors
    assert len(set(errors)) == 1
    assert "ranks [3] hold" in errors[0] and "ranks [0-2, 4-7] hold" in errors[0]


def case_state_dict_resume():
    mesh = DeviceMesh.from_sizes(dp_size=8)
    labels, values = make_batch(11)
    feats, outs = shard_for_rank(labels, values, 8, dist.get_rank(), 1, 0)
    first = TokenStats(mesh)
    first.accumulate(feats[:1], {"values": outs[:1]})
    saved = first.state_dict()
    resumed = TokenStats(mesh).load_state_dict(saved)
    resumed.accumulate(feats[1:], {"values": outs[1:]})
    return resumed.calculate()


def test_state_dict_resume_mid_interval(dist_pool):
    whole = _whole(11)
    for got in dist_pool.run(case_state_dict_resume):
        assert got["tokens"] == whole["tokens"]
        assert math.isclose(got["mean"], whole["mean"], rel_tol=1e-12)


def case_twinkle_process_groups():
    mesh = DeviceMesh.from_sizes(tp_size=2, cp_size=2, dp_size=2)
    return {dims: dist.get_process_group_ranks(mesh.create_process_group(list(dims)))
            for dims in (("dp",), ("tp",), ("dp", "cp"), ("cp",))}


def test_twinkle_create_process_group_names_the_mesh_groups(dist_pool):
    lay = Layout(tp=2, cp=2, dp=2)
    for rank, got in enumerate(dist_pool.run(case_twinkle_process_groups)):
        assert got == {("dp",): lay.group_ranks("dp", rank), ("tp",): lay.group_ranks("tp", rank),
                       ("dp", "cp"): lay.group_ranks("dp-cp", rank), ("cp",): lay.group_ranks("cp", rank)}


def case_gather_results():
    m = TokenStats(DeviceMesh.from_sizes(tp_size=2, dp_size=4))
    return m.gather_results([{"rank": dist.get_rank()}])


def test_gather_results_over_data_group(dist_pool):
    for rank, got in enumerate(dist_pool.run(case_gather_results)):
        assert sorted(r["rank"] for r in got) == Layout(tp=2, dp=4).group_ranks("dp", rank)


def case_deepspeed_ulysses():
    """Ulysses SP through deepspeed's mesh_device: the sequence group is CP, data group SP x DP."""
    import deepspeed
    import deepspeed.comm as ds_dist
    from deepspeed.utils import groups as ds_groups

    skip_deepspeed_shm_op()
    deepspeed.init_distributed(dist_backend="gloo")
    mesh_device = ds_dist.initialize_mesh_device((4, 2), ("data_parallel", "sequence_parallel"))
    ds_groups.mesh_device = mesh_device
    try:
        mesh = DeviceMesh.from_deepspeed()
        labels, values = make_batch(5)
        metric = TokenStats(mesh)
        feats, outs = shard_for_rank(labels, values, mesh.dp_size, mesh.dp_rank, mesh.cp_size, mesh.cp_rank)
        metric.accumulate(feats, {"values": outs})
        return _ranks(mesh), ds_groups._get_sequence_parallel_world_size(), metric.calculate()
    finally:
        ds_groups.mesh_device = None


def test_deepspeed_ulysses_sequence_groups(dist_pool):
    lay = Layout(cp=2, dp=4)
    whole = _whole(5)
    for rank, (ranks, sp_size, got) in enumerate(dist_pool.run(case_deepspeed_ulysses)):
        assert sp_size == 2
        assert ranks == _expected(lay, rank)
        assert got["tokens"] == whole["tokens"]
        assert math.isclose(got["mean"], whole["mean"], rel_tol=1e-12)


class Placed(Metric):
    """One state per scope, fed the values the test computes from the rank's position."""

    d = State("sum")                              # data: the last stage's, TP replicas agree
    s = State("sum", scope="stage")               # every stage, TP replicas agree
    s_low = State("min", scope="stage")
    m = State("sum", torch.int64, scope="model")  # every TP x PP rank holds a part
    m_peak = State("max", scope="model")

    def update(self, inputs, outputs, **kwargs):
        return dict(outputs)

    def compute(self, s):
        return dict(s)


def _placed_values(dp, tp, pp, cp=0):
    return {"d": 1.0 + 10 * dp + 100 * pp + 1000 * cp, "s": 7.0 * (dp + 1) + 0.5 * pp + cp,
            "s_low": -float((pp + 1) * (dp + 2) + cp), "m": 2 ** 53 + 3 * tp + 5 * pp + 11 * dp + cp,
            "m_peak": 1.5 * tp + pp - dp + 0.25 * cp}


def case_state_scopes(sizes):
    mesh = DeviceMesh.from_sizes(**{f"{k}_size": v for k, v in sizes.items()})
    metric = Placed(mesh)
    pos = dict(dp=mesh.dp_rank, tp=mesh.tp_rank, pp=mesh.pp_rank, cp=mesh.cp_rank)
    counts, results = [], []
    for _ in range(2):
        metric.accumulate(None, _placed_values(**pos))
        with CollectiveCounter() as c:
            results.append(metric.calculate())
        counts.append(c.total)
    return pos, mesh.pp_size, counts, results


@pytest.mark.parametrize("sizes", [dict(tp=2, pp=2, dp=2), dict(tp=2, cp=2, dp=2)])
def test_state_scopes_merge_over_their_ranks(dist_pool, sizes):
    """``scope="stage"`` sums one TP rank per stage, ``"model"`` every rank, ``"data"``
    only the last stage's data group; int64 stays exact past 2**53; same collectives."""
    out = dist_pool.run(case_state_scopes, sizes)
    last = out[0][1] - 1
    every = [_placed_values(**pos) for pos, *_ in out]
    tp0 = [v for (pos, *_), v in zip(out, every) if pos["tp"] == 0]
    expected = {
        "d": sum(v["d"] for (pos, *_), v in zip(out, every) if pos["tp"] == 0 and pos["pp"] == last),
        "s": sum(v["s"] for v in tp0), "s_low": min(v["s_low"] for v in tp0),
        "m": sum(v["m"] for v in every), "m_peak": max(v["m_peak"] for v in every)}
    assert isinstance(expected["m"], int) and expected["m"] > 2 ** 56
    for pos, _, counts, results in out:
        assert results == [expected, expected], (pos, results)
        assert counts[1] == 2


def case_stage_scope_replicas_disagree():
    mesh = DeviceMesh.from_sizes(tp_size=2, pp_size=2, dp_size=2)
    metric = Placed(mesh)
    values = _placed_values(mesh.dp_rank, 0, mesh.pp_rank)
    values["s"] += mesh.tp_rank  # TP replicas of a stage must agree on a "stage" state
    metric.accumulate(None, values)
    return sync_error(metric.calculate)


def test_stage_scope_checks_tp_replicas(dist_pool):
    for err in dist_pool.run(case_stage_scope_replicas_disagree):
        assert err is not None and "Placed.s " in err, err
