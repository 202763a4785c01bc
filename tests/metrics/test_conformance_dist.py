"""Every metric ``twinkle_metrics`` exports passes ``twinkle_metrics.testing.check_metric``: the
single-process checks (declared keys, idempotent calculate, state_dict, pickling, rejected
calls, export round trip) and one or two layouts on the shared gloo ranks.

Each metric has a feeder that gives a rank its part of the interval's batch (its DP rows, its
CP columns, its vocab shard, its pipeline stage's layers) and, where the metric validates
input, a call it must refuse.
"""
import functools
import math
import random
from types import SimpleNamespace

import pytest
import torch

import twinkle_metrics
from tests.moeref import feed_layers
from tests.passref import make_samples
from tests.refmetric import cp_slice, dp_shards
from tests.rlref import make_ppo_batch, make_rl_batch, ragged
from twinkle_metrics import (
    Accuracy,
    CISPOMetric,
    CompletionRewardMetric,
    DPOMetric,
    EmbeddingMetric,
    GRPOMetric,
    GSPOMetric,
    LossMetric,
    Metric,
    ModelNormMetric,
    MoERoutingMetric,
    MTPMetric,
    PassAtKMetric,
    PPOMetric,
    PPOValueMetric,
    RolloutMismatchMetric,
    StalenessMetric,
    StepGuard,
    TrainMetric,
)
from twinkle_metrics.testing import check_metric

pytestmark = pytest.mark.xdist_group("dist")

SEED, N_SEQ, SEQ_LEN, VOCAB = 5, 12, 8, 16


def _rows(shard, n=N_SEQ) -> torch.Tensor:
    return torch.tensor(list(dp_shards(n, shard.dp_size)[shard.dp_rank]), dtype=torch.long)


def _cols(shard) -> torch.Tensor:
    return cp_slice(SEQ_LEN, shard.cp_size, shard.cp_rank)


def _halves(rows):
    half = (len(rows) + 1) // 2
    return [rows[:half], rows[half:]]  # two pipeline microbatches


# ------------------------------------------------------------------------------ LM
def feed_loss(m, shard):
    """Megatron's loss reports of this rank's sequences; a non-last stage reports none."""
    if not shard.is_last_stage:
        m.accumulate(None, [])
        return
    g = torch.Generator().manual_seed(SEED + shard.interval)
    sums = torch.rand(N_SEQ, generator=g, dtype=torch.float64) * 4
    counts = torch.randint(0, 6, (N_SEQ,), generator=g).double()
    reports = [{"lm loss": torch.stack([sums[i], counts[i]])} for i in _rows(shard).tolist()]
    m.accumulate(None, reports, grad_norm=2.0 + shard.interval)


def reject_loss(m):
    m.accumulate(None, [{"lm loss": torch.tensor([1.0, 2.0, 3.0])}])


def _lm_batch(interval):
    g = torch.Generator().manual_seed(SEED + interval)
    labels = torch.randint(0, VOCAB, (N_SEQ, SEQ_LEN), generator=g)
    labels[torch.rand(N_SEQ, SEQ_LEN, generator=g) < 0.3] = -100
    logits = (torch.randn(N_SEQ, SEQ_LEN, VOCAB, generator=g) * 2).round()  # ties, across TP shards too
    return labels, logits


def feed_accuracy(m, shard):
    """This rank's rows and CP columns, its TP shard of the vocabulary."""
    if not shard.is_last_stage:
        m.accumulate([], {})
        return
    labels, logits = _lm_batch(shard.interval)
    v = VOCAB // shard.tp_size
    vocab = slice(shard.tp_rank * v, (shard.tp_rank + 1) * v)
    rows, cols = _rows(shard), _cols(shard)
    m.accumulate([{"labels": labels[p][:, cols]} for p in _halves(rows)],
                 {"logits": [logits[p][:, cols][..., vocab] for p in _halves(rows)]})


def reject_accuracy(m):
    m.accumulate({"labels": torch.zeros(2, 3, dtype=torch.long)}, {"logits": torch.zeros(2, 4, VOCAB)})


def feed_mtp(m, shard):
    """Per MTP depth: this rank's rows, its TP shard of the vocabulary, and its loss pair."""
    labels, logits = _lm_batch(shard.interval)
    v = VOCAB // shard.tp_size
    vocab = slice(shard.tp_rank * v, (shard.tp_rank + 1) * v)
    rows = _rows(shard)
    for k in (1, 2):
        m.accumulate({"labels": labels[rows].roll(-k, 1)}, {"mtp_logits": logits[rows][..., vocab]}, depth=k)
        m.accumulate(None, {"mtp_loss": 0.5 * k * len(rows), "mtp_num_tokens": len(rows)}, depth=k)


def reject_mtp(m):
    m.accumulate({"labels": torch.zeros(2, 3, dtype=torch.long)}, {"mtp_logits": torch.zeros(2, 4, VOCAB)}, depth=1)


#: pair-aligned row ranges of 12 embedding rows per DP rank (of 1 or 2)
EMB_ROWS = {1: [(0, 12)], 2: [(0, 6), (6, 12)]}


def feed_embedding(m, shard):
    g = torch.Generator().manual_seed(SEED + shard.interval)
    emb = torch.randn(12, 6, generator=g, dtype=torch.float64)
    labels = torch.tensor([1, 0] * 6)
    lo, hi = EMB_ROWS[shard.dp_size][shard.dp_rank]
    m.accumulate({"labels": labels[lo:hi]}, {"embeddings": emb[lo:hi]})


def reject_embedding(m):
    m.accumulate({"labels": torch.tensor([1, 0, 1])}, {"embeddings": torch.randn(4, 6)})


def feed_train(m, shard):
    m.accumulate(None, None, lr=[1e-3, 1e-4], step=4 * (shard.interval + 1), gradient_accumulation_steps=2,
                 tokens=100 + shard.dp_rank, samples=2)


# ------------------------------------------------------------------------------ RL
def _rl(m, shard, **extra):
    """The GRPO family's call: this rank's rows and CP columns, Twinkle's ragged old log-probs."""
    if not shard.is_last_stage:
        m.accumulate([], {})
        return
    b = make_rl_batch(SEED + shard.interval, N_SEQ, SEQ_LEN)
    rows, cols = _rows(shard), _cols(shard)
    lab, lp, old = b["labels"][:, cols], b["logps"][:, cols], b["old"][:, cols]
    m.accumulate([{"labels": lab[p]} for p in _halves(rows)], {"logps": [lp[p] for p in _halves(rows)]},
                 old_logps=ragged(old[rows], lab[rows]), advantages=b["adv"][rows], ref_logps=b["ref"][rows][:, cols],
                 **extra)


def feed_policy(m, shard):
    _rl(m, shard)


def reject_policy(m):
    b = make_rl_batch(SEED, 3, SEQ_LEN)
    m.accumulate({"labels": b["labels"]}, {"logps": b["logps"]}, old_logps=b["old"], advantages=b["adv"][:2])


def feed_rollout(m, shard):
    if not shard.is_last_stage:
        m.accumulate([], {})
        return
    b = make_ppo_batch(SEED + shard.interval, N_SEQ, SEQ_LEN)
    rows, cols = _rows(shard), _cols(shard)
    lab = b["labels"][rows][:, cols]
    m.accumulate({"labels": lab}, {"logps": b["train"][rows][:, cols]},
                 rollout_logps=ragged(b["rollout"][rows][:, cols], lab))


def reject_rollout(m):
    m.accumulate({"labels": torch.ones(2, 3, dtype=torch.long)}, {"logps": torch.zeros(2, 3)},
                 rollout_logps=torch.zeros(3, 3))  # 3 sequences for 2


def feed_value(m, shard):
    if not shard.is_last_stage:
        m.accumulate([], {})
        return
    b = make_ppo_batch(SEED + shard.interval, N_SEQ, SEQ_LEN, offset=5.0)
    rows, cols = _rows(shard), _cols(shard)
    cut = {k: b[k][rows][:, cols] for k in ("labels", "values", "old", "returns", "adv")}
    m.accumulate({"labels": cut["labels"]}, {"values": cut["values"]}, old_values=cut["old"],
                 returns=cut["returns"], advantages=cut["adv"])


def reject_value(m):
    m.accumulate({"labels": torch.ones(2, 3, dtype=torch.long)}, {"values": torch.zeros(2, 3)},
                 old_values=torch.zeros(2, 3), returns=torch.zeros(3, 3))


def feed_dpo(m, shard):
    """Interleaved (chosen, rejected) rows: this rank's pairs, its CP columns."""
    if not shard.is_last_stage:
        m.accumulate([], {})
        return
    b = make_rl_batch(SEED + shard.interval, N_SEQ, SEQ_LEN)
    pairs = dp_shards(N_SEQ // 2, shard.dp_size)[shard.dp_rank]
    rows, cols = torch.arange(2 * pairs.start, 2 * pairs.stop), _cols(shard)
    m.accumulate({"labels": b["labels"][rows][:, cols]}, {"logps": b["logps"][rows][:, cols]},
                 ref_outputs={"logps": b["ref"][rows][:, cols]})


def reject_dpo(m):
    m.accumulate({"labels": torch.ones(3, 2, dtype=torch.long)}, {"logps": torch.zeros(3, 2)},
                 ref_outputs={"logps": torch.zeros(3, 2)})


def feed_rewards(m, shard):
    """Whole prompt groups (2 generations) per DP rank; CP peers pass the same."""
    rng = random.Random(SEED + shard.interval)
    acc = [float(rng.choice([0, 1])) for _ in range(N_SEQ)]
    fmt = [rng.gauss(0, 1) for _ in range(N_SEQ)]
    lens = [rng.randint(1, 20) for _ in range(N_SEQ)]
    pairs = dp_shards(N_SEQ // 2, shard.dp_size)[shard.dp_rank]
    rows = range(2 * pairs.start, 2 * pairs.stop)
    m.accumulate(rewards={"acc": [acc[i] for i in rows], "fmt": [fmt[i] for i in rows]},
                 completion_lengths=[lens[i] for i in rows], generate_time=1.5)


def reject_rewards(m):
    m.accumulate(rewards={"acc": [1.0, 0.0], "typo": [1.0, 1.0]})  # a name reward_names does not hold


def feed_pass_at_k(m, shard):
    if not shard.is_last_stage:
        m.accumulate([], {})
        return
    mine = make_samples(40 + shard.interval)[shard.dp_rank::shard.dp_size]
    m.accumulate({"data_source": [s["source"] for s in mine]}, None, prompt_ids=[s["prompt"] for s in mine],
                 correct=[s["correct"] for s in mine], answers=[s["answer"] for s in mine],
                 rewards=[s["reward"] for s in mine])


def reject_pass_at_k(m):
    m.accumulate(None, None, correct=[1, 0])


def feed_staleness(m, shard):
    g = torch.Generator().manual_seed(SEED + shard.interval)
    labels = torch.randint(0, 50, (N_SEQ, SEQ_LEN), generator=g)
    labels[torch.rand(N_SEQ, SEQ_LEN, generator=g) < 0.3] = -100
    versions = torch.randint(10, 21, (N_SEQ, SEQ_LEN), generator=g)  # per token: partial rollouts
    in_flight = 5 + shard.interval + 3 * (shard.dp_rank == shard.dp_size - 1)  # the last DP rank's the most
    if not shard.is_last_stage:
        m.accumulate([], None, policy_version=20, rollout_versions=versions, in_flight=in_flight)
        return
    rows, cols = _rows(shard), _cols(shard)
    m.accumulate([{"labels": labels[p][:, cols]} for p in _halves(rows)], None, policy_version=20,
                 rollout_versions=versions[rows][:, cols], in_flight=in_flight)


def reject_staleness(m):
    m.accumulate({"labels": torch.ones(2, 2, dtype=torch.long)}, None, policy_version=3, rollout_versions=[1, 9])


# ------------------------------------------------------------------------------ system
MOE_LAYERS, MOE_EXPERTS = 4, 6


def reject_moe(m):
    m.observe(MOE_LAYERS, routing_map=torch.ones(3, MOE_EXPERTS, dtype=torch.bool))


class TinyModel(torch.nn.Module):
    """A replicated model with gradients (every data rank holds the same)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(SEED)
        self.embedding = torch.nn.Embedding(10, 4)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
        for number, layer in enumerate(self.layers, 1):
            layer.layer_number, layer.config = number, SimpleNamespace(num_layers=2)
        h = self.embedding(torch.arange(10))
        for layer in self.layers:
            h = torch.relu(layer(h))
        h.pow(2).mean().backward()


def make_norms(mesh):
    return ModelNormMetric(mesh, model=TinyModel())


def feed_norms(m, shard):
    m.accumulate(None, None)


def feed_guard(m, shard):
    """Four steps of this rank's part: its data shard's loss on the last stage, one grad norm
    everywhere. Interval 0 ends with a NaN grad norm on every rank (rank 0 is named: the
    single process's rank too); interval 1 holds a 5x spike of every shard's loss."""
    g = torch.Generator().manual_seed(SEED)
    sums = torch.rand(N_SEQ, generator=g, dtype=torch.float64) + 2
    counts = torch.randint(1, 6, (N_SEQ,), generator=g).double()
    rows = _rows(shard)
    for i in range(4):
        step = 4 * shard.interval + i
        scale = (1 + 0.02 * step) * (5.0 if step == 6 else 1.0)
        pair = torch.stack([(sums[rows] * counts[rows]).sum() * scale, counts[rows].sum()])
        m.check(loss=[{"lm loss": pair}] if shard.is_last_stage else [],
                grad_norm=math.nan if step == 3 else 1.0, step=step)


def reject_guard(m):
    m.check(loss=torch.zeros(3))


#: class name -> (make_metric, feed, layouts, reject, ignore): every Metric twinkle_metrics exports
CASES = {
    "LossMetric": (functools.partial(LossMetric, loss_reduction="sum"), feed_loss, ["pp2xdp2"], reject_loss, None),
    "Accuracy": (functools.partial(Accuracy, vocab_parallel=True), feed_accuracy, ["tp2xdp2"], reject_accuracy,
                 None),
    "EmbeddingMetric": (EmbeddingMetric, feed_embedding, ["dp2"], reject_embedding, None),
    "TrainMetric": (functools.partial(TrainMetric, counts="local"), feed_train, ["dp2"], None,
                    lambda key: "time" in key or "speed" in key or "/s" in key or key == "mfu"),
    "GRPOMetric": (functools.partial(GRPOMetric, top_k_kl=3), feed_policy, ["tp2xdp2"], reject_policy, None),
    "GSPOMetric": (functools.partial(GSPOMetric, epsilon=0.05), feed_policy, ["cp2xdp2"], reject_policy, None),
    "CISPOMetric": (CISPOMetric, feed_policy, ["dp2"], reject_policy, None),
    "PPOMetric": (functools.partial(PPOMetric, loss_agg_mode="seq-mean-token-mean"), feed_policy, ["cp2xdp2"],
                  reject_policy, None),
    "PPOValueMetric": (PPOValueMetric, feed_value, ["tp2xdp2"], reject_value, None),
    "RolloutMismatchMetric": (RolloutMismatchMetric, feed_rollout, ["cp2xdp2"], reject_rollout, None),
    "DPOMetric": (DPOMetric, feed_dpo, ["cp2xdp2"], reject_dpo, None),
    "CompletionRewardMetric": (functools.partial(CompletionRewardMetric, reward_names=["acc", "fmt"],
                                                 num_generations=2), feed_rewards, ["dp2"], reject_rewards,
                               lambda key: "time" in key or "/s" in key),
    "PassAtKMetric": (functools.partial(PassAtKMetric, k=(1, 2), with_answers=True, with_rewards=True,
                                        max_prompts=32, max_samples=256, num_bootstrap=20, slice_by="data_source"),
                      feed_pass_at_k, ["dp2"],
                      reject_pass_at_k, None),
    "StalenessMetric": (functools.partial(StalenessMetric, max_staleness=4), feed_staleness, ["cp2xdp2"],
                        reject_staleness, None),
    "MoERoutingMetric": (functools.partial(MoERoutingMetric, num_layers=MOE_LAYERS, num_experts=MOE_EXPERTS),
                         functools.partial(feed_layers, num_layers=MOE_LAYERS, num_experts=MOE_EXPERTS),
                         ["pp2xdp2"], reject_moe, None),
    "ModelNormMetric": (make_norms, feed_norms, ["dp2"], None, None),
    "MTPMetric": (functools.partial(MTPMetric, depths=2, vocab_parallel=True), feed_mtp, ["tp2xdp2"], reject_mtp,
                  None),
    "StepGuard": (functools.partial(StepGuard, warmup=3), feed_guard, ["tp2xpp2xdp2"], reject_guard, None),
}


def test_every_exported_metric_has_a_case():
    exported = {name for name in twinkle_metrics.__all__
                if isinstance(getattr(twinkle_metrics, name), type)
                and issubclass(getattr(twinkle_metrics, name), Metric) and name != "Metric"}
    assert exported == set(CASES)
    # every shipped metric declares its keys (the library checks them; a collection refuses clashes by them)
    assert not [name for name in exported if not getattr(twinkle_metrics, name).result_keys]


@pytest.mark.parametrize("name", sorted(CASES))
def test_shipped_metric_conforms(dist_pool, name):
    make_metric, feed, layouts, reject, ignore = CASES[name]
    check_metric(make_metric, feed, layouts, reject=reject, ignore=ignore, pool=dist_pool)
