"""Single-process tests of TrainMetric, LossMetric, Accuracy and EmbeddingMetric."""
import math

import pytest
import torch
import torch.nn.functional as F

from twinkle_metrics import Accuracy, EmbeddingMetric, LossMetric, MetricCollection, TrainMetric
from twinkle_metrics.comm.order import ordered_f32, ordered_f64
from twinkle_metrics.kernels.argmax import argmax_keys, argmax_of_keys
from twinkle_metrics.testing import assert_results_close, forbid_device_waits


def _lm(seed, b=4, s=6, v=11, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, v, (b, s), generator=g)
    labels = torch.where(torch.rand(b, s, generator=g) < 0.7, labels, torch.full_like(labels, -100))
    logits = (torch.randn(b, s, v, generator=g) * 2).round().to(dtype)  # many ties
    return labels, logits


def _ref_accuracy(labels, logits, mask=None):
    pred = logits.argmax(-1)
    labels = labels[..., -pred.shape[-1]:]
    mask = (labels != -100) if mask is None else mask[..., -pred.shape[-1]:].bool()
    c, t = int(((pred == labels) & mask).sum()), int(mask.sum())
    return {"accuracy": c / t, "correct_tokens": c, "total_tokens": t}


# ------------------------------------------------------------------ Accuracy
def test_accuracy_matches_reference_and_twinkle_keys():
    labels, logits = _lm(0)
    with forbid_device_waits():
        m = Accuracy().accumulate({"labels": labels}, {"logits": logits})
    got = m.calculate()
    assert set(got) == {"accuracy", "correct_tokens", "total_tokens"}
    assert type(got["accuracy"]) is float and type(got["total_tokens"]) is int
    assert_results_close(got, _ref_accuracy(labels, logits))


def test_accuracy_right_aligns_labels_when_asked_and_uses_completion_mask():
    labels, logits = _lm(1, s=7)
    short = logits[:, 1:]                       # logits one shorter than labels
    mask = torch.ones_like(labels)
    mask[:, :3] = 0
    got = Accuracy(align="right").accumulate({"labels": labels, "completion_mask": mask}, {"logits": short}).calculate()
    assert_results_close(got, _ref_accuracy(labels, short, mask))
    m = Accuracy()  # by default longer labels are a shift to fix, not to guess
    with pytest.raises(ValueError, match=r"labels \[4, 7\] do not match logits \[4, 6, 11\].*align='right'"):
        m.accumulate({"labels": labels, "completion_mask": mask}, {"logits": short})
    assert m.calculate() == {}


def test_accuracy_microbatch_list_equals_whole_and_bf16():
    labels, logits = _lm(2, b=5, dtype=torch.bfloat16)
    whole = Accuracy().accumulate({"labels": labels}, {"logits": logits}).calculate()
    feats = [{"labels": labels[:2]}, {"labels": labels[2:]}]
    as_list = Accuracy().accumulate(feats, {"logits": [logits[:2], logits[2:]]}).calculate()
    as_dicts = Accuracy().accumulate(feats, [{"logits": logits[:2]}, {"logits": logits[2:]}]).calculate()
    assert_results_close(as_list, whole)
    assert_results_close(as_dicts, whole)
    assert Accuracy().accumulate([], {}).calculate() == {}
    with pytest.raises(ValueError, match=r"got inputs\['labels'\] but no outputs\['logits'\]"):
        Accuracy().accumulate({"labels": labels}, {"loss": 1.0})  # labels without logits: part of a call


def test_accuracy_errors_name_field_and_shapes():
    labels, logits = _lm(3)
    with pytest.raises(ValueError, match=r"Accuracy: labels \[4, 5\] do not match logits \[4, 6, 11\]"):
        Accuracy().accumulate({"labels": labels[:, :5]}, {"logits": logits})
    with pytest.raises(ValueError, match=r"Accuracy: labels \[3, 6\] do not match"):
        Accuracy().accumulate({"labels": labels[:3]}, {"logits": logits})
    with pytest.raises(TypeError, match="Accuracy: labels must have an integer dtype, got torch.float32"):
        Accuracy().accumulate({"labels": labels.float()}, {"logits": logits})
    with pytest.raises(ValueError, match=r"Accuracy: got outputs\['logits'\] but no inputs\['labels'\]"):
        Accuracy().accumulate({"input_ids": labels}, {"logits": logits})
    with pytest.raises(ValueError, match=r"Accuracy: got outputs\['logits'\] but no inputs\['labels'\]"):
        Accuracy().accumulate(None, {"logits": logits})
    with pytest.raises(ValueError, match=r"Accuracy: outputs\['logits'\] has 3 entries but there are 2"):
        Accuracy().accumulate([{"labels": labels[:2]}, {"labels": labels[2:]}], {"logits": [logits] * 3})
    with pytest.raises(TypeError, match=r"Accuracy: outputs\['logits'\] must be a floating tensor"):
        Accuracy().accumulate({"labels": labels}, {"logits": labels})


def _emulated_vp_argmax(full, tp):
    """The library's keys for each vocab shard, MAX-reduced by torch.maximum (what the TP
    all_reduce does), turned back into indices by the library."""
    v = full.shape[-1] // tp
    best = None
    for r in range(tp):
        x = full[..., r * v:(r + 1) * v]
        idx = x.argmax(-1)
        key = argmax_keys(x.gather(-1, idx.unsqueeze(-1)).squeeze(-1), idx + r * v, full.shape[-1])
        best = key if best is None else torch.maximum(best, key)
    return argmax_of_keys(best, full.shape[-1])


def test_packed_argmax_keys_follow_torch_argmax_ties_nan_and_signed_zero():
    full = torch.tensor([
        [1.0, 5.0, 0.0, 2.0, 5.0, 1.0, 5.0, 0.0],              # tie across shards: 1
        [0.0, 1.0, 2.0, 3.0, 9.0, 9.0, 1.0, 0.0],              # tie inside shard 1: 4
        [-0.0, -1.0, -3.0, -2.0, 0.0, -5.0, -7.0, -0.5],       # -0.0 == +0.0: 0
        [-3.0, -2.0, -9.0, -2.0, -2.0, -8.0, -2.0, -4.0],      # negative ties: 1
        [1.0, 2.0, 3.0, 4.0, float("nan"), 1.0, float("nan"), 1.0],  # first NaN: 4
        [-math.inf, -math.inf, -math.inf, -math.inf, -math.inf, -math.inf, -math.inf, -math.inf],
        [1.0, math.inf, 2.0, 3.0, math.inf, 0.0, 1.0, 2.0],    # +inf tie: 1
    ])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = full.to(dtype)
        assert torch.equal(_emulated_vp_argmax(x, 2), x.argmax(-1)), dtype
        assert torch.equal(_emulated_vp_argmax(x, 4), x.argmax(-1)), dtype
    g = torch.Generator().manual_seed(0)
    rnd = (torch.randn(64, 32, generator=g) * 3).round().to(torch.bfloat16)
    assert torch.equal(_emulated_vp_argmax(rnd, 4), rnd.argmax(-1))


def test_ordered_ints_preserve_float_order():
    vals = torch.tensor([-math.inf, -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, math.inf, math.nan])
    o32, o64 = ordered_f32(vals), ordered_f64(vals.double())
    for o in (o32, o64):
        assert (o[1:-1] >= o[:-2]).all() and o[3] == o[4] and o[-1] > o[-2]


# ------------------------------------------------------------------ LossMetric
def _megatron_reports(seed, n_mb=3):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 20, (n_mb,), generator=g).double()
    counts[0] = 0  # a microbatch without tokens
    sums = torch.rand(n_mb, generator=g, dtype=torch.float64) * counts
    return [{"lm loss": torch.stack([s, c])} for s, c in zip(sums, counts)], sums, counts


def test_loss_sum_from_megatron_reports():
    reports, sums, counts = _megatron_reports(0)
    m = LossMetric(loss_reduction="sum")
    with forbid_device_waits():
        m.accumulate(None, reports[:2], grad_norm=torch.tensor(3.0))
        m.accumulate(None, reports[2:], grad_norm=2.0)
        m.accumulate(None, [])                                  # a non-last stage
    got = m.calculate()
    assert_results_close(got, {"loss": float(sums.sum() / counts.sum()), "num_tokens": int(counts.sum()),
                               "grad_norm": 2.0})
    assert type(got["loss"]) is float and type(got["num_tokens"]) is int


def test_loss_sum_is_split_invariant_mean_is_not():
    reports, sums, counts = _megatron_reports(1, n_mb=4)
    whole = LossMetric(loss_reduction="sum").accumulate(
        None, {"loss": sums.sum(), "num_tokens": counts.sum()}).calculate()
    split = LossMetric(loss_reduction="sum").accumulate(
        None, {"loss": list(sums), "num_tokens": list(counts)}).calculate()
    assert_results_close(split, whole)
    mean = LossMetric().accumulate(None, reports).calculate()   # per-microbatch means, averaged
    has = counts > 0
    assert math.isclose(mean["loss"], float((sums[has] / counts[has]).mean()), rel_tol=1e-12)
    assert "grad_norm" not in mean


def test_loss_reduction_per_call_and_tokens_from_labels():
    labels, _ = _lm(4)
    m = LossMetric()                                           # constructor default 'mean'
    m.accumulate({"labels": labels}, {"loss": torch.tensor(12.0)}, loss_reduction="sum")
    n = int((labels != -100).sum())
    assert_results_close(m.calculate(), {"loss": 12.0 / n, "num_tokens": n})
    feats = [{"labels": labels[:2]}, {"labels": labels[2:]}]
    per_mb = LossMetric(loss_reduction="sum").accumulate(feats, {"loss": [5.0, 7.0]}).calculate()
    assert_results_close(per_mb, {"loss": 12.0 / n, "num_tokens": n})
    twinkle_mean = LossMetric().accumulate({"labels": labels}, {"loss": 2.0}).accumulate(
        {"labels": labels}, {"loss": 4.0}).calculate()
    assert twinkle_mean == {"loss": 3.0}


def test_loss_sum_over_only_masked_tokens_reports_no_loss():
    """0 / 0 is no measurement: an interval of 'sum' entries without tokens reports no loss
    (not 0.0), whether split over microbatches or not; a NaN sum still shows; 'mean'
    entries beside it keep their mean."""
    masked = {"labels": torch.full((2, 5), -100)}
    m = LossMetric(loss_reduction="sum")
    m.accumulate(masked, {"loss": torch.tensor(0.0)}).accumulate(None, [{"lm loss": torch.zeros(2)}] * 2)
    assert m.calculate() == {}
    m.accumulate(None, {"loss": [0.0, math.nan], "num_tokens": [0, 0]})
    got = m.calculate()
    assert set(got) == {"loss", "loss_nonfinite"} and math.isnan(got["loss"])
    m.accumulate(masked, {"loss": 0.0}).accumulate(None, {"loss": 3.0}, loss_reduction="mean")
    with pytest.raises(ValueError, match="mixes 1 loss_reduction='sum' entries with 1 'mean' ones"):
        m.calculate()  # a sum over tokens and a mean of calls make no loss together
    m.reset()
    m.accumulate(masked, {"loss": 0.0}).accumulate(None, {"loss": 6.0, "num_tokens": 4})
    assert m.calculate() == {"loss": 1.5, "num_tokens": 4}


def test_loss_refuses_a_state_dict_missing_a_state():
    m = LossMetric(loss_reduction="sum").accumulate(None, {"loss": 6.0, "num_tokens": 4})
    saved = m.state_dict()
    for name in ("sum_entries", "entries"):
        with pytest.raises(ValueError, match=rf"missing states \['{name}'\]"):
            LossMetric(loss_reduction="sum").load_state_dict({k: v for k, v in saved.items() if k != name})


def test_loss_errors_and_skips():
    labels, _ = _lm(5)
    feats = [{"labels": labels[:2]}, {"labels": labels[2:]}]
    with pytest.raises(ValueError, match=r"LossMetric: outputs\['loss'\] has 3 entries but there are 2"):
        LossMetric().accumulate(feats, {"loss": [1.0, 2.0, 3.0]})
    with pytest.raises(ValueError,
                       match=r"LossMetric: outputs\['num_tokens'\] has 1 entries but outputs\['loss'\] has 2"):
        LossMetric(loss_reduction="sum").accumulate(None, {"loss": [1.0, 2.0], "num_tokens": [3]})
    with pytest.raises(ValueError, match="LossMetric: got 2 input microbatches but 3 loss reports"):
        LossMetric().accumulate(feats, [{"lm loss": torch.tensor([1.0, 2.0])}] * 3)
    with pytest.raises(ValueError, match="LossMetric: loss_reduction='sum' needs the token count.*labels missing"):
        LossMetric(loss_reduction="sum").accumulate(None, {"loss": 1.0})
    with pytest.raises(ValueError, match="LossMetric: loss_reduction must be one of"):
        LossMetric(loss_reduction="avg")
    with pytest.raises(TypeError, match=r"LossMetric: outputs\['loss'\] must be a real number or a tensor, got str"):
        LossMetric().accumulate(None, {"loss": "0.5"})
    with pytest.raises(ValueError,
                       match=r"LossMetric: outputs\['loss'\] must be a scalar, got a tensor of shape \[4, 6\]"):
        LossMetric().accumulate(None, {"loss": torch.zeros(4, 6)})
    with pytest.raises(TypeError, match="LossMetric: labels must have an integer dtype"):
        LossMetric(loss_reduction="sum").accumulate({"labels": labels.float()}, {"loss": 1.0})
    assert LossMetric().accumulate({"labels": labels}, {"logits": torch.zeros(1)}).calculate() == {}


# ------------------------------------------------------------------ TrainMetric
def test_train_metric_keys_numbers_and_rates():
    m = TrainMetric(flops_per_token=60.0, peak_flops=1e9)
    with forbid_device_waits():
        m.accumulate(None, None, lr=1e-4, step=8, gradient_accumulation_steps=4, tokens=1000, samples=8)
        m.accumulate(None, None, lr=2e-4, step=16, gradient_accumulation_steps=4, tokens=3000, samples=8)
    got = m.calculate()
    memory = {"peak memory GiB", "train/peak_memory_rank", "train/peak_memory_reserved_gib",
              "train/peak_memory_reserved_rank"}
    cuda = memory if torch.accelerator.is_available() and torch.accelerator.memory_stats() else set()
    assert set(got) == {"learning rate", "iters", "total time elapse", "speed", "step time", "tokens/s",
                        "samples/s", "mfu", "train/step_time_max", "train/step_time_min",
                        "train/step_time_slowest_rank"} | cuda
    assert all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in got.values())
    assert got["learning rate"] == 2e-4 and got["iters"] == 4
    assert math.isclose(got["speed"] * got["step time"], 1.0, rel_tol=1e-9)   # 4 iterations
    assert math.isclose(got["tokens/s"] / got["samples/s"], 4000 / 16, rel_tol=1e-12)
    assert math.isclose(got["mfu"], got["tokens/s"] * 60.0 / 1 / 1e9, rel_tol=1e-12)
    # the clock itself (from construction to the last accumulate): the controlled-clock test below
    # one rank: the slowest and the fastest are this one
    assert got["train/step_time_slowest_rank"] == 0 and got["train/step_time_max"] == got["train/step_time_min"]
    # The next interval counts only steps since the last calculate.
    m.accumulate(None, None, lr=[1e-4, 0.0], step=24, gradient_accumulation_steps=4)
    nxt = m.calculate()
    assert nxt["learning rate(param group 1)"] == 1e-4 and nxt["learning rate(param group 2)"] == 0.0
    assert "learning rate" not in nxt and nxt["iters"] == 6 and "tokens/s" not in nxt
    assert math.isclose(nxt["speed"] * nxt["step time"], 1.0, rel_tol=1e-9)


def test_train_metric_errors():
    with pytest.raises(ValueError, match=r"TrainMetric: lr has 3 param groups, more than 2; pass "
                                         r"TrainMetric\(max_param_groups=3\)"):
        TrainMetric(max_param_groups=2).accumulate(None, None, lr=[1.0, 2.0, 3.0])
    with pytest.raises(TypeError, match="TrainMetric: step must be an int, got float"):
        TrainMetric().accumulate(None, None, step=1.5)
    with pytest.raises(TypeError, match="TrainMetric: lr must be a number, got str"):
        TrainMetric().accumulate(None, None, lr="1e-3")
    with pytest.raises(ValueError, match="TrainMetric: counts must be one of"):
        TrainMetric(counts="per-rank")


def test_all_four_in_one_collection():
    labels, logits = _lm(6)
    emb = torch.randn(4, 3)
    emb_metric = EmbeddingMetric()
    lm = MetricCollection({"": TrainMetric(), "loss": LossMetric(loss_reduction="sum"), "acc": Accuracy()})
    lm.accumulate({"labels": labels}, {"logits": logits, "loss": torch.tensor(3.0)}, lr=1e-3, step=2,
                    gradient_accumulation_steps=1, grad_norm=1.0)
    emb_metric.accumulate({"labels": torch.tensor([1, 0, 1, 0])}, {"embeddings": emb})
    coll = MetricCollection({"": lm[0], "loss": lm[1], "acc": lm[2], "emb": emb_metric})
    got = coll.calculate()
    assert got["acc/accuracy"] == _ref_accuracy(labels, logits)["accuracy"]
    assert got["loss/grad_norm"] == 1.0 and got["iters"] == 2
    want = _ref_embedding(emb, torch.tensor([1, 0, 1, 0]))  # two anchors, each followed by its positive
    assert_results_close({k: v for k, v in got.items() if k.startswith("emb/")},
                         {f"emb/{k}": v for k, v in want.items()}, rel=1e-12)


# ------------------------------------------------------------------ EmbeddingMetric
def _ref_embedding(emb, labels):
    anchors = [i for i in range(len(labels)) if labels[i] > 0 and i + 1 < len(labels)]
    a = F.normalize(emb[anchors].double(), dim=-1)
    p = F.normalize(emb[[i + 1 for i in anchors]].double(), dim=-1)
    sim = a @ p.T
    pos = sim.diagonal()
    k = len(anchors)
    out = {"pos_sim": float(pos.mean()), "pos_sim_min": float(pos.min()), "pos_sim_max": float(pos.max())}
    off = ~torch.eye(k, dtype=torch.bool)
    hardest = torch.where(off, sim, -torch.inf).amax(-1)
    out["in_batch_accuracy"] = float((pos > hardest).double().mean())
    if k > 1:
        out["neg_sim"] = float(sim[off].mean())
        out["margin"] = float((pos - hardest).mean())
    return out


def _emb_batch(seed, n=9, d=5):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(n, d, generator=g)
    labels = torch.tensor([1, 0, 1, 0, 0, 1, 0, 1, 0][:n])
    return emb, labels


def test_embedding_matches_reference_with_twinkle_keys():
    emb, labels = _emb_batch(0)
    m = EmbeddingMetric()
    with forbid_device_waits():
        m.accumulate({"labels": labels}, {"embeddings": emb, "loss": torch.tensor(0.25)}, grad_norm=0.5)
        m.accumulate({"labels": labels}, {"embeddings": emb, "loss": 0.75})
    got = m.calculate()
    want = _ref_embedding(emb, labels)
    want.update(loss=0.5, grad_norm=0.5)
    assert_results_close(got, want, rel=1e-12)
    assert {"pos_sim", "pos_sim_min", "pos_sim_max", "neg_sim", "loss", "grad_norm"} <= set(got)


def test_embedding_microbatches_and_3d_and_no_anchors():
    emb, labels = _emb_batch(1)
    feats = [{"labels": labels[:4]}, {"labels": labels[4:]}]
    whole = EmbeddingMetric().accumulate({"labels": labels}, {"embeddings": emb}).calculate()
    as_list = EmbeddingMetric().accumulate(feats, {"embeddings": [emb[:4], emb[4:]]}).calculate()
    as_cat = EmbeddingMetric().accumulate(feats, {"embeddings": emb}).calculate()
    assert_results_close(as_list, whole)
    assert_results_close(as_cat, whole)
    seq = torch.stack([emb, torch.randn_like(emb)], dim=1)     # [n, s, d]: first token is used
    assert_results_close(EmbeddingMetric().accumulate({"labels": labels}, {"logits": seq}).calculate(), whole)
    none = EmbeddingMetric().accumulate({"labels": torch.zeros(9, dtype=torch.long)}, {"embeddings": emb})
    assert none.calculate() == {}


def test_embedding_errors():
    emb, labels = _emb_batch(2)
    with pytest.raises(ValueError, match=r"EmbeddingMetric: labels of microbatch 0 have 8 entries \(shape \[8\]\) "
                                         r"but embeddings have 9 rows \(shape \[9, 5\]\)"):
        EmbeddingMetric().accumulate({"labels": labels[:8]}, {"embeddings": emb})
    with pytest.raises(ValueError, match=r"EmbeddingMetric: got outputs 'embeddings' or 'logits' but no inputs"):
        EmbeddingMetric().accumulate(None, {"embeddings": emb})
    with pytest.raises(TypeError, match="EmbeddingMetric: labels must have an integer dtype"):
        EmbeddingMetric().accumulate({"labels": labels.float()}, {"embeddings": emb})
    with pytest.raises(ValueError, match=r"EmbeddingMetric: outputs\['embeddings'\] has shape \[9, 5\] but the 2 "
                                         r"microbatches hold 8 labels"):
        EmbeddingMetric().accumulate([{"labels": labels[:4]}, {"labels": labels[4:8]}], {"embeddings": emb})
    with pytest.raises(ValueError, match=r"EmbeddingMetric: outputs\['embeddings'\] has 3 entries but there are 2"):
        EmbeddingMetric().accumulate([{"labels": labels[:4]}, {"labels": labels[4:]}], {"embeddings": [emb] * 3})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_device_sync_on_cuda():
    """Ground truth for 'no device waits': CUDA's sync debug mode errors on any sync."""
    dev = torch.device("cuda")
    labels, logits = _lm(7, dtype=torch.bfloat16)
    labels, logits = labels.to(dev), logits.to(dev)
    emb, elab = _emb_batch(3)
    emb, elab = emb.to(dev), elab.to(dev)
    reports, _, _ = _megatron_reports(3)
    reports = [{k: v.to(dev) for k, v in r.items()} for r in reports]
    metrics = [Accuracy(), LossMetric(loss_reduction="sum"), EmbeddingMetric(), TrainMetric()]
    for m in metrics:  # first call moves states to the device; warm up kernels too
        m.to(dev)
    grad_norm, loss = torch.tensor(1.0, device=dev), torch.tensor(0.1, device=dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        metrics[0].accumulate({"labels": labels}, {"logits": logits})
        metrics[1].accumulate(None, reports, grad_norm=grad_norm)
        metrics[2].accumulate({"labels": elab}, {"embeddings": emb, "loss": loss})
        metrics[3].accumulate(None, None, lr=1e-3, step=1, gradient_accumulation_steps=1,
                              tokens=reports[1]["lm loss"][1], samples=4)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    got = MetricCollection({"acc": metrics[0], "loss": metrics[1], "emb": metrics[2], "": metrics[3]}).calculate()
    assert_results_close({k: got[k] for k in ("acc/accuracy",)},
                         {"acc/accuracy": _ref_accuracy(labels.cpu(), logits.cpu())["accuracy"]})
    assert got["peak memory GiB"] > 0


def test_train_metric_empty_lr_list_reports_no_lr():
    # Twinkle's driver passes lr=[] when there is no optimizer (evaluation).
    got = TrainMetric().accumulate(None, None, lr=[], step=2, gradient_accumulation_steps=1).calculate()
    assert got["iters"] == 2 and not any(k.startswith("learning rate") for k in got)


def test_accuracy_float_completion_mask_counts_nonzero():
    torch.manual_seed(3)
    logits = torch.randn(2, 5, 7)
    labels = logits.argmax(-1)
    labels[0, 1] = (labels[0, 1] + 1) % 7
    mask = torch.tensor([[1, 1, 0, 1, 1], [0, 1, 1, 1, 0]])
    as_int = Accuracy().accumulate({"labels": labels, "completion_mask": mask}, {"logits": logits}).calculate()
    as_float = Accuracy().accumulate({"labels": labels, "completion_mask": mask.float()},
                                     {"logits": logits}).calculate()
    assert as_float == as_int and as_int["total_tokens"] == 7 and as_int["correct_tokens"] == 6


def test_accuracy_list_outputs_without_labels_is_an_error():
    with pytest.raises(ValueError, match=r"Accuracy: got outputs\['logits'\] but no inputs\['labels'\]"):
        Accuracy().accumulate(None, [{"logits": torch.randn(1, 3, 5)}])


def test_train_metric_times_against_a_controlled_clock(monkeypatch):
    import types

    import twinkle_metrics.metrics.system.train as train_module

    now = [100.0]
    monkeypatch.setattr(train_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    m = TrainMetric()  # the clock starts at 100 s
    now[0] = 102.0
    m.accumulate(None, None, step=8, gradient_accumulation_steps=4, tokens=1000)
    now[0] = 106.0
    m.accumulate(None, None, step=16, gradient_accumulation_steps=4, tokens=3000)
    got = m.calculate()  # the next interval starts here, at 106 s
    assert got["total time elapse"] == 6.0 and got["iters"] == 4
    assert got["step time"] == 6.0 / 4 and got["speed"] == 4 / 6.0 and got["tokens/s"] == 4000 / 6.0
    now[0] = 110.0
    m.accumulate(None, None, step=24, gradient_accumulation_steps=4)
    got = m.calculate()
    assert got["total time elapse"] == 10.0 and got["iters"] == 6
    assert got["step time"] == 4.0 / 2 and got["speed"] == 2 / 4.0


def test_loss_report_with_more_than_a_pair_says_what_it_got():
    m = LossMetric(loss_reduction="sum")
    with pytest.raises(ValueError, match=r"LossMetric: outputs\[0\]\['lm loss'\] holds 3 values \(shape \[3\]\); "
                                         r"expected one loss, or Megatron's \[loss_sum, num_tokens\] pair"):
        m.accumulate(None, [{"lm loss": torch.tensor([1.0, 2.0, 3.0])}])
    assert m.calculate() == {}  # nothing added


def test_embedding_in_batch_accuracy_ranks_only_anchors_with_negatives():
    """An anchor alone in its batch has nothing to be ranked against: it is no hit."""
    lone = torch.tensor([[1.0, 0.0], [-1.0, 0.0]])  # its positive points the other way
    m = EmbeddingMetric().accumulate({"labels": torch.tensor([1, 0])}, {"embeddings": lone})
    got = m.calculate()
    assert got["pos_sim"] == -1.0 and "in_batch_accuracy" not in got and "margin" not in got
    two = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [1.0, 0.0]])  # each anchor nearer the other's positive
    m.accumulate({"labels": torch.tensor([1, 0])}, {"embeddings": lone})
    m.accumulate({"labels": torch.tensor([1, 0, 1, 0])}, {"embeddings": two})
    assert m.calculate()["in_batch_accuracy"] == 0.0


def test_loss_ppl_is_megatrons_capped_exp_of_the_token_weighted_loss_and_opt_in():
    sums, counts = [3.0, 9.0, 0.5], [4, 2, 1]
    want = sum(sums) / sum(counts)
    reports = [{"lm loss": torch.tensor([s, float(n)])} for s, n in zip(sums, counts)]
    m = LossMetric(loss_reduction="sum", ppl=True)
    with forbid_device_waits():
        m.accumulate(None, reports)
    got = m.calculate()
    assert got == {"loss": want, "num_tokens": 7, "ppl": math.exp(want)}
    # off by default: the keys stay Twinkle's; 'mean' (a mean of means) reports no ppl
    assert "ppl" not in LossMetric(loss_reduction="sum").accumulate(None, reports).calculate()
    assert LossMetric(ppl=True).accumulate(None, {"loss": 2.0}).calculate() == {"loss": 2.0}
    # Megatron's exp(min(20, loss)); a NaN loss stays NaN (min(20, nan) would be 20)
    big = LossMetric(loss_reduction="sum", ppl=True).accumulate(None, {"loss": 500.0, "num_tokens": 2}).calculate()
    assert big["ppl"] == math.exp(20) and big["loss"] == 250.0
    nan = LossMetric(loss_reduction="sum", ppl=True).accumulate(None, {"loss": math.nan, "num_tokens": 2}).calculate()
    assert math.isnan(nan["ppl"])
    # compute-only: ranks agree on it, checkpoints load across it
    assert LossMetric(ppl=True).fingerprint() == LossMetric().fingerprint()
    assert LossMetric(ppl=True).sync_fingerprint() != LossMetric().sync_fingerprint()
    with pytest.raises(TypeError, match="LossMetric: ppl must be True or False"):
        LossMetric(ppl="yes")
