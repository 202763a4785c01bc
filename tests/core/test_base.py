"""Single-process tests of the metric base, states, collection and microbatch helper."""
import math

import pytest
import torch

from parallel import DeviceMesh, Layout
from tests.refmetric import TokenStats, make_batch
from twinkle_metrics import GRPOMetric, Metric, MetricCollection, State, UnknownArgumentWarning, microbatches
from twinkle_metrics.testing import DeviceWaitError, assert_results_close, forbid_device_waits


def _whole(labels, values):
    return TokenStats().accumulate({"labels": labels}, {"values": values}).calculate()


def _plain(labels, values):
    """TokenStats' results recomputed with Python floats over the unmasked tokens."""
    kept = [v for lrow, vrow in zip(labels.tolist(), values.tolist()) for y, v in zip(lrow, vrow) if y != -100]
    return {"mean": sum(kept) / len(kept), "max": max(kept), "min": min(kept), "tokens": len(kept)}


def test_states_declared_once_and_reset_restores_defaults():
    m = TokenStats()
    assert list(m.declarations) == ["total", "count", "peak", "low"]
    assert m.count.dtype == torch.int64 and m.total.dtype == torch.float64
    labels, values = make_batch(0)
    m.accumulate({"labels": labels}, {"values": values})
    assert m.count == _plain(labels, values)["tokens"]
    m.reset()
    assert m.total == 0 and m.count == 0 and m.peak == -math.inf and m.low == math.inf


def test_states_cannot_be_assigned():
    with pytest.raises(AttributeError, match="metric state"):
        TokenStats().total = torch.tensor(1.0)


def test_calculate_resets_and_returns_plain_numbers():
    labels, values = make_batch(1)
    m = TokenStats().accumulate({"labels": labels}, {"values": values})
    res = m.calculate(reset=False)
    assert type(res["tokens"]) is int and type(res["mean"]) is float
    assert m.calculate() == res
    assert m.calculate() == {}


def test_microbatch_list_equals_whole_batch():
    labels, values = make_batch(2)
    whole = _whole(labels, values)
    feats = [{"labels": labels[:3]}, {"labels": labels[3:]}]
    as_list = TokenStats().accumulate(feats, {"values": [values[:3], values[3:]]}).calculate()
    as_cat = TokenStats().accumulate(feats, {"values": values}).calculate()
    as_dicts = TokenStats().accumulate(feats, [{"values": values[:3]}, {"values": values[3:]}]).calculate()
    for got in (as_list, as_cat, as_dicts):
        assert_results_close(got, whole)


def test_empty_list_contributes_nothing():
    m = TokenStats().accumulate([], {})
    assert m.calculate() == {}


def test_microbatch_errors_name_metric_field_and_shapes():
    labels, values = make_batch(3)
    feats = [{"labels": labels[:3]}, {"labels": labels[3:]}]
    with pytest.raises(ValueError, match=r"TokenStats: outputs\['values'\] has 3 entries but there are 2"):
        microbatches("TokenStats", feats, {"values": [values] * 3}, ("values",))
    with pytest.raises(ValueError, match=r"shape \[9, 8\] but the 2 input microbatches hold 10"):
        microbatches("TokenStats", feats, {"values": values[:9]}, ("values",))
    with pytest.raises(ValueError, match="single value but there are 2"):
        microbatches("TokenStats", feats, {"values": torch.tensor(1.0)}, ("values",))
    with pytest.raises(TypeError, match=r"inputs\[1\] is a int"):
        microbatches("TokenStats", [{"labels": labels}, 3], {}, ("values",))
    with pytest.raises(ValueError, match="2 input microbatches but 1 output dicts"):
        microbatches("TokenStats", feats, [{"values": values}], ("values",))


def test_failed_accumulate_loses_nothing():
    labels, values = make_batch(4)
    m = TokenStats().accumulate({"labels": labels}, {"values": values})
    before = {k: v.clone() for k, v in m.states.items()}
    with pytest.raises(ValueError):
        m.accumulate([{"labels": labels[:3]}, {"labels": labels[3:]}], {"values": values[:9]})
    for k, v in m.states.items():
        assert torch.equal(v, before[k])


def test_bad_contribution_shape_changes_no_state():
    class Two(Metric):
        a = State("sum")
        b = State("sum", shape=(2,))

        def update(self, inputs, outputs, **kw):
            return {"a": 1.0, "b": torch.ones(3)}

        def compute(self, s):
            return s

    m = Two()
    with pytest.raises(ValueError, match=r"state 'b' has shape \[3\], expected \[2\]"):
        m.accumulate()
    assert m.a == 0


class _AllOps(Metric):
    """One state per fold kind, so the grouped (foreach) fold is checked state by state."""
    n = State("sum", torch.int64)
    total = State("sum")
    vec = State("sum", shape=(3,))
    hi = State("max")
    lo = State("min")
    ihi = State("max", torch.int64)
    last = State("max", torch.int64, local="last")
    pair = State(lambda rows: rows.sum(0), shape=(2,), default=0.0,
                 local=lambda old, new: torch.stack([old[0] + new[0], torch.maximum(old[1], new[1])]))

    def update(self, inputs, outputs, **kw):
        return dict(outputs)

    def compute(self, s):
        return s


def _fold_one(spec, old, new):
    """What folding ``new`` into a state means, one op per state (the definition)."""
    new = torch.as_tensor(new).to(old.dtype)
    op = spec.local or spec.reduce
    if callable(op):
        old.copy_(op(old, new))
    elif op == "sum":
        old.add_(new)
    elif op == "max":
        torch.maximum(old, new, out=old)
    elif op == "min":
        torch.minimum(old, new, out=old)
    else:  # last
        old.copy_(new)


def _fold_reference(calls):
    """The per-state fold (what the grouped fold must equal)."""
    ref = _AllOps()
    for c in calls:
        for name, value in c.items():
            _fold_one(ref.declarations[name], ref.states[name], value)
    return ref


def test_grouped_fold_equals_per_state_fold():
    calls = [
        {"n": torch.tensor(3), "total": torch.tensor(1.5, dtype=torch.float64), "vec": torch.arange(3.0),
         "hi": 2.0, "lo": torch.tensor(-1.0), "ihi": 7, "last": 4, "pair": torch.tensor([1.0, 5.0])},
        {"n": 2, "total": 0.25, "vec": 1.0, "hi": torch.tensor(-3.0, dtype=torch.float64),
         "lo": -2.5, "ihi": torch.tensor(9), "last": torch.tensor(1), "pair": torch.tensor([2.0, 4.0])},
        {"hi": float("nan"), "n": torch.tensor(True), "total": 2 ** 60},
    ]
    m = _AllOps()
    for c in calls:
        m.accumulate(None, c)
    ref = _fold_reference(calls)
    for name, t in m.states.items():
        assert t.dtype == ref.states[name].dtype and t.shape == ref.states[name].shape, name
        assert torch.equal(t, ref.states[name]) or (t.isnan().all() and ref.states[name].isnan().all()), name
    assert m.n == 6 and m.last == 1 and m.pair.tolist() == [3.0, 5.0] and math.isnan(m.hi)


@pytest.mark.parametrize("bad", [
    {"vec": torch.ones(4)},                                           # shape
    {"ihi": 2 ** 70},                                                 # int64 overflow
    {"pair": torch.ones(5)},                                          # shape of a callable's input
    {"pair": torch.tensor(1.0)},                                      # callable merge raises
    {"nope": 1.0},                                                    # unknown state
])
def test_grouped_fold_is_all_or_nothing(bad):
    m = _AllOps().accumulate(None, {"n": 1, "total": 1.0, "hi": 1.0, "lo": 1.0, "ihi": 1, "last": 1,
                                    "pair": torch.tensor([1.0, 1.0]), "vec": torch.ones(3)})
    before = {k: v.clone() for k, v in m.states.items()}
    good = {"n": torch.tensor(5), "total": 2.0, "hi": torch.tensor(9.0), "lo": -9.0, "ihi": 9, "last": 9,
            "pair": torch.tensor([9.0, 9.0]), "vec": torch.full((3,), 9.0)}
    with pytest.raises((ValueError, RuntimeError, KeyError, IndexError, OverflowError)):
        m.accumulate(None, {**good, **bad})  # the bad entry comes last: the good ones were staged
    for k, v in m.states.items():
        assert torch.equal(v, before[k]), k


def test_accumulate_never_waits_for_device():
    labels, values = make_batch(5)
    m = TokenStats()
    with forbid_device_waits():
        m.accumulate([{"labels": labels[:4]}, {"labels": labels[4:]}], {"values": values})
    assert m.count == _plain(labels, values)["tokens"]  # both microbatches counted


def test_guard_catches_waits():
    t = torch.ones(3)
    counts = torch.tensor([1, 2, 0])

    def assign():
        t[t > 5] = 0.0

    waits = (lambda: t.item(), lambda: t.tolist(), lambda: float(t[0]), lambda: bool(t[0]),
             lambda: t[t > 0], lambda: torch.nonzero(t), lambda: t.cpu(), lambda: torch.equal(t, t),
             lambda: t[0].is_nonzero(), lambda: counts.bincount(), lambda: torch.bincount(counts),
             lambda: torch.where(t > 0), lambda: t.repeat_interleave(counts),
             lambda: torch.repeat_interleave(t, counts), assign, lambda: t.to("cpu"),
             lambda: t.to(device="cpu:0"))
    with forbid_device_waits():
        for i, fn in enumerate(waits):
            with pytest.raises(DeviceWaitError):
                fn()
                raise AssertionError(f"call {i} was not caught")
        # the same calls in forms that do not wait pass
        torch.where(t > 0, t, 0.0)
        t.repeat_interleave(2)
        t.repeat_interleave(counts, output_size=3)
        t[torch.tensor([0, 1])] = 1.0
        t.to(torch.float64)
        t.to(t.device, non_blocking=True)   # to the tensor's own device: no host read
        t.clone().copy_(t)                  # host to host (device to host is caught on a GPU)
    assert t.sum().item() == 3.0 and torch.equal(t, t)  # restored afterwards


def test_fold_helpers_merge_numbers_and_tensors():
    from twinkle_metrics.core import fold

    out = {}
    for v in (2.0, torch.tensor(5.0), 1):
        fold.add(out, "sum", v)
        fold.maximum(out, "max", v)
        fold.minimum(out, "min", v)
    assert out["sum"].item() == 8.0 and out["max"].item() == 5.0 and out["min"].item() == 1.0
    numbers = {}
    for v in (3, 7, 5):
        fold.maximum(numbers, "max", v)
        fold.minimum(numbers, "min", v)
    assert numbers == {"max": 7, "min": 3}
    rows = {}
    fold.maximum(rows, "peak", torch.tensor([1.0, 4.0]))
    fold.maximum(rows, "peak", torch.tensor([3.0, 2.0]))
    assert rows["peak"].tolist() == [3.0, 4.0]


def test_guard_leaves_torch_as_it_was():
    """The guard restores torch exactly: no attribute of torch.Tensor or torch changes, and
    tensors of 0-d tensors still build (a Tensor.__getitem__ once assigned would make
    tensors look like sequences to torch.tensor)."""
    before = (dict(vars(torch.Tensor)), dict(vars(torch)))
    with forbid_device_waits():
        pass
    assert (dict(vars(torch.Tensor)), dict(vars(torch))) == before
    t = torch.tensor(2.0)
    assert torch.tensor([[t, t]]).tolist() == [[2.0, 2.0]]


def test_state_dict_roundtrip_and_errors():
    labels, values = make_batch(6)
    m = TokenStats().accumulate({"labels": labels}, {"values": values})
    sd = m.state_dict()
    assert_results_close(TokenStats().load_state_dict(sd).calculate(), m.calculate())
    with pytest.raises(ValueError, match="missing states"):
        TokenStats().load_state_dict({"total": torch.tensor(0.0)})


def test_collection_prefixes_and_collisions():
    labels, values = make_batch(7)
    coll = MetricCollection({"a": TokenStats(), "b": TokenStats()})
    coll.accumulate({"labels": labels}, {"values": values})
    res = coll.calculate()
    want = _plain(labels, values)
    assert_results_close(res, {f"{p}/{k}": v for p in "ab" for k, v in want.items()}, rel=1e-12)
    flat = MetricCollection([TokenStats(), TokenStats()])
    flat.accumulate({"labels": labels}, {"values": values})
    with pytest.raises(ValueError, match="comes from two metrics"):
        flat.calculate()
    assert flat[0].count == flat[1].count == want["tokens"]  # the error lost nothing


def test_collection_state_dict():
    labels, values = make_batch(8)
    coll = MetricCollection({"a": TokenStats()}).accumulate({"labels": labels}, {"values": values})
    other = MetricCollection({"a": TokenStats()}).load_state_dict(coll.state_dict())
    assert_results_close(other.calculate(), coll.calculate())


def test_unknown_constructor_arguments_warn_and_bad_meshes_raise():
    # Twinkle's metrics ignore unknown constructor arguments; ours warn and ignore them
    with pytest.warns(UnknownArgumentWarning, match="TokenStats: ignoring unknown constructor argument 'bogus'"):
        m = TokenStats(None, None, bogus=1)
    assert "bogus" not in m.fingerprint() and not hasattr(m, "bogus")
    with pytest.raises(TypeError, match="device_mesh must be a parallel.DeviceMesh"):
        TokenStats("dp")


def test_state_declaration_errors():
    with pytest.raises(ValueError, match="reduce must be one of"):
        State("mean")
    with pytest.raises(ValueError, match="dtype must be"):
        State("sum", torch.float32)
    with pytest.raises(ValueError, match="callable reduce needs"):
        State(lambda rows: rows[0])


def test_single_process_mesh_is_degenerate():
    mesh = DeviceMesh.current()
    assert (mesh.dp_size, mesh.tp_size, mesh.pp_size, mesh.cp_size, mesh.data_size) == (1, 1, 1, 1, 1)
    assert mesh.is_last_stage and mesh.is_first_stage and mesh.data_group is None


def test_layout_only_mesh_before_init():
    mesh = DeviceMesh.from_sizes(tp_size=2, pp_size=2, dp_size=2)
    assert (mesh.tp_size, mesh.pp_size, mesh.dp_size, mesh.data_size) == (2, 2, 2, 2)
    assert mesh.data_group is None


def test_layout_matches_megatron_rank_generator_rules():
    lay = Layout(tp=2, pp=2, dp=2)
    assert lay.all_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.all_groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.all_groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert Layout(tp=2, cp=2, dp=2).all_groups("dp-cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert Layout(tp=2, dp=4, ep=4).all_groups("ep") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert lay.coords(5) == {"tp": 1, "cp": 0, "dp": 0, "pp": 1, "ep": 0}


def test_layout_validation_messages():
    with pytest.raises(ValueError, match="tp_size must be a positive int, got 0"):
        Layout(tp=0)
    with pytest.raises(ValueError, match="order must name each"):
        Layout(order="tp-dp-pp")
    with pytest.raises(ValueError, match="world has 8 ranks"):
        DeviceMesh.from_sizes(tp_size=2, dp_size=2, world_size=8)
    with pytest.raises(TypeError, match="unsupported arguments"):
        DeviceMesh.from_sizes(hsdp_size=2)
    with pytest.raises(ValueError, match="fsdp_size with pp_size > 1"):
        DeviceMesh.from_sizes(fsdp_size=2, pp_size=2)
    with pytest.raises(ValueError, match="cp_size or ulysses_size"):
        DeviceMesh.from_sizes(cp_size=2, ulysses_size=2)


def test_twinkle_size_keywords():
    # Twinkle's from_sizes(fsdp_size=4, dp_size=2): 8 data ranks; ulysses splits tokens like CP.
    mesh = DeviceMesh.from_sizes(fsdp_size=4, dp_size=2, tp_size=2, sequence_parallel=True,
                                 device_type="cuda")
    assert (mesh.dp_size, mesh.tp_size, mesh.data_size) == (8, 2, 8)
    mesh = DeviceMesh.from_sizes(ulysses_size=2, dp_size=2)
    assert (mesh.cp_size, mesh.dp_size, mesh.data_size) == (2, 2, 4)


def test_merged_shards_equal_whole_batch():
    from twinkle_metrics.testing import merged_results

    labels, values = make_batch(9)
    whole = _whole(labels, values)
    shards = [TokenStats().accumulate({"labels": labels[i:i + 3]}, {"values": values[i:i + 3]})
              for i in range(0, labels.shape[0], 3)]
    shards.append(TokenStats())  # a rank that saw nothing
    assert_results_close(merged_results(shards), whole)
    with pytest.raises(ValueError, match="same metric"):
        merged_results([TokenStats(), MetricCollection])


def _readme_masked_mean():
    """The ``MaskedMean`` of the README's "Writing a metric" block, executed as written."""
    import os
    import re

    with open(os.path.join(os.path.abspath(os.path.join(__file__, "../../..")), "README.md")) as f:
        readme = f.read()
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "class MaskedMean" in b)
    scope = {}
    exec(block, scope)  # noqa: S102 - the documented example, run as a user would copy it
    return scope["MaskedMean"]


@pytest.mark.e2e  # runs launch/example_custom_metric.py: launch/ is loaded only from the end-to-end tier
def test_documented_custom_metric_reports_the_max_over_microbatches():
    import importlib.util
    import os

    path = os.path.join(os.path.abspath(os.path.join(__file__, "../../..")), "launch", "example_custom_metric.py")
    spec = importlib.util.spec_from_file_location("example_custom_metric", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    labels = torch.tensor([[1, 2, -100], [3, -100, -100]])
    values = torch.tensor([[9.0, 1.0, 50.0], [2.0, 70.0, 80.0]], dtype=torch.float64)  # max 9 in mb 0
    for cls in (example.MaskedMean, _readme_masked_mean()):
        got = cls().accumulate([{"labels": labels[:1]}, {"labels": labels[1:]}],
                               {"values": values}).calculate()
        assert got == {"mean": 12.0 / 3, "max": 9.0, "tokens": 3}, (cls, got)


def test_twinkle_names_on_a_single_rank_mesh():
    from twinkle_metrics import DeviceMesh as Exported

    mesh = Exported.single()
    assert Exported is DeviceMesh and mesh.create_process_group(["dp"]) is None
    with pytest.raises(ValueError, match=r"no group over axes \['dp', 'tp'\]; known: "):
        mesh.create_process_group(["dp", "tp"])


def test_state_dict_differences_names_what_changed():
    from twinkle_metrics.testing import state_dict_differences

    a = {"0:": {"x": torch.tensor([1.0, float("nan")]), "n": torch.tensor(3)}, "__fingerprint__": "M()"}
    same = {"0:": {"x": torch.tensor([1.0, float("nan")]), "n": torch.tensor(3)}, "__fingerprint__": "M()"}
    assert state_dict_differences(a, same) == []  # NaN equals NaN
    other = {"0:": {"x": torch.tensor([1.0, 2.0]), "n": torch.tensor(3.0)}, "__fingerprint__": "N()"}
    assert sorted(state_dict_differences(a, other)) == ["0:/n", "0:/x", "__fingerprint__"]
    assert state_dict_differences({"x": torch.zeros(1)}, {"y": torch.zeros(1)}) == ["x", "y"]


def test_state_scope_is_validated():
    with pytest.raises(ValueError, match="scope must be one of"):
        State("sum", scope="pipeline")
    with pytest.raises(ValueError, match="needs reduce 'sum', 'max' or 'min'"):
        State(lambda rows: rows[0], default=0.0, local="last", scope="model")
    with pytest.raises(ValueError, match="drop per_rank"):
        State("max", scope="model", per_rank=True)
    # ranks must agree on the scope: it is part of what they compare
    assert State("sum").signature != State("sum", scope="stage").signature


def test_states_move_to_an_accelerator_in_one_copy_per_dtype():
    """``move_states`` (first accumulate on a GPU, ``reset()`` there, ``Metric.to``): the
    host states of each dtype travel as one block, each state a view of it with its own
    shape; the meta device stands in for the accelerator (no data, the same code path)."""
    from twinkle_metrics.core.state import move_states, new_states
    m = GRPOMetric(top_k_kl=3)
    moved = move_states(m.states, "meta")
    assert list(moved) == list(m.states)
    for name, t in moved.items():
        src = m.states[name]
        assert t.device.type == "meta" and t.dtype == src.dtype and t.shape == src.shape, name
    bases = {}
    for t in moved.values():
        bases.setdefault(t.dtype, set()).add(id(t._base))
    assert all(len(b) == 1 and None not in b for b in bases.values()), bases  # one block per dtype
    fresh = new_states(m.declarations, "meta")
    assert {k: (v.dtype, v.shape) for k, v in fresh.items()} == {k: (v.dtype, v.shape) for k, v in moved.items()}
    assert new_states(m.declarations, "cpu").keys() == m.states.keys()
    for name, t in new_states(m.declarations, "cpu").items():
        assert torch.equal(t, m.declarations[name].new("cpu")), name


def test_reset_states_are_disjoint_views_of_one_fresh_block_per_dtype():
    """``reset()`` cuts every state out of one copy of its dtype's defaults: folding into one
    state leaves the others at their defaults, and the next reset leaves the states handed
    out before it alone."""
    m = GRPOMetric(top_k_kl=3)
    before = m.states
    bases = {}
    for t in before.values():
        bases.setdefault(t.dtype, set()).add(id(t._base))
    assert all(len(b) == 1 and None not in b for b in bases.values()), bases
    name = next(n for n, t in before.items() if t.dtype == torch.float64 and t.shape == ())
    before[name].add_(5.0)
    for n, t in before.items():
        if n != name:
            assert torch.equal(t, m.declarations[n].new("cpu")), n
    m.reset()
    assert before[name].item() == m.declarations[name].new("cpu").item() + 5.0
    assert all(torch.equal(t, m.declarations[n].new("cpu")) for n, t in m.states.items())


class _CountsCalls(Metric):
    """An update that names its one keyword and takes no **kwargs."""
    calls = State("sum", torch.int64)

    def update(self, inputs, outputs, *, weight=1):
        return {"calls": weight}

    def compute(self, s):
        return {"calls": int(s["calls"])}


def test_a_shared_kwargs_dict_reaches_updates_without_kwargs():
    """A trainer passes one kwargs dict to every metric of a collection: an update that
    does not take **kwargs gets the keywords it names and no others."""
    from twinkle_metrics import ModelNormMetric, MoERoutingMetric, TrainMetric

    lin = torch.nn.Linear(2, 1)
    lin.weight.grad = torch.ones_like(lin.weight)
    coll = MetricCollection({"train": TrainMetric(), "norm": ModelNormMetric(model=lin),
                             "moe": MoERoutingMetric(num_layers=1, num_experts=2), "calls": _CountsCalls()})
    coll.accumulate(None, None, lr=1e-4, step=1, weight=3)
    got = coll.calculate()
    assert got["calls/calls"] == 3 and got["train/learning rate"] == 1e-4
    assert got["norm/norm/grad"] == pytest.approx(math.sqrt(2))
    with pytest.raises(TypeError, match="unexpected keyword argument 'wieght'; did you mean 'weight'"):
        _CountsCalls().accumulate(None, None, wieght=3)
