"""Fault injection, single process: autograd, all-or-nothing, fingerprints, exact integers,
resuming at another data-parallel size, misspelt keywords.

The multi-rank half (schemas that differ between ranks, TP disagreement, timeouts,
collectives inside accumulate) is in test_faults_dist.py and test_exchange_dist.py.
"""
import gc
import math
import weakref

import pytest
import torch

from tests.refmetric import TokenStats, make_batch
from tests.rlref import make_rl_batch, ref_grpo
from twinkle_metrics import (
    Accuracy,
    CISPOMetric,
    CompletionRewardMetric,
    DPOMetric,
    EmbeddingMetric,
    GRPOMetric,
    LossMetric,
    Metric,
    MetricCollection,
    State,
    TrainMetric,
)
from twinkle_metrics.core.state import interval_of
from twinkle_metrics.testing import merged_results, state_dict_differences


# ----------------------------------------------------------------------------- autograd
def _graph_inputs():
    """(caller-side leaf, per-metric (metric, call)) where every output requires grad."""
    w = torch.randn(3, requires_grad=True)
    b = make_rl_batch(3)
    scale = w.sum() * 0 + 1  # carries the graph into every output below
    emb = torch.randn(6, 16) * scale
    rl = {"logps": b["logps"] * scale}
    labels = torch.randint(0, 7, (2, 5))
    calls = [
        (EmbeddingMetric(), ({"labels": torch.tensor([1, 0, 1, 0, 1, 0])},
                             {"embeddings": emb, "loss": scale * 2.0}), {"grad_norm": scale}),
        (CompletionRewardMetric(), (None, None), {"rewards": {"acc": torch.rand(4) * scale},
                                                  "completion_lengths": torch.tensor([3.0, 4, 5, 6]) * scale}),
        (LossMetric(loss_reduction="sum"), (None, {"loss": scale * 3.0, "num_tokens": 4}), {"grad_norm": scale}),
        (GRPOMetric(top_k_kl=2), ({"labels": b["labels"]}, rl),
         {"old_logps": b["old"] * scale, "advantages": b["adv"] * scale}),
        (DPOMetric(), ({"labels": b["labels"][:4]}, {"logps": b["logps"][:4] * scale}),
         {"ref_outputs": {"logps": b["old"][:4] * scale}}),
        (Accuracy(), ({"labels": labels}, {"logits": torch.randn(2, 5, 7) * scale}), {}),
    ]
    return w, calls


def test_states_never_hold_the_autograd_graph():
    _, calls = _graph_inputs()
    for metric, (inputs, outputs), kw in calls:
        metric.accumulate(inputs, outputs, **kw)
        for name, t in metric.states.items():
            assert not t.requires_grad and t.grad_fn is None, (type(metric).__name__, name)


def test_dropping_the_outputs_frees_their_graph():
    for i in range(6):
        w, calls = _graph_inputs()
        metric, (inputs, outputs), kw = calls[i]
        metric.accumulate(inputs, outputs, **kw)
        ref = weakref.ref(w)
        del w, calls, inputs, outputs, kw
        gc.collect()
        assert ref() is None, type(metric).__name__  # nothing in the metric reaches the graph
        assert metric.calculate()  # and the numbers are there


# --------------------------------------------------------------------- all or nothing
def test_collection_accumulate_is_all_or_nothing():
    labels = torch.randint(0, 5, (2, 4))
    coll = MetricCollection([LossMetric(), Accuracy(), TrainMetric()])
    before = coll.state_dict()
    bad_logits = torch.randn(2, 3, 5, 9)  # 4-D: Accuracy rejects labels of another shape
    with pytest.raises(ValueError, match="Accuracy: labels"):
        coll.accumulate({"labels": labels}, {"loss": 2.0, "logits": bad_logits}, step=7)
    assert not state_dict_differences(coll.state_dict(), before)
    assert interval_of(coll[2]).last_host == {}  # host bookkeeping (an Origin's step) waits for the commit too
    coll.accumulate({"labels": labels}, {"loss": 2.0, "logits": torch.randn(2, 4, 5)}, step=7)
    assert coll.calculate()["loss"] == 2.0  # counted once


def test_load_state_dict_is_all_or_nothing():
    src = MetricCollection([LossMetric(), Accuracy()])
    src.accumulate({"labels": torch.tensor([[1, 2]])}, {"loss": 1.0, "logits": torch.randn(1, 2, 4)})
    saved = src.state_dict()
    dst = MetricCollection([LossMetric(), Accuracy(ignore_index=0)])  # another argument
    dst.accumulate(None, {"loss": 5.0})
    before = dst.state_dict()
    with pytest.raises(ValueError, match="ignore_index=-100.* but this metric is .*ignore_index=0"):
        dst.load_state_dict(saved)
    assert not state_dict_differences(dst.state_dict(), before)  # the LossMetric was not loaded either
    saved["1:"]["total"] = torch.zeros(3, dtype=torch.int64)  # a bad shape in one state
    m = Accuracy()
    m.accumulate({"labels": torch.tensor([[1]])}, {"logits": torch.randn(1, 1, 4)})
    before = m.state_dict()
    with pytest.raises(ValueError, match="shape"):
        m.load_state_dict(saved["1:"])
    assert not state_dict_differences(m.state_dict(), before)


@pytest.mark.parametrize("saver,loader", [
    (lambda: LossMetric(loss_reduction="sum"), lambda: LossMetric(loss_reduction="mean")),
    (lambda: DPOMetric(beta=0.1), lambda: DPOMetric(beta=1.0)),
    (lambda: GRPOMetric(), lambda: CISPOMetric()),
    (lambda: CISPOMetric(), lambda: GRPOMetric()),
    (lambda: GRPOMetric(epsilon=0.2), lambda: GRPOMetric(epsilon=0.3)),
    (lambda: Accuracy(vocab_parallel=True), lambda: Accuracy()),
])
def test_arguments_that_change_meaning_are_in_the_fingerprint(saver, loader):
    a, b = saver(), loader()
    assert a.fingerprint() != b.fingerprint()
    with pytest.raises(ValueError, match="saved by .* but this metric is"):
        b.load_state_dict(a.state_dict())
    saver().load_state_dict(a.state_dict())  # the same arguments load


def test_fingerprint_leaves_out_what_does_not_change_meaning():
    assert GRPOMetric(entropy_chunk_size=4).fingerprint() == GRPOMetric().fingerprint()
    assert (CompletionRewardMetric(reward_names=["a"]).fingerprint()
            == CompletionRewardMetric().fingerprint())


# ------------------------------------------------------------------------ exact integers
class _Big(Metric):
    n = State("sum", torch.int64)
    hi = State("max", torch.int64)
    lo = State("min", torch.int64)
    untouched_hi = State("max", torch.int64)

    def update(self, inputs, outputs, value=None, **kw):
        return {"n": value, "hi": value, "lo": value}

    def compute(self, s):
        return dict(s)


def test_int64_states_are_exact_beyond_2_pow_53():
    m = _Big()
    big = 2 ** 53 + 1
    m.accumulate(value=big).accumulate(value=torch.tensor(big))
    got = m.calculate()
    assert got["n"] == 2 * big and got["hi"] == got["lo"] == big
    assert got["untouched_hi"] == -(2 ** 63 - 1)  # the identity, exactly, never 2**63 as a float
    step = 2 ** 60 + 3
    t = TrainMetric()
    t.accumulate(step=step)
    assert t.calculate()["iters"] == step


def _untouched_extreme_cases():
    """(metric, inputs, outputs, kwargs, max/min states the call leaves at their identity):
    calls that produce some keys but never touch those extremes."""
    b = make_rl_batch(3)
    return [
        (TrainMetric(), None, None, {"lr": 1e-4}, ("step", "rank_step_time_max", "rank_step_time_min")),
        (TrainMetric(), None, None, {"step": 3}, ("lr", "lr_groups")),
        (LossMetric(), None, {"loss": 2.0}, {}, ("grad_norm",)),
        (GRPOMetric(top_k_kl=2), {"labels": b["labels"]}, {"logps": b["logps"]}, {},
         ("logr_max", "logr_min", "adv_min", "adv_max")),
        (EmbeddingMetric(), None, {"loss": 2.0}, {}, ("pos_min", "pos_max", "grad_norm")),
        (CompletionRewardMetric(), None, None, {"rewards": {"acc": [1.0, 0.0]}}, ("len_min", "len_max")),
    ]


def _is_identity(t):
    """A max/min state still at its identity: +-inf, or int64's extremes."""
    t = t.double() if not t.is_floating_point() else t
    return bool((t.isinf() | (t.abs() >= 2.0 ** 62)).all())


def _values(value):
    return [v for x in value for v in _values(x)] if isinstance(value, (list, tuple)) else [value]


@pytest.mark.parametrize("case", range(6))
def test_untouched_extremes_never_leak_out(case):
    metric, inputs, outputs, kw, untouched = _untouched_extreme_cases()[case]
    metric.accumulate(inputs, outputs, **kw)
    for name in untouched:  # the premise: these states were left at their identity
        assert _is_identity(metric.states[name]), (name, metric.states[name])
    got = metric.calculate()
    assert got, metric  # something is reported, so the loop below checks values
    for key, value in got.items():
        for v in _values(value):
            assert isinstance(v, (int, float)) and math.isfinite(v) and abs(v) < 2 ** 62, (key, value)


# ------------------------------------------------------------- resume at another DP size
def test_load_state_dicts_of_several_ranks_equals_the_uninterrupted_run():
    labels, values = make_batch(5, n_seq=12)
    whole = TokenStats().accumulate({"labels": labels}, {"values": values}).calculate()
    shards = [TokenStats().accumulate({"labels": labels[i:i + 3]}, {"values": values[i:i + 3]})
              for i in range(0, 12, 3)]  # four ranks of the saved run
    saved = [m.state_dict() for m in shards]
    resumed = [TokenStats().load_state_dict(saved[:2]), TokenStats().load_state_dict(saved[2:])]
    got = merged_results(resumed)  # two ranks of the resumed run
    assert got["tokens"] == whole["tokens"] and got["max"] == whole["max"]
    assert math.isclose(got["mean"], whole["mean"], rel_tol=1e-12)


def test_load_state_dicts_merges_rewards_seen_on_some_ranks_only():
    a, b = CompletionRewardMetric(), CompletionRewardMetric()
    a.accumulate(rewards={"acc": [1.0, 2.0]})
    b.accumulate(rewards={"acc": [3.0], "fmt": [0.5]})
    whole = CompletionRewardMetric().accumulate(rewards={"acc": [1.0, 2.0, 3.0], "fmt": [0.5]})
    merged = CompletionRewardMetric().load_state_dict([a.state_dict(), b.state_dict()])
    got, want = merged.calculate(), whole.calculate()
    assert got.keys() == want.keys()
    for k in want:
        assert math.isclose(got[k], want[k], rel_tol=1e-12), k


# ------------------------------------------------------------------- misspelt keywords
def test_misspelt_keywords_raise_with_a_suggestion():
    b = make_rl_batch(2)
    with pytest.raises(TypeError, match="'old_logp'.*did you mean 'old_logps'"):
        GRPOMetric().accumulate({"labels": b["labels"]}, {"logps": b["logps"]}, old_logp=b["old"])
    with pytest.raises(TypeError, match="'grad_norms'.*did you mean 'grad_norm'"):
        LossMetric().accumulate(None, {"loss": 1.0}, grad_norms=1.0)
    m = LossMetric()
    m.accumulate(None, {"loss": 1.0}, lr=1e-4, step=3)  # Twinkle's common keywords: every metric takes them
    with pytest.raises(TypeError, match="LossMetric.accumulate: unexpected keyword argument 'old_logps'"):
        m.accumulate(None, {"loss": 1.0}, old_logps=None)  # another metric's: only where that metric is
    coll = MetricCollection([m, GRPOMetric()])
    coll.accumulate(None, {"loss": 1.0}, old_logps=None)  # the collection's members take it
    assert m.calculate() == {"loss": 1.0}


def test_a_collection_takes_one_shared_kwargs_dict():
    b = make_rl_batch(4)
    coll = MetricCollection([TrainMetric(), LossMetric(), GRPOMetric()])
    kwargs = dict(lr=1e-4, step=1, grad_norm=0.5, old_logps=b["old"])
    coll.accumulate({"labels": b["labels"]}, {"logps": b["logps"], "loss": 2.0}, **kwargs)
    out = coll.calculate()
    assert out["loss"] == 2.0 and out["grad_norm"] == 0.5
    assert math.isclose(out["train/approx_kl"], ref_grpo(b)["train/approx_kl"], rel_tol=1e-12)  # old_logps reached it
    with pytest.raises(TypeError, match="did you mean 'grad_norm'"):
        coll.accumulate(None, {"loss": 2.0}, grad_nrm=0.5)


# ------------------------------------------------------------ a mesh that cannot reduce
def test_layout_only_mesh_raises_in_calculate():
    from parallel import DeviceMesh

    mesh = DeviceMesh.from_sizes(dp_size=2, tp_size=2, create_groups=False)
    m = TokenStats(mesh)
    labels, values = make_batch(1)
    m.accumulate({"labels": labels}, {"values": values})
    before = m.state_dict()
    with pytest.raises(RuntimeError, match="layout-only"):
        m.calculate()
    assert not state_dict_differences(m.state_dict(), before)  # nothing reset, nothing lost
