"""A rank that rejects its input never desynchronises the collectives inside accumulate.

For each metric that communicates in ``accumulate``, one rank gets bad input while
the others get good input: the rejecting rank raises its own error, every other
rank of its group a ``MetricSyncError`` naming it, ranks of other groups go on; no
state changes where it raised; and the run then calculates exactly what a run
without the failed calls gives. On the shared 8-rank gloo pool.
"""
import pytest
import torch
import torch.distributed as dist

from parallel import DeviceMesh
from twinkle_metrics import Accuracy, DPOMetric, EmbeddingMetric, GRPOMetric, GSPOMetric, LossMetric, MetricCollection
from twinkle_metrics.testing import state_dict_differences

pytestmark = pytest.mark.xdist_group("dist")

B, S, V = 4, 6, 8  # sequences, tokens per sequence (whole), vocab (whole)


def _gen(seed, rank):
    return torch.Generator().manual_seed(1000 * seed + rank)


def _cols(mesh):
    per = S // mesh.cp_size
    return slice(mesh.cp_rank * per, (mesh.cp_rank + 1) * per)


def _labels(g, b=B, s=S):
    labels = torch.randint(0, V, (b, s), generator=g)
    return torch.where(torch.rand(b, s, generator=g) < 0.8, labels, torch.full_like(labels, -100))


# ------------------------------------------------------------------ per metric: (mesh, metric, call)
def _accuracy(mesh, seed, bad):
    # The same tokens on both TP ranks (seeded by DP rank), each with its vocab shard.
    g = _gen(seed, mesh.dp_rank)
    logits = torch.randn(2, S, V, generator=g)
    labels = _labels(g, 2)
    width = V // mesh.tp_size
    shard = logits[..., mesh.tp_rank * width:(mesh.tp_rank + 1) * width].contiguous()
    if bad == "missing":
        return (None, {"logits": shard}), {}
    if bad == "tokens":  # valid on its own, but a different token count than its TP peer
        return ({"labels": labels[:, :-1]}, {"logits": shard[:, :-1]}), {}
    return ({"labels": labels}, {"logits": shard}), {}


def _embedding(mesh, seed, bad):
    g = _gen(seed, dist.get_rank())
    emb = torch.randn(B, 5, generator=g, dtype=torch.float64)
    labels = torch.tensor([1, 0, 1, 0])
    if bad:
        return ({"labels": labels}, {"embeddings": emb.to(torch.int64)}), {}  # TypeError
    return ({"labels": labels}, {"embeddings": emb}), {"grad_norm": float(seed)}


def _dpo(mesh, seed, bad):
    g = _gen(seed, mesh.dp_rank)  # whole sequences per DP rank; each CP rank takes its columns
    labels, lp = _labels(g), -torch.rand(B, S, generator=g, dtype=torch.float64)
    cols = _cols(mesh)
    if bad:
        return ({"labels": labels[:, cols]}, {"logps": lp[:2, cols]}), {}  # batch 2 vs labels 4
    return ({"labels": labels[:, cols]}, {"logps": lp[:, cols]}), {}


def _gspo(mesh, seed, bad):
    g = _gen(seed, mesh.dp_rank)
    labels, lp = _labels(g), -torch.rand(B, S, generator=g, dtype=torch.float64)
    old = lp + 0.3 * torch.randn(B, S, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    cols = _cols(mesh)
    feat = {"labels": labels[:, cols]}
    if bad:
        return (feat, {"logps": lp[:2, cols]}), {"old_logps": old[:, cols], "advantages": adv}
    return (feat, {"logps": lp[:, cols]}), {"old_logps": old[:, cols], "advantages": adv}


def _grpo_entropy(mesh, seed, bad):
    g = _gen(seed, mesh.dp_rank)
    labels, lp = _labels(g), -torch.rand(B, S, generator=g, dtype=torch.float64)
    logits = torch.randn(B, S, V, generator=g, dtype=torch.float64)
    width = V // mesh.tp_size
    shard = logits[..., mesh.tp_rank * width:(mesh.tp_rank + 1) * width]
    if bad:
        shard = shard[:1]  # batch 1 vs log-probs 4: ValueError
    return ({"labels": labels}, {"logps": lp, "logits": shard}), {}


CASES = {
    "accuracy": (dict(tp_size=2), "tp", lambda m: Accuracy(m, vocab_parallel=True), _accuracy),
    "embedding": (dict(dp_size=8), "dp_cp", lambda m: EmbeddingMetric(m), _embedding),
    "dpo": (dict(cp_size=2), "cp", lambda m: DPOMetric(m, beta=0.5), _dpo),
    "gspo": (dict(cp_size=2), "cp", lambda m: GSPOMetric(m), _gspo),
    "grpo_entropy": (dict(tp_size=2), "tp",
                     lambda m: GRPOMetric(m, entropy_from_logits=True, vocab_parallel=True), _grpo_entropy),
}


def case_reject(kind, bad_rank, bad):
    sizes, axis, make, call = CASES[kind]
    mesh = DeviceMesh.from_sizes(**sizes)
    metric, reference = make(mesh), make(mesh)
    me = dist.get_rank()

    def step(m, seed, how=None):
        (inputs, outputs), kw = call(mesh, seed, how)
        m.accumulate(inputs, outputs, **kw)

    step(metric, 0)
    step(reference, 0)
    before = metric.state_dict()
    outcome = None
    try:
        step(metric, 1, bad if me == bad_rank else None)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        outcome = (type(exc).__name__, str(exc))
    unchanged = not state_dict_differences(before, metric.state_dict())
    if outcome is None:
        step(reference, 1)  # the run without the failed calls
    step(metric, 2)
    step(reference, 2)
    return outcome, unchanged, mesh.ranks(axis), metric.calculate(), reference.calculate()


@pytest.mark.parametrize("kind,bad_rank,bad,backend", [
    ("accuracy", 3, "missing", "gloo"), ("embedding", 5, True, "gloo"), ("dpo", 2, True, "gloo"),
    ("gspo", 7, True, "gloo"), ("grpo_entropy", 4, True, "gloo"),
    # device groups: the agreements run on gloo groups the library makes at the first call
    ("accuracy", 3, "missing", "standin"), ("embedding", 5, True, "standin"), ("dpo", 2, True, "standin")])
def test_rejected_input_raises_on_every_rank_of_the_group(dist_pool, kind, bad_rank, bad, backend):
    out = dist_pool.run(case_reject, kind, bad_rank, bad, backend=backend)
    group = out[bad_rank][2]
    assert bad_rank in group and len(group) > 1
    for rank, (outcome, unchanged, _ranks, got, want) in enumerate(out):
        if rank == bad_rank:
            assert outcome is not None and outcome[0] in ("ValueError", "TypeError"), outcome
        elif rank in group:
            assert outcome is not None and outcome[0] == "MetricSyncError", (rank, outcome)
            assert f"rank {bad_rank} rejected its input" in outcome[1]
            assert type(CASES[kind][2](DeviceMesh.single())).__name__ in outcome[1]
            assert "nothing was accumulated" in outcome[1]
        else:
            assert outcome is None, (rank, outcome)
        if outcome is not None:
            assert unchanged, f"rank {rank}: states changed by a call that raised"
        assert got == want, (rank, got, want)
        assert got == out[0][3]  # every rank returns the same numbers


def test_tp_peers_with_different_token_counts_both_raise(dist_pool):
    out = dist_pool.run(case_reject, "accuracy", 3, "tokens")
    for rank, (outcome, unchanged, _ranks, got, want) in enumerate(out):
        if rank in (2, 3):
            assert outcome is not None and outcome[0] == "ValueError", (rank, outcome)
            assert "TP ranks hold different vocab-parallel logits" in outcome[1]
            assert unchanged
        else:
            assert outcome is None, (rank, outcome)
        assert got == want


def case_collection_joins_later_metric():
    mesh = DeviceMesh.from_sizes(tp_size=2)
    coll = MetricCollection([LossMetric(mesh, loss_reduction="sum"), Accuracy(mesh, vocab_parallel=True)])
    (inputs, outputs), _ = _accuracy(mesh, 1, None)
    outputs = dict(outputs, loss=torch.tensor(1.0))
    if dist.get_rank() == 3:
        outputs["loss"] = "not a number"  # LossMetric rejects: Accuracy's update never runs here
    try:
        coll.accumulate(inputs, outputs)
        return None
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return type(exc).__name__, str(exc)


def test_collection_joins_the_exchange_of_a_later_metric(dist_pool):
    out = dist_pool.run(case_collection_joins_later_metric, timeout=120)
    assert out[3] is not None and out[3][0] in ("ValueError", "TypeError")
    assert out[2] is not None and out[2][0] == "MetricSyncError" and "rank 3" in out[2][1]
    assert all(o is None for r, o in enumerate(out) if r not in (2, 3))
