"""Multi-rank tests of MoERoutingMetric on 8 real gloo ranks: sharded == whole.

Synthetic routing for 4 MoE layers split over 2 pipeline stages (stage s holds layers
2s and 2s+1). The tokens of a layer are cut into contiguous chunks, two per rank that
routes disjoint tokens (two microbatches), each chunk one call with its own aux and z
loss. The whole: one process observing every chunk of every layer.
"""
import pytest
import torch

from parallel import DeviceMesh
from tests.moeref import losses, make_layer, piece
from twinkle_metrics import MetricSyncError, MoERoutingMetric
from twinkle_metrics.testing import CollectiveCounter, assert_results_close, forbid_device_waits

pytestmark = pytest.mark.xdist_group("dist")

SEED, L, E, K, T = 11, 4, 8, 2, 45
MICRO = 2


def _layers():
    # layer 3 routes nearly everything to the first experts, so it has dead experts
    return [make_layer(SEED + i, T, E, K, skew=3.0 if i == 3 else 1.0) for i in range(L)]


def _chunk_calls(data, layer, chunk, n_chunks):
    rows = torch.arange(T).tensor_split(n_chunks)[chunk].tolist()
    f = piece(data[layer], rows, K)
    f.update(losses(SEED, layer, chunk))
    return f


def whole_results(n_routing_ranks):
    data = _layers()
    m = MoERoutingMetric(DeviceMesh.single(), num_layers=L, num_experts=E)
    n = n_routing_ranks * MICRO
    for layer in range(L):
        for c in range(n):
            m.observe(layer, **_chunk_calls(data, layer, c, n))
    return m.calculate()


def _routing_rank(mesh, sequence_parallel):
    """(index among the ranks that route disjoint tokens, how many there are)."""
    idx = mesh.dp_rank * mesh.cp_size + mesh.cp_rank
    n = mesh.dp_size * mesh.cp_size
    if sequence_parallel:
        return idx * mesh.tp_size + mesh.tp_rank, n * mesh.tp_size
    return idx, n


def case_sharded_equals_whole(sizes, sequence_parallel, metric_sp):
    mesh = DeviceMesh.from_sizes(**{f"{k}_size": v for k, v in sizes.items()})
    data = _layers()
    m = MoERoutingMetric(mesh, num_layers=L, num_experts=E, sequence_parallel=metric_sp)
    me, n = _routing_rank(mesh, sequence_parallel)
    per_stage = L // mesh.pp_size
    calls = [(layer, _chunk_calls(data, layer, me * MICRO + j, n * MICRO))
             for layer in range(mesh.pp_rank * per_stage, (mesh.pp_rank + 1) * per_stage)
             for j in range(MICRO)]
    with CollectiveCounter() as c, forbid_device_waits():
        for layer, fields in calls:
            m.observe(layer, **fields)
    try:
        return "ok", m.calculate(), c.total
    except MetricSyncError as e:
        return "MetricSyncError", str(e), c.total


LAYOUTS = [
    # TP replicas route the same tokens and count once
    (dict(tp=2, pp=2, dp=2), False),
    # sequence parallelism: each TP rank routes its own part of the sequence
    (dict(tp=2, pp=2, dp=2), True),
    # expert parallelism (EP2 over DP2 x CP2): routing stays on every DP x CP rank
    (dict(pp=2, cp=2, dp=2, ep=2), False),
]


@pytest.mark.parametrize("sizes,sp", LAYOUTS, ids=["tp2pp2dp2", "tp2pp2dp2-sp", "ep2cp2dp2pp2"])
def test_moe_sharded_equals_whole(dist_pool, sizes, sp):
    n_routing = sizes.get("dp", 1) * sizes.get("cp", 1) * (sizes.get("tp", 1) if sp else 1)
    whole = whole_results(n_routing)
    # the comparison can fail: a layer with dead experts, drops, per-layer losses
    assert whole["moe/layer3/dead_expert_fraction"] > 0 and whole["moe/tokens_dropped"] > 0
    assert len({round(whole[f"moe/layer{i}/aux_loss"], 9) for i in range(L)}) == L
    for kind, got, collectives in dist_pool.run(case_sharded_equals_whole, sizes, sp, sp):
        assert kind == "ok", got
        assert collectives == 0  # accumulate never communicates
        assert_results_close(got, whole, rel=1e-12)


def test_moe_sequence_parallel_tokens_without_the_flag_raise_everywhere(dist_pool):
    """TP ranks that route disjoint tokens into a metric built without
    sequence_parallel=True disagree as replicas: every rank raises, naming the fix."""
    for kind, text, _ in dist_pool.run(case_sharded_equals_whole, dict(tp=2, pp=2, dp=2), True, False):
        assert kind == "MetricSyncError", text
        assert "disagree on MoERoutingMetric." in text and "sequence_parallel=True" in text
