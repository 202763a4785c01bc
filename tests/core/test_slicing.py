"""slice_by: each slice's keys equal a separate metric fed only that slice's sequences."""
import pytest
import torch

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
    PPOValueMetric,
    RolloutMismatchMetric,
    TrainMetric,
)
from twinkle_metrics.testing import assert_results_close, forbid_device_waits, state_dict_differences

N = 12
# sources per sequence; pairs (2k, 2k+1) share one, as DPO's chosen/rejected do
SOURCES = ["math", "math", "code", "code", "math", "math", "chat", "chat", "code", "code", "math", "math"]


def _b():
    b = make_rl_batch(5, N, 8)
    p = make_ppo_batch(5, N, 8)
    return b, p


def _rows(rows):
    return torch.tensor(rows, dtype=torch.long)


# Each case: (metric factory, call(rows) -> (inputs, outputs, kwargs)) built by plain indexing.
def _cases():
    b, p = _b()

    def feats(rows, extra=None):
        r = _rows(rows)
        f = {"labels": b["labels"][r], "data_source": [SOURCES[i] for i in rows]}
        return f

    def grpo_call(rows):
        r = _rows(rows)
        lab = b["labels"][r]
        half = (len(rows) + 1) // 2
        micro = [list(rows[:half]), list(rows[half:])]
        micro = [m for m in micro if m]
        return ([feats(m) for m in micro], {"logps": [b["logps"][_rows(m)] for m in micro]},
                dict(old_logps=ragged(b["old"][r], lab), advantages=b["adv"][r],
                     ref_logps=[b["ref"][_rows(m)] for m in micro]))

    return {
        "accuracy": (lambda **k: Accuracy(**k),
                     lambda rows: (feats(rows), {"logits": b["logits"][_rows(rows)]}, {})),
        "grpo": (lambda **k: GRPOMetric(top_k_kl=3, **k), grpo_call),
        "gspo": (lambda **k: GSPOMetric(epsilon=0.05, **k), grpo_call),
        "cispo": (lambda **k: CISPOMetric(**k), grpo_call),
        "dpo": (lambda **k: DPOMetric(beta=0.3, **k),
                lambda rows: (feats(rows), {"logps": b["logps"][_rows(rows)]},
                              dict(ref_outputs={"logps": b["ref"][_rows(rows)]}))),
        "reward": (lambda **k: CompletionRewardMetric(**k),
                   lambda rows: (feats(rows), None,
                                 dict(rewards={"acc": [float(i % 3) for i in rows],
                                               "fmt": [0.5 * i for i in rows]},
                                      completion_lengths=[3 + i for i in rows], generate_time=1.5))),
        "ppo_value": (lambda **k: PPOValueMetric(**k),
                      lambda rows: (feats(rows), {"values": p["values"][_rows(rows)]},
                                    dict(old_values=p["old"][_rows(rows)], returns=p["returns"][_rows(rows)],
                                         advantages=p["adv"][_rows(rows)]))),
        "rollout": (lambda **k: RolloutMismatchMetric(**k),
                    lambda rows: (feats(rows), {"logps": p["train"][_rows(rows)]},
                                  dict(rollout_logps=p["rollout"][_rows(rows)]))),
    }


CASES = _cases()


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_slice_equals_a_metric_fed_only_that_slice(name):
    make, call = CASES[name]
    sliced = make(slice_by="data_source")
    order = [3, 0, 1, 2, 5, 4, 6, 7, 9, 8, 10, 11] if name != "dpo" else list(range(N))
    first, second = call(order[:6]), call(order[6:])
    with forbid_device_waits():
        sliced.accumulate(*first[:2], **first[2])
        sliced.accumulate(*second[:2], **second[2])
    got = sliced.calculate()
    whole = make()
    whole.accumulate(*call(order)[:2], **call(order)[2])
    want = whole.calculate()
    for source in ("math", "code", "chat"):
        rows = [i for i in order if SOURCES[i] == source]
        alone = make()
        alone.accumulate(*call(rows)[:2], **call(rows)[2])
        part = {k: v for k, v in alone.calculate().items() if not k.startswith("_")}
        if name == "reward":  # per-call profiling readings belong to the whole call only
            part = {k: v for k, v in part.items() if not k.startswith("profiling/")}
        want.update({f"{k}/{source}": v for k, v in part.items()})
    assert_results_close(got, want, rel=1e-12)
    assert any(k.endswith("/chat") for k in got)


def test_loss_metric_slices_whole_microbatches():
    feats = [{"labels": torch.tensor([[1, 2, -100]]), "data_source": ["a"]},
             {"labels": torch.tensor([[3, -100, -100]]), "data_source": ["b"]},
             {"labels": torch.tensor([[4, 5, 6]]), "data_source": ["a"]}]
    reports = [{"lm loss": torch.tensor([3.0, 2.0])}, {"lm loss": torch.tensor([1.0, 1.0])},
               {"lm loss": torch.tensor([6.0, 3.0])}]
    m = LossMetric(loss_reduction="sum", slice_by="data_source")
    m.accumulate(feats, reports)
    assert m.calculate() == {"loss": 10.0 / 6, "num_tokens": 6, "loss/a": 9.0 / 5, "num_tokens/a": 5,
                             "loss/b": 1.0, "num_tokens/b": 1}
    mixed = [{"labels": torch.tensor([[1, 2], [3, 4]]), "data_source": ["a", "b"]}]
    with pytest.raises(ValueError, match=r"LossMetric: outputs of microbatch 0\['lm loss'\] .* cannot be split"):
        m.accumulate(mixed, [{"lm loss": torch.tensor([3.0, 2.0])}])


def test_slice_errors_leave_the_metric_unchanged():
    make, call = CASES["accuracy"]
    m = make(slice_by="data_source", max_slices=2)
    m.accumulate(*call([0, 1, 2, 3])[:2])          # math, code
    before = m.state_dict()
    with pytest.raises(ValueError, match=r"Accuracy: 3 slices of 'data_source' .* exceed max_slices=2"):
        m.accumulate(*call([6, 7])[:2])            # chat: a third slice
    inputs, outputs, _ = call([0, 1])
    del inputs["data_source"]
    with pytest.raises(ValueError, match="Accuracy: slice_by='data_source' but input feature 0 has no"):
        m.accumulate(inputs, outputs)
    inputs, outputs, _ = call([0, 1])
    inputs["data_source"] = [1.5, 2.5]
    with pytest.raises(TypeError, match="holds float values; expected strings or ints"):
        m.accumulate(inputs, outputs)
    assert state_dict_differences(m.state_dict(), before) == []


def test_unsliceable_metrics_and_bad_arguments_say_so():
    for cls in (TrainMetric, EmbeddingMetric):
        with pytest.raises(ValueError, match=f"{cls.__name__}: slice_by is not supported"):
            cls(slice_by="data_source")
    with pytest.raises(ValueError, match="max_slices must be an int >= 1"):
        Accuracy(slice_by="x", max_slices=0)
    with pytest.raises(TypeError, match="slice_by must be the name of a per-sequence input field"):
        Accuracy(slice_by=3)
    # slicing changes the states: ranks (and checkpoints) must agree on it
    assert Accuracy(slice_by="data_source").fingerprint() != Accuracy().fingerprint()


def test_loading_more_slices_than_max_slices_raises_and_loads_nothing():
    """Rank states merged on load (a smaller DP size) can hold more slices than the bound:
    refused, all or nothing, as an accumulate beyond it would be."""
    def fed(sources):
        m = Accuracy(slice_by="src", max_slices=2)
        m.accumulate({"labels": torch.ones(len(sources), 2, dtype=torch.long), "src": sources},
                     {"logits": torch.randn(len(sources), 2, 3)})
        return m.state_dict()

    saved = [fed(["a", "b"]), fed(["c"])]
    m = Accuracy(slice_by="src", max_slices=2)
    with pytest.raises(ValueError, match=r"3 slices of 'src' \(\['a', 'b', 'c'\]\), more than max_slices=2"):
        m.load_state_dict(saved)
    assert m.calculate() == {}  # nothing loaded
    assert set(Accuracy(slice_by="src", max_slices=3).load_state_dict(saved).calculate()) >= {"accuracy/c"}


def test_dpo_slices_every_input_form_alike():
    """Interleaved, separate chosen/rejected batches (different lengths per side) and
    per-pair sums: the same pairs give the same slice keys."""
    b = make_rl_batch(9, N, 8)
    lab, lp, ref = b["labels"], b["logps"], b["ref"]
    c, r = _rows(range(0, N, 2)), _rows(range(1, N, 2))
    src = SOURCES[::2]  # one per pair
    inter = DPOMetric(beta=0.2, slice_by="data_source")
    inter.accumulate({"labels": lab, "data_source": SOURCES}, {"logps": lp}, ref_outputs={"logps": ref})
    want = inter.calculate()
    assert {"rewards/margins/math", "rewards/margins/chat"} <= set(want)
    sep = DPOMetric(beta=0.2, slice_by="data_source")
    sep.accumulate(chosen=({"labels": lab[c], "data_source": src}, {"logps": lp[c]}),
                   rejected=({"labels": lab[r][:, :6], "data_source": src}, {"logps": lp[r][:, :6]}),
                   ref_chosen={"logps": ref[c]}, ref_rejected={"logps": ref[r][:, :6]})
    got = sep.calculate()
    masked = lab != -100
    lab_r = lab[r].clone()
    lab_r[:, 6:] = -100  # the rejected side cut to 6 tokens
    inter2 = DPOMetric(beta=0.2, slice_by="data_source")
    lab2 = lab.clone()
    lab2[r] = lab_r
    inter2.accumulate({"labels": lab2, "data_source": SOURCES}, {"logps": lp}, ref_outputs={"logps": ref})
    assert_results_close(got, inter2.calculate(), rel=1e-12)
    sums = (lp * masked).sum(1).double()
    ref_sums = (ref * masked).sum(1).double()
    pre = DPOMetric(beta=0.2, slice_by="data_source")
    pre.accumulate({"data_source": src}, {"chosen_logps": sums[c], "rejected_logps": sums[r],
                                          "ref_chosen_logps": ref_sums[c], "ref_rejected_logps": ref_sums[r]})
    assert_results_close(pre.calculate(), want, rel=1e-12)
    with pytest.raises(ValueError, match="both sides of a pair must carry the same data_source"):
        sep.accumulate(chosen=({"labels": lab[c], "data_source": src}, {"logps": lp[c]}),
                       rejected=({"labels": lab[r], "data_source": src[::-1]}, {"logps": lp[r]}))
    with pytest.raises(ValueError, match=r"DPOMetric: slice_by='data_source', but this call has data and no inputs"):
        pre.accumulate(None, {"chosen_logps": sums[c], "rejected_logps": sums[r]})


def test_slice_field_must_match_the_sequences_and_calls_need_inputs():
    make, call = CASES["accuracy"]
    inputs, outputs, _ = call([0, 1, 2])
    m = make(slice_by="data_source")
    before = m.state_dict()
    for bad in (["math"], ["math", "code"], ["a", "b", "c", "d"]):
        with pytest.raises(ValueError, match=rf"Accuracy: slice_by field 'data_source' of input feature 0 has "
                                             rf"{len(bad)} entries but the feature holds 3 sequences"):
            m.accumulate({**inputs, "data_source": bad}, outputs)
    assert state_dict_differences(m.state_dict(), before) == []
    m.accumulate({**inputs, "data_source": "code"}, outputs)  # one name: the whole microbatch's
    alone = make().accumulate(inputs, outputs).calculate()
    assert_results_close({k: v for k, v in m.calculate().items() if k.endswith("/code")},
                         {f"{k}/code": v for k, v in alone.items()})
    loss = LossMetric(slice_by="data_source")
    with pytest.raises(ValueError, match="LossMetric: slice_by='data_source', but this call has data and no inputs"):
        loss.accumulate(None, {"loss": 1.0})
    reward = CompletionRewardMetric(slice_by="data_source")
    with pytest.raises(ValueError, match="CompletionRewardMetric: slice_by='data_source', but this call has data"):
        reward.accumulate(rewards=[1.0, 2.0])
    loss.accumulate(None, None, grad_norm=2.0, loss_reduction="sum")  # a reading and a setting alone
    assert loss.calculate() == {"grad_norm": 2.0}


def test_per_call_settings_reach_every_slice():
    lab = torch.tensor([[1, 2, 3, -100], [0, 4, 5, 6]])
    inputs = [{"labels": lab, "data_source": ["a", "a"]}, {"labels": lab[:1], "data_source": ["b"]}]
    outputs = {"loss": [torch.tensor(7.0), torch.tensor(3.0)]}
    per_call = LossMetric(slice_by="data_source").accumulate(inputs, outputs, loss_reduction="sum")
    built = LossMetric(slice_by="data_source", loss_reduction="sum").accumulate(inputs, outputs)
    want = built.calculate()
    assert want["loss/a"] == want["loss/b"] == 1.0
    assert per_call.calculate() == want


def test_slicing_leaves_valid_calls_alone():
    """What a sliced metric does not read (TrainMetric's lr list beside it), empty pipeline
    stages ([] with None per microbatch) and DPO's other forms keep working."""
    from twinkle_metrics import MetricCollection

    coll = MetricCollection({"loss": LossMetric(slice_by="data_source"), "train": TrainMetric()})
    coll.accumulate(None, None, grad_norm=1.5, lr=[1e-4], step=1)
    got = coll.calculate()
    assert got["loss/grad_norm"] == 1.5 and got["train/learning rate"] == 1e-4
    for m in (Accuracy(slice_by="data_source"), GRPOMetric(slice_by="data_source")):
        m.accumulate([], {"logits": [None, None], "logps": [None, None]})
        assert m.calculate() == {}
    # separate batches with one reference dict per microbatch, microbatches mixing slices
    b = make_rl_batch(9, N, 8)
    lab, lp, ref = b["labels"], b["logps"], b["ref"]
    c, r = _rows(range(0, N, 2)), _rows(range(1, N, 2))
    src = SOURCES[::2]
    halves = [slice(0, 3), slice(3, 6)]

    def side(rows):
        return ([{"labels": lab[rows][h], "data_source": src[h]} for h in halves],
                {"logps": [lp[rows][h] for h in halves]})

    sep = DPOMetric(beta=0.2, slice_by="data_source")
    sep.accumulate(chosen=side(c), rejected=side(r), ref_chosen=[{"logps": ref[c][h]} for h in halves],
                   ref_rejected=[{"logps": ref[r][h]} for h in halves])
    inter = DPOMetric(beta=0.2, slice_by="data_source")
    inter.accumulate({"labels": lab, "data_source": SOURCES}, {"logps": lp}, ref_outputs={"logps": ref})
    assert_results_close(sep.calculate(), inter.calculate(), rel=1e-12)
    # per-pair sums as [n, 1], beside outputs DPO does not read
    pre = DPOMetric()
    pre.accumulate(None, {"chosen_logps": torch.tensor([[-1.0], [-2.0]]), "rejected_logps": torch.tensor([-3.0, -1.0]),
                          "chosen_logits": torch.zeros(2, 3), "mean_chosen_logps": torch.zeros(2)})
    assert pre.calculate() == {"logps/chosen": -1.5, "logps/rejected": -2.0}
