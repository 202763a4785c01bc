"""Single-process tests of PPOValueMetric and RolloutMismatchMetric against plain-Python references."""
import gc
import math
import statistics
import weakref

import pytest
import torch

from tests.rlref import make_ppo_batch, ragged, ref_ppo_value, ref_rollout
from twinkle_metrics import GRPOMetric, MetricCollection, PPOValueMetric, RolloutMismatchMetric
from twinkle_metrics.integrations.factory import build_metrics
from twinkle_metrics.testing import (
    assert_results_close,
    forbid_device_waits,
    merged_results,
    state_dict_differences,
)

REL = 1e-10


def _halves(n):
    return [torch.arange(0, n // 2), torch.arange(n // 2, n)]


# ----------------------------------------------------------------------------- PPO value
def test_ppo_value_matches_reference_over_calls_and_microbatches():
    b = make_ppo_batch(0)
    lab = b["labels"]
    m = PPOValueMetric(epsilon=0.3)
    parts = _halves(lab.shape[0])
    rows = parts[1]
    feats = [{"labels": lab[rows[:3]]}, {"labels": lab[rows[3:]]}]
    old, adv = ragged(b["old"][rows], lab[rows]), ragged(b["adv"][rows], lab[rows])
    with forbid_device_waits():
        # call 1: one batch, dense side inputs; call 2: two microbatches, ragged old values
        m.accumulate({"labels": lab[parts[0]]}, {"values": b["values"][parts[0]]},
                     old_values=b["old"][parts[0]], returns=b["returns"][parts[0]],
                     advantages=b["adv"][parts[0]])
        m.accumulate(feats, {"values": [b["values"][rows[:3]], b["values"][rows[3:]]]},
                     old_values=old, returns=b["returns"][rows], advantages=adv)
    want = ref_ppo_value(lab, b["values"], b["old"], b["returns"], b["adv"], eps=0.3)
    assert 0 < want["train/value_clip_ratio"] < 1  # the clip count can be wrong
    assert_results_close(m.calculate(), want, rel=REL)
    assert m.calculate() == {}  # reset


def test_ppo_value_microbatches_in_one_call_equal_one_call_each():
    """A call's microbatches are joined into one pass of launches: the same numbers as
    accumulating them one call each, also when one microbatch lacks a side input, the
    others give it per sequence or per token, and dtypes differ between microbatches."""
    b = make_ppo_batch(4)
    lab, v = b["labels"], b["values"]
    rows = [torch.arange(0, 3), torch.arange(3, 7), torch.arange(7, lab.shape[0])]
    feats = [{"labels": lab[r]} for r in rows]
    values = [v[rows[0]].float(), v[rows[1]], v[rows[2]]]
    olds = [b["old"][rows[0]], None, ragged(b["old"][rows[2]], lab[rows[2]])]
    rets = [b["returns"][r] for r in rows]
    advs = [b["adv"][rows[0]], b["adv"][rows[1]][:, :1], b["adv"][rows[2]]]  # per sequence in the middle
    for policy in ("propagate", "skip"):
        joined, one_each = PPOValueMetric(epsilon=0.2, nan_policy=policy), PPOValueMetric(epsilon=0.2,
                                                                                          nan_policy=policy)
        with forbid_device_waits():
            joined.accumulate(feats, [{"values": x} for x in values], old_values=olds, returns=rets,
                              advantages=advs)
            for f, x, o, r, a in zip(feats, values, olds, rets, advs):
                one_each.accumulate(f, {"values": x}, old_values=[o], returns=[r], advantages=[a])
        got, want = joined.calculate(), one_each.calculate()
        assert set(want) >= {"train/value_clip_ratio", "train/explained_variance", "train/advantage_std"}
        assert_results_close(got, want, rel=REL)


def test_ppo_value_float32_and_per_sequence_forms():
    b = make_ppo_batch(1)
    lab = b["labels"]
    seq_adv = torch.randn(lab.shape[0], dtype=torch.float64)
    seq_ret = torch.randn(lab.shape[0], dtype=torch.float64)
    v32 = b["values"].float()
    want = ref_ppo_value(lab, v32.double(), b["old"], seq_ret, seq_adv)
    forms = [  # one value per sequence: a [N] tensor, [N, 1], a list of numbers, a list of 1-element entries
        dict(returns=seq_ret, advantages=seq_adv),
        dict(returns=seq_ret[:, None], advantages=seq_adv[:, None]),
        dict(returns=seq_ret.tolist(), advantages=seq_adv.tolist()),
        dict(returns=[torch.tensor([x], dtype=torch.float64) for x in seq_ret.tolist()], advantages=seq_adv.tolist()),
    ]
    for kw in forms:
        m = PPOValueMetric()
        with forbid_device_waits():
            m.accumulate({"labels": lab}, {"values": v32}, old_values=b["old"], **kw)
        assert_results_close(m.calculate(), want, rel=REL)


def test_ppo_value_explained_variance_exact_with_large_offset():
    """Returns and values near 1e8 with unit spread: moments keep Var(R) and Var(R - v)."""
    b = make_ppo_batch(2, n_seq=64, seq_len=32, offset=1e8)
    lab = b["labels"]
    m = PPOValueMetric()
    for rows in torch.arange(lab.shape[0]).split(5):
        m.accumulate({"labels": lab[rows]}, {"values": b["values"][rows]},
                     old_values=b["old"][rows], returns=b["returns"][rows])
    got = m.calculate()
    want = ref_ppo_value(lab, b["values"], b["old"], b["returns"])
    assert math.isclose(got["train/explained_variance"], want["train/explained_variance"], rel_tol=1e-9)
    # (n, sum, sum of squares) in float64 on the same returns is far off: the test can fail
    r = torch.cat([b["returns"][i][lab[i] != -100] for i in range(lab.shape[0])])
    naive = float((r * r).sum() / r.numel() - (r.sum() / r.numel()) ** 2)
    assert not math.isclose(naive, statistics.pvariance(r.tolist()), rel_tol=1e-3)


def test_ppo_value_reports_what_the_inputs_define():
    b = make_ppo_batch(3)
    lab = b["labels"]
    m = PPOValueMetric()
    m.accumulate({"labels": lab}, {"values": b["values"]})
    assert set(m.calculate()) == {"train/value_mean"}
    m.accumulate({"labels": lab}, {"values": b["values"]}, returns=b["returns"])
    assert set(m.calculate()) == {"train/value_mean", "train/return_mean", "train/explained_variance"}
    with pytest.raises(ValueError, match=r"got keyword 'returns' but no outputs\['values'\]"):
        m.accumulate({"labels": lab}, None, returns=b["returns"])  # part of a value step
    m.accumulate({"labels": lab}, {"logps": b["train"]}, advantages=b["adv"])  # a policy step: not ours
    assert m.calculate() == {}


def test_ppo_value_constant_returns_floor_the_variance():
    lab = torch.tensor([[1, 2, 3, -100]])
    m = PPOValueMetric()
    m.accumulate({"labels": lab}, {"values": torch.tensor([[0.5, 1.0, 2.0, 9.0]], dtype=torch.float64)},
                 returns=torch.ones(1, 4, dtype=torch.float64))
    var_err = statistics.pvariance([0.5, 0.0, -1.0])
    assert math.isclose(m.calculate()["train/explained_variance"], 1 - var_err / 1e-8, rel_tol=1e-12)


def test_ppo_value_completion_mask_over_labels():
    b = make_ppo_batch(4)
    lab = b["labels"]
    mask = (lab != -100).long()
    mask[:, :2] = 0
    lab2 = torch.where(mask.bool(), lab, torch.full_like(lab, -100))
    m = PPOValueMetric()
    m.accumulate({"labels": lab, "completion_mask": mask}, {"values": b["values"]}, old_values=b["old"],
                 returns=b["returns"])
    assert_results_close(m.calculate(), ref_ppo_value(lab2, b["values"], b["old"], b["returns"]), rel=REL)


# ----------------------------------------------------------------------------- rollout
def test_rollout_matches_reference_over_calls_and_microbatches():
    b = make_ppo_batch(5)
    lab = b["labels"]
    m = RolloutMismatchMetric(is_threshold=1.5)
    parts = _halves(lab.shape[0])
    rows = parts[1]
    roll = ragged(b["rollout"][rows], lab[rows])
    with forbid_device_waits():
        m.accumulate({"labels": lab[parts[0]]}, {"logps": b["train"][parts[0]]},
                     rollout_logps=b["rollout"][parts[0]])
        m.accumulate([{"labels": lab[rows[:2]]}, {"labels": lab[rows[2:]]}],
                     {"logps": [b["train"][rows[:2]], b["train"][rows[2:]]]}, rollout_logps=roll)
    want = ref_rollout(lab, b["train"], b["rollout"], high=1.5)
    assert 0 < want["rollout/is_fraction_high"] and 0 < want["rollout/is_fraction_low"]
    assert want["rollout/seq_ess"] < want["rollout/token_ess"] < 1
    assert_results_close(m.calculate(), want, rel=REL)


def test_rollout_thresholds():
    b = make_ppo_batch(6)
    lab = b["labels"]
    for high, low in ((3.0, None), (1.2, 0.9), (1.0, 0.0)):
        m = RolloutMismatchMetric(is_threshold=high, is_threshold_low=low)
        m.accumulate({"labels": lab}, {"logps": b["train"].float()}, rollout_logps=b["rollout"].float())
        want = ref_rollout(lab, b["train"].float(), b["rollout"].float(), high=high, low=low)
        assert_results_close(m.calculate(), want, rel=1e-9)


def test_rollout_sequence_ess_with_huge_sequence_log_ratios():
    """Sequence log-ratios of +-600: e^(2 s) overflows float64; the shifted merge does not."""
    g = torch.Generator().manual_seed(7)
    n_seq, s = 6, 400
    lab = torch.zeros(n_seq, s, dtype=torch.long)
    train = -torch.rand(n_seq, s, generator=g, dtype=torch.float64)
    shift = torch.tensor([1.5, -1.5, 1.49, 0.2, -0.7, 1.2], dtype=torch.float64)[:, None]
    rollout = train - shift + 0.01 * torch.randn(n_seq, s, generator=g, dtype=torch.float64)
    whole = RolloutMismatchMetric().accumulate({"labels": lab}, {"logps": train}, rollout_logps=rollout)
    shards = [RolloutMismatchMetric().accumulate({"labels": lab[r]}, {"logps": train[r]}, rollout_logps=rollout[r])
              for r in (torch.tensor([1, 4]), torch.tensor([0]), torch.tensor([2, 3, 5]))]
    want = ref_rollout(lab, train, rollout)
    assert 0.1 < want["rollout/seq_ess"] < 0.99  # two sequences share the weight, not one
    merged = merged_results(shards)
    got = whole.calculate()
    assert math.isclose(got["rollout/seq_ess"], want["rollout/seq_ess"], rel_tol=1e-9)
    assert_results_close(merged, got, rel=1e-12)


def test_rollout_merge_of_shards_equals_whole():
    b = make_ppo_batch(8)
    lab = b["labels"]
    whole = RolloutMismatchMetric().accumulate({"labels": lab}, {"logps": b["train"]}, rollout_logps=b["rollout"])
    shards = []
    for rows in (torch.arange(0, 5), torch.arange(5, 12), torch.arange(0, 0)):
        m = RolloutMismatchMetric()
        if len(rows):
            m.accumulate({"labels": lab[rows]}, {"logps": b["train"][rows]}, rollout_logps=b["rollout"][rows])
        shards.append(m)  # one shard empty: the identity of every state
    assert_results_close(merged_results(shards), whole.calculate(), rel=1e-12)


def test_rollout_without_rollout_logps_adds_nothing():
    b = make_ppo_batch(9)
    m = RolloutMismatchMetric()
    m.accumulate({"labels": b["labels"]}, {"logps": b["train"]})
    assert m.calculate() == {}


def test_rollout_with_grpo_in_a_collection():
    b = make_ppo_batch(10)
    lab = b["labels"]
    coll = MetricCollection({"grpo": GRPOMetric(), "": RolloutMismatchMetric()})
    roll = ragged(b["rollout"], lab)
    with forbid_device_waits():
        coll.accumulate({"labels": lab}, {"logps": b["train"]}, old_logps=b["train"], rollout_logps=roll)
    got = coll.calculate()
    assert_results_close({k: v for k, v in got.items() if k.startswith("rollout/")},
                         ref_rollout(lab, b["train"], b["rollout"]), rel=REL)
    assert got["grpo/train/approx_kl"] == 0.0


# --------------------------------------------------------------------------- non-finite
def _poisoned():
    b = make_ppo_batch(11)
    lab = b["labels"]
    i, t = 3, int((lab[3] != -100).nonzero()[0])
    for key in ("values", "rollout"):
        b[key] = b[key].clone()
        b[key][i, t] = math.nan
        b[key][0, 0] = math.inf  # sequence 0 is fully masked: padding, never counted
    clean = lab.clone()
    clean[i, t] = -100
    return b, lab, clean


def test_nan_policy_skip_equals_data_without_the_token():
    b, lab, clean = _poisoned()
    m = PPOValueMetric(nan_policy="skip")
    m.accumulate({"labels": lab}, {"values": b["values"]}, old_values=b["old"], returns=b["returns"],
                 advantages=b["adv"])
    want = ref_ppo_value(clean, b["values"], b["old"], b["returns"], b["adv"])
    want["train/nonfinite_tokens"] = 1
    assert_results_close(m.calculate(), want, rel=REL)
    r = RolloutMismatchMetric(nan_policy="skip")
    r.accumulate({"labels": lab}, {"logps": b["train"]}, rollout_logps=b["rollout"])
    want = ref_rollout(clean, b["train"], b["rollout"])
    want["rollout/nonfinite_tokens"] = 1
    assert_results_close(r.calculate(), want, rel=REL)


def test_nan_policy_propagate_shows_nan():
    b, lab, _ = _poisoned()
    m = PPOValueMetric()
    m.accumulate({"labels": lab}, {"values": b["values"]}, old_values=b["old"], returns=b["returns"])
    got = m.calculate()
    assert got.pop("train/nonfinite_tokens") == 1
    assert math.isfinite(got.pop("train/return_mean"))  # the only key v does not feed
    assert all(math.isnan(v) for v in got.values()), got
    r = RolloutMismatchMetric()
    r.accumulate({"labels": lab}, {"logps": b["train"]}, rollout_logps=b["rollout"])
    got = r.calculate()
    assert got.pop("rollout/nonfinite_tokens") == 1
    assert math.isfinite(got.pop("rollout/training_ppl"))  # the NaN is a rollout log-prob
    assert all(math.isnan(v) for v in got.values()), got


# ------------------------------------------------------------------------------ errors
def test_errors_name_metric_field_and_expected():
    b = make_ppo_batch(12)
    lab = b["labels"]
    v = PPOValueMetric()
    cases = [
        (v, ({"labels": lab}, {"values": b["values"][:, :3, None]}), {}, ValueError,
         r"PPOValueMetric: outputs\['values'\] has shape \[12, 3, 1\] but the labels/mask are \[12, 8\]"),
        (v, ({"labels": lab}, {"values": b["values"]}), {"returns": b["returns"][:5]}, ValueError,
         r"PPOValueMetric: returns has shape \[5, 8\] but the batch holds 12 sequences"),
        (v, ({"labels": lab}, {"values": b["values"]}), {"old_values": [[1.0]] * 3}, ValueError,
         r"PPOValueMetric: old_values has 3 entries; expected one per microbatch \(1\) or one per sequence \(12\)"),
        (v, ({"labels": lab}, {"logps": b["values"]}), {"returns": b["returns"]}, ValueError,
         r"PPOValueMetric: got keyword 'returns' but no outputs\['values'\]"),
        (v, (None, {"values": b["values"]}), {}, ValueError,
         r"PPOValueMetric: got outputs\['values'\] but no inputs 'labels' or 'completion_mask'"),
        (v, ({"labels": lab}, {"values": "x"}), {}, TypeError, r"PPOValueMetric: outputs\['values'\] must be a tensor"),
        (v, ({"labels": lab}, {"values": b["values"]}), {"old_value": b["old"]}, TypeError,
         r"unexpected keyword argument 'old_value'; did you mean 'old_values'"),
        (RolloutMismatchMetric(), ({"labels": lab}, {"logps": b["train"]}),
         {"rollout_logps": [0.5] * 12}, ValueError,
         r"RolloutMismatchMetric: rollout_logps holds per-token values but got one number for a sequence"),
        (RolloutMismatchMetric(), ({"labels": lab}, {"logps": b["train"]}),
         {"rollout_logps": b["rollout"][:, :3, None]}, ValueError,
         r"RolloutMismatchMetric: rollout_logps has shape \[12, 3, 1\] but the microbatch has 12 sequences"),
    ]
    for metric, (inputs, outputs), kw, exc, pattern in cases:
        before = metric.state_dict()
        with pytest.raises(exc, match=pattern):
            metric.accumulate(inputs, outputs, **kw)
        assert not state_dict_differences(before, metric.state_dict())  # nothing folded in


def test_constructor_arguments_validated():
    with pytest.raises(ValueError, match="PPOValueMetric: epsilon"):
        PPOValueMetric(epsilon=-0.1)
    with pytest.raises(ValueError, match="PPOValueMetric: nan_policy"):
        PPOValueMetric(nan_policy="ignore")
    with pytest.raises(ValueError, match=r"RolloutMismatchMetric: is_threshold must be > 0, got 0"):
        RolloutMismatchMetric(is_threshold=0)
    with pytest.raises(ValueError, match=r"is_threshold_low must be in \[0, is_threshold=2.0\], got 3.0"):
        RolloutMismatchMetric(is_threshold_low=3.0)
    with pytest.raises(TypeError, match="RolloutMismatchMetric: is_threshold must be a number, got str"):
        RolloutMismatchMetric(is_threshold="2")
    assert RolloutMismatchMetric(is_threshold=4.0).is_threshold_low == 0.25


# ---------------------------------------------------------------------------- autograd
def _graph_calls():
    w = torch.randn(3, requires_grad=True)
    scale = w.sum() * 0 + 1
    b = make_ppo_batch(13)
    lab = b["labels"]
    return w, [
        (PPOValueMetric(), ({"labels": lab}, {"values": b["values"] * scale}),
         dict(old_values=b["old"] * scale, returns=b["returns"] * scale, advantages=b["adv"] * scale)),
        (RolloutMismatchMetric(), ({"labels": lab}, {"logps": b["train"] * scale}),
         dict(rollout_logps=ragged(b["rollout"] * scale, lab))),
    ]


@pytest.mark.parametrize("index", [0, 1])
def test_no_autograd_graph_is_held(index):
    w, calls = _graph_calls()
    metric, (inputs, outputs), kw = calls[index]
    metric.accumulate(inputs, outputs, **kw)
    for name, t in metric.states.items():
        assert not t.requires_grad and t.grad_fn is None, name
    ref = weakref.ref(w)
    del w, calls, inputs, outputs, kw
    gc.collect()
    assert ref() is None  # nothing in the metric reaches the graph
    assert metric.calculate()


def test_factory_builds_both_by_name():
    coll = build_metrics([{"type": "PPOValueMetric", "kwargs": {"epsilon": 0.1}},
                          {"type": "RolloutMismatchMetric", "kwargs": {"is_threshold": 3.0}}])
    assert [type(m).__name__ for m in coll] == ["PPOValueMetric", "RolloutMismatchMetric"]
    assert coll[0].epsilon == 0.1 and coll[1].is_threshold == 3.0


@pytest.mark.parametrize("cls", [PPOValueMetric, RolloutMismatchMetric])
def test_docstring_example_runs(cls):
    from parallel import DeviceMesh

    doc = cls.__doc__
    block = doc[doc.index("In a training step::") + len("In a training step::"):]
    code = "\n".join(line[8:] for line in block.strip("\n").splitlines())
    b = make_ppo_batch(14)
    env = {cls.__name__: cls, "mesh": DeviceMesh.single(), "labels": b["labels"], "values": b["values"],
           "old_values": b["old"], "returns": b["returns"], "advantages": b["adv"],
           "old_logps": b["train"], "vllm_logps": b["rollout"]}
    exec(compile(code.replace("m.calculate()", "result = m.calculate()"), "docstring", "exec"), env)
    want = (ref_ppo_value(b["labels"], b["values"], b["old"], b["returns"], b["adv"]) if cls is PPOValueMetric
            else ref_rollout(b["labels"], b["train"], b["rollout"]))
    assert_results_close(env["result"], want, rel=REL)
