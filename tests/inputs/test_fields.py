"""Every field a metric reads is checked in one place (``twinkle_metrics.inputs.fields``),
for every shipped metric from its own declaration; counts are counts; collections refuse
clashes when built; misspelt constructor arguments raise."""
import inspect

import pytest
import torch

import twinkle_metrics as tm
from twinkle_metrics import Accuracy, GRPOMetric, LossMetric, Metric, MetricCollection, Reads, State
from twinkle_metrics.core.config import constructor_keywords
from twinkle_metrics.inputs.fields import records, typo_of
from twinkle_metrics.testing import state_dict_differences


def _shipped():
    classes = [getattr(tm, n) for n in tm.__all__]
    classes = [c for c in classes if inspect.isclass(c) and issubclass(c, Metric) and c is not Metric]
    return [c(num_layers=2, num_experts=4) if c is tm.MoERoutingMetric else c() for c in classes]


SHIPPED = _shipped()
IDS = [type(m).__name__ for m in SHIPPED]


def _call(fields):
    """(inputs, outputs, kwargs) carrying ``fields`` ((side, name) pairs), each a small tensor."""
    inputs, outputs, kwargs = {}, {}, {}
    for side, name in fields:
        {"inputs": inputs, "outputs": outputs, "keyword": kwargs}[side][name] = torch.ones(2, 3)
    return inputs or None, outputs or None, kwargs


def _partial_calls(metric):
    """For each record: a call with one of its own fields and without a required other one."""
    for record in records(type(metric)):
        fields = [f.resolved(metric) for f in record.fields]
        for own in (f for f in fields if f.carries):
            for missing in (f for f in fields if f.required and f is not own):
                yield own, missing


@pytest.mark.parametrize("metric", SHIPPED, ids=IDS)
def test_a_record_carried_in_part_raises_naming_metric_and_field_and_changes_nothing(metric):
    name = type(metric).__name__
    cases = list(_partial_calls(metric))
    if not any(f.required for r in records(type(metric)) for f in r.fields):
        pytest.skip(f"{name} reads no required field")
    assert cases, name
    before = metric.state_dict()
    for own, missing in cases:
        inputs, outputs, kwargs = _call([(own.side, own.names[0])])
        with pytest.raises(ValueError) as info:
            metric.accumulate(inputs, outputs, **kwargs)
        msg = str(info.value)
        assert msg.startswith(f"{name}: got ") and repr(missing.names[0]) in msg, msg
        assert "Nothing was accumulated" in msg
    assert state_dict_differences(before, metric.state_dict()) == []


@pytest.mark.parametrize("metric", SHIPPED, ids=IDS)
def test_a_near_miss_of_a_read_field_raises_with_a_did_you_mean(metric):
    name = type(metric).__name__
    fields = [f.resolved(metric) for r in records(type(metric)) for f in r.fields if f.side != "keyword"]
    if not fields:
        pytest.skip(f"{name} reads no input or output field")
    before = metric.state_dict()
    for f in fields:
        real = f.names[0]
        typo = real[:-1] if len(real) > 4 else real + "x"
        assert typo_of(typo, real)
        inputs, outputs, kwargs = _call([(f.side, typo)])
        with pytest.raises(ValueError, match=rf"did you mean {real!r}") as info:
            metric.accumulate(inputs, outputs, **kwargs)
        assert str(info.value).startswith(f"{name}: ")
    assert state_dict_differences(before, metric.state_dict()) == []


@pytest.mark.parametrize("metric", SHIPPED, ids=IDS)
def test_a_keyword_no_metric_takes_raises_and_nothing_here_adds_nothing(metric):
    name = type(metric).__name__
    before = metric.state_dict()
    with pytest.raises(TypeError, match=rf"{name}.accumulate: unexpected keyword argument 'no_such_keyword'"):
        metric.accumulate(None, None, no_such_keyword=1)
    if records(type(metric)) and all(any(f.required for f in r.fields) for r in records(type(metric))):
        metric.accumulate([], [])  # a pipeline stage without the loss
        metric.accumulate(None, None, lr=1e-4, step=3)  # Twinkle's common keywords
        assert state_dict_differences(before, metric.state_dict()) == []


def test_the_keyword_check_does_not_depend_on_other_classes():
    def check():
        with pytest.raises(TypeError, match="'zzz_custom'"):
            LossMetric().accumulate(None, {"loss": 1.0}, zzz_custom=1)

    check()

    class Custom(Metric):  # a user's metric naming the keyword
        total = State("sum")

        def update(self, inputs, outputs, *, zzz_custom=None, **kwargs):
            return {"total": zzz_custom}

        def compute(self, s):
            return {"custom": s["total"]}

    check()  # still refused where no metric of the call takes it
    coll = MetricCollection([LossMetric(), Custom()])
    coll.accumulate(None, {"loss": 1.0}, zzz_custom=2)  # taken by a member: each gets its own
    assert coll.calculate() == {"loss": 1.0, "custom": 2.0}


def test_the_issue_examples_raise():
    labels, logits = torch.tensor([[1, 2]]), torch.randn(1, 2, 5)
    m = Accuracy()
    with pytest.raises(ValueError, match=r"did you mean 'logits'"):
        m.accumulate({"labels": labels}, {"logit": logits})
    with pytest.raises(ValueError, match=r"got inputs\['labels'\] but no outputs\['logits'\]"):
        m.accumulate({"labels": labels}, {})
    with pytest.raises(ValueError, match=r"labels \[2, 5\] do not match logits \[2, 4, 7\].*align='right'"):
        m.accumulate({"labels": torch.ones(2, 5, dtype=torch.long)}, {"logits": torch.randn(2, 4, 7)})
    assert m.calculate() == {}
    with pytest.raises(ValueError, match=r"'lm loss' \(loss_key"):
        LossMetric().accumulate(None, [{"loss": torch.tensor([3.0, 2.0])}])


def test_a_collection_excuses_a_member_whose_call_another_reads_whole():
    labels, logits = torch.tensor([[1, 2, -100]]), torch.randn(1, 3, 5)
    coll = MetricCollection([LossMetric(), Accuracy()])
    coll.accumulate({"labels": labels}, {"logits": logits})  # Accuracy's call: LossMetric adds nothing
    coll.accumulate(None, {"loss": 2.0})  # LossMetric's: Accuracy adds nothing
    got = coll.calculate()
    assert got["loss"] == 2.0 and got["total_tokens"] == 2
    with pytest.raises(ValueError, match=r"LossMetric: got outputs\['num_tokens'\] but no outputs 'lm loss' or"):
        coll.accumulate({"labels": labels}, {"num_tokens": 3})  # nobody reads it whole
    rl = MetricCollection({"policy": GRPOMetric(), "rollout": tm.RolloutMismatchMetric(),
                           "value": tm.PPOValueMetric()})  # GRPO and PPO value both report advantages
    lp = torch.zeros(1, 3)
    rl.accumulate({"labels": labels}, {"logps": lp}, advantages=torch.ones(1))  # a policy step
    rl.accumulate({"labels": labels}, {"logps": lp}, rollout_logps=lp)
    got = rl.calculate()
    assert "rollout/rollout/mismatch_kl" in got and "value/train/advantage_mean" not in got


# ------------------------------------------------------------------------------- counts
@pytest.mark.parametrize("bad, error", [(-2, ValueError), (2.5, ValueError), (torch.tensor(2.5), ValueError),
                                        (torch.tensor(-1), ValueError), (True, TypeError),
                                        (torch.tensor([1, 2]), TypeError)])
def test_counts_are_non_negative_integers_and_a_valid_batch_is_kept(bad, error):
    m = LossMetric(loss_reduction="sum")
    m.accumulate(None, {"loss": 3.0, "num_tokens": 2})
    before = m.state_dict()
    with pytest.raises(error, match="num_tokens"):
        m.accumulate(None, {"loss": 5.0, "num_tokens": bad})
    assert state_dict_differences(before, m.state_dict()) == []
    assert m.calculate() == {"loss": 1.5, "num_tokens": 2}


def test_other_counts_are_checked_alike():
    with pytest.raises(ValueError, match=r"LossMetric: outputs\[0\]\['lm loss'\] is \[loss_sum, num_tokens\]"):
        LossMetric(loss_reduction="sum").accumulate(None, [{"lm loss": torch.tensor([3.0, -2.0])}])
    with pytest.raises(ValueError, match="TrainMetric: tokens = -5"):
        tm.TrainMetric().accumulate(None, None, tokens=-5)
    with pytest.raises(ValueError, match=r"completion_lengths\[1\] = -3"):
        tm.CompletionRewardMetric().accumulate(completion_lengths=[4, -3])
    with pytest.raises(ValueError, match=r"completion_lengths\[0\] = 1.5"):
        tm.CompletionRewardMetric().accumulate(completion_lengths=torch.tensor([1.5]))
    whole = LossMetric(loss_reduction="sum").accumulate(None, {"loss": 3.0, "num_tokens": 2.0})  # a whole float
    assert whole.calculate()["loss"] == 1.5


def test_a_negative_device_total_raises_at_calculate_naming_the_interval():
    """Device counts are checked by dtype in accumulate and by their reduced total at
    calculate(); the states of such an interval stand here for a device's."""
    m = LossMetric(loss_reduction="sum")
    m.accumulate(None, {"loss": 1.0, "num_tokens": 1}).calculate()
    state = m.state_dict()
    state.update(loss_total=torch.tensor(2.0, dtype=torch.float64), entries=torch.tensor(1),
                 sum_entries=torch.tensor(1), num_tokens=torch.tensor(-2.0, dtype=torch.float64))
    m.load_state_dict(state)
    for _ in range(2):  # the interval is kept: every calculate says so, never an empty dict
        with pytest.raises(ValueError, match=r"LossMetric: calculate\(\) of interval 1: num_tokens totals -2.0"):
            m.calculate()


# ------------------------------------------------------------------- collections, arguments
def test_a_collection_refuses_clashes_when_built():
    loss = LossMetric()
    with pytest.raises(ValueError, match=r"member 0 \(LossMetric\) and member 1 \(LossMetric\) are the same"):
        MetricCollection([loss, loss])
    with pytest.raises(ValueError, match=r"member 0 \('a': LossMetric\) and member 1 \('b': LossMetric\) are the s"):
        MetricCollection({"a": loss, "b": loss})
    with pytest.raises(ValueError, match=r"member 0 \(LossMetric\) and member 1 \(LossMetric\) both return 'loss'"):
        MetricCollection([LossMetric(), LossMetric(ppl=True)])
    with pytest.raises(ValueError, match=r"both return 'loss'"):
        MetricCollection([LossMetric(), tm.EmbeddingMetric()])
    with pytest.raises(ValueError, match=r"both return 'train/completion_length'"):
        MetricCollection([tm.CompletionRewardMetric(), tm.CompletionRewardMetric()])
    MetricCollection({"train": LossMetric(), "eval": LossMetric()})  # the dict form keeps both
    # one of each family: the rest return distinct keys
    MetricCollection([m for m in _shipped() if type(m) not in (tm.EmbeddingMetric, tm.PPOValueMetric, tm.GSPOMetric,
                                                               tm.CISPOMetric, tm.PPOMetric)])


@pytest.mark.parametrize("metric", SHIPPED, ids=IDS)
def test_a_misspelt_constructor_argument_raises(metric):
    cls = type(metric)
    names = [n for n in constructor_keywords(cls) if len(n) > 4]
    for name in names:
        typo = name[:-2] + name[-1] + name[-2]  # the last two letters swapped, else one dropped
        typo = typo if typo != name else name[:-1]
        kwargs = dict(num_layers=2, num_experts=4) if cls is tm.MoERoutingMetric else {}
        with pytest.raises(TypeError, match=rf"{cls.__name__}: unknown constructor argument {typo!r}: did you mean "
                                            rf"{name!r}"):
            cls(**kwargs, **{typo: 1})


def test_reads_declarations_are_checked_for_the_author():
    with pytest.raises(TypeError, match="names keyword .*'rewards'.* but Bad.update does not take it"):
        class Bad(Metric):
            reads = Reads(keywords=("rewards",))

            def update(self, inputs, outputs, **kwargs):
                return {}
