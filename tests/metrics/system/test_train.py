"""Single-process tests of TrainMetric's memory peaks and of resuming it from a checkpoint,
against a controlled clock (torch's allocator counters stand in through torch's own
``torch.accelerator`` functions)."""
import math
import types

import pytest
import torch

import twinkle_metrics.metrics.system.train as train_module
from twinkle_metrics import LossMetric, MetricCollection, TrainMetric
from twinkle_metrics.testing import forbid_device_waits

GIB = 2 ** 30
#: seconds each step takes: uneven, so that a rate over other steps or other time differs
STEP_SECONDS = {k: 1.0 + (k % 4) * 0.5 for k in range(1, 16)}
RATES = ("iters", "speed", "step time", "tokens/s", "samples/s", "mfu")


@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(train_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    return now


def _steps(metric, clock, steps):
    """Each step takes its STEP_SECONDS, then is accumulated (2 micro steps per step)."""
    for k in steps:
        clock[0] += STEP_SECONDS[k]
        with forbid_device_waits():
            metric.accumulate(None, None, lr=1e-4, step=2 * k, gradient_accumulation_steps=2,
                              tokens=100 * k, samples=k)


def _make():
    return TrainMetric(flops_per_token=6.0, peak_flops=1e4)


def _rates(result):
    return {k: result[k] for k in RATES}


def _without_a_stop(clock, calculated_after: int):
    """What a run that never stopped reports for steps ``calculated_after + 1`` to 15, having
    calculated after step ``calculated_after``."""
    whole = _make()
    _steps(whole, clock, range(1, calculated_after + 1))
    whole.calculate()
    _steps(whole, clock, range(calculated_after + 1, 16))
    return whole.calculate()


def test_a_resume_mid_interval_reports_what_a_run_without_the_stop_reports(clock):
    """Saved after step 10 with no calculate since step 4; resumed 500 s later by a new
    metric on a clock that starts again: steps 5-15 read as one interval, as in a run that
    never stopped (the old code: speed from step 0 over the new clock's 5 steps)."""
    want = _without_a_stop(clock, 4)

    clock[0] = 0.0
    saved = _make()
    _steps(saved, clock, range(1, 5))
    saved.calculate()
    _steps(saved, clock, range(5, 11))
    state = saved.state_dict()
    clock[0] = 500.0  # another process: its clock has another zero
    resumed = _make().load_state_dict(state)
    _steps(resumed, clock, range(11, 16))
    got = resumed.calculate()
    assert got["iters"] == 15 and want["iters"] == 15
    assert _rates(got) == pytest.approx(_rates(want), rel=1e-12)
    assert want["speed"] == pytest.approx(11 / sum(STEP_SECONDS[k] for k in range(5, 16)), rel=1e-12)


def test_a_resume_after_a_calculate_counts_from_the_saved_step_and_the_load(clock):
    """The usual checkpoint, saved right after a calculate: the first interval after the
    resume is steps 11-15 and their time, as in the run that never stopped."""
    want = _without_a_stop(clock, 10)

    clock[0] = 0.0
    saved = _make()
    _steps(saved, clock, range(1, 11))
    saved.calculate()
    state = saved.state_dict()
    assert state["__followed__"] == {"step": 20}  # the step the next interval counts from
    clock[0] = 7.0
    resumed = _make()
    clock[0] = 900.0  # loaded much later than built: the interval starts at the load
    resumed.load_state_dict(state)
    _steps(resumed, clock, range(11, 16))
    got = resumed.calculate()
    assert _rates(got) == pytest.approx(_rates(want), rel=1e-12)
    assert got["speed"] == pytest.approx(5 / sum(STEP_SECONDS[k] for k in range(11, 16)), rel=1e-12)


def test_a_load_of_several_ranks_takes_their_longest_interval(clock):
    """Resuming at a smaller data-parallel size: the saved ranks' intervals merge into the
    longest, as calculate() would merge them, and the new steps add their own time."""
    saved = []
    for seconds in (3.0, 5.0):  # two ranks of the old run, one slower
        clock[0] = 0.0
        m = TrainMetric(counts="local")
        clock[0] = seconds
        m.accumulate(None, None, step=4, tokens=40)
        saved.append(m.state_dict())
    clock[0] = 100.0
    resumed = TrainMetric(counts="local").load_state_dict(saved)
    clock[0] = 102.0
    resumed.accumulate(None, None, step=6, tokens=20)
    got = resumed.calculate()
    assert got["speed"] == 6 / 7.0 and got["tokens/s"] == 100 / 7.0


def test_a_load_into_the_same_metric_keeps_its_clock(clock):
    m = _make()
    _steps(m, clock, range(1, 4))
    m.load_state_dict(m.state_dict())  # one clock: the interval simply goes on
    _steps(m, clock, range(4, 6))
    assert m.calculate()["speed"] == pytest.approx(5 / sum(STEP_SECONDS[k] for k in range(1, 6)), rel=1e-12)


def test_a_collection_resumes_its_train_metric_too(clock):
    coll = MetricCollection({"train": _make(), "loss": LossMetric(loss_reduction="sum")})
    _steps(coll["train"], clock, range(1, 11))
    coll.calculate()
    state = coll.state_dict()
    clock[0] = 50.0
    resumed = MetricCollection({"train": _make(), "loss": LossMetric(loss_reduction="sum")})
    resumed.load_state_dict(state)
    _steps(resumed["train"], clock, range(11, 13))
    assert resumed.calculate()["train/speed"] == pytest.approx(2 / (STEP_SECONDS[11] + STEP_SECONDS[12]))


def test_a_malformed_followed_record_is_refused():
    state = _make().state_dict()
    state["__followed__"] = {"steps": 3}
    m = _make()
    with pytest.raises(ValueError, match=r"TrainMetric.load_state_dict: '__followed__' of state dict 0 is "
                                         r"\{'steps': 3\}; expected numbers for states among \['step'\]"):
        m.load_state_dict(state)


# ------------------------------------------------------------------------ memory
def _allocator(monkeypatch, stats):
    """torch's allocator counters as an accelerator reports them."""
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "memory_stats", lambda *a: dict(stats))


def test_peak_memory_is_the_allocators_peak_and_names_its_rank(monkeypatch):
    _allocator(monkeypatch, {"allocated_bytes.all.peak": 3 * GIB + 5, "reserved_bytes.all.peak": 4 * GIB})
    m = TrainMetric()
    with forbid_device_waits():
        m.accumulate(None, None, step=1)
    _allocator(monkeypatch, {"allocated_bytes.all.peak": 2 * GIB, "reserved_bytes.all.peak": 6 * GIB})
    m.accumulate(None, None, step=2)  # a lower reading (the caller reset the counter) keeps the higher
    got = m.calculate()
    assert got["peak memory GiB"] == (3 * GIB + 5) / GIB and got["train/peak_memory_rank"] == 0
    assert got["train/peak_memory_reserved_gib"] == 6.0 and got["train/peak_memory_reserved_rank"] == 0
    assert set(got) <= set(TrainMetric.result_keys)


def test_no_memory_keys_before_the_allocator_starts_or_where_it_reports_nothing(monkeypatch):
    _allocator(monkeypatch, {})  # torch's counters are empty until the allocator starts
    assert not any("memory" in k for k in TrainMetric().accumulate(None, None, step=1).calculate())
    _allocator(monkeypatch, {"allocated_bytes.all.peak": GIB})  # no reserved counter
    got = TrainMetric().accumulate(None, None, step=1).calculate()
    assert got["peak memory GiB"] == 1.0 and "train/peak_memory_reserved_gib" not in got
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    assert "peak memory GiB" not in TrainMetric().accumulate(None, None, step=1).calculate()


def test_a_peak_past_the_packed_range_is_clamped_not_wrapped(monkeypatch):
    _allocator(monkeypatch, {"allocated_bytes.all.peak": 2 ** 50})
    got = TrainMetric().accumulate(None, None, step=1).calculate()
    assert got["peak memory GiB"] == ((2 ** 63 - 1) >> 20) / GIB and got["train/peak_memory_rank"] == 0
    assert math.isfinite(got["peak memory GiB"])


def test_a_checkpoint_of_the_states_before_version_2_is_refused():
    """v1 kept (start, end) and a per-data-group float peak: its numbers mean something else."""
    state = _make().state_dict()
    state["__fingerprint__"] = state["__fingerprint__"].replace("TrainMetric/v2(", "TrainMetric/v1(")
    with pytest.raises(ValueError, match="saved by version 1 of TrainMetric's states, this is version 2"):
        _make().load_state_dict(state)
