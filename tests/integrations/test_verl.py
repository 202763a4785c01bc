"""``twinkle_metrics.integrations.verl.reduce_metrics`` against verl 0.9's own
``reduce_metrics`` (its file, loaded by path: ``tests/verlref.py``), one process."""
import copy
import json

import numpy as np
import pytest
import torch

from tests import verlref
from tests.rlref import make_rl_batch
from twinkle_metrics import GRPOMetric, LossMetric, Metric, MetricCollection, State
from twinkle_metrics.integrations.verl import exports_in, reduce_metrics
from twinkle_metrics.testing import assert_results_close


@pytest.fixture(scope="module")
def verl():
    return verlref.metric_utils()


def _plain(verl):
    """A driver's dict of the shapes verl's trainer hands its reduce_metrics."""
    clipfrac, kl = verl.Metric("mean"), verl.Metric(verl.AggregationType.SUM)
    clipfrac.extend([0.1, 0.3])
    kl.extend([1.0, torch.tensor(2.5)])
    return {
        "actor/pg_loss": [0.5, 1.25, 2.0],
        "actor/pg_clipfrac": clipfrac,
        "actor/kl_loss": kl,
        "actor/ratio_max": [1.5, 3.0, 2.0],
        "actor/ratio_min": np.array([0.5, 0.25]),
        "critic/vf_max_abs": [[1.0, 4.0], [2.0, 3.0]],
        "actor/lr": [1e-5, 1e-5],
        "perf/mfu/actor": [0.25, 0.5],
        "actor/grad_norm": 3.0,
        "response_length/mean": [7, 9, 12],
    }


def test_other_keys_reduce_exactly_as_verl_does(verl):
    ours, theirs = _plain(verl), _plain(verl)
    got = reduce_metrics(ours)
    want = verl.reduce_metrics(theirs)
    assert got is ours  # in place and returned, as verl's
    assert list(got) == list(want)
    for key in want:
        assert type(got[key]) is type(want[key]) and got[key] == want[key], key


def _worker_steps():
    """One worker's two mini-batches of (loss sum, tokens) reports, and the export of each."""
    reports = [[(6.0, 3), (1.0, 4)], [(2.5, 1)]]
    worker = MetricCollection({"lm": LossMetric(loss_reduction="sum")})
    exports = []
    for mini in reports:
        for loss, n in mini:
            worker.accumulate(None, {"loss": loss, "num_tokens": n})
        exports.append(json.loads(json.dumps(worker.export())))  # what travels through verl
    whole = LossMetric(loss_reduction="sum")
    for loss, n in (r for mini in reports for r in mini):
        whole.accumulate(None, {"loss": loss, "num_tokens": n})
    return exports, {f"lm/{k}": v for k, v in whole.calculate().items()}


def test_exports_merge_exactly_beside_verls_keys(verl):
    exports, whole = _worker_steps()
    ours = {"actor/twinkle": [[e] for e in exports], **_plain(verl)}
    got = reduce_metrics(ours)
    want = verl.reduce_metrics(_plain(verl))
    assert "actor/twinkle" not in got
    assert_results_close({k[len("actor/twinkle/"):]: v for k, v in got.items() if k.startswith("actor/twinkle/")},
                         whole)
    for key in want:
        assert got[key] == want[key], key


def test_one_export_alone_and_a_flat_list_read_alike():
    exports, whole = _worker_steps()
    flat = reduce_metrics({"t": list(exports)})
    nested = reduce_metrics({"t": [exports[:1], [exports[1:]]]})
    assert flat == nested
    assert_results_close({k[2:]: v for k, v in flat.items()}, whole)
    one = reduce_metrics({"t": exports[0]})
    assert one["t/lm/loss"] == 7.0 / 7


def test_intervals_are_not_merged_when_told_not_to():
    exports, _ = _worker_steps()
    metrics = {"actor/twinkle": exports}
    before = copy.deepcopy(metrics)
    with pytest.raises(ValueError, match="key 'actor/twinkle'.*interval"):
        reduce_metrics(metrics, merge_intervals=False)
    assert metrics == before


@pytest.mark.parametrize("spoil, error, match", [
    (lambda e: e + [1.0], ValueError, "1 other values"),
    (lambda e: [{**e[0], "version": 99}], ValueError, "version"),
    (lambda e: [{k: v for k, v in e[0].items() if k != "place"}], (TypeError, ValueError), "place"),
])
def test_a_bad_key_raises_naming_it_and_changes_nothing(verl, spoil, error, match):
    exports, _ = _worker_steps()
    metrics = {"actor/twinkle": spoil(exports), **_plain(verl)}
    before = copy.deepcopy(metrics)
    with pytest.raises(error, match=match) as info:
        reduce_metrics(metrics)
    assert "key 'actor/twinkle'" in str(info.value)
    assert metrics.keys() == before.keys()
    assert metrics["actor/pg_loss"] == before["actor/pg_loss"] and metrics["actor/twinkle"] == before["actor/twinkle"]


def test_results_never_overwrite_a_key():
    exports, _ = _worker_steps()
    with pytest.raises(ValueError, match="overwrite"):
        reduce_metrics({"t": exports, "t/lm/loss": [1.0]})


class _Peak(Metric):
    """A metric of one's own: not rebuilt from an export, so the driver's is given."""
    peak = State("max")

    def update(self, inputs, outputs, **kwargs):
        return {"peak": torch.as_tensor(outputs["value"], dtype=torch.float64).amax()}

    def compute(self, s):
        return {"peak": s["peak"]}


def test_a_metric_of_ones_own_takes_the_drivers_metric():
    worker = _Peak()
    worker.accumulate(None, {"value": [1.0, 5.0]})
    exported = [worker.export()]
    worker.accumulate(None, {"value": [7.0]})
    exported.append(worker.export())
    with pytest.raises(ValueError, match="not a metric class of twinkle_metrics"):
        reduce_metrics({"own": list(exported)})
    assert reduce_metrics({"own": list(exported)}, drivers={"own": _Peak()}) == {"own/peak": 7.0}
    with pytest.raises(ValueError, match="hold no exports"):
        reduce_metrics({"own": exported, "x": [1.0]}, drivers={"own": _Peak(), "x": _Peak()})


def test_exports_as_json_text_merge_alike_and_bad_text_names_the_key(verl):
    """An export as ``json.dumps(export)`` (what a JSON transport carries), alone or in lists,
    merges as the export does; text that does not parse, and a key verl's rule cannot reduce,
    raise naming the key before anything changes."""
    exports, whole = _worker_steps()
    texts = [json.dumps(e) for e in exports]
    as_text = reduce_metrics({"t": [[texts[0]], texts[1]]})
    assert as_text == reduce_metrics({"t": exports})
    assert_results_close({k[2:]: v for k, v in as_text.items()}, whole)
    assert reduce_metrics({"t": json.dumps(exports)}) == as_text  # one text of the list
    for bad, error, match in (([texts[0][:-9], texts[1]], ValueError, "does not parse"),
                              (["not a number", "x"], TypeError, "holds list"),
                              ([texts[0], "x"], ValueError, "1 other values")):
        metrics = {"actor/t": bad, **_plain(verl)}
        before = copy.deepcopy(metrics)
        with pytest.raises(error, match=match) as info:
            reduce_metrics(metrics)
        assert "key 'actor/t'" in str(info.value)
        assert metrics.keys() == before.keys() and metrics["actor/t"] == bad
        assert metrics["actor/pg_loss"] == before["actor/pg_loss"]


def test_results_that_are_not_numbers_go_to_records_not_to_the_logged_metrics():
    """GRPO's ``_high_kl_records`` (a list of dicts) never enters what verl logs."""
    b = make_rl_batch(1)
    worker = MetricCollection({"grpo": GRPOMetric(top_k_kl=3)})
    worker["grpo"].accumulate({"labels": b["labels"]}, {"logps": b["logps"]}, old_logps=b["old"],
                              advantages=b["adv"])
    export = json.loads(json.dumps(worker.export()))
    whole = GRPOMetric(top_k_kl=3)
    whole.accumulate({"labels": b["labels"]}, {"logps": b["logps"]}, old_logps=b["old"], advantages=b["adv"])
    want = whole.calculate()
    got = reduce_metrics({"actor/twinkle": [export]})
    assert all(isinstance(v, (int, float)) for v in got.values())
    assert got["actor/twinkle/grpo/train/approx_kl"] == want["train/approx_kl"]
    assert "actor/twinkle/grpo/_high_kl_records" not in got
    records = {}
    again = reduce_metrics({"actor/twinkle": [export]}, records=records)
    assert again == got and records == {"actor/twinkle/grpo/_high_kl_records": want["_high_kl_records"]}
    assert len(want["_high_kl_records"]) == 3


def test_exports_in_reads_only_exports():
    exports, _ = _worker_steps()
    assert exports_in([1.0, 2.0]) is None and exports_in(3.0) is None and exports_in([]) is None
    assert exports_in([[exports[0]], exports[1]]) == exports
