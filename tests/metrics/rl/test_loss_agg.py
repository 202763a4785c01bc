"""loss_agg_mode= on the GRPO family and RolloutMismatchMetric (verl's agg_loss modes), one process.

The references below loop over sequences and tokens with Python floats, independent of the
metrics' tensor code.
"""
import contextlib
import math
import re

import pytest
import torch

from tests.rlref import make_ppo_batch, make_rl_batch, ragged
from twinkle_metrics import CISPOMetric, GRPOMetric, GSPOMetric, MetricCollection, PPOMetric, RolloutMismatchMetric
from twinkle_metrics.core.metric import FINGERPRINT_KEY
from twinkle_metrics.kernels import dispatch, rollout_triton
from twinkle_metrics.testing import assert_results_close, forbid_device_waits

MODES = ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
N_SEQ, SEQ_LEN = 9, 10


def _batch(seed=7):
    b = make_rl_batch(seed, N_SEQ, SEQ_LEN)  # ragged masks, sequence 0 fully masked
    b["labels"][3, 1:] = -100  # a one-token sequence
    b["labels"][5] = torch.where(torch.arange(SEQ_LEN) % 2 == 0, 4, -100)
    b["old"] = b["logps"] + 0.35 * torch.randn(N_SEQ, SEQ_LEN, generator=torch.Generator().manual_seed(seed),
                                               dtype=torch.float64)  # enough clipping
    return b


def _aggregate(mode, seqs, width, norm=None):
    """The modes' definitions over per-sequence lists of token values (Python floats): verl
    0.9.1's agg_loss without its 1e-8 in the token-mean's divisor."""
    live = [v for v in seqs if v]
    if mode == "token-mean":
        return sum(sum(v) for v in live) / sum(len(v) for v in live)
    if mode == "seq-mean-token-mean":
        return sum(sum(v) / len(v) for v in live) / len(live)
    if mode == "seq-mean-token-sum":
        return sum(sum(v) for v in live) / len(live)
    return sum(sum(v) / (norm if norm is not None else width) for v in live) / len(live)


def _reference(b, mode, eps=0.2, by_sign=True, has_old=None, norm=None, per_token_adv=False):
    """clip fraction, k3 KL, ratio mean and the other token-mean keys, per verl's mode."""
    lab, lp, old, adv, ref = b["labels"], b["logps"], b["old"], b["adv"], b["ref"]
    lo, hi = 1 - eps, 1 + eps
    cols = {k: [] for k in ("clip", "low", "high", "kl", "ratio", "diff", "new", "ref_kl", "adv")}
    for i in range(lab.shape[0]):
        row = {k: [] for k in cols}
        for t in range(lab.shape[1]):
            if lab[i, t] == -100:
                continue
            a = float(adv[i, t]) if per_token_adv else float(adv[i])
            x = float(lp[i, t])
            row["new"].append(x)
            row["adv"].append(a)
            rd = float(ref[i, t]) - x
            row["ref_kl"].append(math.exp(rd) - rd - 1)
            if has_old is not None and not has_old[i, t]:
                continue
            d = x - float(old[i, t])
            r = math.exp(d)
            low = r < lo and (a < 0 or not by_sign)
            high = r > hi and (a > 0 or not by_sign)
            row["low"].append(float(low))
            row["high"].append(float(high))
            row["clip"].append(float(low or high))
            row["kl"].append(r - d - 1)
            row["ratio"].append(r)
            row["diff"].append(d)
        for k in cols:
            cols[k].append(row[k])
    got = {k: _aggregate(mode, v, lab.shape[1], norm) for k, v in cols.items()}
    return {"train/clip_ratio": got["clip"], "train/clip_ratio_low": got["low"],
            "train/clip_ratio_high": got["high"], "train/approx_kl": got["kl"], "train/ratio_mean": got["ratio"],
            "train/logp_diff_mean": got["diff"], "train/mean_new_logp": got["new"], "train/ref_kl": got["ref_kl"],
            "train/advantage_mean": got["adv"]}


def _feed(m, b, ragged_old=True, guard=contextlib.nullcontext):
    """Two microbatches of one call, Twinkle's ragged old log-probs (built outside ``guard``)."""
    parts = [slice(0, 5), slice(5, None)]
    old = ragged(b["old"], b["labels"]) if ragged_old else b["old"]
    feats, outputs = [{"labels": b["labels"][p]} for p in parts], {"logps": [b["logps"][p] for p in parts]}
    with guard():
        m.accumulate(feats, outputs, old_logps=old, advantages=b["adv"], ref_logps=b["ref"])


@pytest.mark.parametrize("mode", ("token-mean",) + MODES)
@pytest.mark.parametrize("cls,by_sign", [(GRPOMetric, True), (PPOMetric, True), (CISPOMetric, False)])
def test_modes_match_a_plain_python_reference(mode, cls, by_sign):
    b = _batch()
    m = cls(loss_agg_mode=mode)
    _feed(m, b, guard=forbid_device_waits)
    got = m.calculate()
    want = _reference(b, mode, by_sign=by_sign)
    for key, value in want.items():
        assert math.isclose(got[key], value, rel_tol=1e-12, abs_tol=1e-14), (key, got[key], value)
    assert math.isclose(got["train/policy_confidence"], math.exp(want["train/mean_new_logp"]), rel_tol=1e-12)
    if mode == "seq-mean-token-mean":  # the acceptance reading: mean over sequences of clipped fractions
        fractions = []
        for i in range(N_SEQ):
            toks = [t for t in range(SEQ_LEN) if b["labels"][i, t] != -100]
            if toks:
                clipped = [_clipped(b, i, t, by_sign) for t in toks]
                fractions.append(sum(clipped) / len(clipped))
        assert math.isclose(got["train/clip_ratio"], sum(fractions) / len(fractions), rel_tol=1e-12)


def _clipped(b, i, t, by_sign, eps=0.2):
    r = math.exp(float(b["logps"][i, t]) - float(b["old"][i, t]))
    a = float(b["adv"][i])
    return (r < 1 - eps and (a < 0 or not by_sign)) or (r > 1 + eps and (a > 0 or not by_sign))


@pytest.mark.parametrize("mode", MODES)
def test_partial_old_logps_per_token_advantages_and_two_calls(mode):
    """Old log-probs for only some tokens (short ragged entries: their own counts, a sequence
    with tokens and none), per-token advantages, and an interval of two calls."""
    b = _batch(11)
    b["adv"] = torch.randn(N_SEQ, SEQ_LEN, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    has_old = torch.zeros(N_SEQ, SEQ_LEN, dtype=torch.bool)
    olds = []
    for i in range(N_SEQ):
        valid = (b["labels"][i] != -100).nonzero().flatten()
        keep = valid[:max(0, len(valid) - i % 3)] if i != 4 else valid[:0]
        has_old[i, keep] = True
        olds.append(b["old"][i, keep].clone())
    m = GRPOMetric(loss_agg_mode=mode)
    for rows in (slice(0, 4), slice(4, N_SEQ)):
        m.accumulate({"labels": b["labels"][rows]}, {"logps": b["logps"][rows]}, old_logps=olds[rows],
                     advantages=b["adv"][rows], ref_logps=b["ref"][rows])
    got = m.calculate()
    want = _reference(b, mode, has_old=has_old, per_token_adv=True)
    assert has_old.sum() < (b["labels"] != -100).sum()
    for key, value in want.items():
        assert math.isclose(got[key], value, rel_tol=1e-12, abs_tol=1e-14), (key, got[key], value)


def test_sum_norm_takes_a_constant_normaliser():
    b = _batch()
    m = GRPOMetric(loss_agg_mode="seq-mean-token-sum-norm", loss_agg_norm=64)
    _feed(m, b)
    got = m.calculate()
    want = _reference(b, "seq-mean-token-sum-norm", norm=64.0)
    for key in ("train/clip_ratio", "train/approx_kl", "train/ratio_mean"):
        assert math.isclose(got[key], want[key], rel_tol=1e-12), key
    # the default normaliser is each sequence's token capacity (the mask's length)
    d = GRPOMetric(loss_agg_mode="seq-mean-token-sum-norm")
    _feed(d, b)
    assert math.isclose(d.calculate()["train/approx_kl"], got["train/approx_kl"] * 64 / SEQ_LEN, rel_tol=1e-12)


def test_gspo_clip_keys_stay_over_sequences_and_entropy_follows_the_mode():
    b = _batch()
    ent = torch.rand(N_SEQ, SEQ_LEN, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    token, seq = GSPOMetric(epsilon=0.05), GSPOMetric(epsilon=0.05, loss_agg_mode="seq-mean-token-mean")
    for m in (token, seq):
        m.accumulate({"labels": b["labels"]}, {"logps": b["logps"], "entropies": ent}, old_logps=b["old"],
                     advantages=b["adv"])
    t, s = token.calculate(), seq.calculate()
    for key in ("train/clip_ratio", "train/clip_ratio_low", "train/clip_ratio_high", "train/ratio_max",
                "train/token_kl_max", "train/advantage_min"):
        assert s[key] == t[key], key
    assert t["train/clip_ratio"] > 0
    per_seq = [[float(ent[i, j]) for j in range(SEQ_LEN) if b["labels"][i, j] != -100] for i in range(N_SEQ)]
    assert math.isclose(s["train/entropy"], _aggregate("seq-mean-token-mean", per_seq, SEQ_LEN), rel_tol=1e-12)


def _rollout_reference(p, mode, thr=1.5):
    lab, lp, roll = p["labels"], p["train"], p["rollout"]
    cols = {k: [] for k in ("w", "high", "low", "kl", "k3", "abs", "train", "rollout")}
    for i in range(lab.shape[0]):
        row = {k: [] for k in cols}
        for t in range(lab.shape[1]):
            if lab[i, t] == -100:
                continue
            d = float(lp[i, t]) - float(roll[i, t])
            w = math.exp(d)
            row["w"].append(w)
            row["high"].append(float(w > thr))
            row["low"].append(float(w < 1 / thr))
            row["kl"].append(-d)
            row["k3"].append(math.exp(-d) + d - 1)
            row["abs"].append(abs(d))
            row["train"].append(float(lp[i, t]))
            row["rollout"].append(float(roll[i, t]))
        for k in cols:
            cols[k].append(row[k])
    a = {k: _aggregate(mode, v, lab.shape[1]) for k, v in cols.items()}
    return {"rollout/is_ratio_mean": a["w"], "rollout/is_fraction_high": a["high"],
            "rollout/is_fraction_low": a["low"], "rollout/mismatch_kl": a["kl"], "rollout/mismatch_k3_kl": a["k3"],
            "rollout/logp_abs_diff_mean": a["abs"], "rollout/training_ppl": math.exp(-a["train"]),
            "rollout/rollout_ppl": math.exp(-a["rollout"]), "rollout/ppl_ratio": math.exp(a["rollout"] - a["train"])}


@pytest.mark.parametrize("mode", ("token-mean",) + MODES)
def test_rollout_mismatch_modes_match_a_plain_python_reference(mode):
    p = make_ppo_batch(4, N_SEQ, SEQ_LEN)
    m = RolloutMismatchMetric(is_threshold=1.5, loss_agg_mode=mode)
    roll = ragged(p["rollout"], p["labels"])
    with forbid_device_waits():
        m.accumulate([{"labels": p["labels"][:5]}, {"labels": p["labels"][5:]}],
                     {"logps": [p["train"][:5], p["train"][5:]]}, rollout_logps=roll)
    got = m.calculate()
    for key, value in _rollout_reference(p, mode).items():
        assert math.isclose(got[key], value, rel_tol=1e-11), (key, got[key], value)
    plain = RolloutMismatchMetric(is_threshold=1.5)
    plain.accumulate({"labels": p["labels"]}, {"logps": p["train"]}, rollout_logps=p["rollout"])
    base = plain.calculate()
    for key in ("rollout/is_ratio_std", "rollout/token_ess", "rollout/seq_ess", "rollout/log_ppl_abs_diff",
                "rollout/is_ratio_max", "rollout/logp_abs_diff_max"):  # not token means: as before
        assert math.isclose(got[key], base[key], rel_tol=1e-12), key


def _full_results(cls, **kw):
    b = _batch()
    m = cls(top_k_kl=3, quantiles=(0.5, 0.9), **kw) if cls is not RolloutMismatchMetric else cls(**kw)
    if cls is RolloutMismatchMetric:
        m.accumulate({"labels": b["labels"]}, {"logps": b["logps"]}, rollout_logps=ragged(b["old"], b["labels"]))
    else:
        _feed(m, b)
    return m, m.calculate()


@pytest.mark.parametrize("cls", [GRPOMetric, GSPOMetric, CISPOMetric, PPOMetric, RolloutMismatchMetric])
def test_default_mode_is_bit_identical_and_keeps_fingerprint_and_states(cls):
    plain, want = _full_results(cls)
    named, got = _full_results(cls, loss_agg_mode="token-mean", loss_agg_norm=None)
    assert got == want  # exact, every key
    assert named.fingerprint() == plain.fingerprint()
    # a checkpoint saved before the aggregation and clip arguments existed still loads (the
    # Schema reads an argument its fingerprint lacks as its default) and gives the same numbers
    fed = cls() if cls is RolloutMismatchMetric else cls(top_k_kl=3, quantiles=(0.5, 0.9))
    b = _batch()
    if cls is RolloutMismatchMetric:
        fed.accumulate({"labels": b["labels"]}, {"logps": b["logps"]}, rollout_logps=ragged(b["old"], b["labels"]))
    else:
        _feed(fed, b)
    state = fed.state_dict()
    state[FINGERPRINT_KEY] = re.sub(r"(loss_agg_mode|loss_agg_norm|clip_ratio_c|token_clip_ratio)=[^,)]*(, )?", "",
                                    state[FINGERPRINT_KEY])
    assert "loss_agg" not in state[FINGERPRINT_KEY]
    fresh = cls() if cls is RolloutMismatchMetric else cls(top_k_kl=3, quantiles=(0.5, 0.9))
    assert fresh.load_state_dict(state).calculate() == want
    assert set(named.state_dict()) == set(plain.state_dict())
    assert not any(k.startswith("seq_") and k not in ("seq_ess",) for k in plain.state_dict())


@pytest.mark.parametrize("cls", [GRPOMetric, RolloutMismatchMetric])
def test_mode_enters_the_fingerprint_states_are_wide_and_checkpoints_round_trip(cls):
    m, out = _full_results(cls, loss_agg_mode="seq-mean-token-sum")
    assert "loss_agg_mode='seq-mean-token-sum'" in m.fingerprint()
    assert m.fingerprint() != cls(loss_agg_mode="seq-mean-token-mean").fingerprint()
    assert m.declarations["seq_sums"].dtype == torch.float64 and m.declarations["seq_counts"].dtype == torch.int64
    a, _ = _full_results(cls, loss_agg_mode="seq-mean-token-sum")
    a.reset()
    b = _batch()
    if cls is RolloutMismatchMetric:
        a.accumulate({"labels": b["labels"]}, {"logps": b["logps"]}, rollout_logps=ragged(b["old"], b["labels"]))
    else:
        _feed(a, b)
    state = a.state_dict()
    fresh = cls(loss_agg_mode="seq-mean-token-sum", **({} if cls is RolloutMismatchMetric else
                                                        dict(top_k_kl=3, quantiles=(0.5, 0.9))))
    fresh.load_state_dict(state)
    assert_results_close(fresh.calculate(), out, rel=0)
    with pytest.raises(ValueError, match="was saved by"):
        cls().load_state_dict(state)


@pytest.mark.parametrize("cls", [GRPOMetric, GSPOMetric, CISPOMetric, PPOMetric, RolloutMismatchMetric])
def test_unknown_mode_and_misplaced_normaliser_raise_at_construction(cls):
    name = cls.__name__
    with pytest.raises(ValueError, match=rf"{name}: loss_agg_mode must be one of 'token-mean', "
                                         r"'seq-mean-token-mean', 'seq-mean-token-sum', "
                                         r"'seq-mean-token-sum-norm', got 'seq-mean'"):
        cls(loss_agg_mode="seq-mean")
    with pytest.raises(ValueError, match=rf"{name}: loss_agg_norm applies to loss_agg_mode="
                                         r"'seq-mean-token-sum-norm' only"):
        cls(loss_agg_mode="seq-mean-token-mean", loss_agg_norm=128)
    for bad in (0, -1.0, math.inf, True, "128"):
        with pytest.raises(ValueError, match=rf"{name}: loss_agg_norm must be a finite number > 0"):
            cls(loss_agg_mode="seq-mean-token-sum-norm", loss_agg_norm=bad)


def test_sequence_modes_take_the_torch_path_where_the_kernels_would_run(monkeypatch):
    """The fused kernels make no per-sequence table: a non-default mode never fuses."""
    monkeypatch.setattr(dispatch, "device_ok", lambda x: True)
    b = _batch()
    from twinkle_metrics.metrics.rl.policy.batch import Microbatch
    from twinkle_metrics.metrics.rl.policy.sums import fuses

    item = dict(feat={}, lp=b["logps"], m=b["labels"] != -100, ent=None, em=None, adv=None, has_adv=None,
                ref=None, has_ref=None, old=None, has_old=None)
    assert fuses(GRPOMetric().config, Microbatch(item, None))
    assert not fuses(GRPOMetric(loss_agg_mode="seq-mean-token-mean").config, Microbatch(item, None))

    class Fused(Exception):
        """RolloutMismatchMetric took the one-kernel path."""

    def token_stats(*args, **kwargs):
        raise Fused

    monkeypatch.setattr(rollout_triton, "token_stats", token_stats)
    call = ({"labels": b["labels"]}, {"logps": b["logps"]})
    with pytest.raises(Fused):
        RolloutMismatchMetric().accumulate(*call, rollout_logps=b["old"])
    got = RolloutMismatchMetric(loss_agg_mode="seq-mean-token-sum").accumulate(*call, rollout_logps=b["old"])
    got = got.calculate()
    monkeypatch.undo()  # the real device_ok: CPU tensors take the torch path
    want = RolloutMismatchMetric(loss_agg_mode="seq-mean-token-sum").accumulate(*call, rollout_logps=b["old"])
    assert got and got == want.calculate()


def test_nan_propagates_into_its_sequence_and_the_key():
    b = _batch()
    b["logps"][2, 0] = math.nan
    b["labels"][2, 0] = 1
    m = GRPOMetric(loss_agg_mode="seq-mean-token-mean")
    _feed(m, b, ragged_old=False)
    out = m.calculate()
    assert math.isnan(out["train/approx_kl"]) and math.isnan(out["train/clip_ratio"])
    assert out["train/nonfinite_tokens"] == 1


def test_sliced_sequence_modes_equal_a_metric_fed_only_that_slice():
    b = _batch()
    sources = ["a", "b", "a", "a", "b", "b", "a", "b", "a"]
    sliced = GRPOMetric(loss_agg_mode="seq-mean-token-mean", slice_by="data_source")
    sliced.accumulate({"labels": b["labels"], "data_source": sources}, {"logps": b["logps"]},
                      old_logps=b["old"], advantages=b["adv"])
    got = sliced.calculate()
    for source in ("a", "b"):
        rows = torch.tensor([i for i, s in enumerate(sources) if s == source])
        alone = GRPOMetric(loss_agg_mode="seq-mean-token-mean")
        alone.accumulate({"labels": b["labels"][rows]}, {"logps": b["logps"][rows]}, old_logps=b["old"][rows],
                         advantages=b["adv"][rows])
        for key, value in alone.calculate().items():
            assert math.isclose(got[f"{key}/{source}"], value, rel_tol=1e-12), key


def test_async_calculate_equals_sync_interval_by_interval():
    b = _batch()
    sync, asyn = (MetricCollection({"grpo": GRPOMetric(loss_agg_mode="seq-mean-token-mean"),
                                    "roll": RolloutMismatchMetric(loss_agg_mode="seq-mean-token-sum")})
                  for _ in range(2))
    expected, handles = [], []
    for rows in (slice(0, 4), slice(4, None)):
        for coll in (sync, asyn):
            coll.accumulate({"labels": b["labels"][rows]}, {"logps": b["logps"][rows]}, old_logps=b["old"][rows],
                            advantages=b["adv"][rows], rollout_logps=b["ref"][rows])
        expected.append(sync.calculate())
        handles.append(asyn.calculate(async_op=True))
    assert [h.wait() for h in handles] == expected
    assert expected[0] != expected[1] and "grpo/train/clip_ratio" in expected[0]
