"""CUDA-only checks (skipped without a GPU): the ground truth for "accumulate never waits".

``torch.cuda.set_sync_debug_mode("error")`` raises on any host-device synchronisation,
so each metric's ``accumulate`` runs under it with the input forms users pass: tensors,
Python lists of per-sequence values, Twinkle's ragged per-sequence log-probs, reward
lists, separate DPO batches, entropy from logits, top-k KL records, PPO value
statistics, MoE router outputs.
"""
import pytest
import torch

from tests.rlref import make_rl_batch, ragged
from twinkle_metrics import (
    Accuracy,
    CISPOMetric,
    CompletionRewardMetric,
    DPOMetric,
    EmbeddingMetric,
    GRPOMetric,
    GSPOMetric,
    LossMetric,
    MoERoutingMetric,
    PPOValueMetric,
    TrainMetric,
)
from twinkle_metrics.testing import assert_results_close

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cuda(b):
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in b.items()}


def _calls():
    """(label, metric, call); every input is built here, outside the sync-checked window, and
    the same on every call (seeded), so that two paths can be compared."""
    torch.manual_seed(0)
    b = _cuda(make_rl_batch(0))
    lab, lp = b["labels"], b["logps"]
    feats = [{"labels": lab[:5]}, {"labels": lab[5:]}]
    ragged_old, adv_list = ragged(b["old"], lab), b["adv"].tolist()
    report = [{"lm loss": torch.tensor([3.0, 4.0], device="cuda")}]
    grad_norm = torch.tensor(1.5, device="cuda")
    emb_labels, emb = torch.tensor([1, 0, 1, 0], device="cuda"), torch.randn(4, 8, device="cuda")
    tokens = torch.tensor(512, device="cuda")
    logits32 = b["logits"].float()
    routing = torch.rand(512, 16, device="cuda") < 0.25
    router_logits = torch.randn(512, 16, device="cuda")
    valid = torch.rand(512, device="cuda") < 0.9
    router_probs = torch.softmax(torch.randn(7, 64, 16, device="cuda", dtype=torch.float64), -1)
    aux, z = torch.tensor(0.01, device="cuda"), torch.tensor(0.001, device="cuda")
    torch.cuda.synchronize()
    return [
        ("GRPO tensors", GRPOMetric(top_k_kl=4),
         lambda m: m.accumulate({"labels": lab}, {"logps": lp}, old_logps=b["old"], advantages=b["adv"],
                                ref_logps=b["ref"])),
        ("GRPO list advantages, ragged old logps", GRPOMetric(),
         lambda m: m.accumulate({"labels": lab}, {"logps": lp}, old_logps=ragged_old, advantages=adv_list)),
        ("GRPO microbatch lists", GSPOMetric(),
         lambda m: m.accumulate(feats, {"logps": [lp[:5], lp[5:]]}, old_logps=[b["old"][:5], b["old"][5:]],
                                advantages=[b["adv"][:5], b["adv"][5:]])),
        ("CISPO entropy from logits", CISPOMetric(entropy_from_logits=True),
         lambda m: m.accumulate({"labels": lab}, {"logps": lp, "logits": b["logits"]}, old_logps=b["old"],
                                advantages=b["adv"])),
        ("DPO interleaved with reference", DPOMetric(),
         lambda m: m.accumulate({"labels": lab}, {"logps": lp}, ref_outputs={"logps": b["ref"]})),
        ("DPO separate batches", DPOMetric(),
         lambda m: m.accumulate(None, None, chosen=({"labels": lab[:6]}, {"logps": lp[:6]}),
                                rejected=({"labels": lab[6:]}, {"logps": lp[6:]}))),
        ("rewards from Python lists", CompletionRewardMetric(num_generations=4, max_completion_length=8),
         lambda m: m.accumulate(rewards={"acc": [1.0, 0.0, 1.0, 1.0], "fmt": [0.5, 0.5, 0.5, 0.5]},
                                completion_lengths=[3, 8, 5, 2], generate_time=0.5)),
        ("Accuracy vocab-parallel (one rank)", Accuracy(vocab_parallel=True),
         lambda m: m.accumulate({"labels": lab}, {"logits": logits32})),
        ("Loss Megatron reports", LossMetric(loss_reduction="sum"),
         lambda m: m.accumulate(None, report, grad_norm=grad_norm)),
        ("Embedding", EmbeddingMetric(),
         lambda m: m.accumulate({"labels": emb_labels}, {"embeddings": emb, "loss": 0.3})),
        ("PPO value, per-sequence advantages", PPOValueMetric(epsilon=0.1),
         lambda m: m.accumulate({"labels": lab}, {"values": b["logps"]}, old_values=b["old"], returns=b["ref"],
                                advantages=b["adv"])),
        ("PPO value microbatches, ragged old values", PPOValueMetric(nan_policy="skip"),
         lambda m: m.accumulate(feats, [{"values": lp[:5]}, {"values": lp[5:]}], old_values=ragged_old,
                                returns=[b["ref"][:5], b["ref"][5:]])),
        ("MoE router logits, as the hooks pass them", MoERoutingMetric(num_layers=4, num_experts=16),
         lambda m: m.observe(2, routing_map=routing, router_logits=router_logits, token_mask=valid,
                             aux_loss=aux, z_loss=z, tokens_dropped=routing.sum() - (routing & valid[:, None]).sum())),
        ("MoE router probs float64, dropped as an int", MoERoutingMetric(num_layers=4, num_experts=16,
                                                                         nan_policy="skip"),
         lambda m: m.observe(0, routing_map=router_probs > 0.1, router_probs=router_probs, tokens_dropped=3)),
        ("Train", TrainMetric(),
         lambda m: m.accumulate(None, None, lr=[1e-3, 1e-4], step=4, gradient_accumulation_steps=2,
                                tokens=tokens, samples=8)),
    ]


N_CALLS = 15  # len(_calls()); the calls build CUDA tensors, so not at collection time


@pytest.fixture(params=["torch", "triton"])
def kernel_path(request, monkeypatch):
    """Every call on the torch path and on the Triton path (the default where triton is installed)."""
    from twinkle_metrics.kernels import backend, dispatch
    if request.param == "triton" and not dispatch.available():
        pytest.skip("triton is not installed")
    with backend("auto" if request.param == "triton" else "torch"):  # "auto": CUDA tensors take the kernels
        yield request.param


@pytest.mark.parametrize("index", range(N_CALLS))
def test_accumulate_never_synchronises(index, kernel_path):
    calls = _calls()
    assert len(calls) == N_CALLS
    label, metric, call = calls[index]
    call(metric)  # warm-up: states move to the device, kernels load
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call(metric)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert metric.calculate(), label
    from twinkle_metrics.kernels import dispatch
    assert dispatch.failed is None, dispatch.failed  # a kernel that fell back would hide here


@pytest.mark.parametrize("index", range(N_CALLS))
def test_triton_path_agrees_with_torch_path(index, monkeypatch):
    """The same calls on both paths: the same keys, the same numbers (float64 inputs; the
    float32 logits paths within float32 rounding). TrainMetric's clock is held still, so its
    timings compare too."""
    import types

    import twinkle_metrics.metrics.system.train as train_module
    from twinkle_metrics.kernels import backend, dispatch
    if not dispatch.available():
        pytest.skip("triton is not installed")
    results = {}
    for path in ("torch", "triton"):
        clock = iter(range(10**6)).__next__  # each path's clock reads 0, 1, 2, ...
        monkeypatch.setattr(train_module, "time", types.SimpleNamespace(perf_counter=clock))
        with backend("auto" if path == "triton" else "torch"):  # "auto": CUDA tensors take the kernels
            label, metric, call = _calls()[index]
            call(metric)
            call(metric)
            results[path] = metric.calculate()
            assert dispatch.failed is None, dispatch.failed
    assert_results_close(results["triton"], results["torch"], rel=1e-5 if "logits" in label or
                         "Accuracy" in label or "MoE" in label else 1e-9)


def test_cpu_contribution_after_cuda_states_is_not_lost():
    """States stay on the device; a CPU value is copied to them, never the reverse."""
    m = LossMetric(loss_reduction="sum")
    m.accumulate(None, [{"lm loss": torch.tensor([5.0, 1.0], device="cuda")}])
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # queue work ahead of the next fold
        a = a @ a / 4096
    m.accumulate(None, [{"lm loss": torch.tensor([1.0, 1.0])}])      # CPU tensor
    m.accumulate(None, [{"lm loss": torch.tensor([100.0, 1.0], device="cuda")}])
    assert all(t.is_cuda for t in m.states.values())
    assert_results_close(m.calculate(), {"loss": 106.0 / 3, "num_tokens": 3})


def test_calculate_makes_one_synchronisation():
    """calculate() of CUDA-resident and CPU-resident metrics together (a Train metric fed
    Python numbers, rewards from lists): the one device-to-host copy of the results, no
    copy per CPU state (they travel in one non-blocking copy)."""
    import warnings

    from twinkle_metrics import MetricCollection
    wanted = ("GRPO tensors", "rewards from Python lists", "Train", "DPO interleaved with reference")
    picked = [(metric, call) for label, metric, call in _calls() if label in wanted]
    coll = MetricCollection([metric for metric, _ in picked])
    for _ in range(2):
        for metric, call in picked:
            call(metric)
        coll.calculate()  # the first agrees on the plan
    for metric, call in picked:
        call(metric)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = coll.calculate()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert out and len(syncs) <= 1, syncs
