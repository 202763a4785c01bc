"""Single-process tests of the NaN/inf policy (``nan_policy``) and of clear errors for
inputs that used to be ignored silently. References are plain Python with the
non-finite entries removed (skip) or a NaN/inf expected (propagate)."""
import math

import pytest
import torch

from tests.rlref import make_rl_batch, ref_dpo, ref_grpo
from twinkle_metrics import (
    CISPOMetric,
    CompletionRewardMetric,
    DPOMetric,
    EmbeddingMetric,
    GRPOMetric,
    GSPOMetric,
    LossMetric,
    MetricCollection,
)
from twinkle_metrics.testing import assert_results_close, forbid_device_waits, state_dict_differences

NAN, INF = math.nan, math.inf


def _rejected(m, exc, match, *args, **kwargs):
    """The call raises ``exc`` matching ``match`` and leaves every state as it was."""
    before = m.state_dict()
    with pytest.raises(exc, match=match):
        m.accumulate(*args, **kwargs)
    assert not state_dict_differences(before, m.state_dict())


@pytest.mark.parametrize("cls", [LossMetric, GRPOMetric, GSPOMetric, CISPOMetric, DPOMetric, EmbeddingMetric,
                                 CompletionRewardMetric])
def test_invalid_nan_policy_names_metric_argument_and_values(cls):
    with pytest.raises(ValueError, match=rf"{cls.__name__}: nan_policy must be one of \['propagate', 'skip'\], "
                                         r"got 'ignore'"):
        cls(nan_policy="ignore")
    assert cls(nan_policy="skip").nan_policy == "skip"


# --------------------------------------------------------------------------- LossMetric
def _loss_reports():
    """Megatron pairs (sum, count), some non-finite; the clean ones for the reference."""
    pairs = [(2.0, 4.0), (1.0, NAN), (3.0, 2.0), (NAN, 5.0), (INF, 1.0), (1.5, INF), (0.0, 0.0), (4.0, 3.0)]
    clean = [(s, n) for s, n in pairs if math.isfinite(s) and math.isfinite(n)]
    reports = [{"lm loss": torch.tensor([s, n], dtype=torch.float64)} for s, n in pairs]
    return reports, clean, len(pairs) - len(clean)


def test_loss_skip_equals_clean_data_and_counts():
    reports, clean, bad = _loss_reports()
    for reduction in ("sum", "mean"):
        m = LossMetric(loss_reduction=reduction, nan_policy="skip")
        with forbid_device_waits():
            m.accumulate(None, reports[:3]).accumulate(None, reports[3:])
        got = m.calculate()
        if reduction == "sum":
            n = sum(c for _, c in clean)
            want = {"loss": sum(s for s, _ in clean) / n, "num_tokens": int(n)}
        else:
            means = [s / c for s, c in clean if c > 0]
            want = {"loss": sum(means) / len(means)}
        want["loss_nonfinite"] = bad
        assert_results_close(got, want, rel=1e-12)
    # the plain {'loss', 'num_tokens'} form and Python numbers
    m = LossMetric(loss_reduction="sum", nan_policy="skip")
    m.accumulate(None, {"loss": [1.0, NAN, 2.0, 5.0], "num_tokens": [2, 3, 4, INF]})
    assert_results_close(m.calculate(), {"loss": 3.0 / 6, "num_tokens": 6, "loss_nonfinite": 2})
    m = LossMetric(nan_policy="skip").accumulate(None, {"loss": torch.tensor(NAN)}).accumulate(None, {"loss": 3.0})
    assert m.calculate() == {"loss": 3.0, "loss_nonfinite": 1}


@pytest.mark.parametrize("pair", [(1.0, NAN), (1.0, INF), (NAN, 2.0), (INF, 2.0), (-INF, 2.0)])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_loss_propagate_never_gives_a_finite_wrong_loss(pair, reduction):
    reports = [{"lm loss": torch.tensor([2.0, 4.0], dtype=torch.float64)},
               {"lm loss": torch.tensor(pair, dtype=torch.float64)}]
    m = LossMetric(loss_reduction=reduction)  # propagate is the default
    with forbid_device_waits():
        m.accumulate(None, reports)
    got = m.calculate()

    def check(loss):
        assert not math.isfinite(loss), got
        if math.isnan(pair[0]) or math.isnan(pair[1]) or not math.isfinite(pair[1]):
            assert math.isnan(loss)  # never 3 / inf = 0.0
        else:
            assert loss == pair[0] * INF  # an inf loss keeps its sign

    check(got["loss"])
    assert got["loss_nonfinite"] == 1
    if reduction == "sum" and not math.isfinite(pair[1]):
        assert not math.isfinite(got["num_tokens"])  # the count feeds num_tokens too
    # Python numbers take the same path, to the same value
    m = LossMetric(loss_reduction="sum").accumulate(None, {"loss": [2.0, pair[0]], "num_tokens": [4, pair[1]]})
    check(m.calculate()["loss"])


def test_loss_clean_data_keeps_the_key_set():
    reports, _, _ = _loss_reports()
    got = LossMetric(loss_reduction="sum").accumulate(None, [reports[0], reports[2]]).calculate()
    assert set(got) == {"loss", "num_tokens"}


def test_loss_misspelt_report_key_is_an_error():
    m = LossMetric().accumulate(None, [{"lm loss": torch.tensor([1.0, 2.0])}])
    _rejected(m, ValueError, r"LossMetric: no outputs 'lm loss' or 'loss', but the outputs hold 'lm_loss'.*did you "
                             r"mean 'lm loss', or pass loss_key='lm_loss'",
              None, [{"lm_loss": torch.tensor([1.0, 2.0])}])
    _rejected(m, ValueError, r"pass loss_key='LM-Loss'",
              None, {"LM-Loss": torch.tensor(1.0)})
    _rejected(m, ValueError, r"did you mean 'loss sum'",  # a report pair under another name
              None, [{"loss sum": torch.tensor([1.0, 2.0])}])
    assert LossMetric(loss_key="lm_loss").accumulate(None, [{"lm_loss": torch.tensor([1.0, 2.0])}]).calculate() == \
        {"loss": 0.5}
    # dicts that are legitimately something else are still skipped, as Twinkle does
    assert LossMetric().accumulate(None, {"logits": torch.zeros(2), "aux_loss": torch.tensor(1.0)}).calculate() == {}
    assert LossMetric().accumulate(None, [None, {}]).calculate() == {}


def test_loss_scalar_report_under_sum_asks_for_the_pair():
    labels = torch.tensor([[1, 2, -100]])
    for inputs in (None, {"labels": labels}):
        m = LossMetric(loss_reduction="sum")
        _rejected(m, ValueError, r"LossMetric: outputs\['lm loss'\] is a single value, but loss_reduction='sum' "
                                 r"needs a loss sum and its token count; return \(loss_sum, num_tokens, "
                                 r"\{'lm loss': torch.stack\(\[loss_sum, num_tokens\]\)\}\) from Megatron's "
                                 r"loss_func \(twinkle_metrics.integrations.megatron.loss_func",
                  inputs, {"lm loss": torch.tensor(0.7)})
    # megatron-core's quickstart returns (loss, {'lm loss': loss}): the schedule's list holds scalars
    _rejected(LossMetric(loss_reduction="sum"), ValueError,
              r"outputs\[1\]\['lm loss'\] is a single value.*twinkle_metrics.integrations.megatron.loss_func",
              None, [{"lm loss": torch.tensor([2.0, 4.0])}, {"lm loss": torch.tensor(0.7)}])
    got = LossMetric(loss_reduction="sum").accumulate(None, {"lm loss": 6.0, "num_tokens": 3}).calculate()
    assert got == {"loss": 2.0, "num_tokens": 3}
    assert LossMetric().accumulate(None, [{"lm loss": torch.tensor(0.5)}]).calculate() == {"loss": 0.5}


# --------------------------------------------------------------------------- GRPO family
def _poisoned_rl_batch(seed, where=("logps", "old", "ref", "adv", "ent")):
    """A batch with NaN/inf injected at valid tokens of the named inputs, NaN/-inf padding at
    every masked position, and the valid tokens that hold a non-finite value."""
    b = make_rl_batch(seed)
    lab = b["labels"]
    valid = lab != -100
    pos = [tuple(p) for p in valid.nonzero().tolist()]
    g = torch.Generator().manual_seed(seed)
    ent = torch.rand(lab.shape, generator=g, dtype=torch.float64) * 3
    data = {"logps": b["logps"].clone(), "old": b["old"].clone(), "ref": b["ref"].clone(), "ent": ent}
    adv = b["adv"].clone()
    bad = torch.zeros_like(valid)
    inject = {"logps": [(pos[1], NAN), (pos[9], -INF)], "old": [(pos[4], INF), (pos[9], NAN)],
              "ref": [(pos[12], -INF)], "ent": [(pos[20], NAN)]}
    for name in where:
        if name == "adv":  # a per-sequence advantage: every valid token of that sequence
            seq = pos[30][0]
            adv[seq] = NAN
            bad[seq] |= valid[seq]
            continue
        for (i, t), v in inject[name]:
            data[name][i, t] = v
            bad[i, t] = True
    for name, pad in (("logps", NAN), ("old", -INF), ("ref", NAN), ("ent", INF)):
        data[name] = torch.where(valid, data[name], pad)  # padding: ignored, not counted
    clean = dict(b, labels=torch.where(bad, -100, lab))  # the same data without those tokens
    return b, data, adv, bad, clean, ent


def _ref_mean_entropy(ent, labels):
    vals = [float(ent[i, t]) for i in range(labels.shape[0]) for t in range(labels.shape[1])
            if labels[i, t] != -100]
    return sum(vals) / len(vals)


@pytest.mark.parametrize("cls,kind", [(GRPOMetric, "grpo"), (GSPOMetric, "gspo"), (CISPOMetric, "cispo")])
def test_grpo_family_skip_equals_the_data_without_those_tokens(cls, kind):
    b, data, adv, bad, clean, ent = _poisoned_rl_batch(30)
    eps, eps_high = (0.05, 0.08) if kind == "gspo" else (0.2, 0.28)
    want = ref_grpo(clean, kind, eps=eps, eps_high=eps_high, top_k=4,
                    entropy=_ref_mean_entropy(ent, clean["labels"]))
    want["train/nonfinite_tokens"] = int(bad.sum())
    m = cls(nan_policy="skip", epsilon=eps, epsilon_high=eps_high, top_k_kl=4)
    feats = [{"labels": b["labels"][:5], "position_ids": b["pos"][:5]},
             {"labels": b["labels"][5:], "position_ids": b["pos"][5:]}]
    with forbid_device_waits():
        m.accumulate(feats, {"logps": data["logps"], "entropies": [data["ent"][:5], data["ent"][5:]]},
                     old_logps=data["old"], advantages=adv, ref_logps=data["ref"])
    assert_results_close(m.calculate(), want, rel=1e-9)


def test_grpo_skip_with_ragged_side_inputs_and_entropy_from_logits():
    b, data, adv, bad, clean, _ = _poisoned_rl_batch(31, where=("logps", "old"))
    lab = b["labels"]
    logits = b["logits"].clone()
    i, t = [tuple(p) for p in (lab != -100).nonzero().tolist()][25]
    logits[i, t, 3] = NAN  # its entropy is NaN: that token is dropped too
    bad[i, t] = True
    clean["labels"] = torch.where(bad, -100, lab)
    from tests.rlref import ragged, ref_entropy
    want = ref_grpo(clean, entropy=ref_entropy(b["logits"], clean["labels"]))
    want["train/nonfinite_tokens"] = int(bad.sum())
    m = GRPOMetric(nan_policy="skip", entropy_from_logits=True)
    old_ragged, adv_list = ragged(data["old"], lab), list(b["adv"])
    with forbid_device_waits():
        m.accumulate({"labels": lab}, {"logps": data["logps"], "logits": logits},
                     old_logps=old_ragged, advantages=adv_list, ref_logps=b["ref"])
    assert_results_close(m.calculate(), want, rel=1e-9)


@pytest.mark.parametrize("cls", [GRPOMetric, GSPOMetric, CISPOMetric])
def test_grpo_family_propagate_shows_nan_in_every_key_it_feeds(cls):
    b, data, adv, bad, clean, _ = _poisoned_rl_batch(32)
    m = cls()
    with forbid_device_waits():
        m.accumulate({"labels": b["labels"]}, {"logps": data["logps"], "entropies": data["ent"]},
                     old_logps=data["old"], advantages=adv, ref_logps=data["ref"])
    got = m.calculate()
    assert got.pop("train/nonfinite_tokens") == int(bad.sum())
    assert len(got) == 18 and all(not math.isfinite(v) for v in got.values()), got


def test_grpo_propagate_touches_only_the_keys_the_value_feeds():
    b, data, adv, bad, clean, ent = _poisoned_rl_batch(33, where=("ent",))
    want = ref_grpo(b, entropy=NAN)
    want["train/nonfinite_tokens"] = 1
    got = GRPOMetric().accumulate({"labels": b["labels"]}, {"logps": data["logps"], "entropies": data["ent"]},
                                  old_logps=data["old"], advantages=b["adv"], ref_logps=data["ref"]).calculate()
    assert_results_close(got, want, rel=1e-9)
    # a NaN advantage: the advantage and clip keys, nothing else
    b, data, adv, bad, clean, ent = _poisoned_rl_batch(33, where=("adv",))
    got = GRPOMetric().accumulate({"labels": b["labels"]}, {"logps": data["logps"]}, old_logps=data["old"],
                                  advantages=adv, ref_logps=data["ref"]).calculate()
    want = ref_grpo(b)
    for k, v in got.items():
        if k.startswith(("train/advantage", "train/clip_ratio")):
            assert math.isnan(v), k
        elif k == "train/nonfinite_tokens":
            assert v == int(bad.sum())
        else:
            assert math.isclose(v, want[k], rel_tol=1e-9), k


def test_grpo_all_tokens_skipped_still_reports_the_count():
    lab = torch.tensor([[1, 2, -100]])
    got = GRPOMetric(nan_policy="skip").accumulate({"labels": lab}, {"logps": torch.tensor([[NAN, INF, 0.0]])})
    assert got.calculate() == {"train/nonfinite_tokens": 2}


def test_grpo_clean_data_keeps_the_key_set():
    b = make_rl_batch(34)
    got = GRPOMetric().accumulate({"labels": b["labels"]}, {"logps": b["logps"]}, old_logps=b["old"],
                                  advantages=b["adv"]).calculate()
    assert "train/nonfinite_tokens" not in got


# --------------------------------------------------------------------------- DPO
def _poisoned_dpo(seed):
    b = make_rl_batch(seed)
    lab = b["labels"]
    valid = lab != -100
    lp = torch.where(valid, b["logps"], NAN)   # padding: ignored
    ref = torch.where(valid, b["ref"], -INF)
    pos = [tuple(p) for p in valid.nonzero().tolist()]
    lp[next(p for p in pos if p[0] == 2)] = NAN    # a chosen token (pair 1)
    ref[next(p for p in pos if p[0] == 5)] = INF   # a rejected reference token (pair 2)
    bad_pairs = [1, 2]
    return b, lp, ref, bad_pairs


def test_dpo_skip_equals_the_pairs_without_non_finite_ones():
    b, lp, ref, bad_pairs = _poisoned_dpo(40)
    keep = [i for i in range(b["labels"].shape[0]) if i // 2 not in bad_pairs]
    clean = {k: b[k][keep] for k in ("labels", "logps", "ref")}
    want = ref_dpo(clean, beta=0.3)
    want["logps/nonfinite_pairs"] = len(bad_pairs)
    m = DPOMetric(beta=0.3, nan_policy="skip")
    with forbid_device_waits():
        m.accumulate({"labels": b["labels"]}, {"logps": lp}, ref_outputs={"logps": ref})
    assert_results_close(m.calculate(), want, rel=1e-10)
    # separate batches and pre-summed sequence log-probs: the same
    lab = b["labels"]
    sep = DPOMetric(beta=0.3, nan_policy="skip")
    with forbid_device_waits():
        sep.accumulate(chosen=({"labels": lab[0::2]}, {"logps": lp[0::2]}),
                       rejected=({"labels": lab[1::2]}, {"logps": lp[1::2]}),
                       ref_chosen={"logps": ref[0::2]}, ref_rejected={"logps": ref[1::2]})
    assert_results_close(sep.calculate(), want, rel=1e-10)
    seq = torch.where(lab != -100, lp, 0.0).sum(1)
    rseq = torch.where(lab != -100, ref, 0.0).sum(1)
    pre = DPOMetric(beta=0.3, nan_policy="skip").accumulate(None, {
        "chosen_logps": seq[0::2], "rejected_logps": seq[1::2],
        "ref_chosen_logps": rseq[0::2], "ref_rejected_logps": rseq[1::2]})
    assert_results_close(pre.calculate(), want, rel=1e-10)


def test_dpo_propagate_shows_nan_in_every_key_it_feeds():
    b, lp, ref, bad_pairs = _poisoned_dpo(41)
    got = DPOMetric().accumulate({"labels": b["labels"]}, {"logps": lp}, ref_outputs={"logps": ref}).calculate()
    assert got.pop("logps/nonfinite_pairs") == len(bad_pairs)
    want = ref_dpo(b)
    for k in ("logps/rejected", "logps/ref_chosen"):  # keys the two values do not feed
        assert math.isclose(got.pop(k), want[k], rel_tol=1e-10)
    assert len(got) == 6 and all(not math.isfinite(v) for v in got.values()), got
    # a non-finite reference only: the policy's own keys stay exact
    valid = b["labels"] != -100
    ref_only = torch.where(valid, b["ref"], NAN)
    ref_only[next(tuple(p) for p in valid.nonzero().tolist() if p[0] == 4)] = NAN  # chosen of pair 2
    got = DPOMetric().accumulate({"labels": b["labels"]}, {"logps": b["logps"]},
                                 ref_outputs={"logps": ref_only}).calculate()
    for k in ("logps/chosen", "logps/rejected", "logps/ref_rejected", "rewards/rejected"):
        assert math.isclose(got.pop(k), want[k], rel_tol=1e-10), k
    assert got.pop("logps/nonfinite_pairs") == 1
    assert len(got) == 4 and all(math.isnan(v) for v in got.values()), got


# --------------------------------------------------------------------------- Embedding
def _ref_embedding(emb, labels):
    from tests.metrics.lm.test_metrics_basic import _ref_embedding as ref
    return ref(emb, labels)


def _poisoned_embeddings():
    g = torch.Generator().manual_seed(50)
    emb = torch.randn(9, 5, generator=g)
    labels = torch.tensor([1, 0, 1, 0, 0, 1, 0, 1, 0])  # anchors 0, 2, 5, 7; positives 1, 3, 6, 8
    emb[3, 1] = NAN   # the positive of anchor 2
    emb[5, 4] = INF   # anchor 5
    emb[4] = NAN      # a row no statistic uses: ignored, not counted
    clean_labels = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 0])
    return emb, labels, clean_labels


def test_embedding_skip_drops_the_pairs_of_non_finite_rows():
    emb, labels, clean_labels = _poisoned_embeddings()
    want = _ref_embedding(emb, clean_labels)
    want["nonfinite_rows"] = 2
    m = EmbeddingMetric(nan_policy="skip")
    with forbid_device_waits():
        m.accumulate({"labels": labels}, {"embeddings": emb})
    assert_results_close(m.calculate(), want, rel=1e-12)


def test_embedding_propagate_shows_nan_in_every_key_it_feeds():
    emb, labels, _ = _poisoned_embeddings()
    m = EmbeddingMetric()
    with forbid_device_waits():
        m.accumulate({"labels": labels}, {"embeddings": emb})
    got = m.calculate()
    assert got.pop("nonfinite_rows") == 2
    assert set(got) == {"pos_sim", "pos_sim_min", "pos_sim_max", "neg_sim", "margin", "in_batch_accuracy"}
    assert all(math.isnan(v) for v in got.values()), got
    # NaN in rows no statistic uses changes nothing and is not counted (it used to poison neg_sim)
    g = torch.Generator().manual_seed(51)
    emb = torch.randn(9, 5, generator=g)
    want = _ref_embedding(emb, labels)
    emb[4] = NAN
    assert_results_close(EmbeddingMetric().accumulate({"labels": labels}, {"embeddings": emb}).calculate(),
                         want, rel=1e-12)


def test_embedding_loss_follows_the_policy_as_loss_metric_does():
    emb, labels, _ = _poisoned_embeddings()
    clean = torch.randn(9, 5, generator=torch.Generator().manual_seed(52))
    for policy in ("skip", "propagate"):
        m = EmbeddingMetric(nan_policy=policy)
        with forbid_device_waits():
            m.accumulate({"labels": labels}, {"embeddings": clean, "loss": torch.tensor(NAN)})
            m.accumulate({"labels": labels}, {"embeddings": clean, "loss": [torch.tensor(2.0), INF]})
        got = m.calculate()
        assert got["loss_nonfinite"] == 2
        if policy == "skip":
            assert got["loss"] == 2.0
        else:
            assert math.isnan(got["loss"])


# --------------------------------------------------------------------------- CompletionRewardMetric
def _stats(vals):
    import statistics
    return statistics.fmean(vals), statistics.stdev(vals)


def test_reward_skip_is_the_default_and_counts():
    a = [1.0, NAN, 3.0, INF, None, 2.0, 0.5, 0.5]
    b = [0.0, 1.0, -INF, 1.0, 2.0, 2.0, 1.0, 1.0]
    m = CompletionRewardMetric(num_generations=2)
    assert m.nan_policy == "skip"
    with forbid_device_waits():
        m.accumulate(rewards={"a": torch.tensor([NAN if v is None else v for v in a], dtype=torch.float64), "b": b})
    got = m.calculate()
    ma, sa = _stats([1.0, 3.0, 2.0, 0.5, 0.5])
    mb, sb = _stats([0.0, 1.0, 1.0, 2.0, 2.0, 1.0, 1.0])
    # totals with non-finite rewards as 0 (TRL's nansum): [1, 1], [0, 1], [2, 4], [1.5, 1.5]
    want = {"train/a_reward": ma, "train/a_reward_std": sa, "train/b_reward": mb, "train/b_reward_std": sb,
            "train/frac_reward_zero_std": 0.5, "train/nonfinite_rewards": 4}
    assert_results_close(got, want, rel=1e-12)
    clean = CompletionRewardMetric().accumulate(rewards={"a": [1.0, 2.0]}).calculate()
    assert "train/nonfinite_rewards" not in clean


def test_reward_skip_named_zero_std_reward_leaves_non_finite_out_of_the_group():
    m = CompletionRewardMetric(num_generations=3, zero_std_reward="a")
    m.accumulate(rewards={"a": [1.0, NAN, 1.0, 2.0, 3.0, INF]})
    assert m.calculate()["train/frac_reward_zero_std"] == 0.5  # group 1: {1, 1}; group 2: {2, 3}
    m = CompletionRewardMetric(zero_std_reward="a")
    m.accumulate(rewards={"a": [1.0, NAN, 1.0, 2.0, 3.0, INF]}, group_ids=[0, 0, 0, 1, 1, 1])
    assert m.calculate()["train/frac_reward_zero_std"] == 0.5


def test_reward_propagate_shows_nan_in_every_key_it_feeds():
    for kw in ({"num_generations": 2}, {}):
        m = CompletionRewardMetric(nan_policy="propagate", **kw)
        ids = None if kw else [0, 0, 1, 1]
        with forbid_device_waits():
            m.accumulate(rewards={"a": torch.tensor([1.0, 1.0, NAN, 2.0], dtype=torch.float64),
                                  "b": torch.tensor([1.0, 1.0, 1.0, 1.0], dtype=torch.float64)},
                         completion_lengths=[3, 4, 5, 6], group_ids=ids)
        got = m.calculate()
        assert math.isnan(got["train/a_reward"]) and math.isnan(got["train/a_reward_std"])
        assert math.isnan(got["train/frac_reward_zero_std"])
        assert got["train/b_reward"] == 1.0 and got["train/completion_length"] == 4.5
        assert got["train/nonfinite_rewards"] == 1
    one = CompletionRewardMetric(nan_policy="propagate").accumulate(rewards={"a": [INF]}).calculate()
    assert one["train/a_reward"] == INF and math.isnan(one["train/a_reward_std"])


def test_reward_shapes_other_than_n_or_n_by_1_are_errors():
    m = CompletionRewardMetric().accumulate(rewards={"a": [1.0, 2.0]})
    _rejected(m, ValueError, r"CompletionRewardMetric: rewards\['a'\] has shape \[2, 2\]; expected one value per "
                             r"completion: \[n\] or \[n, 1\]", rewards={"a": torch.ones(2, 2)})
    _rejected(m, ValueError, r"rewards\['a'\] has shape \[2, 3\]", rewards={"a": [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]})
    _rejected(m, ValueError, r"completion_lengths has shape \[2, 4\]", completion_lengths=torch.ones(2, 4))
    _rejected(m, ValueError, r"got both completion_lengths and completions",
              completion_lengths=[1, 2], completions=["a", "b"])
    col = CompletionRewardMetric().accumulate(rewards={"a": torch.tensor([[1.0], [3.0]])}).calculate()
    assert col == CompletionRewardMetric().accumulate(rewards={"a": [1.0, 3.0]}).calculate()


# --------------------------------------------------------------------------- clear errors
def test_rl_logps_without_inputs_are_errors():
    b = make_rl_batch(60)
    for cls in (GRPOMetric, GSPOMetric, DPOMetric):
        m = cls().accumulate({"labels": b["labels"]}, {"logps": b["logps"]})
        _rejected(m, ValueError, rf"{cls.__name__}: got outputs\['logps'\] but no inputs 'labels' or "
                                 "'completion_mask'.*inputs is None",
                  None, {"logps": b["logps"]})
        _rejected(m, ValueError, "but no inputs 'labels' or 'completion_mask'", None, [{"logps": b["logps"]}])
        assert cls().accumulate([], []).calculate() == {}        # a non-last pipeline stage
        assert cls().accumulate({"labels": b["labels"]}, None).calculate() == {}
    m = DPOMetric()
    _rejected(m, ValueError, r"DPOMetric: chosen outputs\['logps'\] given but the inputs of chosen= is None",
              chosen=(None, {"logps": b["logps"][0::2]}), rejected=({"labels": b["labels"][1::2]},
                                                                    {"logps": b["logps"][1::2]}))
    # the pre-summed form needs no inputs
    pre = DPOMetric().accumulate(None, {"chosen_logps": torch.tensor([-1.0]), "rejected_logps": torch.tensor([-2.0])})
    assert pre.calculate() == {"logps/chosen": -1.0, "logps/rejected": -2.0}


def test_rl_ignored_arguments_are_errors():
    b = make_rl_batch(61)
    lab, lp = b["labels"], b["logps"]
    g = GRPOMetric().accumulate({"labels": lab}, {"logps": lp})
    _rejected(g, ValueError, r"GRPOMetric: ref_outputs must be a dict with 'logps'.*got \['logits'\]",
              {"labels": lab}, {"logps": lp}, ref_outputs={"logits": lp})
    _rejected(g, ValueError, "GRPOMetric: got both ref_logps= and ref_outputs=",
              {"labels": lab}, {"logps": lp}, ref_logps=b["ref"], ref_outputs={"logps": b["ref"]})
    _rejected(g, ValueError, r"GRPOMetric: no outputs\['logps'\], but the outputs hold 'logp'.*did you mean 'logps'",
              {"labels": lab}, {"logp": lp})
    d = DPOMetric().accumulate({"labels": lab}, {"logps": lp})
    _rejected(d, ValueError, r"DPOMetric: no outputs\['logps'\], but the outputs hold 'logp'.*did you mean 'logps'",
              {"labels": lab}, {"logp": lp})
    _rejected(d, ValueError, r"DPOMetric: reference outputs for outputs of microbatch 0 have no 'logps'",
              {"labels": lab}, {"logps": lp}, ref_outputs={"logp": b["ref"]})
    _rejected(d, ValueError, r"DPOMetric: got keyword 'ref_chosen' but no keyword 'chosen'",
              {"labels": lab}, {"logps": lp}, ref_chosen={"logps": b["ref"][0::2]})
    _rejected(d, ValueError, r"DPOMetric: got chosen=/rejected= and also inputs/outputs",
              {"labels": lab}, {"logps": lp}, chosen=({"labels": lab[0::2]}, {"logps": lp[0::2]}),
              rejected=({"labels": lab[1::2]}, {"logps": lp[1::2]}))
    _rejected(d, ValueError, r"DPOMetric: got outputs\['rejected_logps'\] but no outputs\['chosen_logps'\]",
              None, {"rejected_logps": torch.tensor([-1.0])})


def test_dpo_empty_batch_is_a_no_op():
    b = make_rl_batch(62)
    m = DPOMetric().accumulate({"labels": b["labels"]}, {"logps": b["logps"]}, ref_outputs={"logps": b["ref"]})
    before = m.state_dict()
    empty = torch.zeros(0, 8, dtype=torch.long)
    with forbid_device_waits():
        m.accumulate({"labels": empty}, {"logps": torch.zeros(0, 8)}, ref_outputs={"logps": torch.zeros(0, 8)})
        m.accumulate({"labels": empty}, {"logps": torch.zeros(0, 8)})
        m.accumulate(chosen=({"labels": empty}, {"logps": torch.zeros(0, 8)}),
                     rejected=({"labels": empty}, {"logps": torch.zeros(0, 8)}))
        m.accumulate([], [])
    assert not state_dict_differences(before, m.state_dict())
    assert_results_close(m.calculate(), ref_dpo(b), rel=1e-10)
    assert DPOMetric().accumulate({"labels": empty}, {"logps": torch.zeros(0, 8)}).calculate() == {}


def test_collection_of_every_metric_has_distinct_nonfinite_keys():
    b = make_rl_batch(63)
    lab = b["labels"]
    lp = torch.where(lab != -100, b["logps"], 0.0)
    lp[2, (lab[2] != -100).nonzero()[0, 0]] = NAN
    emb = torch.randn(lab.shape[0], 4)
    emb[1, 0] = NAN
    # Loss and Embedding share Twinkle's 'loss' key, so they go into two list collections
    for first, key in ((LossMetric(), "loss_nonfinite"), (EmbeddingMetric(), "nonfinite_rows")):
        ms = [first, GRPOMetric(), DPOMetric(), CompletionRewardMetric()]
        coll = MetricCollection(ms)
        coll.accumulate({"labels": lab}, {"logps": lp}, rewards=[1.0, NAN])
        if isinstance(first, LossMetric):
            first.accumulate(None, {"loss": torch.tensor(NAN)})
        else:
            first.accumulate({"labels": torch.tensor([1] + [0] * 11)}, {"embeddings": emb})
        got = coll.calculate()
        assert {k: got[k] for k in got if "nonfinite" in k} == {
            key: 1, "train/nonfinite_tokens": 1, "logps/nonfinite_pairs": 1, "train/nonfinite_rewards": 1}
