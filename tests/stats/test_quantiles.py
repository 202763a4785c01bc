"""Quantiles from histograms (single process): the bucket math at its edges, each
metric's quantile keys against numpy's nearest-rank quantiles of the same values
within the documented relative error, and TrainMetric's straggler keys."""
import math
import random
import types

import numpy as np
import pytest
import torch

from tests.rlref import make_rl_batch
from twinkle_metrics import CompletionRewardMetric, DPOMetric, GRPOMetric, GSPOMetric, TrainMetric
from twinkle_metrics.metrics.rl.dpo import MARGIN_HISTOGRAM
from twinkle_metrics.metrics.rl.policy.table import ENTROPY_HISTOGRAM, KL_HISTOGRAM, RATIO_HISTOGRAM
from twinkle_metrics.metrics.rl.reward import LENGTH_HISTOGRAM, REWARD_HISTOGRAM
from twinkle_metrics.stats.histogram import Histogram, nearest_rank, quantile_suffix
from twinkle_metrics.testing import DeviceWaitError, forbid_device_waits, merged_results

QS = (0.5, 0.9, 0.99)


def reference(values, q):
    """numpy's nearest-rank quantile (inverted CDF): a member of the data."""
    return float(np.quantile(np.asarray(values, dtype=np.float64), q, method="inverted_cdf"))


def assert_within(got, want, hist, key=""):
    """The documented bound: |reported - true| <= rel_error * |true| inside [lo, hi)."""
    assert hist.lo <= abs(want) < hist.hi or want == 0, (key, want)
    slack = 1e-12  # one float64 logarithm's rounding at a bucket edge
    assert abs(got - want) <= (hist.rel_error + slack) * abs(want), (key, got, want)


# --------------------------------------------------------------- the histogram
def test_bucket_bound_holds_for_every_value_and_is_tight():
    h = Histogram(1e-3, 1e4, rel_error=0.01)
    rng = random.Random(0)
    values = [s * 10 ** rng.uniform(-3, 4) for s in (1, -1) for _ in range(2000)]
    got = [h.bucket_values()[i] for i in h.index(torch.tensor(values, dtype=torch.float64)).tolist()]
    errors = [abs(g - v) / abs(v) for g, v in zip(got, values)]
    assert max(errors) <= 0.01 + 1e-12
    assert max(errors) > 0.009  # the bound is what the buckets give, not loose
    assert all((g > 0) == (v > 0) for g, v in zip(got, values))


@pytest.mark.parametrize("signed", [True, False])
def test_bucket_edges(signed):
    h = Histogram(1e-6, 1e9, rel_error=0.01, signed=signed)
    x = torch.tensor([0.0, -0.0, 1e-7, 5e-324, 2e9, math.inf, math.nan, 1e-6, 3.0,
                      -1e-7, -2e9, -math.inf, -3.0], dtype=torch.float64)
    got = [h.bucket_values()[i] for i in h.index(x).tolist()]
    assert got[:4] == [0.0, 0.0, h.lo, h.lo]           # zero exact; underflow reads as lo
    assert got[4:6] == [h.hi, h.hi]                    # overflow and +inf read as hi
    assert math.isnan(got[6]) and h.index(x)[6] == h.n_buckets - 1
    assert abs(got[7] - 1e-6) <= 0.01 * 1e-6 and abs(got[8] - 3.0) <= 0.03
    if signed:
        assert got[9:] == [-h.lo, -h.hi, -h.hi, pytest.approx(-3.0, rel=0.01)]
    else:                                              # negatives count as zero
        assert got[9:] == [0.0] * 4
    # buckets are in ascending order of value, NaN last
    vals = h.bucket_values()[:-1]
    assert vals == sorted(vals) and len(set(vals)) == len(vals)


def test_counts_are_masked_weights_and_nan_is_apart():
    h = Histogram(1e-6, 1e9)
    x = torch.tensor([[1.0, math.nan, -2.0], [0.0, 7.0, math.nan]], dtype=torch.float32)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    c = h.counts(x, mask)
    assert c.dtype == torch.int64 and c.shape == (h.n_buckets,) and int(c.sum()) == 3
    assert int(c[h.nan]) == 1 and int(c[h.zero]) == 1
    assert h.quantiles(c.tolist(), (0.5, 0.99)) == [0.0, pytest.approx(1.0, rel=0.01)]
    assert all(math.isnan(v) for v in h.quantiles(c.tolist(), (0.5,), propagate_nan=True))
    assert h.quantiles([0] * h.n_buckets, (0.5,)) == [] and h.quantile([0] * h.n_buckets, 0.5) is None
    only_nan = h.counts(torch.tensor([math.nan])).tolist()
    assert h.quantiles(only_nan, (0.5,)) == []


def test_quantiles_match_numpy_within_the_bound():
    rng = random.Random(1)
    h = Histogram(1e-6, 1e9)
    for n in (1, 2, 3, 10, 101, 1000):
        values = [rng.choice([-1, 1]) * math.exp(rng.uniform(-10, 15)) for _ in range(n)]
        values += [0.0] * (n // 7)
        counts = h.counts(torch.tensor(values, dtype=torch.float64)).tolist()
        qs = (0.01, 0.1, 0.25, 0.5, 0.7, 0.9, 0.99, 0.999)
        for q, got in zip(qs, h.quantiles(counts, qs)):
            assert_within(got, reference(values, q), h, (n, q))


def test_nearest_rank_reads_q_as_written():
    assert nearest_rank(0.7, 10) == 7 and nearest_rank(0.5, 1) == 1 and nearest_rank(0.01, 3) == 1
    assert nearest_rank(0.99, 100) == 99 and nearest_rank(0.991, 100) == 100
    assert [quantile_suffix(q) for q in (0.5, 0.9, 0.999, 0.05, 1e-5)] == ["p50", "p90", "p99.9", "p5", "p0.001"]


def test_histogram_arguments_are_checked():
    for kwargs in (dict(lo=0.0), dict(lo=2.0, hi=1.0), dict(rel_error=0.0), dict(hi=math.inf),
                   dict(lo=1e-300, hi=1e300, rel_error=1e-4)):
        with pytest.raises(ValueError, match="Histogram"):
            Histogram(**kwargs)
    assert Histogram(1e-6, 1e6, signed=False).hi >= 1e6


def test_counting_never_waits_for_the_device():
    h = Histogram()
    x = torch.randn(64, 32)
    with forbid_device_waits():
        c = h.counts(x, x > 0)
        c = c + h.counts(x.double())
    with pytest.raises(DeviceWaitError):  # the guard is live around this code
        with forbid_device_waits():
            torch.bincount(h.index(x).reshape(-1))
    assert int(c.sum()) == int((x > 0).sum()) + x.numel()


# ------------------------------------------------------------------ the metrics
@pytest.mark.parametrize("cls", [CompletionRewardMetric, GRPOMetric, GSPOMetric, DPOMetric])
@pytest.mark.parametrize("bad", [(0.5, 1.0), (0.0,), (-0.1,), (0.5, 0.5), ("0.5",), ()])
def test_quantiles_argument_is_validated(cls, bad):
    with pytest.raises((ValueError, TypeError), match=f"{cls.__name__}: quantiles"):
        cls(quantiles=bad)


@pytest.mark.parametrize("cls", [CompletionRewardMetric, GRPOMetric, DPOMetric])
def test_quantiles_enter_the_fingerprint_and_cost_nothing_when_off(cls):
    plain, with_q = cls(), cls(quantiles=QS)
    assert "quantiles=(0.5, 0.9, 0.99)" in with_q.fingerprint()
    assert with_q.fingerprint() != cls(quantiles=(0.5,)).fingerprint() != plain.fingerprint()
    assert not any("hist" in name for name in plain.states)
    with pytest.raises(ValueError, match="was saved by"):
        plain.load_state_dict(with_q.state_dict())


def _rewards(seed, n=60):
    rng = random.Random(seed)
    acc = [float(rng.choice([0, 1])) for _ in range(n)]
    fmt = [rng.gauss(-1.0, 3.0) for _ in range(n)]
    lens = [rng.randint(0, 500) for _ in range(n)]
    return acc, fmt, lens


def test_reward_quantiles_against_numpy():
    acc, fmt, lens = _rewards(2)
    fmt_with_nan = fmt[:-3] + [math.nan, None, math.inf]  # dropped under the default 'skip'
    m = CompletionRewardMetric(quantiles=(0.5, 0.9, 0.999))
    with forbid_device_waits():
        m.accumulate(rewards={"acc": acc[:30], "fmt": fmt_with_nan[:30]}, completion_lengths=lens[:30])
        m.accumulate(rewards={"acc": acc[30:], "fmt": fmt_with_nan[30:]}, completion_lengths=lens[30:])
    got = m.calculate()
    finite = [v for v in fmt_with_nan if v is not None and math.isfinite(v)]
    for key, values, hist in (("train/completion_length", lens, LENGTH_HISTOGRAM),
                              ("train/acc_reward", acc, REWARD_HISTOGRAM),
                              ("train/fmt_reward", finite, REWARD_HISTOGRAM)):
        for q, suffix in ((0.5, "p50"), (0.9, "p90"), (0.999, "p99.9")):
            assert_within(got[f"{key}_{suffix}"], reference(values, q), hist, key)
    # the keys sit next to their mean key
    keys = list(got)
    assert keys[keys.index("train/fmt_reward") + 2:][:3] == ["train/fmt_reward_p50", "train/fmt_reward_p90",
                                                              "train/fmt_reward_p99.9"]
    # 'propagate': a NaN reward makes that reward's quantiles NaN, as its mean
    p = CompletionRewardMetric(quantiles=(0.5,), nan_policy="propagate")
    p.accumulate(rewards={"fmt": fmt_with_nan})
    assert math.isnan(p.calculate()["train/fmt_reward_p50"])


def test_reward_histograms_are_dynamic_and_merge_like_one_process():
    acc, fmt, lens = _rewards(3)
    whole = CompletionRewardMetric(quantiles=QS)
    whole.accumulate(rewards={"acc": acc, "fmt": fmt}, completion_lengths=lens)
    shards = [CompletionRewardMetric(quantiles=QS) for _ in range(3)]
    shards[0].accumulate(rewards={"acc": acc[:20]}, completion_lengths=lens[:20])   # no 'fmt' here
    shards[1].accumulate(rewards={"acc": acc[20:], "fmt": fmt[20:]}, completion_lengths=lens[20:])
    shards[2].accumulate(rewards={"fmt": fmt[:20]})
    assert "hist/reward/fmt" not in shards[0].states and "hist/reward/fmt" in shards[2].states
    merged = merged_results(shards)
    want = whole.calculate()
    assert {k: v for k, v in merged.items() if "_p" in k} == {k: v for k, v in want.items() if "_p" in k}
    fixed = CompletionRewardMetric(reward_names=["acc"], quantiles=QS)
    assert "hist/reward/acc" in fixed.states and fixed.dynamic_state("hist/reward/x") is None


def _grpo_reference(b, entropies):
    ratio, kl, ent = [], [], []
    for i in range(b["labels"].shape[0]):
        for t in range(b["labels"].shape[1]):
            if b["labels"][i, t] == -100:
                continue
            d = float(b["logps"][i, t]) - float(b["old"][i, t])
            ratio.append(math.exp(d))
            kl.append(math.exp(d) - d - 1)
            ent.append(float(entropies[i, t]))
    return ratio, kl, ent


@pytest.mark.parametrize("cls,top_k", [(GRPOMetric, 0), (GRPOMetric, 3), (GSPOMetric, 0)])
def test_grpo_quantiles_against_numpy(cls, top_k):
    b = make_rl_batch(5, n_seq=16, seq_len=12)
    ent = torch.rand(16, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) * 3
    m = cls(quantiles=(0.5, 0.9, 0.99), top_k_kl=top_k)
    plain = cls(top_k_kl=top_k)
    for metric in (m, plain):
        with forbid_device_waits():
            for rows in (slice(0, 7), slice(7, 16)):  # two microbatches
                metric.accumulate({"labels": b["labels"][rows]}, {"logps": b["logps"][rows], "entropies": ent[rows]},
                                  old_logps=b["old"][rows], advantages=b["adv"][rows])
    got, without = m.calculate(), plain.calculate()
    assert {k: v for k, v in got.items() if not k.endswith(("_p50", "_p90", "_p99"))} == without
    ratio, kl, entv = _grpo_reference(b, ent)
    for key, values, hist in (("train/ratio", ratio, RATIO_HISTOGRAM), ("train/token_kl", kl, KL_HISTOGRAM),
                              ("train/entropy", entv, ENTROPY_HISTOGRAM)):
        for q in (0.5, 0.9, 0.99):
            assert_within(got[f"{key}_{quantile_suffix(q)}"], reference(values, q), hist, key)


def test_grpo_quantiles_follow_the_nan_policy():
    b = make_rl_batch(6)
    logps = b["logps"].clone()
    i, t = (b["labels"] != -100).nonzero()[0].tolist()
    logps[i, t] = math.nan
    for policy in ("propagate", "skip"):
        m = GRPOMetric(quantiles=(0.5,), nan_policy=policy)
        m.accumulate({"labels": b["labels"]}, {"logps": logps}, old_logps=b["old"])
        got = m.calculate()
        assert math.isnan(got["train/ratio_p50"]) == (policy == "propagate")
        assert math.isnan(got["train/token_kl_p50"]) == (policy == "propagate")
        if policy == "skip":
            _, kl, _ = _grpo_reference(b, torch.zeros_like(logps))  # the same tokens, none NaN
            del kl[int((b["labels"][:i] != -100).sum()) + int((b["labels"][i, :t] != -100).sum())]
            assert_within(got["train/token_kl_p50"], reference(kl, 0.5), KL_HISTOGRAM)


def test_dpo_margin_quantiles_against_numpy():
    g = torch.Generator().manual_seed(7)
    n = 40
    seq = -torch.rand(4, n, dtype=torch.float64, generator=g) * 20  # chosen, ref_c, rejected, ref_r
    m = DPOMetric(beta=0.2, quantiles=QS)
    with forbid_device_waits():
        m.accumulate(None, {"chosen_logps": seq[0], "rejected_logps": seq[2],
                            "ref_chosen_logps": seq[1], "ref_rejected_logps": seq[3]})
    got = m.calculate()
    margins = [0.2 * (float(seq[0, j]) - float(seq[1, j])) - 0.2 * (float(seq[2, j]) - float(seq[3, j]))
               for j in range(n)]
    assert any(v < 0 for v in margins) and any(v > 0 for v in margins)
    for q in QS:
        assert_within(got[f"rewards/margins_{quantile_suffix(q)}"], reference(margins, q), MARGIN_HISTOGRAM)


def test_sliced_quantiles_equal_a_metric_fed_only_that_slice():
    b = make_rl_batch(8, n_seq=6)
    tasks = ["x", "y", "x", "x", "y", "y"]
    sliced = GRPOMetric(quantiles=QS, slice_by="task")
    sliced.accumulate({"labels": b["labels"], "task": tasks}, {"logps": b["logps"]}, old_logps=b["old"])
    got = sliced.calculate()
    for task in ("x", "y"):
        rows = [i for i, t in enumerate(tasks) if t == task]
        alone = GRPOMetric(quantiles=QS)
        alone.accumulate({"labels": b["labels"][rows]}, {"logps": b["logps"][rows]}, old_logps=b["old"][rows])
        want = alone.calculate()
        keys = [k for k in want if k.rsplit("_", 1)[-1] in ("p50", "p90", "p99")]
        assert len(keys) == 6 and {k: got[f"{k}/{task}"] for k in keys} == {k: want[k] for k in keys}


# ------------------------------------------------------------ TrainMetric spread
def test_train_metric_step_time_spread_single_process(monkeypatch):
    import twinkle_metrics.metrics.system.train as train_module

    now = [50.0]
    monkeypatch.setattr(train_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    m = TrainMetric()
    assert "train/step_time_max" not in m.accumulate(None, None, lr=1e-3).calculate()  # no steps given
    now[0] = 53.0
    m.accumulate(None, None, step=6, gradient_accumulation_steps=2)
    got = m.calculate()
    assert got["train/step_time_max"] == got["train/step_time_min"] == got["step time"] == 1.0
    assert got["train/step_time_slowest_rank"] == 0
