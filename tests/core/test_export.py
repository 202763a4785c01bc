"""Exports in one process: every shipped metric round-trips through JSON, a driver merges
shards (their places set as DP/TP/PP ranks would set them), and every malformed or
mismatched input raises naming the export and the field, leaving the driver unchanged."""
import copy
import json
import math

import pytest
import torch

from tests.moeref import make_layer, piece
from tests.passref import make_samples
from tests.rlref import make_ppo_batch, make_rl_batch, ragged
from twinkle_metrics import (
    Accuracy,
    CompletionRewardMetric,
    DPOMetric,
    GRPOMetric,
    LossMetric,
    Metric,
    MetricCollection,
    ModelNormMetric,
    MoERoutingMetric,
    State,
    agreed_results,
    from_export,
    is_export,
)
from twinkle_metrics.core.export import VERSION
from twinkle_metrics.core.merge import equal
from twinkle_metrics.core.state import interval_of
from twinkle_metrics.metrics import SHIPPED
from twinkle_metrics.testing import state_dict_differences

Q = (0.5, 0.9)


def _rl(m, seed=1, rows=range(12)):
    b = make_rl_batch(seed)
    r = torch.tensor(list(rows))
    lab = b["labels"][r]
    m.accumulate({"labels": lab, "data_source": ["a" if i % 3 else "b" for i in rows]}, {"logps": b["logps"][r]},
                 old_logps=ragged(b["old"][r], lab), advantages=b["adv"][r], ref_logps=b["ref"][r])


def _dpo(m, seed=1, pairs=range(6)):
    b = make_rl_batch(seed)
    r = torch.tensor([i for p in pairs for i in (2 * p, 2 * p + 1)])
    m.accumulate({"labels": b["labels"][r]}, {"logps": b["logps"][r]}, ref_outputs={"logps": b["ref"][r]})


def _reward(m, seed=1, rows=range(12)):
    rows = list(rows)
    g = torch.Generator().manual_seed(seed)
    acc = torch.randint(0, 2, (12,), generator=g).double().tolist()
    fmt = (torch.randn(12, generator=g, dtype=torch.float64) + 1e6).tolist()
    fmt[3] = math.nan  # skipped (nan_policy="skip") and counted
    m.accumulate(rewards={"acc": [acc[i] for i in rows], "fmt": [fmt[i] for i in rows]},
                 completion_lengths=[(7 * i) % 19 + 1 for i in rows], generate_time=1.5)


def _lm(m, seed=1, rows=range(8)):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 11, (8, 6), generator=g)
    labels[torch.rand(8, 6, generator=g) < 0.3] = -100
    logits = torch.randn(8, 6, 11, generator=g)
    r = torch.tensor(list(rows))
    if isinstance(m, Accuracy):
        m.accumulate({"labels": labels[r]}, {"logits": logits[r]})
    else:
        m.accumulate({"labels": labels[r]}, {"loss": float(len(r)) * 1.25}, grad_norm=math.inf)


def _ppo(m, seed=1):
    b = make_ppo_batch(seed)
    m.accumulate({"labels": b["labels"]}, {"values": b["values"]}, old_values=b["old"], returns=b["returns"],
                 advantages=b["adv"])


def _rollout(m, seed=1):
    b = make_ppo_batch(seed)
    m.accumulate({"labels": b["labels"]}, {"logps": b["train"]}, rollout_logps=b["rollout"])


def _pass(m, seed=1):
    s = make_samples(seed)
    m.accumulate(None, None, prompt_ids=[x["prompt"] for x in s], correct=[x["correct"] for x in s],
                 answers=[x["answer"] for x in s], rewards=[x["reward"] for x in s])


def _stale(m, seed=1):
    labels = make_rl_batch(seed)["labels"]
    m.accumulate({"labels": labels}, None, policy_version=10, rollout_versions=[10 - i % 4 for i in range(12)])


def _norms(m, seed=1):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model(torch.randn(5, 3)).pow(2).mean().backward()
    m.model = model
    m.accumulate(None, None)


def _moe(m, seed=1):
    for layer in range(2):
        m.observe(layer, **piece(make_layer(seed + layer, 20, 4, 2), list(range(20)), 2), aux_loss=1.5)


def _emb(m, seed=1):
    g = torch.Generator().manual_seed(seed)
    m.accumulate({"labels": torch.tensor([1, 0, 1, 0, 0, 1])}, {"embeddings": torch.randn(6, 5, generator=g)})


def _mtp(m, seed=1):
    g = torch.Generator().manual_seed(seed)
    for k in (1, 2):
        labels = torch.randint(0, 11, (4, 6), generator=g)
        mask = (torch.rand(4, 6, generator=g) < 0.7).float()
        m.accumulate({"labels": labels, "completion_mask": mask},
                     {"mtp_logits": torch.randn(4, 6, 11, generator=g), "mtp_losses": torch.rand(4, 6, generator=g)},
                     depth=k)


def _guard(m, seed=1):
    for loss in (2.0, 2.1, 1.9, 2.0, math.nan, 9.0, 2.05):  # a NaN, then a spike: a stop (max_skips=1)
        m.check(loss=torch.tensor([loss * 8, 8.0], dtype=torch.float64), grad_norm=1.0)


def _train(m, seed=1):
    m.accumulate(None, None, lr=[1e-3, 2e-4], step=4, tokens=100, samples=3)


#: every shipped metric: (constructor arguments, feed); states as rich as the metric has
WORKERS = {
    "Accuracy": ({}, _lm),
    "LossMetric": ({"loss_reduction": "sum", "ppl": True}, _lm),
    "EmbeddingMetric": ({}, _emb),
    "TrainMetric": ({"counts": "local"}, _train),
    "CompletionRewardMetric": ({"quantiles": Q, "max_completion_length": 15, "num_generations": 2}, _reward),
    "DPOMetric": ({"beta": 0.3, "quantiles": Q}, _dpo),
    "GRPOMetric": ({"top_k_kl": 3, "quantiles": Q, "slice_by": "data_source"}, _rl),
    "GSPOMetric": ({"epsilon": 0.05, "top_k_kl": 2}, _rl),
    "CISPOMetric": ({}, _rl),
    "PPOMetric": ({"quantiles": Q}, _rl),
    "PPOValueMetric": ({"epsilon": 0.3}, _ppo),
    "RolloutMismatchMetric": ({"is_threshold": 1.5}, _rollout),
    "PassAtKMetric": ({"k": (1, 2, 4), "with_answers": True, "with_rewards": True, "num_bootstrap": 0}, _pass),
    "StalenessMetric": ({"max_staleness": 2}, _stale),
    "ModelNormMetric": ({}, _norms),
    "MoERoutingMetric": ({"num_layers": 2, "num_experts": 4, "percentiles": (50, 90)}, _moe),
    "MTPMetric": ({"depths": 2, "megatron_keys": True}, _mtp),
    "StepGuard": ({"warmup": 4, "max_skips": 1}, _guard),
}


def _wire(export, **kw):
    """What reaches a driver: the export as JSON text and back."""
    return json.loads(json.dumps(export, **kw))


def _fed(name, **feed_kw):
    kwargs, feed = WORKERS[name]
    m = SHIPPED[name](**kwargs)
    feed(m, **feed_kw)
    return m


def test_every_shipped_metric_is_covered():
    assert sorted(WORKERS) == sorted(SHIPPED)


@pytest.mark.parametrize("name", sorted(WORKERS))
def test_every_shipped_metric_round_trips_through_json(name):
    """The driver's calculate_from of one worker's JSON export is exactly the worker's
    calculate(): the same keys, the same numbers (NaN where NaN), strict JSON on the wire."""
    worker, twin = _fed(name), _fed(name)
    if name == "TrainMetric":  # wall clocks: take the twin's states, not a second reading
        twin.load_state_dict(worker.state_dict())
    export = worker.export()
    assert is_export(export) and not is_export({"loss": 1.0}) and not is_export([export])
    text = json.dumps(export, allow_nan=False)  # no NaN/Infinity tokens: any JSON reader takes it
    assert json.loads(text) == export and json.loads(json.dumps(export)) == export
    want = twin.calculate()
    kwargs = dict(WORKERS[name][0])
    driver = SHIPPED[name](**kwargs)
    got = driver.calculate_from([json.loads(text)])
    assert list(got) == list(want) and equal(got, want), (got, want)
    assert worker.calculate() == {} or name in ("TrainMetric", "StalenessMetric", "PassAtKMetric", "MTPMetric")  # reset
    # built from the JSON arguments alone: no class named by the data, no worker code
    assert equal(from_export(json.loads(text)).calculate_from([json.loads(text)]), want)


def test_the_wire_keeps_int64_beyond_2_53_infinities_nan_and_signed_zero():
    class Wide(Metric):
        big = State("sum", torch.int64)
        low = State("min", torch.int64)
        top = State("max")
        total = State("sum")
        zero = State("max")

        def update(self, inputs, outputs, **kw):
            return {"big": 2 ** 60 + 1, "low": -(2 ** 62) - 3, "top": math.inf, "total": math.nan, "zero": -0.0}

        def compute(self, s):
            return dict(s)

    export = Wide().accumulate().export()
    states = export["metrics"][0]["states"]
    assert states["big"][1] == 2 ** 60 + 1 and states["top"][1] == "inf" and states["total"][1] == "nan"
    got = Wide().calculate_from([_wire(export, allow_nan=False)])
    assert got["big"] == 2 ** 60 + 1 and got["low"] == -(2 ** 62) - 3 and got["top"] == math.inf
    assert math.isnan(got["total"]) and math.copysign(1, got["zero"]) == -1
    ints = export["metrics"][0]["states"]
    assert type(ints["big"][1]) is int  # an exact integer on the wire, not a float


def test_families_and_slices_travel_and_unite():
    """A reward name and a slice seen by one worker only are created on the driver (at
    their identity for the others), as the sync creates them on the ranks that lack them."""
    a, b = CompletionRewardMetric(), CompletionRewardMetric()
    a.accumulate(rewards={"acc": [1.0, 0.0]}, completion_lengths=[3, 4])
    b.accumulate(rewards={"fmt": [0.5]}, completion_lengths=[9])
    whole = CompletionRewardMetric()
    whole.accumulate(rewards={"acc": [1.0, 0.0]}, completion_lengths=[3, 4])
    whole.accumulate(rewards={"fmt": [0.5]}, completion_lengths=[9])
    exports = _shards([a.export(), b.export()])
    assert not any("fmt" in n for n in exports[0]["metrics"][0]["states"])  # a's export has no fmt state
    assert equal(CompletionRewardMetric().calculate_from(exports), whole.calculate())
    g1, g2, gw = (GRPOMetric(slice_by="data_source") for _ in range(3))
    _rl(g1, rows=range(0, 5)), _rl(g2, rows=range(5, 12)), _rl(gw)
    got = GRPOMetric(slice_by="data_source").calculate_from(_shards([g1.export(), g2.export()]))
    want = gw.calculate()
    assert sorted(got) == sorted(want) and any(k.endswith("/b") for k in got)
    for key in want:
        if key != "_high_kl_records":
            assert math.isclose(got[key], want[key], rel_tol=1e-12, abs_tol=1e-12) or equal(got[key], want[key]), key


# ------------------------------------------------------------------ places, as a mesh sets them
def _place(export, *, data_rank=0, data_size=1, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, rank=None):
    e = copy.deepcopy(export)
    p = e["place"]
    p.update(data_rank=data_rank, data_size=data_size, dp_rank=data_rank, dp_size=data_size, tp_rank=tp_rank,
             tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, last_stage=pp_rank == pp_size - 1,
             source=pp_rank == pp_size - 1 and tp_rank == 0,
             rank=rank if rank is not None else data_rank * tp_size + tp_rank + pp_rank * tp_size * data_size)
    return e


def _shards(exports, **kw):
    return [_place(e, data_rank=i, data_size=len(exports), **kw) for i, e in enumerate(exports)]


def _loss_collection():
    return MetricCollection({"loss": LossMetric(loss_reduction="sum"), "acc": Accuracy()})


def _loss_exports():
    """Two data shards of a (loss, accuracy) collection, and one process holding both."""
    parts = []
    for rows in (range(0, 3), range(3, 8)):
        c = _loss_collection()
        _lm(c["loss"], rows=rows), _lm(c["acc"], rows=rows)
        parts.append(c.export())
    whole = _loss_collection()
    _lm(whole["loss"]), _lm(whole["acc"])
    return _shards(parts), whole.calculate()


def test_shards_merge_to_the_whole_and_replicas_or_stages_count_once():
    exports, want = _loss_exports()
    driver = _loss_collection()
    assert driver.calculate_from(exports) == want
    # TP2 x PP2: every data shard's replicas and the first stage's (empty) exports too
    empty = _loss_collection().export()
    full = []
    for d, e in enumerate(exports):
        for t in range(2):
            full.append(_place(e, data_rank=d, data_size=2, tp_rank=t, tp_size=2, pp_rank=1, pp_size=2))
            full.append(_place(empty, data_rank=d, data_size=2, tp_rank=t, tp_size=2, pp_rank=0, pp_size=2))
    assert driver.calculate_from(full) == want
    assert driver.calculate_from([e for e in full if e["place"]["source"]]) == want
    assert driver.calculate_from(full + full[:3]) == want  # an export given twice counts once
    assert driver.calculate_from(list(reversed(full))) == want  # any order


def test_merge_intervals_folds_as_one_long_interval():
    per_interval, whole = [], MetricCollection({"loss": LossMetric(loss_reduction="sum"),
                                                "grpo": GRPOMetric(top_k_kl=4)})
    workers = [MetricCollection({"loss": LossMetric(loss_reduction="sum"), "grpo": GRPOMetric(top_k_kl=4)})
               for _ in range(2)]
    for seed in (1, 2):
        for d, w in enumerate(workers):
            _lm(w["loss"], seed=seed + d), _rl(w["grpo"], seed=seed + 10 * d)
            per_interval.append(_place(w.export(), data_rank=d, data_size=2))
    assert [e["metrics"][0]["interval"] for e in per_interval] == [0, 0, 1, 1]
    driver = MetricCollection({"loss": LossMetric(loss_reduction="sum"), "grpo": GRPOMetric(top_k_kl=4)})
    with pytest.raises(ValueError, match=r"export 2: field 'metrics\[0\].interval'.*merge_intervals=True"):
        driver.calculate_from(per_interval)
    # the same workers, one long interval each (what calculate() every 2 steps would merge)
    long = []
    for d in range(2):
        w = MetricCollection({"loss": LossMetric(loss_reduction="sum"), "grpo": GRPOMetric(top_k_kl=4)})
        for seed in (1, 2):
            _lm(w["loss"], seed=seed + d), _rl(w["grpo"], seed=seed + 10 * d)
        long.append(_place(w.export(), data_rank=d, data_size=2))
    want = driver.calculate_from(long)
    got = driver.calculate_from(per_interval, merge_intervals=True)
    assert got.keys() == want.keys()
    for key in want:
        assert equal(got[key], want[key]) or math.isclose(got[key], want[key], rel_tol=1e-12), key
    with pytest.raises(ValueError, match="data shard 1 of 2"):  # every interval complete on its own
        driver.calculate_from(per_interval[:3], merge_intervals=True)
    assert whole.calculate() == {}


def test_several_worker_groups_each_bring_their_own_metrics():
    """An actor group (loss, accuracy over DP2) and a reward group (rewards, one rank)."""
    actor, want = _loss_exports()
    reward = CompletionRewardMetric()
    _reward(reward)
    twin = CompletionRewardMetric()
    _reward(twin)
    want.update(twin.calculate())
    driver = MetricCollection({"loss": LossMetric(loss_reduction="sum"), "acc": Accuracy(),
                               "": CompletionRewardMetric()})
    reward_export = MetricCollection({"": reward}).export()
    assert equal(driver.calculate_from(actor + [reward_export]), want)
    rebuilt = from_export(actor + [reward_export])
    assert equal(rebuilt.calculate_from(actor + [reward_export]), want)
    with pytest.raises(ValueError, match="no export carries CompletionRewardMetric"):
        driver.calculate_from(actor)
    with pytest.raises(ValueError, match=r"export 2 \(metrics\[0\]\) carries CompletionRewardMetric, which this"):
        _loss_collection().calculate_from(actor + [reward_export])


# ------------------------------------------------------------------ errors, and nothing changes
def _driver_with_state():
    d = _loss_collection()
    _lm(d["loss"], seed=7), _lm(d["acc"], seed=7)
    return d


def _edit(exports, index, fn):
    out = copy.deepcopy(exports)
    fn(out[index])
    return out


def _bad_cases():
    exports, _ = _loss_exports()
    stale = copy.deepcopy(exports[1])
    stale["metrics"][0]["states"]["loss_total"][1] += 1.0
    replica = _place(exports[1], data_rank=1, data_size=2, tp_rank=1, tp_size=2)
    replica["metrics"][1]["states"]["correct"][1] += 1
    tp = [_place(e, data_rank=d, data_size=2, tp_size=2) for d, e in enumerate(exports)]
    return [
        ("empty list", [], ValueError, "empty list"),
        ("not a list", exports[0], TypeError, r"exports must be a list"),
        ("dropped shard", exports[:1], ValueError, "no export of interval 0 holds data shard 1 of 2"),
        ("two exports of one shard", exports + [stale], ValueError, "exports 1 and 2 both hold 'loss'"),
        ("replicas disagree", tp + [replica], ValueError,
         r"exports 1 and 2 are TP replicas of 'acc' \(Accuracy\).*disagree on state 'correct'"),
        ("newer format", _edit(exports, 1, lambda e: e.update(version=VERSION + 1)), ValueError,
         r"export 1: field 'version' is 2, newer"),
        ("not an export", [{"loss": 1.0}], ValueError, "export 0: field 'format'"),
        ("a string", ["{}"], TypeError, "export 0: field 'export' is a str"),
        ("state value", _edit(exports, 0, lambda e: e["metrics"][0]["states"]["loss_total"].__setitem__(1, "x")),
         ValueError, r"export 0: field \"metrics\[0\].states\['loss_total'\]\" holds 'x'"),
        ("float in int64", _edit(exports, 1, lambda e: e["metrics"][1]["states"]["correct"].__setitem__(1, 2.5)),
         ValueError, r"export 1: field \"metrics\[1\].states\['correct'\]\" holds 2.5"),
        ("int past int64", _edit(exports, 1, lambda e: e["metrics"][1]["states"]["correct"].__setitem__(1, 2 ** 63)),
         ValueError, "holds 9223372036854775808; an int64 state holds ints in int64 range"),
        ("negative count", _edit(exports, 1, lambda e: e["metrics"][1]["states"]["total"].__setitem__(1, -4)),
         ValueError, r"export 1: field \"metrics\[1\].states\['total'\]\" of 'acc' \(Accuracy\) holds -4: an int64 "
         "'sum' state counts"),
        ("bool rank", _edit(exports, 0, lambda e: e["place"].__setitem__("tp_rank", True)), TypeError,
         "export 0: field 'place.tp_rank' is a bool"),
        ("rank past size", _edit(exports, 1, lambda e: e["place"].__setitem__("data_rank", 2)), ValueError,
         "export 1: field 'place.data_rank' is 2 of data_size 2"),
        ("missing field", _edit(exports, 0, lambda e: e["metrics"][0].pop("fingerprint")), ValueError,
         r"export 0: field 'metrics\[0\].fingerprint' is missing"),
        ("other sizes", _edit(exports, 1, lambda e: e["place"].update(tp_size=2)), ValueError,
         r"export 1: field 'place.tp_size'"),
        ("other arguments", _edit(exports, 0, lambda e: e["metrics"][0].update(
            fingerprint=e["metrics"][0]["fingerprint"].replace("'sum'", "'mean'"))), ValueError,
         r"export 0: field 'metrics\[0\].fingerprint'.*build the driver metric with the workers'"),
        ("state the driver lacks", _edit(exports, 0, lambda e: e["metrics"][0]["states"].update(extra=[0, 1])),
         ValueError, r"export 0: field 'metrics\[0\].states' holds 'loss' \(LossMetric\).extra"),
        ("other declaration", _edit(exports, 0, lambda e: e["metrics"][0]["decls"][0].update(scope="model")),
         ValueError, r"export 0: field 'metrics\[0\].decls' declares"),
        ("interval", _edit(exports, 1, lambda e: e["metrics"][0].update(interval=5)), ValueError,
         r"export 1: field 'metrics\[0\].interval'"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_exports_raise_naming_the_export_and_the_field_and_change_nothing(case):
    _, exports, error, pattern = case
    driver = _driver_with_state()
    before = driver.state_dict()
    with pytest.raises(error, match=pattern):
        driver.calculate_from(exports)
    assert not state_dict_differences(before, driver.state_dict())
    assert equal(driver.calculate(), _driver_with_state().calculate())


def test_counts_are_checked_at_the_driver_as_on_the_workers():
    """A negative count in an export raises naming the export, the metric and the state (an
    Accuracy whose total is negated would report 2.0 otherwise), in a histogram's bucket too;
    the checks a metric's compute makes name the exports' interval, not the driver's."""
    acc = Accuracy()
    _lm(acc)
    export = acc.export()
    total = export["metrics"][0]["states"]["total"][1]
    export["metrics"][0]["states"]["total"][1] = -total
    with pytest.raises(ValueError, match=rf"export 0: field \"metrics\[0\].states\['total'\]\" of Accuracy holds "
                                         rf"-{total}: an int64 'sum' state counts"):
        Accuracy().calculate_from([export])
    grpo = GRPOMetric(quantiles=Q)
    _rl(grpo)
    export = grpo.export()
    export["metrics"][0]["states"]["hist_kl"][1][7] = -1
    with pytest.raises(ValueError, match=r"states\['hist_kl'\]\" of GRPOMetric holds -1"):
        GRPOMetric(quantiles=Q).calculate_from([export])

    worker, driver = LossMetric(loss_reduction="sum"), LossMetric(loss_reduction="sum")
    for _ in range(3):  # intervals 0, 1, 2; the driver's is 0
        _lm(worker)
        export = worker.export()
    export["metrics"][0]["states"]["num_tokens"][1] = -3.0  # a float count: LossMetric's compute checks it
    with pytest.raises(ValueError, match=r"LossMetric: calculate\(\) of interval 2: num_tokens totals -3.0"):
        driver.calculate_from([export])
    assert interval_of(driver).number == 0


def test_a_driver_metric_takes_only_its_own_class_and_arguments():
    exports, _ = _loss_exports()
    with pytest.raises(ValueError, match=r"export 0 carries no DPOMetric \(it carries .loss. \(LossMetric\), .acc."):
        DPOMetric().calculate_from(exports)
    with pytest.raises(ValueError, match="field 'metrics\\[0\\].fingerprint'"):
        LossMetric(loss_reduction="mean").calculate_from(exports)
    assert LossMetric(loss_reduction="sum").calculate_from(exports)["num_tokens"] > 0  # picked by class
    with pytest.raises(TypeError, match="merge_intervals must be a bool"):
        LossMetric(loss_reduction="sum").calculate_from(exports, merge_intervals="yes")


def test_stage_and_model_scoped_states_need_every_stage_or_rank():
    moe = [MoERoutingMetric(num_layers=2, num_experts=4) for _ in range(2)]
    for p, m in enumerate(moe):  # layer p lives on stage p
        m.observe(p, **piece(make_layer(p, 20, 4, 2), list(range(20)), 2))
    whole = MoERoutingMetric(num_layers=2, num_experts=4)
    for p in range(2):
        whole.observe(p, **piece(make_layer(p, 20, 4, 2), list(range(20)), 2))
    exports = [_place(m.export(), pp_rank=p, pp_size=2) for p, m in enumerate(moe)]
    driver = MoERoutingMetric(num_layers=2, num_experts=4)
    assert equal(driver.calculate_from(exports), whole.calculate())
    with pytest.raises(ValueError, match=r"states of scope 'stage'.*data shard 0, stage 0"):
        driver.calculate_from(exports[1:])
    norms = ModelNormMetric()
    _norms(norms)
    half = _place(norms.export(), tp_rank=1, tp_size=2)
    with pytest.raises(ValueError, match=r"states of scope 'model'.*data shard 0, stage 0, TP rank 0"):
        ModelNormMetric().calculate_from([half])


def test_export_ends_the_interval_counts_it_and_refuses_a_pending_calculate(monkeypatch):
    m = LossMetric()
    _lm(m)
    first = m.export()
    assert first["metrics"][0]["interval"] == 0 and m.calculate() == {}  # reset by the export
    _lm(m)
    m.calculate(reset=False)  # does not end the interval
    assert "loss" in m.calculate()  # ends interval 2 (the check above ended interval 1)
    assert m.export()["metrics"][0]["interval"] == 3
    interval_of(m).handoffs.in_flight.append(object())  # what calculate(async_op=True) leaves while its sync runs
    with pytest.raises(RuntimeError, match="asynchronous calculate\\(\\) of LossMetric is still in flight"):
        m.export()
    coll = _loss_collection()
    interval_of(coll["loss"]).handoffs.in_flight.append(object())
    with pytest.raises(RuntimeError, match="LossMetric"):
        coll.export()


def test_from_export_refuses_what_is_not_the_librarys():
    class Custom(LossMetric):
        pass

    export = Custom().export()
    with pytest.raises(ValueError, match="Custom, which is not a metric class of twinkle_metrics"):
        from_export(export)
    assert Custom().calculate_from([export]) == {}  # the user builds the driver metric
    odd = LossMetric().export()
    odd["metrics"][0]["unexported_arguments"] = ["loss_fn"]
    with pytest.raises(ValueError, match="not plain JSON"):
        from_export(odd)


def test_agreed_results_takes_one_copy_and_names_what_differs():
    a = {"loss": 2.0, "kl": math.nan, "records": [{"kl": 1.0}]}
    got = agreed_results([a, copy.deepcopy(a), copy.deepcopy(a)])
    assert equal(got, a) and got is not a
    with pytest.raises(ValueError, match=r"results 2 differ from results 0 at key 'loss'"):
        agreed_results([a, a, dict(a, loss=2.5)])
    with pytest.raises(ValueError, match=r"results 1 hold other keys.*only in 0: \['records'\]"):
        agreed_results([a, {"loss": 2.0, "kl": math.nan}])
    with pytest.raises(ValueError, match="empty list"):
        agreed_results([])
    with pytest.raises(TypeError, match="results 1 is a list"):
        agreed_results([a, [1]])
