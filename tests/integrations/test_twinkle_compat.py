"""A ModelScope Twinkle training loop with only the import switched.

Twinkle (``twinkle-kit``) is not a test dependency: it pulls transformers, modelscope,
datasets, peft, accelerate and a ``numpy<2.3`` pin (about 1 GB besides torch) and needs
Python >= 3.11. So every test runs with ``TwinkleLikeMesh``, which has the fields, the
``from_sizes`` axis order and the ``create_process_group`` of Twinkle's ``DeviceMesh``
(twinkle-kit 0.5.1, ``twinkle/utils/device_mesh.py``), and, where twinkle is
importable (the benchmark environment, ``make test-twinkle``), again with Twinkle's
own mesh, comparing the numbers with Twinkle's own metrics where Twinkle reduces.
"""
import contextlib
import inspect
import math
import warnings
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pytest
import torch
import torch.distributed as dist

import twinkle_metrics
from parallel import DeviceMesh, is_twinkle_mesh
from tests.refmetric import dp_shards
from twinkle_metrics import LossMetric, MetricCollection, UnknownArgumentWarning
from twinkle_metrics.testing import assert_results_close, forbid_device_waits

pytestmark = pytest.mark.xdist_group("dist")

N_SEQ, SEQ_LEN, VOCAB, STEPS = 10, 6, 7, 3
ENDS = (2, 3)  # calculate() after these steps: two intervals
LRS = ([1e-4, 2e-5], [9e-5, 1.8e-5], [8e-5, 1.6e-5])  # two param groups
GRAD_NORMS = (1.5, 0.75, 2.25)
CLOCK_KEYS = ("total time elapse", "speed")
# Twinkle's string formats: loss '%.4f', grad_norm '%.6f', accuracy '%.2f', lr '%.6e'
TWINKLE_ABS = {"loss": 5e-5, "grad_norm": 5e-7, "accuracy": 5e-3}


@dataclass
class TwinkleLikeMesh:
    """What our metrics read of Twinkle's ``DeviceMesh``: a numpy array of global
    ranks, the axis names (``from_sizes`` orders them fsdp, pp, dp, cp, tp; the last
    varies fastest), the size fields, and ``create_process_group(dims)``, which, like
    Twinkle's, calls ``new_group`` for the caller's group only: the ranks differing
    from it only along ``dims``."""

    mesh: np.ndarray
    mesh_dim_names: tuple
    ep_size: Optional[int] = None
    etp_size: Optional[int] = None
    ep_fsdp_size: Optional[int] = None
    vpp_size: Optional[int] = None
    ulysses_size: Optional[int] = None
    sequence_parallel: bool = False
    device_type: Optional[str] = "cpu"

    @staticmethod
    def from_sizes(*, dp_size=1, fsdp_size=None, tp_size=None, pp_size=None, cp_size=None,
                   ulysses_size=None, vpp_size=None):
        axes = [(name, size) for name, size in (("fsdp", fsdp_size), ("pp", pp_size), ("dp", dp_size),
                                                ("cp", cp_size), ("tp", tp_size)) if size is not None]
        shape = [size for _, size in axes]
        return TwinkleLikeMesh(np.arange(math.prod(shape)).reshape(shape), tuple(n for n, _ in axes),
                               vpp_size=vpp_size, ulysses_size=ulysses_size)

    def create_process_group(self, dims):
        where = np.argwhere(self.mesh == dist.get_rank())[0]
        index = tuple(slice(None) if name in dims else int(where[i])
                      for i, name in enumerate(self.mesh_dim_names))
        return dist.new_group(ranks=sorted(self.mesh[index].flatten().tolist()))


def _mesh_class(kind):
    if kind == "twinkle":
        from twinkle.utils.device_mesh import DeviceMesh as TwinkleDeviceMesh

        return TwinkleDeviceMesh
    return TwinkleLikeMesh


@pytest.fixture(params=["stand-in", "twinkle"])
def kind(request):
    if request.param == "twinkle":
        pytest.importorskip("twinkle.metric", reason="twinkle-kit is installed only in benchmarks/.venv")
    return request.param


# ------------------------------------------------------------------ the loop
def twinkle_loop(M, mesh, process_group, steps, loss_reduction, guard=None):
    """Twinkle's model loop (``TransformersModel.accumulate_metrics``): metrics built
    positionally from ``M`` (``twinkle.metric`` or ``twinkle_metrics``), one shared
    kwargs dict per step, ``calculate()`` of each metric merged at interval ends."""
    metrics = [M.LossMetric(mesh, process_group), M.Accuracy(mesh, process_group),
               M.TrainMetric(mesh, process_group)]
    intervals = []
    for step, (inputs, outputs) in enumerate(steps, 1):
        with guard() if guard else contextlib.nullcontext():
            for m in metrics:
                m.accumulate(inputs, outputs, lr=LRS[step - 1], step=step, gradient_accumulation_steps=1,
                             grad_norm=GRAD_NORMS[step - 1], loss_reduction=loss_reduction)
        if step in ENDS:
            results = {}
            for m in metrics:
                results.update(m.calculate())
            intervals.append(results)
    return intervals


def make_batch(step):
    """InputFeature / ModelOutput fields of the whole batch of ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    labels = torch.randint(0, VOCAB, (N_SEQ, SEQ_LEN), generator=g)
    labels[torch.rand(N_SEQ, SEQ_LEN, generator=g) < 0.3] = -100
    logits = torch.randn(N_SEQ, SEQ_LEN, VOCAB, generator=g)
    token_loss = torch.nn.functional.cross_entropy(logits.double().transpose(1, 2), labels, reduction="none")
    return labels, logits, token_loss


def shard_steps(rows, loss_reduction):
    """(InputFeature, ModelOutput) per step for the sequences ``rows`` of each batch."""
    steps = []
    for step in range(1, STEPS + 1):
        labels, logits, token_loss = make_batch(step)
        lab, lg, tl = labels[rows], logits[rows], token_loss[rows]
        n = int((lab != -100).sum())
        loss = tl.sum() if loss_reduction == "sum" else tl.sum() / n
        steps.append(({"input_ids": lab.clamp(min=0), "labels": lab},
                      {"logits": lg, "loss": loss, "num_tokens": torch.tensor(n)}))
    return steps


def reference(shards, loss_reduction):
    """Plain-Python results per interval for a batch split into ``shards`` (lists of
    sequence indices): what an exact reduction over the data ranks gives."""
    out, first = [], 1
    for end in ENDS:
        loss_sum = tokens = correct = calls = mean_sum = 0
        for step in range(first, end + 1):
            labels, logits, token_loss = make_batch(step)
            for rows in shards:
                shard_loss = shard_tokens = 0
                for i in rows:
                    for j in range(SEQ_LEN):
                        label = int(labels[i, j])
                        if label == -100:
                            continue
                        row = logits[i, j].tolist()
                        correct += row.index(max(row)) == label
                        shard_loss += float(token_loss[i, j])
                        shard_tokens += 1
                loss_sum, tokens = loss_sum + shard_loss, tokens + shard_tokens
                calls, mean_sum = calls + 1, mean_sum + shard_loss / shard_tokens
        lr = LRS[end - 1]
        out.append({"loss": loss_sum / tokens if loss_reduction == "sum" else mean_sum / calls,
                    "grad_norm": GRAD_NORMS[end - 1], "accuracy": correct / tokens,
                    "correct_tokens": correct, "total_tokens": tokens,
                    "learning rate(param group 1)": lr[0], "learning rate(param group 2)": lr[1],
                    "iters": end})
        first = end + 1
    return out


def check_against(ours, want):
    """Our results agree with ``want`` on its keys (clock readings: present only)."""
    for got, expected in zip(ours, want, strict=True):
        assert set(CLOCK_KEYS) <= set(got)
        assert_results_close({k: got[k] for k in expected}, expected, rel=1e-9)


def check_against_twinkle(ours, theirs):
    """Every key Twinkle reports is ours too, with the number its string shows."""
    for got, tw in zip(ours, theirs, strict=True):
        assert set(tw) <= set(got), sorted(set(tw) - set(got))
        for key, text in tw.items():
            if key in CLOCK_KEYS:
                continue
            value = float(text)
            if key.startswith("learning rate"):
                assert got[key] == pytest.approx(value, rel=5e-7), key
            elif key in TWINKLE_ABS:
                assert abs(got[key] - value) <= TWINKLE_ABS[key] + 1e-12, (key, got[key], text)
            else:
                assert got[key] == value, (key, got[key], text)


# ----------------------------------------------------- single process
@pytest.mark.parametrize("loss_reduction", ["sum", "mean"])
def test_twinkle_loop_single_process(kind, loss_reduction):
    mesh = _mesh_class(kind).from_sizes()  # Twinkle's default: one rank, axis 'dp'
    steps = shard_steps(list(range(N_SEQ)), loss_reduction)
    ours = twinkle_loop(twinkle_metrics, mesh, None, steps, loss_reduction, guard=forbid_device_waits)
    check_against(ours, reference([range(N_SEQ)], loss_reduction))
    if kind == "twinkle":
        import twinkle.metric

        check_against_twinkle(ours, twinkle_loop(twinkle.metric, mesh, None, steps, loss_reduction))


def test_twinkle_mesh_is_converted_by_axis_names_and_sizes(kind):
    cls = _mesh_class(kind)
    tw = cls.from_sizes(fsdp_size=2, dp_size=2, tp_size=2)
    assert is_twinkle_mesh(tw)
    metric = LossMetric(tw, None)
    mesh = metric.device_mesh
    assert isinstance(mesh, DeviceMesh) and mesh.source == "twinkle"
    # fsdp ranks hold different data, as Twinkle's data_rank says: they join DP
    assert (mesh.dp_size, mesh.tp_size, mesh.pp_size, mesh.cp_size, mesh.data_size) == (4, 2, 1, 1, 4)
    assert LossMetric(tw, None).device_mesh is mesh  # converted once per Twinkle mesh
    coll = MetricCollection([LossMetric()], device_mesh=tw)
    assert coll[0].device_mesh is mesh
    # Ulysses splits each batch over data ranks: the CP role
    uly = DeviceMesh.from_twinkle(cls.from_sizes(dp_size=4, pp_size=2, ulysses_size=2))
    assert (uly.dp_size, uly.cp_size, uly.pp_size, uly.data_size) == (2, 2, 2, 4)
    # before init_process_group the mesh holds sizes only, and refuses to reduce nothing
    with pytest.raises(RuntimeError, match="layout-only"):
        metric.calculate()


def test_other_meshes_are_refused_with_the_fix():
    class TorchLike:  # a torch DeviceMesh has named axes but no create_process_group
        mesh_dim_names = ("dp",)
        mesh = torch.arange(2)

    with pytest.raises(TypeError, match=r"LossMetric: device_mesh must be .*DeviceMesh.from_torch"):
        LossMetric(TorchLike())
    bad = TwinkleLikeMesh(np.arange(4).reshape(2, 2), ("dp", "tp"), ulysses_size=3)
    with pytest.raises(ValueError, match="ulysses_size 3 must divide dp x fsdp = 2"):
        LossMetric(bad)
    twice = TwinkleLikeMesh(np.array([[0, 1], [1, 2]]), ("dp", "tp"))
    with pytest.raises(ValueError, match="global ranks 0..3 once"):
        LossMetric(twice)


def _exported_metrics():
    return [obj for obj in vars(twinkle_metrics).values()
            if inspect.isclass(obj) and issubclass(obj, twinkle_metrics.Metric) and obj is not twinkle_metrics.Metric]


# Constructor arguments without a default (metrics Twinkle does not have).
REQUIRED = {"MoERoutingMetric": dict(num_layers=2, num_experts=4)}


@pytest.mark.parametrize("cls", _exported_metrics(), ids=lambda c: c.__name__)
def test_twinkle_constructor_positional_mesh_and_unknown_kwargs(cls):
    first, second = list(inspect.signature(cls.__init__).parameters)[1:3]
    assert (first, second) == ("device_mesh", "process_group")
    required = REQUIRED.get(cls.__name__, {})
    plain = cls(DeviceMesh.single(), None, **required)
    key = f"only_in_twinkle_for_{cls.__name__}"
    with pytest.warns(UnknownArgumentWarning) as caught:
        m = cls(DeviceMesh.single(), None, **required, **{key: 1})
    [w] = caught
    assert f"{cls.__name__}: ignoring unknown constructor argument {key!r}" in str(w.message)
    assert w.filename == __file__  # points at the line that built the metric
    assert m.fingerprint() == plain.fingerprint() and not hasattr(m, key)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cls(None, None, **required, **{key: 2})  # once per class and argument


def test_a_misspelt_argument_raises_and_an_extra_one_warns():
    with pytest.raises(TypeError, match=r"'loss_reductoin': did you mean 'loss_reduction'\?"):
        LossMetric(None, None, loss_reductoin="sum")  # would silently build a 'mean' metric
    with pytest.warns(UnknownArgumentWarning, match=r"ignoring unknown constructor argument 'adapter_name'"):
        LossMetric(None, None, adapter_name="default")  # Twinkle's constructors take **kwargs: extras pass


# -------------------------------------------------------------- 8 ranks
def _coords(tw, rank):
    return dict(zip(tw.mesh_dim_names, (int(c) for c in np.argwhere(tw.mesh == rank)[0])))


def _slice(tw, rank, axes):
    """Sorted ranks that differ from ``rank`` only along ``axes``."""
    c = _coords(tw, rank)
    index = tuple(slice(None) if n in axes else c[n] for n in tw.mesh_dim_names)
    return sorted(int(r) for r in tw.mesh[index].flatten())


def case_twinkle_loop(kind):
    import twinkle_metrics as M

    me = dist.get_rank()
    cls = _mesh_class(kind)
    out = {}
    # FSDP2 x DP4 with the process group Twinkle's model builds and hands its metrics.
    # (Twinkle's create_process_group calls new_group for the caller's group only, so
    # it needs a mesh where the group spans every rank: with TP it would hang.)
    tw = cls.from_sizes(fsdp_size=2, dp_size=4)
    pg = tw.create_process_group(["dp", "fsdp"])
    c = _coords(tw, me)
    steps = shard_steps(list(dp_shards(N_SEQ, 8)[c["dp"] * 2 + c["fsdp"]]), "sum")  # Twinkle's data_rank
    out["dp8"] = twinkle_loop(M, tw, pg, steps, "sum")
    if kind == "twinkle":
        import twinkle.metric

        out["dp8_twinkle"] = twinkle_loop(twinkle.metric, tw, pg, steps, "sum")
    # FSDP2 x DP2 x TP2 without a process group: the converted mesh reduces over the
    # data ranks only (TP replicas hold the same batch and are counted once)
    tw = cls.from_sizes(fsdp_size=2, dp_size=2, tp_size=2)
    c = _coords(tw, me)
    steps = shard_steps(list(dp_shards(N_SEQ, 4)[c["dp"] * 2 + c["fsdp"]]), "sum")
    out["dp4_tp2"] = twinkle_loop(M, tw, None, steps, "sum")
    mesh = M.LossMetric(tw, None).device_mesh
    out["groups"] = ({name: mesh.ranks(name) for name in ("dp_cp", "dp", "tp", "mp")},
                     {"dp_cp": _slice(tw, me, ("dp", "fsdp")), "dp": _slice(tw, me, ("dp", "fsdp")),
                      "tp": _slice(tw, me, ("tp",)), "mp": _slice(tw, me, ("tp",))})
    out["create_process_group"] = dist.get_process_group_ranks(mesh.create_process_group(["dp", "fsdp"]))
    # Ulysses 2 inside DP4, TP2: sequence groups are consecutive data ranks
    uly = cls.from_sizes(dp_size=4, tp_size=2, ulysses_size=2)
    umesh = DeviceMesh.from_twinkle(uly)
    u = _coords(uly, me)
    block, col = u["dp"] // 2, u["tp"]
    out["ulysses"] = ({n: umesh.ranks(n) for n in ("cp", "dp", "dp_cp", "tp")},
                      {"cp": sorted(int(uly.mesh[2 * block + k, col]) for k in range(2)),
                       "dp": sorted(int(uly.mesh[u["dp"] % 2 + 2 * b, col]) for b in range(2)),
                       "dp_cp": _slice(uly, me, ("dp",)), "tp": _slice(uly, me, ("tp",))})
    return out


def test_twinkle_loop_on_eight_ranks(dist_pool, kind):
    want8, want4 = reference(dp_shards(N_SEQ, 8), "sum"), reference(dp_shards(N_SEQ, 4), "sum")
    for out in dist_pool.run(case_twinkle_loop, kind):
        check_against(out["dp8"], want8)
        if kind == "twinkle":
            check_against_twinkle(out["dp8"], out["dp8_twinkle"])
        check_against(out["dp4_tp2"], want4)
        got, expected = out["groups"]
        assert got == expected
        assert out["create_process_group"] == expected["dp_cp"]
        got, expected = out["ulysses"]
        assert got == expected
