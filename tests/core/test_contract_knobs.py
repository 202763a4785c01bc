"""The metric contract stays small: every knob (a State field, an Origin parameter, a public
class attribute of Metric) is counted here, and the general ones have their direct tests."""
import ast
import dataclasses
import inspect
import os

import pytest
import torch

from twinkle_metrics import GRPOMetric, LossMetric, Metric, MetricCollection, MetricSyncError, Origin, State
from twinkle_metrics.core import interval

ROOT = os.path.abspath(os.path.join(__file__, "../../.."))


def _knobs():
    state = [f.name for f in dataclasses.fields(State)]
    origin = [p for p in inspect.signature(Origin.__init__).parameters if p != "self"]
    methods = (property, staticmethod, classmethod)
    attributes = [k for k, v in vars(Metric).items()
                  if not k.startswith("_") and not callable(v) and not isinstance(v, methods)]
    return state, origin, attributes


def test_the_contract_has_at_most_16_knobs():
    state, origin, attributes = _knobs()
    assert len(state) + len(origin) + len(attributes) <= 16, (state, origin, attributes)
    # knobs that served one metric or none are gone: their metrics use the general ones
    for gone in ("optional", "legacy", "offset_by", "offset_column", "relative_to"):
        assert gone not in state
    assert origin == ["reading"]
    for gone in ("accepted_kwargs", "creates", "merge_reads", "merge"):
        assert not hasattr(Metric, gone), gone


def _shipped():
    """Every metric twinkle_metrics exports, as built by default (MoE with its sizes), plus
    the options that create states on demand."""
    import twinkle_metrics as tm

    classes = [getattr(tm, n) for n in tm.__all__]
    classes = [c for c in classes if inspect.isclass(c) and issubclass(c, Metric) and c is not Metric]
    out = [c(num_layers=2, num_experts=4) if c is tm.MoERoutingMetric else c() for c in classes]
    return out + [tm.GRPOMetric(top_k_kl=2, quantiles=(0.5,), entropy_from_logits=True),
                  tm.Accuracy(vocab_parallel=True)]


def test_every_knob_serves_two_shipped_metrics_or_is_a_tested_general_one():
    """A knob earns its place by what shipped metrics declare with it (two at least), or as a
    general idea with its example in docs/contract.md and its direct test here (Origin)."""
    state, _, attributes = _knobs()
    metrics = _shipped()
    base = State()
    users = {}
    for m in metrics:
        for spec in list(m.declarations.values()) + list(m.families.values()):
            for f in state:
                if getattr(spec, f) != getattr(base, f):
                    users.setdefault(f, set()).add(type(m).__name__)
        for a in attributes:
            if getattr(m, a) != getattr(Metric, a):
                users.setdefault(a, set()).add(type(m).__name__)
    general = {"keep"}  # general ideas: in docs/contract.md, with their direct tests below
    thin = {k: sorted(users.get(k, ())) for k in state + attributes if len(users.get(k, ())) < 2 and k not in general}
    assert thin == {}
    doc = open(os.path.join(ROOT, "docs", "contract.md")).read()
    assert "Origin(" in doc and all(f"`{a}`" in doc for a in attributes) and "keep=True" in doc


def test_collection_drives_metrics_through_public_or_package_functions():
    """core/collection.py reads no private member of another object (only its own)."""
    tree = ast.parse(open(os.path.join(ROOT, "twinkle_metrics", "core", "collection.py")).read())
    private = [(node.lineno, node.attr) for node in ast.walk(tree)
               if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
               and not (isinstance(node.value, ast.Name) and node.value.id == "self")]
    assert private == []


def test_a_fingerprint_names_the_class_and_its_schema_version_not_its_module():
    assert LossMetric().fingerprint().startswith("LossMetric/v1(loss_reduction='mean', ")


# ----------------------------------------------------------------------------- Origin
NOW = [100.0]


class _Clocked(Metric):
    """Steps per second since the previous calculate(), from two origins."""

    start = Origin(lambda: NOW[0])
    before = Origin("step")
    began = State("min", per_rank=True)
    ended = State("max", per_rank=True)
    first_step = State("min", torch.int64)
    step = State("max", torch.int64, local="last")

    def update(self, inputs, outputs, *, step=None, bad=False, **kwargs):
        if bad:
            raise ValueError("_Clocked: bad input")
        out = {"began": self.start, "ended": NOW[0]}
        if step is not None:
            out.update(step=step, first_step=self.before)
        return out

    def compute(self, s):
        if s["step"] < 0:
            return {"seconds": s["ended"] - s["began"]}
        return {"seconds": s["ended"] - s["began"], "steps": s["step"] - s["first_step"]}


def test_an_origin_is_read_as_each_interval_starts_and_holds_within_it():
    NOW[0] = 100.0
    m = _Clocked()  # the first interval starts at construction
    assert (m.start, m.before) == (100.0, 0)  # a state's origin is 0 before any number
    NOW[0] = 104.0
    m.accumulate(step=3)
    assert (m.start, m.before) == (100.0, 0)  # fixed for the interval
    NOW[0] = 106.0
    m.accumulate(step=5)
    assert m.calculate() == {"seconds": 6.0, "steps": 5}
    assert (m.start, m.before) == (106.0, 5)  # the next interval: the clock now, the newest step
    NOW[0] = 107.0
    m.accumulate()  # an interval without steps
    assert m.calculate() == {"seconds": 1.0}
    assert m.before == 5  # the newest step folded in, over any number of intervals
    NOW[0] = 110.0
    m.reset()
    assert (m.start, m.before) == (110.0, 5)


def test_a_state_origin_moves_only_with_what_was_folded_in():
    NOW[0] = 0.0
    m = _Clocked()
    with pytest.raises(ValueError, match="bad input"):
        m.accumulate(step=9, bad=True)
    coll = MetricCollection([m, LossMetric()])
    with pytest.raises(ValueError):  # the loss metric refuses: the call folds into no metric
        coll.accumulate(None, {"loss": torch.zeros(2, 3)}, step=8)
    m.accumulate(step=torch.tensor(7))  # a tensor is not read on the host: not followed
    m.calculate()
    assert m.before == 0
    m.accumulate(step=4)
    m.calculate()
    assert m.before == 4


def test_origin_takes_a_clock_or_a_state_name():
    for bad in (None, "", 3):
        with pytest.raises(TypeError, match="Origin: reading must be a callable"):
            Origin(bad)


def test_a_failed_interval_folds_back_from_the_earlier_origins(monkeypatch):
    """Values measured from an origin are absolute, reduced with "min": an interval that
    goes back under the next one keeps its start, and the interval keeps its origins."""
    NOW[0] = 10.0
    m = _Clocked()
    NOW[0] = 12.0
    m.accumulate(step=2)

    def fail(*a, **k):
        raise MetricSyncError("ranks disagree (simulated)")

    with monkeypatch.context() as p:
        p.setattr(interval, "sync_handed", fail)
        handle = m.calculate(async_op=True)  # the next interval starts at 12 s, after step 2
        NOW[0] = 15.0
        m.accumulate(step=6)
        with pytest.raises(MetricSyncError):
            handle.wait()
    assert m.states["began"].item() == 10.0  # settled: the earlier start stays under the later one
    assert (m.start, m.before) == (10.0, 0)  # and the interval goes on from the earlier origins
    NOW[0] = 16.0
    m.accumulate(step=7)
    assert m.calculate() == {"seconds": 6.0, "steps": 7}  # one interval from 10 s and step 0


# ------------------------------------------------------------------ kept states
class _Seen(Metric):
    """Tokens of the interval, and of the run (a state kept over calculate())."""

    tokens = State("sum", torch.int64)
    run_tokens = State("sum", torch.int64, keep=True)

    def update(self, inputs, outputs, *, n, **kwargs):
        return {"tokens": n, "run_tokens": n}

    def compute(self, s):
        return {"tokens": s["tokens"], "run_tokens": s["run_tokens"]}


def test_a_kept_state_outlives_calculate_a_resume_and_a_failed_interval(monkeypatch):
    m = _Seen().accumulate(n=3)
    assert m.calculate() == {"tokens": 3, "run_tokens": 3}
    m.accumulate(n=4)
    assert m.calculate() == {"tokens": 4, "run_tokens": 7}
    ranks = [_Seen().accumulate(n=2), _Seen().accumulate(n=5)]  # DP2 saves; DP1 resumes with both
    for r in ranks:
        r.calculate()
    resumed = _Seen().load_state_dict([r.accumulate(n=1).state_dict() for r in ranks])
    assert resumed.calculate() == {"tokens": 2, "run_tokens": 9}

    def fail(*a, **k):
        raise MetricSyncError("ranks disagree (simulated)")

    with monkeypatch.context() as p:
        p.setattr(interval, "sync_handed", fail)
        handle = resumed.calculate(async_op=True)  # handed off with run_tokens 9
        resumed.accumulate(n=10)                   # the next interval goes on from 9
        with pytest.raises(MetricSyncError):
            handle.wait()
    assert resumed.calculate() == {"tokens": 10, "run_tokens": 19}  # the failed interval under it, counted once
    assert resumed.reset().calculate() == {"tokens": 0, "run_tokens": 0}  # reset() starts a new run


# ------------------------------------------------------------------ callable reductions
def _top2(rows):
    """The two largest values of every rank's pair, largest first."""
    return rows.reshape(-1).sort(descending=True).values[:2]


def _top2_fold(old, new):
    return _top2(torch.stack([old, new]))


class _TopTwo(Metric):
    best = State(_top2, shape=(2,), default=float("-inf"), local=_top2_fold)

    def update(self, inputs, outputs, *, values, **kwargs):
        return {"best": _top2(torch.as_tensor(values, dtype=torch.float64).reshape(1, -1))}

    def compute(self, s):
        return {"best": s["best"]}


def test_a_callable_reduction_folds_calls_and_merges_ranks():
    a = _TopTwo().accumulate(values=[1.0, 5.0]).accumulate(values=[3.0, 0.5])
    b = _TopTwo().accumulate(values=[4.0, 2.0])
    assert a.states["best"].tolist() == [5.0, 3.0]  # its own fold, call by call
    # the states of two ranks merged as calculate() merges them, by the state's own reduction
    merged = _TopTwo().load_state_dict([a.state_dict(), b.state_dict()])
    assert merged.calculate() == {"best": [5.0, 4.0]}
    with pytest.raises(ValueError, match="a callable reduce needs an explicit default and local merge"):
        State(_top2, shape=(2,))
    with pytest.raises(ValueError, match="scope='stage' needs reduce 'sum', 'max' or 'min'"):
        State(_top2, shape=(2,), default=0.0, local=_top2_fold, scope="stage")


def test_grpo_records_are_one_state_with_its_own_reduction():
    """The top-k records and what places them (sequences counted, DP and CP rank) are one
    state: two ranks' records merge with the second rank's sequences after the first's."""
    m = GRPOMetric(top_k_kl=2)
    spec = m.declarations["topk"]
    assert callable(spec.reduce) and spec.shape == (3, 7)
    assert not {"n_seq", "dp_index", "cp_index"} & set(m.declarations)
    inf = float("-inf")
    rank0 = torch.tensor([[0.5, 1, 0, 0, 1, 0, 0], [0.2, 0, 3, 0, 1, 0, 0], [4, 0, 0, inf, inf, inf, inf]],
                         dtype=torch.float64)
    rank1 = torch.tensor([[0.3, 0, 2, 0, 1, 0, 0], [inf] * 7, [2, 1, 0, inf, inf, inf, inf]], dtype=torch.float64)
    merged = spec.merge(torch.stack([rank1, rank0]))  # rows in any order: the DP rank places them
    assert merged[:2, :2].tolist() == [[0.5, 1.0], [0.3, 4.0]]  # rank 1's sequence 0 is sequence 4
    assert merged[2, :3].tolist() == [6.0, 1.0, 0.0]


def test_a_load_starts_the_interval_with_origins_taken_at_the_load():
    """The clock is read at the load, and a state's origin is the newest number the saving
    metric had folded into it (kept over its resets, saved with the states)."""
    NOW[0] = 0.0
    saved = _Clocked()
    NOW[0] = 3.0
    saved.accumulate(step=9)
    saved.calculate()
    state = saved.state_dict()  # after a calculate: the step state is back at its default
    NOW[0] = 50.0
    m = _Clocked()
    NOW[0] = 60.0
    m.load_state_dict(state)
    assert (m.start, m.before) == (60.0, 9)
    NOW[0] = 62.0
    m.accumulate(step=12)
    assert m.calculate() == {"seconds": 2.0, "steps": 3}
    assert LossMetric().state_dict().keys() == LossMetric().states.keys() | {"__fingerprint__"}  # none followed
