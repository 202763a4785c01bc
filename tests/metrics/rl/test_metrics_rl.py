"""Single-process tests of CompletionRewardMetric, DPOMetric and the GRPO family."""
import math
import random
import statistics

import pytest
import torch

from tests.rlref import make_rl_batch, ragged, ref_dpo, ref_entropy, ref_grpo, ref_rewards
from twinkle_metrics import CISPOMetric, CompletionRewardMetric, DPOMetric, GRPOMetric, GSPOMetric, MetricCollection
from twinkle_metrics.testing import assert_results_close, forbid_device_waits

REL = 1e-10


# --------------------------------------------------------------------------- rewards
def _reward_data(seed, n=24):
    rng = random.Random(seed)
    acc = [float(rng.choice([0, 1])) for _ in range(n)]
    fmt = [rng.gauss(0.5, 0.2) for _ in range(n)]
    for i in range(0, 8):  # a few prompt groups of 4 with equal totals
        acc[i], fmt[i] = 1.0, 0.25
    lengths = [rng.randint(1, 20) for _ in range(n)]
    return {"accuracy": acc, "format": fmt}, lengths


def test_reward_metric_matches_statistics_over_calls():
    rewards, lengths = _reward_data(0)
    m = CompletionRewardMetric(reward_names=["accuracy", "format"], max_completion_length=16,
                               num_generations=4)
    times = [1.0, 3.0, 2.5]
    for k, (a, b) in enumerate([(0, 8), (8, 12), (12, 24)]):
        with forbid_device_waits():
            m.accumulate(rewards={n: torch.tensor(v[a:b], dtype=torch.float64) for n, v in rewards.items()},
                         completion_lengths=torch.tensor(lengths[a:b]), generate_time=times[k],
                         weight_sync_time=0.5)
    want = ref_rewards(rewards, lengths, 16, 4, times)
    want["profiling/Time taken: move_model_to_sampler"] = 0.5
    assert_results_close(m.calculate(), want, rel=REL)
    assert m.calculate() == {}  # reset; nothing seen gives {} (Twinkle: -1.0)


def test_reward_std_exact_with_large_offset():
    rng = random.Random(1)
    offset = 1e8
    vals = [offset + rng.gauss(0, 1) for _ in range(4000)]
    m = CompletionRewardMetric()
    for i in range(0, 4000, 250):
        m.accumulate(rewards={"r": vals[i:i + 250]})
    got = m.calculate()
    want_std = statistics.stdev(vals)  # exact (Fraction-based) reference
    assert math.isclose(got["train/r_reward_std"], want_std, rel_tol=1e-6)
    assert math.isclose(got["train/r_reward"], statistics.fmean(vals), rel_tol=1e-14)
    # the same data through (n, sum, sum of squares) in float64 is far off: the test can fail
    t = torch.tensor(vals, dtype=torch.float64)
    naive = math.sqrt(max(float((t * t).sum() - t.sum() ** 2 / len(vals)), 0.0) / (len(vals) - 1))
    assert not math.isclose(naive, want_std, rel_tol=1e-2)


def test_reward_plain_list_nan_completions_and_group_ids():
    m = CompletionRewardMetric()
    texts = ["abc", "hello", "", "xy"]
    m.accumulate(rewards=[1.0, float("nan"), 3.0, None], completions=texts,
                 generation_time=2.0, group_ids=[7, 3, 7, 3])
    got = m.calculate()
    assert got["train/reward_reward"] == 2.0
    assert math.isclose(got["train/reward_reward_std"], statistics.stdev([1.0, 3.0]))
    assert got["train/completion_length"] == statistics.fmean(len(t) for t in texts)  # characters
    assert got["profiling/Time taken: generate"] == 2.0
    # TRL sums reward functions with nansum: the missing rewards of group 3 total 0 each,
    # so that group has zero std (group 7: 1 and 3 does not)
    assert got["train/frac_reward_zero_std"] == _trl_frac_zero_std({"r": [1.0, 3.0, float("nan"), None]}, 2) == 0.5


def test_reward_group_ids_any_order_match_reference():
    rng = random.Random(5)
    ids = [g for g in range(6) for _ in range(4)]
    rng.shuffle(ids)
    vals = [1.0 if ids[i] % 3 == 0 else rng.random() for i in range(24)]
    m = CompletionRewardMetric()
    with forbid_device_waits():
        m.accumulate(rewards={"r": torch.tensor(vals, dtype=torch.float64)}, group_ids=torch.tensor(ids))
    groups = {}
    for g, v in zip(ids, vals):
        groups.setdefault(g, []).append(v)
    want = sum(1 for vs in groups.values() if max(vs) == min(vs)) / len(groups)
    assert m.calculate()["train/frac_reward_zero_std"] == want == 2 / 6


def test_reward_dynamic_names_order_independent():
    a, b = CompletionRewardMetric(), CompletionRewardMetric()
    a.accumulate(rewards={"z": [1.0]}).accumulate(rewards={"a": [2.0]})
    b.accumulate(rewards={"a": [2.0], "z": [1.0]})
    assert a.reward_names == b.reward_names == ["a", "z"]
    assert a.calculate() == b.calculate()


def test_reward_name_with_the_slice_separator_is_refused_not_dropped():
    """'@' separates a state from its slice in state names: a reward called 'a@b' would be read
    as slice 'b' of reward 'a' and vanish from the results; it raises instead, nothing added."""
    m = CompletionRewardMetric()
    m.accumulate(rewards={"ok": [1.0]})
    with pytest.raises(ValueError, match=r"CompletionRewardMetric: reward name 'a@b' contains '@'.*'a_b'"):
        m.accumulate(rewards={"a@b": [1.0, 3.0], "ok": [5.0]})
    assert m.calculate()["train/ok_reward"] == 1.0  # the refused call added nothing
    with pytest.raises(ValueError, match="contains '@'"):
        CompletionRewardMetric(reward_names=["a@b"])


def test_reward_errors():
    m = CompletionRewardMetric(reward_names=["acc"], num_generations=4)
    with pytest.raises(ValueError, match=r"CompletionRewardMetric: rewards \['fmt'\] are not in reward_names"):
        m.accumulate(rewards={"fmt": [1.0]})
    with pytest.raises(ValueError, match="6 rewards are not a multiple of num_generations=4"):
        m.accumulate(rewards={"acc": [1.0] * 6})
    with pytest.raises(TypeError, match=r"rewards\['acc'\] must be a number"):
        m.accumulate(rewards={"acc": "bad"})
    with pytest.raises(ValueError, match="both generate_time and generation_time"):
        m.accumulate(generate_time=1.0, generation_time=2.0)
    with pytest.raises(ValueError, match="group_ids has 2 entries but there are 4"):
        CompletionRewardMetric().accumulate(rewards=[1.0, 2, 3, 4], group_ids=[0, 1])
    assert m.calculate() == {}  # failed calls left nothing behind


# --------------------------------------------------------------------------- DPO
def test_dpo_interleaved_matches_reference_and_forbids_waits():
    b = make_rl_batch(0)
    m = DPOMetric(beta=0.1)
    with forbid_device_waits():
        m.accumulate({"labels": b["labels"]}, {"logps": b["logps"]}, ref_outputs={"logps": b["ref"]})
    got = m.calculate()
    assert_results_close(got, ref_dpo(b), rel=REL)
    assert 0.0 <= got["rewards/accuracies"] <= 1.0


def test_dpo_microbatches_separate_and_presummed_agree():
    b = make_rl_batch(1)
    want = ref_dpo(b, beta=0.5)
    lab, lp, ref = b["labels"], b["logps"], b["ref"]
    # pairs split across odd-sized microbatches
    feats = [{"labels": lab[:3]}, {"labels": lab[3:]}]
    got = DPOMetric(beta=0.5).accumulate(feats, {"logps": [lp[:3], lp[3:]]},
                                         ref_outputs={"logps": ref}).calculate()
    assert_results_close(got, want, rel=REL)
    sep = DPOMetric(beta=0.5)
    with forbid_device_waits():
        sep.accumulate(chosen=({"labels": lab[0::2]}, {"logps": lp[0::2]}),
                       rejected=({"completion_mask": lab[1::2] != -100}, {"logps": lp[1::2]}),
                       ref_chosen={"logps": ref[0::2]}, ref_rejected={"logps": ref[1::2]})
    assert_results_close(sep.calculate(), want, rel=REL)
    seq = torch.where(lab != -100, lp, 0.0).sum(1)
    rseq = torch.where(lab != -100, ref, 0.0).sum(1)
    pre = DPOMetric(beta=0.5).accumulate(None, {"chosen_logps": seq[0::2], "rejected_logps": seq[1::2],
                                               "ref_chosen_logps": rseq[0::2],
                                               "ref_rejected_logps": rseq[1::2]})
    assert_results_close(pre.calculate(), want, rel=REL)


def test_dpo_without_ref_and_errors():
    b = make_rl_batch(2)
    got = DPOMetric().accumulate({"labels": b["labels"]}, {"logps": b["logps"]}).calculate()
    assert set(got) == {"logps/chosen", "logps/rejected"}
    m = DPOMetric()
    with pytest.raises(ValueError, match="DPOMetric: the batch has 11 sequences"):
        m.accumulate({"labels": b["labels"][:11]}, {"logps": b["logps"][:11]})
    with pytest.raises(ValueError, match="DPOMetric: chosen has 6 sequences"):
        m.accumulate(chosen=({"labels": b["labels"][:6]}, {"logps": b["logps"][:6]}),
                     rejected=({"labels": b["labels"][:5]}, {"logps": b["logps"][:5]}))
    with pytest.raises(ValueError, match=r"reference logps for outputs have shape \[12, 3\]"):
        m.accumulate({"labels": b["labels"]}, {"logps": b["logps"]}, ref_outputs={"logps": b["ref"][:, :3]})
    with pytest.raises(ValueError, match="got keyword 'chosen' but no keyword 'rejected'"):
        m.accumulate(chosen=({"labels": b["labels"]}, {"logps": b["logps"]}))
    assert m.calculate() == {}


# --------------------------------------------------------------------------- GRPO family
@pytest.mark.parametrize("cls,kind", [(GRPOMetric, "grpo"), (GSPOMetric, "gspo"), (CISPOMetric, "cispo")])
def test_grpo_family_matches_reference(cls, kind):
    b = make_rl_batch(3)
    eps, eps_high = (0.05, 0.08) if kind == "gspo" else (0.2, 0.28)  # sequence ratios stay near 1
    want = ref_grpo(b, kind, eps=eps, eps_high=eps_high, top_k=5)
    m = cls(epsilon=eps, epsilon_high=eps_high, top_k_kl=5)
    with forbid_device_waits():
        m.accumulate({"labels": b["labels"], "position_ids": b["pos"]}, {"logps": b["logps"]},
                     old_logps=b["old"], advantages=b["adv"], ref_logps=b["ref"])
    got = m.calculate()
    assert_results_close(got, want, rel=1e-9)
    assert 0 < got["train/clip_ratio"] < 1


def _rounded_to_float32(b):
    """The batch with float values rounded to float32 (kept float64, for the references)."""
    return {k: v.float().double() if v.is_floating_point() else v for k, v in b.items()}


@pytest.mark.parametrize("cls,kind", [(GRPOMetric, "grpo"), (GSPOMetric, "gspo"), (CISPOMetric, "cispo")])
def test_grpo_family_float32_inputs_exact(cls, kind):
    # Per-token work in float32 is only masking (exact) and sums accumulate in float64;
    # log-ratios and k3 are float64. So float32 inputs match the float64 reference on the
    # same (rounded) values at the float64 tolerance.
    b = _rounded_to_float32(make_rl_batch(21))
    eps, eps_high = (0.05, 0.08) if kind == "gspo" else (0.2, 0.28)
    want = ref_grpo(b, kind, eps=eps, eps_high=eps_high, top_k=5)
    m = cls(epsilon=eps, epsilon_high=eps_high, top_k_kl=5)
    with forbid_device_waits():
        m.accumulate({"labels": b["labels"], "position_ids": b["pos"]}, {"logps": b["logps"].float()},
                     old_logps=b["old"].float(), advantages=b["adv"].float(), ref_logps=b["ref"].float())
    assert_results_close(m.calculate(), want, rel=1e-9)


def test_grpo_small_log_ratios_keep_relative_precision():
    # On-policy steps have |d| ~ 1e-4: k3 ~ d^2/2 must not lose d's low bits (float32 k3 would
    # be off by ~1e-3 relative here).
    b = make_rl_batch(22)
    b["old"] = b["logps"] + 1e-4 * torch.randn(b["logps"].shape, dtype=torch.float64,
                                               generator=torch.Generator().manual_seed(0))
    b = _rounded_to_float32(b)
    want = ref_grpo(b)
    got = GRPOMetric().accumulate({"labels": b["labels"]}, {"logps": b["logps"].float()},
                                  old_logps=b["old"].float(), advantages=b["adv"]).calculate()
    for key in ("train/approx_kl", "train/token_kl_max", "train/logp_diff_mean", "train/ratio_mean"):
        assert math.isclose(got[key], want[key], rel_tol=1e-8), key


@pytest.mark.parametrize("eps,eps_high", [(0.0, 0.0), (-0.05, 0.1), (0.1, -0.05), (1.5, 0.3)])
def test_grpo_clip_bounds_edge_cases(eps, eps_high):
    # epsilon 0, negative (r = 1 would count as clipped, so the gate applies) and >= 1
    b = make_rl_batch(23)
    lab = b["labels"]
    for cls, kind in ((GRPOMetric, "grpo"), (CISPOMetric, "cispo")):
        want = ref_grpo(b, kind, eps=eps, eps_high=eps_high)
        for adv in (b["adv"], [float(a) for a in b["adv"]], ragged(b["adv"][:, None].expand(-1, 8), lab)):
            got = cls(epsilon=eps, epsilon_high=eps_high).accumulate(
                {"labels": lab}, {"logps": b["logps"]}, old_logps=ragged(b["old"], lab), advantages=adv,
                ref_logps=b["ref"]).calculate()
            assert_results_close(got, want, rel=1e-9)


def test_grpo_side_input_forms_agree():
    b = make_rl_batch(4)
    lab, lp = b["labels"], b["logps"]
    want = ref_grpo(b, top_k=4)
    feats = [{"labels": lab[:5]}, {"labels": lab[5:]}]
    outs = {"logps": [lp[:5], lp[5:]]}
    forms = [
        dict(old_logps=b["old"], advantages=b["adv"], ref_logps=b["ref"]),                 # aligned
        dict(old_logps=[b["old"][:5], b["old"][5:]], advantages=[b["adv"][:5], b["adv"][5:]],
             ref_outputs={"logps": [b["ref"][:5], b["ref"][5:]]}),                        # per mb
        dict(old_logps=ragged(b["old"], lab), advantages=[float(a) for a in b["adv"]],
             ref_logps=ragged(b["ref"], lab)),                                            # per seq
        dict(old_logps=ragged(b["old"], lab), advantages=b["adv"][:, None].expand(-1, 8).clone(),
             ref_logps=b["ref"]),                                                         # per token adv
    ]
    for kw in forms:
        m = GRPOMetric(top_k_kl=4)
        with forbid_device_waits():
            m.accumulate(feats, outs, **kw)
        assert_results_close(m.calculate(), want, rel=1e-9)


def test_grpo_denominators_count_only_tokens_with_old():
    b = make_rl_batch(5)
    lab = b["labels"]
    old_list = ragged(b["old"], lab)
    old_list = [o[: len(o) // 2] for o in old_list]  # only the first half of each row has old logps
    has = torch.zeros_like(lab, dtype=torch.bool)
    for i in range(lab.shape[0]):
        idx = [t for t in range(lab.shape[1]) if lab[i, t] != -100][: len(old_list[i])]
        has[i, idx] = True
    want = ref_grpo(b, old_mask=has)
    m = GRPOMetric().accumulate({"labels": lab}, {"logps": b["logps"]}, old_logps=old_list,
                                advantages=b["adv"], ref_logps=b["ref"])
    got = m.calculate()
    for key in ("train/mean_old_logp", "train/approx_kl", "train/logp_diff_mean", "train/ratio_mean",
                "train/clip_ratio", "train/token_kl_max", "train/mean_new_logp"):
        assert math.isclose(got[key], want[key], rel_tol=1e-9), key


def test_grpo_temperature_does_not_rescale_logps():
    b = make_rl_batch(6)
    kw = dict(old_logps=b["old"], advantages=b["adv"])
    a = GRPOMetric(temperature=0.7).accumulate({"labels": b["labels"]}, {"logps": b["logps"]}, **kw).calculate()
    c = GRPOMetric().accumulate({"labels": b["labels"]}, {"logps": b["logps"]}, **kw).calculate()
    assert_results_close(a, c, rel=0)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_entropy_from_logits_chunked_matches_full_softmax(temperature):
    b = make_rl_batch(7)
    want = ref_entropy(b["logits"], b["labels"], temperature)
    m = GRPOMetric(entropy_from_logits=True, temperature=temperature, entropy_chunk_size=5)
    feats = [{"labels": b["labels"][:7]}, {"labels": b["labels"][7:]}]
    with forbid_device_waits():
        m.accumulate(feats, {"logps": b["logps"], "logits": b["logits"]})
    assert math.isclose(m.calculate()["train/entropy"], want, rel_tol=1e-10)
    # float32 logits (the common case) within 1e-5
    m32 = GRPOMetric(entropy_from_logits=True, temperature=temperature, entropy_chunk_size=7)
    m32.accumulate({"labels": b["labels"]}, {"logps": b["logps"], "logits": b["logits"].float()})
    assert math.isclose(m32.calculate()["train/entropy"], want, rel_tol=1e-5)
    # without the opt-in, logits are ignored; given entropies win
    assert "train/entropy" not in GRPOMetric().accumulate(
        {"labels": b["labels"]}, {"logps": b["logps"], "logits": b["logits"]}).calculate()
    ent = torch.full_like(b["logps"], 2.0)
    got = GRPOMetric(entropy_from_logits=True).accumulate(
        {"labels": b["labels"]}, {"logps": b["logps"], "logits": b["logits"], "entropies": ent}).calculate()
    assert got["train/entropy"] == 2.0


@pytest.mark.parametrize("kw", [
    dict(entropy_chunk_bytes=1),                          # budget below one token's row: 1 row per chunk
    dict(entropy_chunk_bytes=3 * 11 * 8 + 5),             # 3 rows of float64 logits
    dict(entropy_chunk_size=5),                           # token cap alone (the old meaning)
    dict(entropy_chunk_size=2, entropy_chunk_bytes=10 ** 9),  # the token cap wins
    {},                                                   # default: 1/64 of the logits, >= 1 MiB
])
def test_entropy_from_logits_any_chunking(kw):
    b = make_rl_batch(12)
    want = ref_entropy(b["logits"], b["labels"], 0.7)
    # logits one position longer than the labels: the [:, :s] slice is strided
    longer = torch.cat([b["logits"], b["logits"][:, :1]], 1)
    for logits, rel in ((b["logits"], 1e-10), (longer, 1e-10), (b["logits"].float(), 1e-6)):
        m = GRPOMetric(entropy_from_logits=True, temperature=0.7, **kw)
        with forbid_device_waits():
            m.accumulate([{"labels": b["labels"][:5]}, {"labels": b["labels"][5:]}],
                         [{"logps": b["logps"][:5], "logits": logits[:5]},
                          {"logps": b["logps"][5:], "logits": logits[5:]}])
        assert math.isclose(m.calculate()["train/entropy"], want, rel_tol=rel), (kw, logits.dtype)


def test_entropy_from_logits_masked_vocab_entries():
    b = make_rl_batch(13)
    want = ref_entropy(b["logits"][..., :-2], b["labels"])  # -inf logits are impossible tokens
    z = b["logits"].clone()
    z[..., -2:] = -math.inf
    for kw in (dict(entropy_chunk_bytes=1), {}):
        got = GRPOMetric(entropy_from_logits=True, **kw).accumulate(
            {"labels": b["labels"]}, {"logps": b["logps"], "logits": z}).calculate()
        assert math.isclose(got["train/entropy"], want, rel_tol=1e-10)


def test_entropy_chunk_arguments_validated():
    for kw in (dict(entropy_chunk_size=0), dict(entropy_chunk_bytes=0), dict(entropy_chunk_size=2.5)):
        with pytest.raises(ValueError, match="GRPOMetric: entropy_chunk_"):
            GRPOMetric(**kw)


def test_grpo_in_collection_ignores_foreign_kwargs():
    b = make_rl_batch(8)
    coll = MetricCollection({"grpo": GRPOMetric(), "dpo": DPOMetric(), "": CompletionRewardMetric()})
    coll.accumulate({"labels": b["labels"]}, {"logps": b["logps"]}, old_logps=b["old"], rewards=[1.0, 2.0])
    got = coll.calculate()
    # each metric took only its own keywords: GRPO without advantages or ref, DPO without
    # ref_outputs, the rewards as one unnamed reward; the values are the references' exactly
    grpo_keys = ("mean_new_logp", "policy_confidence", "mean_old_logp", "logp_diff_mean", "approx_kl",
                 "token_kl_max", "token_ratio_max", "ratio_mean", "ratio_min", "ratio_max")
    want = {f"grpo/train/{k}": ref_grpo(b)[f"train/{k}"] for k in grpo_keys}
    want.update({f"dpo/logps/{k}": ref_dpo(b)[f"logps/{k}"] for k in ("chosen", "rejected")})
    want.update({"train/reward_reward": 1.5, "train/reward_reward_std": math.sqrt(0.5)})
    assert_results_close(got, want, rel=1e-12)


def test_grpo_errors_name_metric_and_field():
    b = make_rl_batch(9)
    m = GSPOMetric()
    with pytest.raises(ValueError, match=r"GSPOMetric: got outputs\['entropies'\] but no outputs\['logps'\]"):
        m.accumulate({"labels": b["labels"]}, {"entropies": b["logps"]})
    with pytest.raises(ValueError, match=r"GSPOMetric: old_logps has 5 entries; expected one per "
                                         r"microbatch \(1\) or one per sequence \(12\)"):
        m.accumulate({"labels": b["labels"]}, {"logps": b["logps"]}, old_logps=[b["old"][0]] * 5)
    with pytest.raises(ValueError, match=r"GSPOMetric: advantages has shape \[11\]"):
        m.accumulate({"labels": b["labels"]}, {"logps": b["logps"]}, advantages=b["adv"][:11])
    with pytest.raises(ValueError, match=r"GSPOMetric: outputs\['logps'\] has shape \[11, 8\]"):
        m.accumulate({"labels": b["labels"]}, [{"logps": b["logps"][:11]}])
    with pytest.raises(ValueError, match="top_k_kl must be an int >= 0"):
        GRPOMetric(top_k_kl=-1)
    assert m.calculate() == {}


# --------------------------------------------------------------------------- review fixes
def _small_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    lab = torch.randint(0, 9, (2, 6), generator=g)
    lab[:, 0] = -100
    lab[0, :3] = -100
    lp = torch.randn(2, 6, generator=g, dtype=torch.float64) - 1
    old = lp + 0.5 * torch.randn(2, 6, generator=g, dtype=torch.float64)
    ref = lp + 0.3 * torch.randn(2, 6, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    return dict(labels=lab, logps=lp, old=old, ref=ref, adv=adv, pos=torch.arange(6).expand(2, 6))


def test_grpo_advantages_b_by_1_mean_one_value_per_sequence():
    b = _small_batch()
    want = ref_grpo(b)
    for adv in (b["adv"], b["adv"][:, None]):  # TRL's advantages.unsqueeze(1)
        got = GRPOMetric().accumulate({"labels": b["labels"]}, {"logps": b["logps"]},
                                      old_logps=b["old"], advantages=adv, ref_logps=b["ref"]).calculate()
        assert_results_close(got, want, rel=1e-12)


def test_grpo_one_sequence_microbatches_read_like_one_call():
    # micro-batch size 1: per-microbatch and per-sequence lists coincide in length; both
    # readings must give the one-call result, for advantages and for old/ref log-probs.
    b = _small_batch(1)
    lab, lp, old, adv = b["labels"], b["logps"], b["old"], b["adv"]
    want = ref_grpo(b)
    feats = [{"labels": lab[:1]}, {"labels": lab[1:]}]
    outs = {"logps": [lp[:1], lp[1:]]}
    rag_old, rag_ref = ragged(old, lab), ragged(b["ref"], lab)
    forms = [
        dict(advantages=[adv[:1], adv[1:]], old_logps=[old[:1], old[1:]], ref_logps=[b["ref"][:1], b["ref"][1:]]),
        dict(advantages=[adv[:1, None], adv[1:, None]], old_logps=rag_old, ref_logps=rag_ref),
        dict(advantages=[[float(adv[0])], [float(adv[1])]], old_logps=[r.tolist() for r in rag_old],
             ref_logps=rag_ref),
        dict(advantages=[float(a) for a in adv], old_logps=[[r] for r in rag_old], ref_logps=b["ref"]),
        dict(advantages=adv, old_logps=old, ref_logps=rag_ref),
    ]
    for kw in forms:
        m = GRPOMetric()
        with forbid_device_waits():
            m.accumulate(feats, outs, **kw)
        assert_results_close(m.calculate(), want, rel=1e-12)
    # a 1-element entry of old_logps is one token's value (the first valid token), not a
    # value for every token of the sequence
    one = [o[:1] for o in rag_old]
    has = torch.zeros_like(lab, dtype=torch.bool)
    for i in range(2):
        has[i, int((lab[i] != -100).int().argmax())] = True
    want1 = ref_grpo(b, old_mask=has)
    got1 = GRPOMetric().accumulate(feats, outs, old_logps=one, advantages=adv).calculate()
    for key in ("train/mean_old_logp", "train/approx_kl", "train/logp_diff_mean", "train/ratio_mean",
                "train/clip_ratio", "train/token_kl_max", "train/mean_new_logp"):
        assert math.isclose(got1[key], want1[key], rel_tol=1e-12), key


def test_grpo_single_1d_sequence_takes_1d_side_inputs():
    b = _small_batch(2)
    one = {k: (v[1:] if torch.is_tensor(v) else v) for k, v in b.items()}
    want = ref_grpo(one)
    got = GRPOMetric().accumulate({"labels": b["labels"][1]}, {"logps": b["logps"][1]},
                                  old_logps=b["old"][1], advantages=b["adv"][1], ref_logps=b["ref"][1]).calculate()
    assert_results_close(got, want, rel=1e-12)


def test_python_float_logps_stay_float64():
    got = DPOMetric().accumulate(None, {"chosen_logps": [-3.3], "rejected_logps": [-1.1],
                                        "ref_chosen_logps": [-2.2], "ref_rejected_logps": [0.0]}).calculate()
    assert got["logps/chosen"] == -3.3 and got["logps/rejected"] == -1.1
    assert math.isclose(got["rewards/chosen"], 0.1 * (-3.3 - -2.2), rel_tol=1e-15)
    lps = [[-0.3, -1.1, -2.7], [-0.7, -0.1, -1.3]]
    labels = [[1, 2, 3], [-100, 4, 5]]
    got = GRPOMetric().accumulate({"labels": labels}, {"logps": lps}).calculate()
    assert got["train/mean_new_logp"] == (-0.3 - 1.1 - 2.7 - 0.1 - 1.3) / 5
    got = DPOMetric().accumulate({"labels": labels}, {"logps": lps}).calculate()
    assert got["logps/chosen"] == -0.3 + -1.1 + -2.7 and got["logps/rejected"] == -0.1 + -1.3


def test_bad_logps_name_metric_and_field():
    b = _small_batch(3)
    lab, lp = b["labels"], b["logps"]
    for cls in (GRPOMetric, DPOMetric):
        m = cls()
        with pytest.raises(ValueError, match=rf"{cls.__name__}: outputs\['logps'\] has shape \[2, 6, 1\]"):
            m.accumulate({"labels": lab}, {"logps": lp[..., None]})
        with pytest.raises(TypeError, match=rf"{cls.__name__}: outputs\['logps'\] must be"):
            m.accumulate({"labels": lab}, {"logps": "x"})
        with pytest.raises(TypeError, match=rf"{cls.__name__}: outputs\['logps'\] must be"):
            m.accumulate({"labels": lab}, {"logps": [[-1.0, -2.0], [-1.0]]})
        assert m.calculate() == {}
    with pytest.raises(ValueError, match=r"DPOMetric: chosen outputs\['logps'\] has shape \[2, 6, 1\]"):
        DPOMetric().accumulate(chosen=({"labels": lab}, {"logps": lp[..., None]}),
                               rejected=({"labels": lab}, {"logps": lp}))
    with pytest.raises(ValueError, match=r"GRPOMetric: old_logps has shape \[2\]"):
        GRPOMetric().accumulate({"labels": lab}, {"logps": lp}, old_logps=lp[:, 0])


def test_masked_nan_and_inf_do_not_poison():
    b = _small_batch(4)
    lab = b["labels"]
    want_g, want_d = ref_grpo(b), ref_dpo(b)
    for pad in (math.nan, -math.inf):
        p = {k: (torch.where(lab != -100, v, pad) if k in ("logps", "old", "ref") else v) for k, v in b.items()}
        adv = torch.where(lab != -100, b["adv"][:, None], pad)
        got = GRPOMetric().accumulate({"labels": lab}, {"logps": p["logps"], "entropies": p["logps"]},
                                      old_logps=p["old"], advantages=adv, ref_logps=p["ref"]).calculate()
        assert_results_close({k: v for k, v in got.items() if k != "train/entropy"}, want_g, rel=1e-12)
        assert math.isclose(got["train/entropy"], want_g["train/mean_new_logp"], rel_tol=1e-12)
        gs = GSPOMetric().accumulate({"labels": lab}, {"logps": p["logps"]}, old_logps=p["old"],
                                     advantages=adv).calculate()
        assert all(v == v for v in gs.values()), gs
        got = DPOMetric().accumulate({"labels": lab}, {"logps": p["logps"]},
                                     ref_outputs={"logps": p["ref"]}).calculate()
        assert_results_close(got, want_d, rel=1e-12)


def _trl_frac_zero_std(rewards, num_generations):
    # TRL: nansum over reward functions, per-group sample std, isclose(std, 0)
    total = [sum(0.0 if v is None or v != v else v for v in vals) for vals in zip(*rewards.values())]
    groups = [total[i:i + num_generations] for i in range(0, len(total), num_generations)]
    return sum(1 for g in groups if math.isclose(statistics.stdev(g), 0.0, abs_tol=1e-8)) / len(groups)


def test_reward_frac_zero_std_follows_trl_nansum():
    rewards = {"a": [1.0, None, 1.0, 1.0, 0.5, 0.5], "b": [1.0, 2.0, 0.0, 0.0, 0.1, 0.1 + 1e-12]}
    want = _trl_frac_zero_std(rewards, 2)
    m = CompletionRewardMetric(num_generations=2).accumulate(rewards=rewards)
    assert m.calculate()["train/frac_reward_zero_std"] == want == 1.0
    m = CompletionRewardMetric().accumulate(rewards=rewards, group_ids=[0, 0, 1, 1, 2, 2])
    assert m.calculate()["train/frac_reward_zero_std"] == want


def test_reward_string_group_ids_and_tensor_none_rewards():
    m = CompletionRewardMetric()
    with forbid_device_waits():
        m.accumulate(rewards={"a": [1.0, 0.0, 2.0, 2.0]}, group_ids=["p1", "p2", "p3", "p3"])
    assert m.calculate()["train/frac_reward_zero_std"] == 1.0
    m.accumulate(rewards={"a": [1.0, 0.0, 2.0]}, group_ids=["u", "u", "v"])
    assert m.calculate()["train/frac_reward_zero_std"] == 0.5
    got = CompletionRewardMetric().accumulate(rewards={"a": [torch.tensor(1.0), None, 3.0]}).calculate()
    assert got["train/a_reward"] == 2.0
    with pytest.raises(TypeError, match=r"CompletionRewardMetric: group_ids"):
        CompletionRewardMetric().accumulate(rewards={"a": [1.0, 0.0]}, group_ids=[[1], [2]])
    with pytest.raises(TypeError, match=r"CompletionRewardMetric: rewards\['a'\]"):
        CompletionRewardMetric().accumulate(rewards={"a": [torch.tensor(1.0), "x"]})


def test_reward_state_dict_with_dynamic_names_loads_into_fresh_metric():
    a = CompletionRewardMetric(num_generations=2)
    a.accumulate(rewards={"z": [1.0, 2.0], "b": [0.5, 0.5]}, completion_lengths=[3, 4])
    a.accumulate(rewards={"c": [4.0, 4.0]})
    fresh = CompletionRewardMetric(num_generations=2).load_state_dict(a.state_dict())
    assert fresh.reward_names == a.reward_names == ["b", "c", "z"]
    assert fresh.calculate() == a.calculate()
    with pytest.raises(ValueError, match="unexpected"):
        CompletionRewardMetric(reward_names=["b"], num_generations=2).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="saved by .*num_generations=2.* but this metric is .*num_generations=None"):
        CompletionRewardMetric().load_state_dict(a.state_dict())


def test_top_k_larger_than_the_batch():
    """top_k_kl above the number of tokens: the records are all the tokens there are."""
    b = make_rl_batch(21, n_seq=2, seq_len=3)
    b["labels"][0] = torch.tensor([3, 4, -100])  # a batch with fewer than 16 valid tokens
    want = ref_grpo(b, top_k=16)
    m = GRPOMetric(top_k_kl=16)
    with forbid_device_waits():
        m.accumulate({"labels": b["labels"], "position_ids": b["pos"]}, {"logps": b["logps"]},
                     old_logps=b["old"], advantages=b["adv"], ref_logps=b["ref"])
    got = m.calculate()
    assert_results_close(got, want, rel=1e-9)
    assert 0 < len(got["_high_kl_records"]) <= 5
