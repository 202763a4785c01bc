"""megatron-core 0.19's GTP weight rematerialisation (``gtp_remat_size=2``) on 8 gloo ranks.

GTP peers hold different tokens, so they belong to the data group (Megatron's own
``dp_cp_gtp_remat``); results are shared over TP x PP at each GTP position, one source in
each; ``ModelNormMetric`` counts a GTP-sharded parameter once. Every case here compares
with one process holding everything. Skipped where megatron-core has no GTP (before 0.19).
"""
import inspect
import math

import pytest
import torch

from parallel import DeviceMesh
from tests.metrics.lm.test_metrics_basic_dist import _check, feed, make_metrics

pytestmark = pytest.mark.xdist_group("dist")


def _has_gtp() -> bool:
    try:
        from megatron.core import parallel_state as ps
    except ImportError:
        return False
    return "gtp_remat_size" in inspect.signature(ps.initialize_model_parallel).parameters


requires_gtp = pytest.mark.skipif(not _has_gtp(), reason="this megatron-core has no GTP "
                                                          "(initialize_model_parallel(gtp_remat_size=...), 0.19+)")


def _init(tp=1, pp=1):
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 gtp_remat_size=2, create_gloo_process_groups=False,
                                 distributed_timeout_minutes=1)
    return ps


def _mesh(ps, source):
    if source == "collection":
        from megatron.core.process_groups_config import ProcessGroupCollection

        return DeviceMesh.from_megatron(ProcessGroupCollection.use_mpu_process_groups())
    return DeviceMesh.from_megatron()


def case_loss_quarter(source):
    """TP2 x GTP2 x DP2: the four data ranks report [data rank + 1, 10] (TP replicas alike)."""
    from twinkle_metrics import LossMetric

    ps = _init(tp=2)
    try:
        mesh = _mesh(ps, source)
        metric = LossMetric(mesh, loss_reduction="sum")
        me = mesh.data_rank
        metric.accumulate(None, [{"lm loss": torch.tensor([me + 1.0, 10.0])}])
        sizes = (mesh.data_size, mesh.dp_size, mesh.tp_size, mesh.get_group("gtp") is not None)
        return metric.calculate()["loss"], sizes, mesh.is_result_source
    finally:
        ps.destroy_model_parallel()


@requires_gtp
@pytest.mark.parametrize("source", ["parallel_state", "collection"])
def test_loss_over_the_gtp_peers_is_exact(dist_pool, source):
    """(1 + 2 + 3 + 4) / 40: the replicate-only data group gives 0.2 or 0.3, and the
    model-parallel group, which spans the GTP peers, two result sources."""
    out = dist_pool.run(case_loss_quarter, source)
    assert [loss for loss, _, _ in out] == [0.25] * 8
    assert all(sizes == (4, 4, 2, True) for _, sizes, _ in out)
    assert sum(source for _, _, source in out) == 4  # PP 1: results shared over TP, TP rank 0 of each


def case_sharded_equals_whole(source, seed):
    """TP2 x GTP2 x PP2: the basic metrics (vocab-parallel accuracy, loss, embeddings,
    train), this rank's share of one batch (the GTP peers are its data ranks)."""
    ps = _init(tp=2, pp=2)
    try:
        mesh = _mesh(ps, source)
        coll = make_metrics(mesh)
        feed(coll, mesh, seed)
        return coll.calculate(), mesh.tp_rank, mesh.data_rank
    finally:
        ps.destroy_model_parallel()


@requires_gtp
@pytest.mark.parametrize("source", ["parallel_state", "collection"])
def test_sharded_equals_whole_tp2_gtp2_pp2(dist_pool, source):
    out = dist_pool.run(case_sharded_equals_whole, source, 7)
    assert len({d for _, _, d in out}) == 2  # the two GTP peers are the data ranks
    _check(out, 7)


# ModelNormMetric: the logical model, whole; "gtp" parameters are split over the GTP peers
# (dim 0), "tp" ones over TP (dim 0), the rest replicated. name -> (shape, sharding)
_MODEL = {"fc1": ((8, 6), "gtp"), "fc2": ((6, 4), "tp"), "norm": ((6,), None), "both": ((8, 4), "gtp+tp")}


def _logical():
    g = torch.Generator().manual_seed(19)
    return {name: (torch.randn(*shape, generator=g), torch.randn(*shape, generator=g))
            for name, (shape, _) in _MODEL.items()}


def case_norms():
    from twinkle_metrics import ModelNormMetric

    ps = _init(tp=2)
    try:
        mesh = DeviceMesh.from_megatron()
        gtp_group = mesh.get_group("gtp")
        gtp_rank, gtp_size = ps.get_gtp_weight_remat_rank(), ps.get_gtp_weight_remat_world_size()
        model = torch.nn.Module()
        for name, (param, grad) in _logical().items():
            kind = _MODEL[name][1] or ""
            if "gtp" in kind:
                param, grad = param.chunk(gtp_size, 0)[gtp_rank], grad.chunk(gtp_size, 0)[gtp_rank]
            if "tp" in kind.replace("gtp", ""):
                dim = 1 if kind == "gtp+tp" else 0
                param, grad = param.chunk(mesh.tp_size, dim)[mesh.tp_rank], grad.chunk(mesh.tp_size, dim)[mesh.tp_rank]
            p = torch.nn.Parameter(param.clone())
            p.grad = grad.clone()  # reduced: the same on every rank holding this part
            if "tp" in kind.replace("gtp", ""):
                p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, 0, 1
            if "gtp" in kind:
                p.is_gtp_weight_remat = True
            setattr(model, name, p)
        metric = ModelNormMetric(mesh, model=model)
        metric.accumulate(None, None)
        return metric.calculate(), gtp_group is not None
    finally:
        ps.destroy_model_parallel()


@requires_gtp
def test_norms_count_gtp_shards_once(dist_pool):
    """TP2 x GTP2 x DP2: each GTP shard once (counting them on data rank 0 alone drops the
    other peer's half; on every data rank counts each twice)."""
    logical = _logical()

    def norm(i, names):
        return math.sqrt(sum(float(torch.linalg.vector_norm(logical[n][i], dtype=torch.float64) ** 2)
                             for n in names))

    out = dist_pool.run(case_norms)
    for got, has_gtp in out:
        assert has_gtp and got == out[0][0]
        assert math.isclose(got["norm/grad"], norm(1, logical), rel_tol=1e-9), got
        assert math.isclose(got["norm/param"], norm(0, logical), rel_tol=1e-9), got
        for name in logical:
            assert math.isclose(got[f"norm/grad/{name}"], norm(1, [name]), rel_tol=1e-9), name
