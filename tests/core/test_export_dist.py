"""Exports on 8 real gloo ranks: Megatron TP2 x PP2 x DP2 groups (megatron-core's own
parallel_state), every rank exports Accuracy (vocab-parallel), LossMetric, GRPOMetric,
DPOMetric and CompletionRewardMetric with quantiles; a driver with no process group
(this test process) merges the JSON of the exports into what one process holding the
whole batch returns, and what the ranks' own calculate() returns."""
import copy
import json

import pytest
import torch

from parallel import DeviceMesh
from tests.moeref import feed_layers
from tests.refmetric import dp_shards
from tests.rlref import make_rl_batch, ragged
from twinkle_metrics import (
    Accuracy,
    CompletionRewardMetric,
    DPOMetric,
    GRPOMetric,
    LossMetric,
    MetricCollection,
    MoERoutingMetric,
    PassAtKMetric,
    from_export,
)
from twinkle_metrics.core.merge import equal
from twinkle_metrics.testing import (
    CollectiveCounter,
    assert_layout_invariant,
    assert_results_close,
    state_dict_differences,
)

pytestmark = pytest.mark.xdist_group("dist")

SEED, N_SEQ, SEQ, V = 5, 12, 8, 16


def make(mesh=None, top_k=4):
    return MetricCollection({
        "acc": Accuracy(mesh, vocab_parallel=True),
        "loss": LossMetric(mesh, loss_reduction="sum"),
        "grpo": GRPOMetric(mesh, top_k_kl=top_k, quantiles=(0.5, 0.9)),
        "dpo": DPOMetric(mesh, beta=0.2, quantiles=(0.5,)),
        "": CompletionRewardMetric(mesh, reward_names=["acc", "fmt"], max_completion_length=15, num_generations=2,
                                   quantiles=(0.1, 0.5, 0.9)),
    })


def feed(coll, dp_rank=0, dp_size=1, tp_rank=0, tp_size=1, last=True):
    """One rank's share: whole prompt groups (pairs of sequences) of its DP rank, its vocab
    shard of the logits; a non-last stage gets what a schedule gives it (nothing)."""
    if not last:
        for m in coll:
            m.accumulate([], {})
        return
    b = make_rl_batch(SEED, N_SEQ, SEQ, vocab=V)
    pairs = dp_shards(N_SEQ // 2, dp_size)[dp_rank]
    rows = torch.arange(2 * pairs.start, 2 * pairs.stop)
    lab, lp = b["labels"][rows], b["logps"][rows]
    v = V // tp_size
    coll["acc"].accumulate({"labels": lab}, {"logits": b["logits"][rows][..., tp_rank * v:(tp_rank + 1) * v]})
    mask = lab != -100
    coll["loss"].accumulate(None, [{"lm loss": torch.stack([(-lp * mask).sum(), mask.sum().double()])}])
    half = (len(rows) + 1) // 2
    parts = [slice(0, half), slice(half, len(rows))]
    coll["grpo"].accumulate([{"labels": lab[p]} for p in parts], {"logps": [lp[p] for p in parts]},
                            old_logps=ragged(b["old"][rows], lab), advantages=b["adv"][rows],
                            ref_logps=[b["ref"][rows][p] for p in parts])
    coll["dpo"].accumulate({"labels": lab}, {"logps": lp}, ref_outputs={"logps": b["ref"][rows]})
    g = torch.Generator().manual_seed(SEED)
    acc = torch.randint(0, 2, (N_SEQ,), generator=g).double()
    fmt = torch.randn(N_SEQ, generator=g, dtype=torch.float64) + 1e6
    coll[""].accumulate(rewards={"acc": acc[rows].tolist(), "fmt": fmt[rows].tolist()},
                        completion_lengths=[(5 * int(i)) % 17 + 1 for i in rows], generate_time=2.0)


def whole_results():
    coll = make(DeviceMesh.single())
    feed(coll)
    return coll.calculate()


def case_export_megatron_tp2_pp2_dp2():
    """Each rank: its export (strict JSON) and the collectives export() issued; then the
    same interval again, calculated by the ranks together (SPMD)."""
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                 create_gloo_process_groups=False, distributed_timeout_minutes=1)
    try:
        mesh = DeviceMesh.from_megatron()
        coll = make(mesh)
        place = dict(dp_rank=mesh.dp_rank, dp_size=mesh.dp_size, tp_rank=mesh.tp_rank, tp_size=mesh.tp_size,
                     last=mesh.is_last_stage)
        feed(coll, **place)
        with CollectiveCounter() as c:
            text = json.dumps(coll.export(), allow_nan=False)
        assert coll.calculate() == {}  # the export ended the interval (collective: every rank)
        feed(coll, **place)
        return text, c.total, coll.calculate()
    finally:
        ps.destroy_model_parallel()


@pytest.fixture(scope="module")
def ranks(dist_pool):
    return dist_pool.run(case_export_megatron_tp2_pp2_dp2)


def _exports(ranks):
    return [json.loads(text) for text, _, _ in ranks]


@pytest.mark.megatron
def test_a_driver_merges_the_json_of_every_rank_into_the_whole_batch(ranks):
    whole = whole_results()
    # the comparison can fail: clipping, KL records, quantiles and rewards all carry numbers
    assert whole["grpo/train/clip_ratio"] > 0 and len(whole["grpo/_high_kl_records"]) == 4
    assert "train/acc_reward_p90" in whole and "grpo/train/ratio_p50" in whole
    assert [n for _, n, _ in ranks] == [0] * 8  # export() is not collective
    exports = _exports(ranks)
    places = sorted((e["place"]["data_rank"], e["place"]["tp_rank"], e["place"]["pp_rank"]) for e in exports)
    assert places == [(d, t, p) for d in range(2) for t in range(2) for p in range(2)]
    driver = make()  # no mesh, no process group
    got = driver.calculate_from(exports)
    assert list(got) == list(whole)
    assert_results_close(got, whole, rel=1e-9)
    for _, _, spmd in ranks:  # what calculate() returns on the workers: the same rows merged alike
        assert list(spmd) == list(got) and equal(got, spmd)
    sources = [e for e in exports if e["place"]["source"]]
    assert len(sources) == 2
    assert_results_close(driver.calculate_from(sources), whole, rel=1e-9)
    assert_results_close(from_export(exports[0]).calculate_from(exports), whole, rel=1e-9)
    assert driver.calculate() == {}  # the driver's own states were never touched


def _altered_replica(exports):
    out = copy.deepcopy(exports)
    e = next(e for e in out if e["place"]["tp_rank"] == 1 and e["place"]["last_stage"])
    grpo = next(m for m in e["metrics"] if m["name"] == "grpo")
    grpo["states"]["n_tok"][1] += 1
    return out


def _malformed(exports):
    out = copy.deepcopy(exports)
    out[3]["metrics"][0]["states"] = [1, 2]
    return out


@pytest.mark.megatron
@pytest.mark.parametrize("case", [
    ("dropped data shard", lambda ex: [e for e in ex if e["place"]["data_rank"] != 1], ValueError,
     "no export of interval 0 holds data shard 1 of 2"),
    ("altered TP replica", _altered_replica, ValueError, r"are TP replicas of 'grpo' \(GRPOMetric\).*n_tok"),
    ("other metric's export", lambda ex: ex + [PassAtKMetric().export()], ValueError,
     r"export 8 \(metrics\[0\]\) carries PassAtKMetric, which this collection does not hold"),
    ("malformed export", _malformed, TypeError, r"export 3: field 'metrics\[0\].states' is a list"),
    ("empty list", lambda ex: [], ValueError, "empty list of exports"),
], ids=lambda c: c[0])
def test_what_a_driver_refuses(ranks, case):
    _, change, error, pattern = case
    driver = make()
    feed(driver)  # a driver with states of its own: they must stay as they are
    before = driver.state_dict()
    with pytest.raises(error, match=pattern):
        driver.calculate_from(change(_exports(ranks)))
    assert not state_dict_differences(before, driver.state_dict())


@pytest.mark.megatron
def test_a_driver_built_with_other_arguments_refuses(ranks):
    with pytest.raises(ValueError, match=r"field 'metrics\[2\].fingerprint'.*top_k_kl=4.*top_k_kl=3"):
        make(top_k=3).calculate_from(_exports(ranks))


# ------------------------------------------------ states every stage contributes: MoE routing
MOE_L, MOE_E, MOE_K, MOE_T, MOE_CHUNKS = 4, 6, 2, 40, 4


def make_moe(mesh):
    return MoERoutingMetric(mesh, num_layers=MOE_L, num_experts=MOE_E)


def feed_moe(m, shard):
    feed_layers(m, shard, MOE_L, MOE_E, MOE_K, MOE_T, MOE_CHUNKS)


def test_stage_scoped_states_merge_from_every_stage(dist_pool):
    """MoE routing counts of scope "stage": the export path of the layout harness merges every
    stage's exports (the data sources' alone are not enough, and are not tried)."""
    assert_layout_invariant(make_moe, feed_moe, ["pp2xdp2", "tp2xpp2xdp2", "cp2xdp2"], pool=dist_pool)
