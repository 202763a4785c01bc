"""Bounded, named waits on every group source (8 real gloo ranks).

Each case leaves some ranks out of a call and checks that the ranks that came raise
``MetricSyncError``, naming the ranks that did not, long before the groups' own timeouts
(Megatron's ``distributed_timeout_minutes`` default, DeepSpeed's, the pool's 60 s). The
bound is set before each case builds its meshes, as a training script sets it.
"""
import os
import time

import pytest
import torch
import torch.distributed as dist

from parallel import DeviceMesh
from parallel import groups as G
from twinkle_metrics import Accuracy, LossMetric
from twinkle_metrics.core.compat import skip_deepspeed_shm_op
from twinkle_metrics.testing import CollectiveCounter

pytestmark = pytest.mark.xdist_group("dist")

#: long enough for a healthy collective of 8 ranks on 2 busy cores, far below the groups' own
BOUND_S = 10
#: the pool's groups give up after 60 s (``DistPool``), Megatron's after 30 minutes: a rank
#: that raised before this did so through the library's bound, not a group's own timeout
GROUPS_S = 50


def _loss(mesh):
    """Megatron's [loss sum, tokens] for 4 tokens per data rank; TP replicas alike."""
    m = LossMetric(mesh, loss_reduction="sum")
    m.accumulate(None, [{"lm loss": torch.tensor([2.0 * (mesh.dp_rank + 1), 4.0], dtype=torch.float64)}])
    return m


def _only(ranks, call):
    """``call()`` on ``ranks`` only: (error type, message, seconds) there, None elsewhere."""
    if dist.get_rank() not in ranks:
        return None
    start = time.monotonic()
    try:
        call()
        return None, "", time.monotonic() - start
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return type(exc).__name__, str(exc), time.monotonic() - start


def _with_bound(fn):
    """Run ``fn`` (which builds its meshes) with ``TWINKLE_METRICS_TIMEOUT_S`` set."""
    os.environ["TWINKLE_METRICS_TIMEOUT_S"] = str(BOUND_S)
    try:
        return fn()
    finally:
        del os.environ["TWINKLE_METRICS_TIMEOUT_S"]


def case_deepspeed_engine_only_rank0_calculates():
    import deepspeed

    skip_deepspeed_shm_op()
    deepspeed.init_distributed(dist_backend="gloo")
    model = torch.nn.Linear(4, 4)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1},
                "zero_allow_untested_optimizer": True})
    def run():
        mesh = DeviceMesh.from_deepspeed(engine)
        return G.group_timeout(mesh.data_group), _only({0}, _loss(mesh).calculate)
    return _with_bound(run)


def case_agreement_in_accumulate_with_a_rank_missing():
    """TP2 x DP4 with vocab-parallel accuracy: rank 1 (the TP peer of rank 0) skips one call."""
    def run():
        mesh = DeviceMesh.from_sizes(tp_size=2, dp_size=4)  # groups wait the pool's 60 s ...
        m = Accuracy(mesh, vocab_parallel=True)
        logits = torch.randn(1, 3, 4, generator=torch.Generator().manual_seed(dist.get_rank() // 2))
        return _only(set(range(8)) - {1}, lambda: m.accumulate({"labels": torch.tensor([[1, 2, 3]])},
                                                                {"logits": logits}))
    return _with_bound(run)  # ... the library's waits BOUND_S


def case_async_with_a_rank_missing():
    """One asynchronous interval on every rank, then one that rank 5 never hands off: the
    others' handles raise naming it, and the interval comes back to the metric."""
    def run():
        mesh = DeviceMesh.from_sizes(dp_size=8, timeout=BOUND_S)
        m = _loss(mesh)
        first = m.calculate(async_op=True).wait()
        m.accumulate(None, [{"lm loss": torch.tensor([1.0, 1.0], dtype=torch.float64)}])

        def second():
            m.calculate(async_op=True).wait()
        out = _only(set(range(8)) - {5}, second)
        kept = m.state_dict()
        return first, out, {k: v for k, v in kept.items() if "sum" in k or "count" in k}
    return run()


def case_every_rank_calls(kind):
    """The healthy path: results as before, the collective budget unchanged, nothing
    added, whatever the groups' own timeouts (the sync runs on them, its bound kept from
    the host), on a mesh over part of the world too."""
    def run():
        if kind == "within":  # timeout= sets the groups' timeout and the bound
            mesh = DeviceMesh.from_sizes(tp_size=2, dp_size=4, timeout=BOUND_S)
        elif kind == "longer":  # the groups take the pool's init timeout, longer than the bound
            mesh = DeviceMesh.from_sizes(tp_size=2, dp_size=4)
        else:  # DP4 over half of the world, its groups with the init timeout
            halves = [dist.new_group([0, 1, 2, 3]), dist.new_group([4, 5, 6, 7])]
            mesh = DeviceMesh({"dp": halves[dist.get_rank() // 4]})
        m = _loss(mesh)
        m.calculate()  # the first call negotiates
        m = _loss(mesh)
        with CollectiveCounter() as counter:
            out = m.calculate()
        return out, counter.total
    return _with_bound(run)


def _check_only_rank0(out):
    kind, text, seconds = out[0][1]
    assert kind == "MetricSyncError", text
    assert "calculate()" in text and "ranks 1-7" in text and "did not arrive" in text, text
    assert seconds < GROUPS_S, f"rank 0 waited {seconds:.1f} s: the groups' own timeout, not the bound"
    assert all(o[1] is None for o in out[1:])


def test_deepspeed_engine_groups_only_rank0_calculates_raises_in_seconds(dist_pool):
    out = dist_pool.run(case_deepspeed_engine_only_rank0_calculates, timeout=180)
    _check_only_rank0(out)


@pytest.mark.parametrize("backend", ["gloo", "standin"])  # standin: on a gloo group made at the first call
def test_agreement_inside_accumulate_names_the_missing_peer(dist_pool, backend):
    out = dist_pool.run(case_agreement_in_accumulate_with_a_rank_missing, timeout=120, backend=backend)
    kind, text, seconds = out[0]
    assert kind == "MetricSyncError" and "rank 1 " in text and "Accuracy.accumulate()" in text, text
    assert "TP group [0, 1]" in text, text
    assert seconds < GROUPS_S, seconds
    assert out[1] is None
    assert all(o == (None, "", o[2]) for o in out[2:]), out[2:]  # the other TP pairs went on


@pytest.mark.parametrize("backend", ["gloo", "standin"])
def test_async_calculate_with_a_rank_missing_raises_and_keeps_the_interval(dist_pool, backend):
    out = dist_pool.run(case_async_with_a_rank_missing, timeout=120, backend=backend)
    for rank, (first, result, kept) in enumerate(out):
        assert first == {"loss": 72.0 / 32, "num_tokens": 32}
        if rank == 5:
            assert result is None
            continue
        kind, text, seconds = result
        assert kind == "MetricSyncError" and "rank 5 " in text, text
        assert seconds < GROUPS_S, seconds
        assert kept and any(v for v in kept.values()), kept  # the interval came back


@pytest.mark.parametrize("kind,collectives", [("within", 2), ("longer", 2), ("partial", 1)])
def test_every_rank_calling_keeps_results_and_the_collective_budget(dist_pool, kind, collectives):
    out = dist_pool.run(case_every_rank_calls, kind, timeout=120)
    for result, total in out:
        assert result == {"loss": 20.0 / 16, "num_tokens": 16}
        assert total == collectives  # data group (and TP x PP); nothing added


def case_vocab_parallel_forgotten(kind):
    """TP2 x DP4, Megatron's vocab shards given without vocab_parallel=True; the two TP
    replicas' shard-only numbers agree (equal shards: no label in either shard's argmax,
    equal entropies), so only the labels' reach can tell."""
    from twinkle_metrics import GRPOMetric

    mesh = DeviceMesh.from_sizes(tp_size=2, dp_size=4)
    local = torch.zeros(1, 3, 4)  # this TP rank's half of an 8-entry vocab
    labels = {"labels": torch.tensor([[5, 6, 7]])}
    if kind == "accuracy":
        m = Accuracy(mesh)  # vocab_parallel forgotten
        m.accumulate(labels, {"logits": local})
    else:
        m = GRPOMetric(mesh, entropy_from_logits=True)
        m.accumulate(labels, {"logits": local, "logps": torch.full((1, 3), -0.5)})
    try:
        return m.calculate()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return type(exc).__name__, str(exc)


@pytest.mark.parametrize("kind", ["accuracy", "grpo_entropy"])
def test_vocab_sharded_logits_without_vocab_parallel_raise_from_the_first_interval(dist_pool, kind):
    for out in dist_pool.run(case_vocab_parallel_forgotten, kind):
        kind_, text = out
        assert kind_ == "ValueError" and "vocab_parallel=True" in text and "reach id 7" in text, out


SOURCES = ("megatron", "megatron_collection", "deepspeed_grid", "deepspeed_topology", "torch", "twinkle", "current")


def _source_mesh(source):
    if source == "megatron":  # parallel_state, distributed_timeout_minutes left at 30
        return DeviceMesh.from_megatron()
    if source == "megatron_collection":
        from megatron.core.process_groups_config import ProcessGroupCollection

        return DeviceMesh.from_megatron(ProcessGroupCollection.use_mpu_process_groups())
    if source.startswith("deepspeed"):
        import deepspeed
        from deepspeed.runtime.pipe.topology import PipelineParallelGrid, PipeModelDataParallelTopology

        skip_deepspeed_shm_op()
        deepspeed.init_distributed(dist_backend="gloo")
        topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
        return DeviceMesh.from_deepspeed(PipelineParallelGrid(topology=topo) if source == "deepspeed_grid" else topo)
    if source == "torch":
        from torch.distributed.device_mesh import init_device_mesh

        return DeviceMesh.from_torch(init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp")))
    if source == "twinkle":
        from tests.integrations.test_twinkle_compat import TwinkleLikeMesh

        return DeviceMesh.from_twinkle(TwinkleLikeMesh.from_sizes(dp_size=4, tp_size=2))
    return DeviceMesh.current()


def case_only_rank0_calculates(source):
    """A mesh of ``source`` (Megatron's groups with their 30-minute default); rank 0 alone
    calls calculate(). Its collective stays in flight on the job's group, which is spent:
    one job per source. Also: the Megatron data group's own timeout."""
    from megatron.core import parallel_state as ps

    if source != "current":  # current(): WORLD as pure data parallel
        ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                     create_gloo_process_groups=False)  # 30-min groups
    try:
        def run():
            mesh = _source_mesh(source)
            return (G.group_timeout(mesh.data_group) if source == "megatron" else None,
                    _only({0}, _loss(mesh).calculate))
        return _with_bound(run)
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("source,backend", [(s, "gloo") for s in SOURCES]
                         + [("megatron", "standin"), ("current", "standin")])
def test_every_group_source_bounds_and_names_a_missing_rank(dist_pool, source, backend):
    out = dist_pool.run(case_only_rank0_calculates, source, timeout=240, backend=backend)
    held, (kind, text, seconds) = out[0]
    assert held is None or held.total_seconds() >= 600, held  # Megatron's long default stays
    assert kind == "MetricSyncError" and "did not arrive" in text and "calculate()" in text, text
    assert "ranks 1-7" in text, text
    assert "collective in flight" in text and "must stop" in text, text  # the job's group, left as it is
    assert seconds < GROUPS_S, seconds
    assert all(o[1] is None for o in out[1:])  # theirs to time out later


def _named(text, what="did not arrive"):
    """The ranks a message names before ``what`` (``"ranks 0-3, 6 of the mesh ... did not
    arrive"`` -> ``{0, 1, 2, 3, 6}``), parsed from the text."""
    import re

    found = re.search(r"\branks? ([0-9][0-9, -]*?) of the [^;]*? " + what, text)
    assert found, text
    out = set()
    for part in found.group(1).split(","):
        lo, _, hi = part.strip().partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


#: scenario -> (ranks that call calculate(), the ranks every one of them must name)
ABSENT = {
    "megatron_last_stage_only": (set(range(4, 8)), set(range(4))),  # TP2 x PP2 x DP2
    "megatron_dp_cp_rank": (set(range(8)) - {6}, {6}),               # TP2 x CP2 x DP2
    "deepspeed_tp_replica": (set(range(8)) - {5}, {5}),              # PP2 x DP2 x TP2
    "torch_dp_rank": (set(range(8)) - {2}, {2}),                     # PP2 x DP2 x TP2
    "twinkle_tp_replica": (set(range(8)) - {3}, {3}),                # DP4 x TP2
}


def case_absent_ranks(scenario):
    """Some ranks of a mesh that spans the world skip one calculate(); the callers'
    data and TP x PP groups differ from rank to rank."""
    from megatron.core import parallel_state as ps

    def mesh():
        if scenario.startswith("megatron"):
            cp = 2 if "cp" in scenario else 1
            ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=3 - cp,
                                         context_parallel_size=cp, create_gloo_process_groups=False)
            return DeviceMesh.from_megatron()
        if scenario.startswith("deepspeed"):
            return _source_mesh("deepspeed_topology")
        return _source_mesh(scenario.split("_")[0])

    try:
        return _with_bound(lambda: _only(ABSENT[scenario][0], _loss(mesh()).calculate))
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("scenario,backend", [(s, "gloo") for s in ABSENT]
                         + [("megatron_last_stage_only", "standin"), ("torch_dp_rank", "standin")])
def test_every_rank_that_came_names_exactly_the_absent_ones(dist_pool, scenario, backend):
    out = dist_pool.run(case_absent_ranks, scenario, timeout=180, backend=backend)
    callers, absent = ABSENT[scenario]
    for rank, result in enumerate(out):
        if rank not in callers:
            assert result is None
            continue
        kind, text, seconds = result
        assert kind == "MetricSyncError" and "calculate()" in text, (rank, text)
        assert _named(text) == absent, (rank, text)
        assert seconds < GROUPS_S, (rank, seconds)


def case_a_late_rank():
    """DP8: ranks 1 and 2 call calculate() and give up; rank 0 calls only once both have
    raised (told through the store, no clock); ranks 3-7 never call."""
    from datetime import timedelta

    store = G.group_store(dist.group.WORLD)
    m = _loss(DeviceMesh.from_sizes(dp_size=8, timeout=BOUND_S))
    rank = dist.get_rank()
    if rank in (1, 2):
        out = _only({rank}, m.calculate)
        store.set(f"tests/late/gave_up/{rank}", "1")
        return out
    if rank == 0:
        store.wait(["tests/late/gave_up/1", "tests/late/gave_up/2"], timedelta(seconds=120))
        first = _only({0}, m.calculate)
        return first, _only({0}, m.calculate)  # the group stays spent
    return None


@pytest.mark.parametrize("backend", ["gloo", "standin"])
def test_a_rank_that_comes_after_the_others_gave_up_says_so_and_never_names_itself(dist_pool, backend):
    out = dist_pool.run(case_a_late_rank, timeout=180, backend=backend)
    for rank in (1, 2):
        kind, text, _ = out[rank]
        assert kind == "MetricSyncError" and _named(text) == {0, 3, 4, 5, 6, 7}, text
    (kind, text, _), (again_kind, again, _) = out[0]
    assert kind == "MetricSyncError", text
    assert _named(text, "gave up") == {1, 2}, text
    assert "restart" in text and "did not arrive" not in text and "this is rank 0" not in text, text
    import re

    assert re.search(r"\branks 3-7 had not come either\b", text), text  # and not rank 0 itself
    assert again_kind == "MetricSyncError" and text in again, again
    assert all(o is None for o in out[3:])
