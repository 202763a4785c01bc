"""``StepGuard`` in one process: verdicts, the policy, the baseline, the counts through
``calculate()`` and ``export()``, checkpoints, and what a healthy step reads from the device.
The multi-rank behaviour (the same verdict everywhere, naming the rank) is in
``test_guard_dist.py``."""
import math
import random

import pytest
import torch

from twinkle_metrics import GuardPolicy, LossMetric, MetricCollection, StepGuard, Verdict
from twinkle_metrics.inputs.checks import host_reads_active
from twinkle_metrics.testing import intercept_device_waits, state_dict_differences

NAN = float("nan")


def pair(loss, tokens=10.0):
    return torch.tensor([loss * tokens, tokens], dtype=torch.float64)


def run(guard, losses, **kw):
    return [guard.check(loss=pair(x), **kw) for x in losses]


def noisy(n, seed=0, start=3.0):
    """A fixed-seed loss curve: decaying, with noise (what a healthy run looks like)."""
    rng = random.Random(seed)
    return [start * math.exp(-i / 150) + 0.5 + rng.gauss(0, 0.03) for i in range(n)]


# ------------------------------------------------------------------------ non-finite
@pytest.mark.parametrize("field, kwargs", [
    ("loss", dict(loss=pair(NAN))),
    ("loss", dict(loss=torch.tensor([1.0, math.inf]))),  # a non-finite count is bad too
    ("loss", dict(loss=[{"lm loss": pair(1.0)}, {"lm loss": pair(NAN)}])),  # Megatron's reports
    ("grad_norm", dict(loss=pair(1.0), grad_norm=math.inf)),
    ("grad_norm", dict(loss=pair(1.0), grad_norm=torch.tensor(NAN))),
    ("values", dict(loss=pair(1.0), values=torch.tensor([[0.5, NAN], [1.0, 2.0]]))),
    ("values", dict(loss=pair(1.0), values=[torch.ones(3), torch.tensor([-math.inf])])),
])
def test_a_nonfinite_input_is_a_skip_naming_this_rank_and_the_input(field, kwargs):
    guard = StepGuard()
    v = guard.check(**kwargs)
    assert (v.action, v.reason, v.bad_ranks) == ("skip", "nonfinite", 1)
    assert v.bad.rank == 0 and v.bad.fields == (field,) and v.bad.step == 0
    assert v.bad.device == "cpu" and v.bad.host  # this host
    assert v.first == v.bad and v.nonfinite[field] == 1
    assert "non-finite" in str(v) and "rank 0" in str(v)


def test_an_input_left_out_of_the_policy_is_not_checked():
    guard = StepGuard(checks=("loss",))
    assert guard.check(loss=pair(1.0), grad_norm=NAN, values=torch.tensor([NAN])).ok
    assert guard.check(loss=pair(NAN), grad_norm=1.0).skip


def test_skip_up_to_max_skips_in_a_row_then_stop_and_an_ok_step_starts_over():
    guard = StepGuard(max_skips=2)
    actions = [guard.check(loss=pair(x)).action for x in (1.0, NAN, NAN, NAN, NAN, 1.0, NAN)]
    assert actions == ["ok", "skip", "skip", "stop", "stop", "ok", "skip"]
    assert StepGuard(on_nonfinite="stop").check(loss=pair(NAN)).stop
    assert StepGuard(max_skips=0).check(loss=pair(NAN)).stop


def test_the_first_bad_rank_of_a_run_stays_named_and_the_interval_keeps_the_lowest_step():
    guard = StepGuard()
    run(guard, [1.0, 1.0])
    first = guard.check(loss=pair(NAN), step=7)
    second = guard.check(loss=pair(1.0), grad_norm=NAN, step=8)
    assert second.bad.step == 8 and second.bad.fields == ("grad_norm",)
    assert second.first == first.bad and second.first.step == 7 and second.first.fields == ("loss",)
    out = guard.calculate()
    assert (out["guard/first_bad_step"], out["guard/first_bad_rank"], out["guard/nonfinite_steps"]) == (7, 0, 2)
    assert guard.check(loss=pair(1.0), step=9).first is None
    assert "guard/first_bad_step" not in guard.calculate()  # a new interval


# ------------------------------------------------------------------------ spikes
def test_the_baseline_is_the_running_mean_and_variance_during_its_first_steps():
    guard = StepGuard(ewma=0.1, warmup=100)
    losses = [2.0, 2.5, 1.5, 2.2, 1.8]
    run(guard, losses)
    out = guard.calculate()
    mean = sum(losses) / len(losses)
    var = sum((x - mean) ** 2 for x in losses) / len(losses)
    assert out["guard/loss_baseline"] == pytest.approx(mean, rel=1e-12)
    assert out["guard/loss_baseline_std"] == pytest.approx(math.sqrt(var), rel=1e-12)


def test_a_spike_needs_the_warmup_and_both_thresholds():
    base = [2.0, 2.1, 1.9, 2.0, 2.05, 1.95]
    guard = StepGuard(warmup=len(base), spike_z=6.0, spike_ratio=1.5)
    assert all(v.ok for v in run(guard, base[:5] + [3.5]))  # 3.5 comes before the warm-up ends
    guard = StepGuard(warmup=len(base), spike_z=6.0, spike_ratio=1.5)
    run(guard, base)
    v = guard.check(loss=pair(2.5))  # z far above 6, ratio 1.25: no spike
    assert v.ok and v.z > 6 and v.ratio == pytest.approx(2.5 / v.baseline_mean)
    v = guard.check(loss=pair(6.0))
    assert (v.action, v.reason, v.spike) == ("skip", "spike", True) and v.ratio > 2.5  # 2.5 joined the baseline
    assert "loss spike" in str(v)
    only_ratio = StepGuard(warmup=len(base), spike_z=None, spike_ratio=1.2)
    run(only_ratio, base)
    assert only_ratio.check(loss=pair(2.5)).spike
    off = StepGuard(warmup=len(base), spike_z=None, spike_ratio=None)
    run(off, base)
    assert off.check(loss=pair(1e6)).ok


def test_a_spike_answered_ok_is_counted_and_joins_the_baseline():
    guard = StepGuard(warmup=4, on_spike="ok", ewma=0.5)
    run(guard, [2.0, 2.1, 1.9, 2.0])
    v = guard.check(loss=pair(10.0))
    assert v.ok and v.spike and v.reason == "spike"
    out = guard.calculate()
    assert out["guard/spikes"] == 1 and out["guard/skipped"] == 0
    assert out["guard/loss_baseline"] > 5  # half of the weight went to 10


def test_a_skipped_spike_stays_out_of_the_baseline():
    guard = StepGuard(warmup=4)
    run(guard, [2.0, 2.1, 1.9, 2.0])
    before = guard.calculate(reset=False)["guard/loss_baseline"]
    assert guard.check(loss=pair(50.0)).skip
    assert guard.calculate()["guard/loss_baseline"] == before


def test_ratio_applies_where_the_baseline_mean_is_positive():
    guard = StepGuard(warmup=3, spike_z=None, spike_ratio=1.5)
    run(guard, [-2.0, -2.1, -1.9])  # an RL loss below zero: no ratio to speak of
    v = guard.check(loss=pair(5.0))
    assert v.ok and v.ratio is None


def test_a_fixed_seed_run_of_300_steps_has_no_false_verdict_and_finds_an_injected_spike():
    losses = noisy(300)
    guard = StepGuard(warmup=50)
    assert [v.step for v in run(guard, losses) if not v.ok] == []
    losses[220] *= 3  # every token's loss of one step
    guard = StepGuard(warmup=50)
    assert [(v.step, v.reason) for v in run(guard, losses) if not v.ok] == [(220, "spike")]


# ------------------------------------------------------------------ through the metrics
def test_counts_come_out_of_calculate_with_the_other_metrics_and_through_export():
    guard, loss_m = StepGuard(warmup=3), LossMetric(loss_reduction="sum")
    metrics = MetricCollection([loss_m, guard])
    for x in (2.0, 2.1, 1.9, NAN, 8.0, 2.0):
        reports = [{"lm loss": pair(x)}]
        if guard.check(loss=reports).ok:
            metrics.accumulate(None, reports)  # the guard adds nothing from other calls
    twin = StepGuard(warmup=3)
    twin.load_state_dict(guard.state_dict())
    sent = twin.export()
    out = metrics.calculate()
    want = {"guard/steps": 6, "guard/skipped": 2, "guard/stopped": 0, "guard/nonfinite_steps": 1,
            "guard/spikes": 1, "guard/first_bad_rank": 0, "guard/first_bad_step": 3}
    assert {k: out[k] for k in want} == want
    assert out["loss"] == pytest.approx(2.0)
    assert StepGuard(warmup=3).calculate_from([sent]) == {k: v for k, v in out.items() if k.startswith("guard/")}


def test_the_state_survives_a_resume_baseline_and_run_of_skips_included():
    losses = noisy(120, seed=3)
    losses[90] = NAN
    losses[91] = NAN
    losses[110] *= 4
    whole = StepGuard(warmup=20, max_skips=2)
    want = run(whole, losses)
    first = StepGuard(warmup=20, max_skips=2)
    got = run(first, losses[:91])  # stopped inside the run of skips
    resumed = StepGuard(warmup=20, max_skips=2)
    resumed.load_state_dict(first.state_dict())
    got += run(resumed, losses[91:])
    assert [(v.step, v.action, v.reason, v.streak) for v in got] == [(v.step, v.action, v.reason, v.streak)
                                                                      for v in want]
    assert [v.loss for v in got] == pytest.approx([v.loss for v in want], nan_ok=True)
    assert got[91].first.step == 90 and got[91].first.host is None  # learnt before the resume
    assert [v.baseline_mean for v in got] == [v.baseline_mean for v in want]
    assert resumed.calculate()["guard/loss_baseline"] == whole.calculate()["guard/loss_baseline"]


def test_a_checkpoint_of_another_policy_is_refused():
    saved = StepGuard(warmup=5).state_dict()
    other = StepGuard(warmup=6)
    before = other.state_dict()
    with pytest.raises(ValueError, match="warmup"):
        other.load_state_dict(saved)
    assert state_dict_differences(before, other.state_dict()) == []


# ------------------------------------------------------------------------ the policy
def test_the_policy_is_data_and_the_guard_is_built_from_it():
    policy = GuardPolicy(checks=("loss", "grad_norm"), max_skips=1, spike_z=None, warmup=10)
    guard = StepGuard.from_policy(policy)
    assert guard.policy == policy and guard.fingerprint() == StepGuard(**policy.arguments()).fingerprint()
    assert guard.fingerprint() != StepGuard().fingerprint()
    with pytest.raises(AttributeError):
        policy.max_skips = 3


@pytest.mark.parametrize("kwargs, match", [
    (dict(checks=("loss", "gradnorm")), "checks must name each of"),
    (dict(checks="loss"), "checks must be a tuple"),
    (dict(on_nonfinite="ok"), "on_nonfinite must be one of"),
    (dict(on_spike="warn"), "on_spike must be one of"),
    (dict(max_skips=-1), "max_skips must be an int >= 0"),
    (dict(spike_ratio=0.9), "spike_ratio must be a number above 1"),
    (dict(spike_z=math.nan), "spike_z must be a number above 0"),
    (dict(ewma=0.0), r"ewma must be a number in \(0, 1\]"),
    (dict(warmup=2.5), "warmup must be an int"),
])
def test_a_bad_policy_raises_naming_the_field(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        StepGuard(**kwargs)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(loss=torch.zeros(3)), ValueError, r"loss is a torch.float32 tensor of shape \[3\]"),
    (dict(loss=[{"loss": pair(1.0)}]), ValueError, r"loss\[0\] has no 'lm loss'"),
    (dict(loss="1.0"), TypeError, "loss must be a real number or a tensor"),
    (dict(loss=pair(1.0), grad_norm=torch.ones(2)), ValueError, "grad_norm must be a scalar"),
    (dict(loss=pair(1.0), values=[1.0, 2.0]), TypeError, r"values\[0\] must be a real tensor"),
    (dict(loss=pair(1.0), step=-1), ValueError, "step must be an int"),
    (dict(loss=pair(1.0), step=True), ValueError, "step must be an int"),
])
def test_bad_input_raises_naming_the_field_and_folds_nothing(kwargs, error, match):
    guard = StepGuard()
    run(guard, [1.0])
    before = guard.state_dict()
    with pytest.raises(error, match=match):
        guard.check(**kwargs)
    assert state_dict_differences(before, guard.state_dict()) == []


def test_update_folds_verdicts_only():
    guard = StepGuard()
    with pytest.raises(TypeError, match="verdict must be a Verdict"):
        guard.accumulate(None, None, verdict="ok")
    guard.accumulate(None, None, step=3, grad_norm=1.0)  # the common keywords: nothing to fold
    assert guard.calculate() == {}
    assert isinstance(guard.check(loss=pair(1.0)), Verdict)


# ------------------------------------------------------------------- what a step reads
def _device_reads(call):
    """The calls that wait for the device made by ``call()`` (host-only reads left out)."""
    seen = []
    with intercept_device_waits(lambda label: None if host_reads_active() else seen.append(label)):
        call()
    return seen


def test_a_healthy_step_reads_the_device_once_and_a_bad_step_more():
    guard = StepGuard(warmup=2)
    run(guard, [1.0, 1.0])
    losses = [{"lm loss": pair(1.0)}, {"lm loss": pair(1.1)}]
    assert _device_reads(lambda: guard.check(loss=losses, grad_norm=torch.tensor(2.0),
                                             values=torch.ones(4, 3))) == ["cpu"]
    bad = _device_reads(lambda: guard.check(loss=losses, grad_norm=torch.tensor(NAN)))
    assert bad[0] == "cpu" and len(bad) > 1
