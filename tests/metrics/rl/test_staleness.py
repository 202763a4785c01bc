"""StalenessMetric in one process: hand formulas, bad input, no device waits."""
import doctest
import math

import pytest
import torch

from twinkle_metrics.metrics.rl import staleness as staleness_module
from twinkle_metrics.metrics.rl.staleness import StalenessMetric
from twinkle_metrics.stats.histogram import nearest_rank
from twinkle_metrics.testing import assert_results_close, forbid_device_waits, state_dict_differences


def _batch(seed=0, b=5, s=7):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 50, (b, s), generator=g)
    labels[torch.rand(b, s, generator=g) < 0.3] = -100
    labels[2] = -100  # a sequence without a counted token
    return labels


def _reference(labels, policy, versions, over=None):
    """Plain Python over (sequence, token) pairs; ``versions`` per sequence or per token."""
    tokens, seqs, spans = [], [], []
    for i, row in enumerate(labels.tolist()):
        vs = [versions[i] if isinstance(versions[i], int) else versions[i][j]
              for j, lab in enumerate(row) if lab != -100]
        if not vs:
            continue
        st = [policy - v for v in vs]
        tokens += st
        seqs.append(sum(st) / len(st))
        spans.append(max(vs) - min(vs))
    ordered = sorted(tokens)
    out = {"staleness/mean": sum(tokens) / len(tokens), "staleness/seq_mean": sum(seqs) / len(seqs),
           "staleness/min": min(tokens), "staleness/max": max(tokens)}
    for q, key in ((0.5, "p50"), (0.9, "p90"), (0.99, "p99")):
        out[f"staleness/{key}"] = ordered[nearest_rank(q, len(ordered)) - 1]
    if over is not None:
        out[f"staleness/frac_over_{over}"] = sum(t > over for t in tokens) / len(tokens)
    if not all(isinstance(v, int) for v in versions):
        out["staleness/span_max"] = max(spans)
    return out


def test_per_sequence_versions_match_the_hand_formulas():
    labels = _batch()
    versions = [7, 3, 9, 10, 5]
    m = StalenessMetric(max_staleness=4)
    with forbid_device_waits():
        m.accumulate({"labels": labels}, None, policy_version=10, rollout_versions=versions)
    got = m.calculate()
    assert_results_close(got, _reference(labels, 10, versions, over=4))
    # the same as a tensor, split over two pipeline microbatches, as one tensor or a list per microbatch
    for vs in (torch.tensor(versions), [torch.tensor(versions[:2]), torch.tensor(versions[2:])]):
        with forbid_device_waits():
            m.accumulate([{"labels": labels[:2]}, {"labels": labels[2:]}], None, policy_version=10,
                         rollout_versions=vs)
        assert_results_close(m.calculate(), got)


def test_per_token_versions_match_the_hand_formulas_with_span():
    labels = _batch(1)
    g = torch.Generator().manual_seed(3)
    versions = torch.randint(0, 12, labels.shape, generator=g)
    versions[labels == -100] = 99  # padding: newer than the policy, but never counted
    m = StalenessMetric(max_staleness=5)
    with forbid_device_waits():
        m.accumulate({"labels": labels}, {"logps": torch.zeros(1)}, policy_version=12, rollout_versions=versions)
    got = m.calculate()
    want = _reference(labels, 12, versions.tolist(), over=5)
    assert_results_close(got, want)
    assert got["staleness/span_max"] > 0 and type(got["staleness/min"]) is int


def test_quantiles_are_exact_whole_versions_and_large_ones_within_one_percent():
    labels = torch.ones(1, 200, dtype=torch.int64)
    versions = torch.arange(200)[None]  # staleness 1000 - v: 801 .. 1000
    m = StalenessMetric(quantiles=(0.5, 0.999)).accumulate({"labels": labels}, None, policy_version=1000,
                                                              rollout_versions=versions)
    got = m.calculate()
    assert abs(got["staleness/p50"] - 900) <= 9 and abs(got["staleness/p99.9"] - 1000) <= 10
    small = StalenessMetric().accumulate({"labels": labels}, None, policy_version=40, rollout_versions=versions % 41)
    ordered = sorted((40 - versions % 41).reshape(-1).tolist())
    got = small.calculate()
    for q, key in ((0.5, "p50"), (0.9, "p90"), (0.99, "p99")):
        assert got[f"staleness/{key}"] == ordered[nearest_rank(q, 200) - 1]
    assert "staleness/p50" not in StalenessMetric(quantiles=None).accumulate(
        {"labels": labels}, None, policy_version=1, rollout_versions=[0]).calculate()


def test_readings_are_interval_maxima_and_nothing_counted_reports_only_them():
    m = StalenessMetric()
    m.accumulate(None, None, in_flight=3, queued=1.5)
    m.accumulate(None, None, in_flight=torch.tensor(7))
    m.accumulate([], None, policy_version=5, rollout_versions=[1, 2, 3])  # a stage without the loss
    assert m.calculate() == {"staleness/in_flight_max": 7, "staleness/queued_max": 1.5}
    assert m.calculate() == {}


def test_span_max_only_with_per_token_versions_and_sequences_without_tokens_do_not_count():
    labels = torch.tensor([[1, 2, 3], [-100, -100, -100]])
    m = StalenessMetric(quantiles=None)
    m.accumulate({"labels": labels}, None, policy_version=4, rollout_versions=[2, 0])
    got = m.calculate()
    assert got == {"staleness/mean": 2.0, "staleness/seq_mean": 2.0, "staleness/min": 2, "staleness/max": 2}
    m.accumulate({"labels": labels}, None, policy_version=4, rollout_versions=torch.tensor([[2, 3, 4], [0, 0, 0]]))
    assert m.calculate()["staleness/span_max"] == 2
    m.accumulate({"labels": labels[1:]}, None, policy_version=4, rollout_versions=torch.tensor([[0, 1, 2]]))
    assert m.calculate() == {}  # per-token versions over no counted token: nothing, span included


def test_completion_mask_and_one_dimensional_labels():
    m = StalenessMetric(quantiles=None)
    m.accumulate({"labels": torch.tensor([5, 6, 7]), "completion_mask": torch.tensor([0, 1, 1])}, None,
                 policy_version=3, rollout_versions=torch.tensor([1, 2, 3]))  # per token of one sequence
    assert m.calculate() == {"staleness/mean": 0.5, "staleness/seq_mean": 0.5, "staleness/min": 0,
                             "staleness/max": 1, "staleness/span_max": 1}


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(rollout_versions=[1, 2]), ValueError, r"StalenessMetric: rollout_versions has 2 versions but the "
                                                r"batch has 3 sequences .*; expected 3"),
    (dict(rollout_versions=torch.tensor([1, 2])), ValueError, r"rollout_versions has shape \[2\] but the "
                                                              r"microbatch has 3 sequences with labels \[3, 4\]"),
    (dict(rollout_versions=torch.zeros(3, 5, dtype=torch.int64)), ValueError, r"expected \[3\] .*or \[3, 4\]"),
    (dict(rollout_versions=torch.zeros(3)), TypeError, "rollout_versions must hold integer versions"),
    (dict(rollout_versions=[1, 2, 11]), ValueError, r"version 11 \(sequence 2\), newer than policy_version=10"),
    (dict(rollout_versions=[1, 2, 3], policy_version=None), ValueError, "but no keyword 'policy_version'"),
    (dict(rollout_versions=[1, 2.5, 3]), TypeError, "rollout_versions must hold one int per sequence"),
    (dict(in_flight="3"), TypeError, "in_flight must be a number"),
])
def test_bad_input_raises_naming_the_field_and_changes_nothing(kwargs, error, match):
    m = StalenessMetric(max_staleness=2)
    labels = torch.ones(3, 4, dtype=torch.int64)
    m.accumulate({"labels": labels}, None, policy_version=10, rollout_versions=[9, 8, 7], in_flight=2)
    before = m.state_dict()
    with pytest.raises(error, match=match):
        m.accumulate({"labels": labels}, None, **{"policy_version": 10, **kwargs})
    assert not state_dict_differences(before, m.state_dict())
    with pytest.raises(ValueError, match="got keyword 'rollout_versions' but no inputs 'labels' or "
                                         "'completion_mask'.*inputs is None"):
        m.accumulate(None, None, policy_version=10, rollout_versions=[1])


def test_negative_staleness_in_a_tensor_raises_at_calculate_on_the_counted_tokens_only():
    labels = torch.tensor([[1, 2, -100]])
    m = StalenessMetric()
    with forbid_device_waits():  # a tensor is not read in accumulate
        m.accumulate({"labels": labels}, None, policy_version=5, rollout_versions=torch.tensor([[4, 5, 9]]))
        m.accumulate({"labels": labels}, None, policy_version=5, rollout_versions=torch.tensor([[4, 6, 0]]))
    with pytest.raises(ValueError, match="StalenessMetric: rollout_versions gave 1 counted tokens a version newer"):
        m.calculate()
    m.reset()
    m.accumulate({"labels": labels}, None, policy_version=5, rollout_versions=torch.tensor([[4, 5, 9]]))
    assert m.calculate()["staleness/max"] == 1


def test_arguments_are_checked_and_fingerprinted():
    with pytest.raises(ValueError, match="max_staleness must be an int >= 0"):
        StalenessMetric(max_staleness=-1)
    with pytest.raises(ValueError, match="quantiles must each be a number in"):
        StalenessMetric(quantiles=(0.5, 1.0))
    assert StalenessMetric(max_staleness=1).fingerprint() != StalenessMetric(max_staleness=2).fingerprint()
    with pytest.raises(ValueError, match="slice_by is not supported"):
        StalenessMetric(slice_by="task")


def test_doctest():
    result = doctest.testmod(staleness_module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted > 0


def test_states_are_int64_and_float64_and_results_plain_numbers():
    m = StalenessMetric()
    assert all(t.dtype in (torch.int64, torch.float64) for t in m.states.values())
    got = m.accumulate({"labels": torch.ones(2, 2)}, None, policy_version=3, rollout_versions=[1, 2]).calculate()
    assert all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in got.values())
    assert math.isclose(got["staleness/mean"], 1.5)


def test_bucket_lookup_is_the_histograms_own_index():
    """The table lookup of integer staleness counts every value where Histogram.index puts it
    (above 65536: where 65536 goes; negatives: in the zero bucket): every integer up to 70000,
    one token each, lands in the histogram state as Histogram.index's buckets count them."""
    hist = staleness_module.STALENESS_HISTOGRAM
    st = torch.cat([torch.arange(-3, 70000), torch.tensor([10 ** 9])])
    policy = 2 * 10 ** 9
    m = StalenessMetric()
    m.accumulate({"labels": torch.ones(1, len(st), dtype=torch.long)}, None, policy_version=policy,
                 rollout_versions=(policy - st)[None])  # per token
    want = torch.bincount(hist.index(st.clamp(max=2 ** 16).double()), minlength=hist.n_buckets)
    assert torch.equal(m.states["hist"], want)
