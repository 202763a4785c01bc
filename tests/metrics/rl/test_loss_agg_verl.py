"""verl 0.9.1's definitions, one process: every loss_agg_mode key against a replica of verl's
``agg_loss`` run on the whole batch and as verl runs it over 4 data-parallel ranks, and the
dual-clip and token-weighted clip fractions against verl's policy-loss comparisons
(``tests/rlref.py``: plain Python, written from verl's formulas)."""
import math

import pytest
import torch

from tests.refmetric import dp_shards
from tests.rlref import make_ppo_batch, make_rl_batch, verl_agg_loss, verl_agg_loss_over_dp, verl_clip_tokens
from twinkle_metrics import CISPOMetric, GRPOMetric, GSPOMetric, PPOMetric, RolloutMismatchMetric
from twinkle_metrics.core.metric import FINGERPRINT_KEY
from twinkle_metrics.kernels import dispatch
from twinkle_metrics.metrics.rl.policy.batch import Microbatch
from twinkle_metrics.metrics.rl.policy.sums import fuses
from twinkle_metrics.testing import forbid_device_waits

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
N_SEQ, SEQ_LEN = 10, 9
SHARDS = [list(r) for r in dp_shards(N_SEQ, 4)]  # 4 DP ranks, uneven


def _batch(seed=5, per_token_adv=False):
    b = make_rl_batch(seed, N_SEQ, SEQ_LEN)  # sequence 0 fully masked
    b["labels"][4, 1:] = -100  # a one-token sequence
    g = torch.Generator().manual_seed(seed)
    b["old"] = b["logps"] + 0.3 * torch.randn(N_SEQ, SEQ_LEN, generator=g, dtype=torch.float64)
    if per_token_adv:  # mixed signs inside a sequence (GAE-like)
        b["adv"] = torch.randn(N_SEQ, SEQ_LEN, generator=g, dtype=torch.float64)
    return b


def _rows(b):
    """The batch as Python rows: mask (0/1), and per token d, advantage, log-probs."""
    mask = [[float(b["labels"][i, t] != -100) for t in range(SEQ_LEN)] for i in range(N_SEQ)]
    lp = b["logps"].tolist()
    old = b["old"].tolist()
    adv = b["adv"].tolist() if b["adv"].dim() == 2 else [[a] * SEQ_LEN for a in b["adv"].tolist()]
    return mask, lp, old, adv


def _token_values(b, eps=0.2):
    """Each key's per-token values (full rows; the mask picks the counted ones)."""
    mask, lp, old, adv = _rows(b)
    ref = b["ref"].tolist()
    d = [[x - o for x, o in zip(lr, orow)] for lr, orow in zip(lp, old)]
    k3 = [[math.exp(x) - x - 1 for x in row] for row in d]
    ratio = [[math.exp(x) for x in row] for row in d]
    clip = [[float((math.exp(x) < 1 - eps and a < 0) or (math.exp(x) > 1 + eps and a > 0))
             for x, a in zip(dr, ar)] for dr, ar in zip(d, adv)]
    ref_kl = [[math.exp(r - x) - (r - x) - 1 for r, x in zip(rr, lr)] for rr, lr in zip(ref, lp)]
    return mask, {"train/approx_kl": k3, "train/ratio_mean": ratio, "train/clip_ratio": clip,
                  "train/logp_diff_mean": d, "train/mean_new_logp": lp, "train/advantage_mean": adv,
                  "train/ref_kl": ref_kl}


@pytest.mark.parametrize("mode,norm", [(mode, None) for mode in MODES] + [("seq-mean-token-sum-norm", 64.0)])
def test_every_mode_key_equals_verl_agg_loss_whole_and_over_four_dp_ranks(mode, norm):
    b = _batch()
    m = GRPOMetric(loss_agg_mode=mode, loss_agg_norm=norm)
    with forbid_device_waits():
        m.accumulate({"labels": b["labels"]}, {"logps": b["logps"]}, old_logps=b["old"], advantages=b["adv"],
                     ref_logps=b["ref"])
    got = m.calculate()
    mask, values = _token_values(b)
    # verl's epsilon in seq-mean-token-mean (n_i + 1e-8) is a relative 1e-8 / n_i at most
    tol = 2e-8 if mode == "seq-mean-token-mean" else 1e-12
    for key, rows in values.items():
        whole = verl_agg_loss(rows, mask, mode, loss_scale_factor=norm)
        sharded = verl_agg_loss_over_dp(rows, mask, mode, SHARDS, loss_scale_factor=norm)
        assert math.isclose(whole, sharded, rel_tol=1e-12), (key, whole, sharded)  # what "global" means
        assert math.isclose(got[key], whole, rel_tol=tol, abs_tol=1e-15), (key, got[key], whole)
    if mode == "seq-mean-token-sum-norm":  # a mean over sequences: no larger for a longer batch
        assert got["train/clip_ratio"] <= SEQ_LEN / (norm or SEQ_LEN)
        live = sum(1 for row in mask if any(row))
        assert math.isclose(got["train/approx_kl"] * live,
                            sum(sum(k * w for k, w in zip(kr, mr)) for kr, mr in
                                zip(values["train/approx_kl"], mask)) / (norm or SEQ_LEN), rel_tol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_rollout_mode_keys_equal_verl_agg_loss(mode):
    p = make_ppo_batch(3, N_SEQ, SEQ_LEN)
    m = RolloutMismatchMetric(is_threshold=1.5, loss_agg_mode=mode)
    m.accumulate({"labels": p["labels"]}, {"logps": p["train"]}, rollout_logps=p["rollout"])
    got = m.calculate()
    mask = [[float(p["labels"][i, t] != -100) for t in range(SEQ_LEN)] for i in range(N_SEQ)]
    d = (p["train"] - p["rollout"]).tolist()
    values = {"rollout/mismatch_kl": [[-x for x in r] for r in d],
              "rollout/mismatch_k3_kl": [[math.exp(-x) + x - 1 for x in r] for r in d],
              "rollout/is_fraction_high": [[float(math.exp(x) > 1.5) for x in r] for r in d],
              "rollout/logp_abs_diff_mean": [[abs(x) for x in r] for r in d]}
    tol = 2e-8 if mode == "seq-mean-token-mean" else 1e-12
    for key, rows in values.items():
        whole = verl_agg_loss(rows, mask, mode)
        assert math.isclose(whole, verl_agg_loss_over_dp(rows, mask, mode, SHARDS), rel_tol=1e-12)
        assert math.isclose(got[key], whole, rel_tol=tol, abs_tol=1e-15), (key, got[key], whole)


def _masked_mean(rows, mask):
    return sum(v * w for r, mr in zip(rows, mask) for v, w in zip(r, mr)) / sum(map(sum, mask))


def _feed_halves(m, b):
    """Two microbatches of one call."""
    half = N_SEQ // 2
    m.accumulate([{"labels": b["labels"][:half]}, {"labels": b["labels"][half:]}],
                 {"logps": [b["logps"][:half], b["logps"][half:]]}, old_logps=b["old"], advantages=b["adv"])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("per_token_adv", [False, True])
@pytest.mark.parametrize("cls,kind", [(GRPOMetric, "ppo"), (PPOMetric, "ppo"), (CISPOMetric, "cispo"),
                                      (GSPOMetric, "gspo")])
def test_dual_and_token_clip_fractions_are_verls_whatever_the_mode(mode, per_token_adv, cls, kind):
    b = _batch(per_token_adv=per_token_adv)
    eps = 0.02 if kind == "gspo" else 0.2  # GSPO's sequence ratios stay near 1
    dual = {"clip_ratio_c": 1.25} if kind == "ppo" else {}
    m = cls(epsilon=eps, loss_agg_mode=mode, token_clip_ratio=True, **dual)
    with forbid_device_waits():
        _feed_halves(m, b)
    got = m.calculate()
    mask, lp, old, adv = _rows(b)
    clipped, lower = verl_clip_tokens(kind, lp, old, adv, mask, eps=eps, clip_ratio_c=1.25)
    assert 0 < _masked_mean(clipped, mask) < 1
    assert math.isclose(got["train/token_clip_ratio"], _masked_mean(clipped, mask), rel_tol=1e-12)
    if kind == "ppo":
        assert 0 < got["train/clip_ratio_dual"] < got["train/token_clip_ratio"]
        assert math.isclose(got["train/clip_ratio_dual"], _masked_mean(lower, mask), rel_tol=1e-12)
    else:
        assert "train/clip_ratio_dual" not in got
    plain = cls(epsilon=eps, loss_agg_mode=mode)
    _feed_halves(plain, b)
    base = plain.calculate()  # the other keys: bit-identical
    assert {k: v for k, v in got.items() if k not in ("train/token_clip_ratio", "train/clip_ratio_dual")} == base
    if kind == "gspo" and not per_token_adv:  # one sign per sequence: the tokens of clipped sequences
        n = [sum(r) for r in mask]
        seq_clipped = [r[0] if any(mr) else 0.0 for r, mr in zip(clipped, mask)]
        assert math.isclose(got["train/token_clip_ratio"], sum(c * k for c, k in zip(seq_clipped, n)) / sum(n),
                            rel_tol=1e-12)
        assert got["train/token_clip_ratio"] != base["train/clip_ratio"]  # sequences, not tokens


def test_token_clip_ratio_is_clip_ratio_under_token_mean_except_for_gspo():
    b = _batch(per_token_adv=True)
    for cls in (GRPOMetric, CISPOMetric, GSPOMetric):
        m = cls(epsilon=0.05, token_clip_ratio=True)
        m.accumulate({"labels": b["labels"]}, {"logps": b["logps"]}, old_logps=b["old"], advantages=b["adv"])
        out = m.calculate()
        same = out["train/token_clip_ratio"] == out["train/clip_ratio"]
        assert same == (cls is not GSPOMetric), cls


def test_gspo_token_counts_with_partial_old_logps_and_two_calls():
    """Old log-probs for some tokens only (ragged, short entries): a sequence's ratio and its
    tokens are those with an old log-prob; two calls add up."""
    b = _batch(7, per_token_adv=True)
    olds, has = [], torch.zeros(N_SEQ, SEQ_LEN, dtype=torch.bool)
    for i in range(N_SEQ):
        valid = (b["labels"][i] != -100).nonzero().flatten()
        keep = valid[:max(0, len(valid) - i % 3)]
        has[i, keep] = True
        olds.append(b["old"][i, keep].clone())
    m = GSPOMetric(epsilon=0.02, token_clip_ratio=True)
    for rows in (slice(0, 4), slice(4, N_SEQ)):
        m.accumulate({"labels": b["labels"][rows]}, {"logps": b["logps"][rows]}, old_logps=olds[rows],
                     advantages=b["adv"][rows])
    _, lp, old, adv = _rows(b)
    mask = has.double().tolist()
    clipped, _ = verl_clip_tokens("gspo", lp, old, adv, mask, eps=0.02)
    assert has.sum() < (b["labels"] != -100).sum()
    assert math.isclose(m.calculate()["train/token_clip_ratio"], _masked_mean(clipped, mask), rel_tol=1e-12)


def test_nan_propagates_into_the_new_keys_and_skip_drops_the_token():
    b = _batch(per_token_adv=True)
    b["old"][2, 0] = math.nan
    b["labels"][2, 0] = 1
    for nan_policy in ("propagate", "skip"):
        for cls, kw in ((GRPOMetric, {"clip_ratio_c": 1.25}), (GSPOMetric, {})):
            m = cls(token_clip_ratio=True, nan_policy=nan_policy, **kw)
            m.accumulate({"labels": b["labels"]}, {"logps": b["logps"]}, old_logps=b["old"], advantages=b["adv"])
            out = m.calculate()
            keys = ["train/token_clip_ratio"] + (["train/clip_ratio_dual"] if kw else [])
            for key in keys:
                assert math.isnan(out[key]) == (nan_policy == "propagate"), (cls, nan_policy, key)


def test_arguments_are_checked_and_checkpoints_from_before_them_load():
    for cls in (GSPOMetric, CISPOMetric):
        with pytest.raises(ValueError, match=rf"{cls.__name__}: clip_ratio_c \(dual-clip PPO\) applies to "
                                             r"GRPOMetric and PPOMetric"):
            cls(clip_ratio_c=3.0)
    for bad in (1.0, 0.5, math.inf, True, "3"):
        with pytest.raises(ValueError, match=r"PPOMetric: clip_ratio_c must be a finite number > 1"):
            PPOMetric(clip_ratio_c=bad)
    with pytest.raises(TypeError, match="GRPOMetric: token_clip_ratio must be True or False, got 1"):
        GRPOMetric(token_clip_ratio=1)
    plain, named = GRPOMetric(), GRPOMetric(clip_ratio_c=None, token_clip_ratio=False)
    assert plain.fingerprint() == named.fingerprint() and set(plain.state_dict()) == set(named.state_dict())
    # a checkpoint from before the arguments existed (no clip_ratio_c, token_clip_ratio) loads
    state = plain.state_dict()
    state[FINGERPRINT_KEY] = state[FINGERPRINT_KEY].replace("clip_ratio_c=None, token_clip_ratio=False, ", "")
    assert "clip_ratio_c" not in state[FINGERPRINT_KEY]
    GRPOMetric().load_state_dict(state)
    with pytest.raises(ValueError, match=r"clip_ratio_c=None there, clip_ratio_c=3.0 here \(it predates"):
        GRPOMetric(clip_ratio_c=3).load_state_dict(state)
    dual = GRPOMetric(clip_ratio_c=3)
    assert "clip_ratio_c=3.0" in dual.fingerprint() and dual.clip_ratio_c == 3.0
    assert "clip_dual" in dual.state_dict() and "clip_tok" in GSPOMetric(token_clip_ratio=True).state_dict()
    # on GRPO the token fraction comes from the clip counts it already has: no state
    assert set(GRPOMetric(token_clip_ratio=True).state_dict()) == set(plain.state_dict())


def test_checkpoint_round_trip_keeps_the_new_counts():
    b = _batch(per_token_adv=True)
    for cls, kw in ((PPOMetric, {"clip_ratio_c": 1.25}), (GSPOMetric, {"epsilon": 0.02})):
        a = cls(token_clip_ratio=True, **kw)
        a.accumulate({"labels": b["labels"]}, {"logps": b["logps"]}, old_logps=b["old"], advantages=b["adv"])
        state = a.state_dict()
        want = a.calculate()
        fresh = cls(token_clip_ratio=True, **kw)
        fresh.load_state_dict(state)
        assert fresh.calculate() == want


def test_the_new_keys_take_the_torch_path_where_the_kernel_would_run(monkeypatch):
    monkeypatch.setattr(dispatch, "device_ok", lambda x: True)
    b = _batch()
    m = b["labels"] != -100
    item = dict(feat={}, lp=b["logps"], m=m, ent=None, em=None, adv=None, has_adv=None, ref=None, has_ref=None,
                old=None, has_old=None)
    assert fuses(GRPOMetric(token_clip_ratio=True).config, Microbatch(item, None))  # existing counts: fused
    assert fuses(GSPOMetric().config, Microbatch(item, None))
    assert not fuses(GRPOMetric(clip_ratio_c=3.0).config, Microbatch(item, None))
    assert not fuses(GSPOMetric(token_clip_ratio=True).config, Microbatch(item, None))


def test_sliced_new_keys_equal_a_metric_fed_only_that_slice():
    b = _batch(per_token_adv=True)
    sources = ["a", "b", "a", "a", "b", "b", "a", "b", "a", "b"]
    for cls, kw in ((PPOMetric, {"clip_ratio_c": 1.25}), (GSPOMetric, {"epsilon": 0.02})):
        sliced = cls(token_clip_ratio=True, slice_by="data_source", **kw)
        sliced.accumulate({"labels": b["labels"], "data_source": sources}, {"logps": b["logps"]},
                          old_logps=b["old"], advantages=b["adv"])
        got = sliced.calculate()
        for source in ("a", "b"):
            rows = torch.tensor([i for i, s in enumerate(sources) if s == source])
            alone = cls(token_clip_ratio=True, **kw)
            alone.accumulate({"labels": b["labels"][rows]}, {"logps": b["logps"][rows]}, old_logps=b["old"][rows],
                             advantages=b["adv"][rows])
            want = alone.calculate()
            assert "train/token_clip_ratio" in want
            for key, value in want.items():
                assert math.isclose(got[f"{key}/{source}"], value, rel_tol=1e-12), (cls, key)
