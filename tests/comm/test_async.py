"""Asynchronous calculate() in one process: same results, hand-off at the call, errors in wait()."""
import threading

import pytest
import torch

from tests.rlref import make_rl_batch, ragged
from twinkle_metrics import (
    Accuracy,
    DPOMetric,
    GRPOMetric,
    LossMetric,
    Metric,
    MetricCollection,
    MetricSyncError,
    State,
)
from twinkle_metrics.core import interval
from twinkle_metrics.integrations.loggers import Logger, LoggerGroup


def _collection():
    return MetricCollection({"grpo": GRPOMetric(top_k_kl=3), "dpo": DPOMetric(beta=0.2),
                             "acc": Accuracy(), "loss": LossMetric()})


def _feed(coll, b, rows):
    rows = torch.tensor(rows)
    lab = b["labels"][rows]
    coll["grpo"].accumulate({"labels": lab}, {"logps": b["logps"][rows]},
                            old_logps=ragged(b["old"][rows], lab), advantages=b["adv"][rows])
    coll["dpo"].accumulate({"labels": lab}, {"logps": b["logps"][rows]}, ref_outputs={"logps": b["ref"][rows]})
    coll["acc"].accumulate({"labels": lab}, {"logits": b["logits"][rows]})
    coll["loss"].accumulate({"labels": lab}, {"loss": b["logps"][rows].mean()})


def test_async_equals_sync_and_hands_the_interval_off():
    b = make_rl_batch(3, 8, 6)
    sync, asyn = _collection(), _collection()
    handles, expected = [], []
    for rows in ([0, 1, 2, 3], [4, 5], [6, 7]):
        _feed(sync, b, rows)
        _feed(asyn, b, rows)
        expected.append(sync.calculate())
        handles.append(asyn.calculate(async_op=True))  # next interval starts now: no wait
    got = [h.wait() for h in handles]
    assert got == expected  # exactly, key order included
    assert all(h.done() for h in handles)
    assert asyn.calculate() == {}  # every interval went to its handle


def test_async_reset_false_keeps_the_interval():
    b = make_rl_batch(3, 8, 6)
    m = _collection()
    _feed(m, b, [0, 1, 2, 3])
    first = m.calculate(async_op=True, reset=False).wait()
    assert m.calculate() == first


def test_async_error_surfaces_from_wait():
    class Loss(Metric):  # declares no result_keys: the clash shows when both return 'loss'
        total = State("sum")

        def update(self, inputs, outputs, **kwargs):
            return {"total": outputs["loss"]}

        def compute(self, s):
            return {"loss": s["total"]}

    coll = MetricCollection([Loss(), Loss()])
    for m in coll:
        m.accumulate(None, {"loss": torch.tensor(2.0)})
    handle = coll.calculate(async_op=True)
    with pytest.raises(ValueError, match="comes from two metrics"):
        handle.wait()
    with pytest.raises(ValueError, match="comes from two metrics"):  # every wait() says so
        handle.wait()


def test_wait_timeout_and_call_order(monkeypatch):
    release = threading.Event()
    real = interval.sync_handed

    def held(*args, **kwargs):
        release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(interval, "sync_handed", held)
    m = LossMetric()
    handles = []
    for loss in (1.0, 2.0, 3.0):
        m.accumulate({"labels": torch.tensor([[1]])}, {"loss": torch.tensor(loss)})
        handles.append(m.calculate(async_op=True))
    assert not handles[0].done()
    with pytest.raises(TimeoutError, match="did not complete within 0.05 s"):
        handles[0].wait(timeout=0.05)
    release.set()
    assert [h.wait(timeout=30)["loss"] for h in handles] == [1.0, 2.0, 3.0]


class _Recorder(Logger):
    def __init__(self):
        self.lines = []

    def log(self, results, step):
        self.lines.append((step, dict(results)))


def test_logger_group_writes_handles_in_order_when_they_complete(monkeypatch):
    release = threading.Event()
    real = interval.sync_handed
    monkeypatch.setattr(interval, "sync_handed", lambda *a, **k: (release.wait(30), real(*a, **k))[1])
    rec = _Recorder()
    group = LoggerGroup([rec])
    m = LossMetric()
    for step, loss in ((10, 1.0), (20, 2.0)):
        m.accumulate({"labels": torch.tensor([[1]])}, {"loss": torch.tensor(loss)})
        group.log(m.calculate(async_op=True), step)  # never blocks
    group.log({"note": 1.0}, 25)  # a plain dict waits behind the pending handles
    assert rec.lines == []
    release.set()
    group.close()  # waits for what is pending, then writes in call order
    assert rec.lines == [(10, {"loss": 1.0}), (20, {"loss": 2.0}), (25, {"note": 1.0})]


def test_logger_group_raises_a_failed_handle_once_and_keeps_logging(monkeypatch):
    """A loop that catches a failed sync keeps its logs: the failed entry raises once and
    leaves the queue; the entries behind it are written; close() writes what it can, closes
    the loggers and raises the first error."""
    calls = {"n": 0}
    real = interval.sync_handed

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] in (1, 3):  # the first and the third calculate fail
            raise MetricSyncError("ranks disagree (simulated)")
        return real(*a, **k)

    monkeypatch.setattr(interval, "sync_handed", flaky)
    rec = _Recorder()
    closed = []
    rec.close = lambda: closed.append(True)
    group = LoggerGroup([rec])
    m = LossMetric()

    def step(loss):
        m.accumulate({"labels": torch.tensor([[1]])}, {"loss": torch.tensor(loss)})
        return m.calculate(async_op=True)

    with pytest.raises(MetricSyncError):
        group.log(step(1.0), 10)   # fails
        group.flush(wait=True)
    group.log(step(2.0), 20)
    group.log({"note": 1.0}, 25)
    group.flush(wait=True)
    # the failed interval (1.0) was folded back into the metric: step 20 reports both
    assert rec.lines == [(20, {"loss": 1.5}), (25, {"note": 1.0})]
    group.log(step(3.0), 30)   # fails
    group.log({"note": 2.0}, 35)
    with pytest.raises(MetricSyncError, match="simulated"):
        group.close()
    assert rec.lines[-1] == (35, {"note": 2.0}) and closed == [True]
    assert m.calculate() == {"loss": 3.0}  # the last failed interval is back in the metric


def test_a_failed_handle_folds_its_interval_back_once(monkeypatch):
    """reset=True: the interval returns to the metric at the first wait() that raises,
    beside what it accumulated since, and a second wait() adds nothing more; reset=False
    kept the states, so nothing is folded back."""
    real = interval.sync_handed
    fail = {"on": True}

    def flaky(*a, **k):
        if fail["on"]:
            raise MetricSyncError("ranks disagree (simulated)")
        return real(*a, **k)

    monkeypatch.setattr(interval, "sync_handed", flaky)
    m = LossMetric(loss_reduction="sum")
    m.accumulate(None, {"loss": 6.0, "num_tokens": 2})
    handle = m.calculate(async_op=True)
    m.accumulate(None, {"loss": 4.0, "num_tokens": 3})  # the next interval goes on
    for _ in range(2):
        with pytest.raises(MetricSyncError):
            handle.wait()
    kept = m.calculate(reset=False, async_op=True)
    with pytest.raises(MetricSyncError):
        kept.wait()
    fail["on"] = False
    assert m.calculate() == {"loss": 2.0, "num_tokens": 5}


def test_a_folded_back_interval_keeps_grpo_record_indices(monkeypatch):
    """GRPO's top-k records of the interval accumulated after a failed hand-off come after
    the folded-back one's sequences, as if the two intervals had been one."""
    from twinkle_metrics.testing import assert_results_close

    b = make_rl_batch(5, 12, 8)

    def call(m, rows):
        r = torch.tensor(rows)
        m.accumulate({"labels": b["labels"][r]}, {"logps": b["logps"][r]}, old_logps=b["old"][r],
                     advantages=b["adv"][r])

    whole = GRPOMetric(top_k_kl=4)
    call(whole, range(6))
    call(whole, range(6, 12))
    want = whole.calculate()
    assert {r["gsi"] for r in want["_high_kl_records"]} & set(range(6, 12))  # later sequences matter

    def fail(*a, **k):
        raise MetricSyncError("ranks disagree (simulated)")

    m = GRPOMetric(top_k_kl=4)
    call(m, range(6))
    with monkeypatch.context() as p:
        p.setattr(interval, "sync_handed", fail)
        handle = m.calculate(async_op=True)
        call(m, range(6, 12))
        with pytest.raises(MetricSyncError):
            handle.wait()
    assert_results_close(m.calculate(), want, rel=1e-12)


class _Last(Metric):
    """A "last" state whose newest value may be its default (0)."""
    value = State("sum", local="last")

    def update(self, inputs, outputs, *, value=None, **kwargs):
        return {} if value is None else {"value": value}

    def compute(self, s):
        return {"value": s["value"]}


def test_failed_intervals_go_back_in_call_order_and_fold_as_accumulate_does(monkeypatch):
    """Two failed hand-offs in flight, then a good calculate: the same results as one
    interval of all three, with each state folded as accumulate folds a call: the newest
    "last" value wins even when it equals the default, GRPO's records keep their sequence
    order, global token counts add up and TrainMetric's clock runs from the first start."""
    import sys
    import types

    from twinkle_metrics import TrainMetric
    from twinkle_metrics.testing import assert_results_close

    b = make_rl_batch(5, 12, 8)

    def make():
        return MetricCollection({"loss": LossMetric(), "grpo": GRPOMetric(top_k_kl=4), "last": _Last(),
                                 "train": TrainMetric()})

    def step(m, k):
        r = torch.arange(4 * k, 4 * k + 4)
        m["loss"].accumulate(None, {"loss": float(k + 1)}, grad_norm=[5.0, 1.0, 2.0][k])
        m["grpo"].accumulate({"labels": b["labels"][r]}, {"logps": b["logps"][r]}, old_logps=b["old"][r],
                             advantages=b["adv"][r])
        m["last"].accumulate(None, None, value=[3.0, 0.0, None][k])
        m["train"].accumulate(None, None, lr=[1e-3, 1e-4, 1e-5][k], step=k + 1, tokens=256)

    def fail(*a, **k):
        raise MetricSyncError("ranks disagree (simulated)")

    want = make()
    for k in range(3):
        step(want, k)
    expected = want.calculate()
    assert {r["gsi"] for r in expected["grpo/_high_kl_records"]} - set(range(4))  # later sequences matter
    now = [100.0]  # a controlled clock: the interval starts at 100 s, steps at 101, 103, 105
    monkeypatch.setattr(sys.modules[TrainMetric.__module__], "time",
                        types.SimpleNamespace(perf_counter=lambda: now[0]))
    m = make()
    now[0] = 101.0
    step(m, 0)
    with monkeypatch.context() as p:
        p.setattr(interval, "sync_handed", fail)
        now[0] = 102.0
        first = m.calculate(async_op=True)
        now[0] = 103.0
        step(m, 1)
        now[0] = 104.0
        second = m.calculate(async_op=True)
        for h in (first, second):
            with pytest.raises(MetricSyncError):
                h.wait()
    now[0] = 105.0
    step(m, 2)
    assert m["train"].states["tokens"].item() == 768
    now[0] = 106.0
    got = m.calculate()

    def timeless(r):  # wall-clock readings differ between the two runs
        return {k: v for k, v in r.items() if not any(w in k for w in ("time", "speed", "/s", "slowest", "fastest"))}

    assert_results_close(timeless(got), timeless(expected), rel=1e-12)
    assert got["last/value"] == 0.0 and got["loss/grad_norm"] == 2.0
    assert got["train/tokens/s"] == 768 / 5  # from the first interval's start (100 s) to the last step


def test_intervals_given_back_late_land_once_and_resets_drop_them(monkeypatch):
    """A failed interval that comes back while a synchronous calculate runs stays for the
    next one; a queued calculate(reset=False) gets it too; reset() and loads drop intervals
    from before them, even those whose sync fails only afterwards."""

    real = interval.sync_handed
    plan = []  # per background job: (gate to wait for, fail?)

    def scripted(*a, **k):
        gate, fail = plan.pop(0)
        gate.wait(10)
        if fail:
            raise MetricSyncError("ranks disagree (simulated)")
        return real(*a, **k)

    monkeypatch.setattr(interval, "sync_handed", scripted)

    def call(m, loss, n):
        m.accumulate(None, {"loss": loss, "num_tokens": n})

    # 1. given back while a synchronous calculate() runs: reported by the next one
    m = LossMetric(loss_reduction="sum")
    gate = threading.Event()
    plan.append((gate, True))
    call(m, 6.0, 2)
    failed = m.calculate(async_op=True)
    call(m, 4.0, 3)
    real_sync = interval.sync_and_compute

    def sync_while_failing(*a, **k):
        gate.set()  # the failed interval comes back in the middle of this calculate
        with pytest.raises(MetricSyncError):
            failed.wait(10)
        return real_sync(*a, **k)

    monkeypatch.setattr(interval, "sync_and_compute", sync_while_failing)
    assert m.calculate() == {"loss": 4.0 / 3, "num_tokens": 3}
    monkeypatch.setattr(interval, "sync_and_compute", real_sync)
    assert m.calculate() == {"loss": 3.0, "num_tokens": 2}

    # 2. a calculate(reset=False) queued behind the failing one reports both, and keeps them
    gate = threading.Event()
    plan += [(gate, True), (gate, False)]
    call(m, 6.0, 2)
    failed = m.calculate(async_op=True)
    call(m, 4.0, 3)
    kept = m.calculate(reset=False, async_op=True)
    gate.set()
    with pytest.raises(MetricSyncError):
        failed.wait(10)
    assert kept.wait(10) == {"loss": 2.0, "num_tokens": 5}
    assert m.calculate() == {"loss": 2.0, "num_tokens": 5}

    # 3. reset() and load_state_dict() drop intervals handed off before them
    for drop in (lambda x: x.reset(), lambda x: x.load_state_dict(LossMetric(loss_reduction="sum").state_dict())):
        gate = threading.Event()
        plan.append((gate, True))
        call(m, 6.0, 2)
        failed = m.calculate(async_op=True)
        drop(m)
        gate.set()
        with pytest.raises(MetricSyncError):
            failed.wait(10)
        call(m, 1.0, 1)
        assert m.calculate() == {"loss": 1.0, "num_tokens": 1}
