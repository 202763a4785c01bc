"""``twinkle_metrics.integrations.megatron`` and the README's Megatron recipe.

Fast tier (no megatron import): ``LogitsHook`` and ``loss_func`` on a stand-in module with
megatron-core GPTModel's shapes and its in-place cross entropy. Slow tier: the README's two
code blocks run verbatim in megatron-core's own training loop on CPU
(``tests/megatron_loop_case.py``), world 1 and TP2 x PP2, against a plain-Python
recomputation from the per-token losses and full-vocab argmax the case recorded.
"""
from __future__ import annotations

import gc
import importlib.util
import json
import math
import os
import subprocess
import sys
import weakref
from functools import partial

import pytest
import torch

from tests import plain_loop
from twinkle_metrics import Accuracy, LossMetric
from twinkle_metrics.integrations import megatron as tm_megatron
from twinkle_metrics.testing import forbid_device_waits

REPO = os.path.abspath(os.path.join(__file__, "../../.."))


class _OutputLayer(torch.nn.Linear):
    """Like ColumnParallelLinear: [s, b, h] -> (logits [s, b, v], bias)."""

    output_size_per_partition = property(lambda self: self.out_features)

    def forward(self, x):
        return super().forward(x), None


class _Config:
    mtp_num_layers = None


class _TinyGPT(torch.nn.Module):
    """GPTModel's call signature and flow: logits in [s, b, v], then (with labels) a cross
    entropy that overwrites the logits in place, as vocab_parallel_cross_entropy does."""

    def __init__(self, vocab=11, hidden=6, mtp=0):
        super().__init__()
        self.config = _Config()
        self.config.mtp_num_layers = mtp or None
        self.post_process = True
        self.embedding = torch.nn.Embedding(vocab, hidden)
        self.output_layer = _OutputLayer(hidden, vocab)

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None, *,
                loss_mask=None):
        h = self.embedding(input_ids).transpose(0, 1)           # [s, b, h]
        for _ in range(self.config.mtp_num_layers or 0):        # MTP heads come first
            self.output_layer(h * 0.5)
        logits, _ = self.output_layer(h)
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        out = logits.detach()  # the in-place part, as megatron's fp32 path: max-shift, exp, normalise
        target = labels.transpose(0, 1).clamp(min=0)
        lse = torch.logsumexp(logits, -1)
        loss = lse - logits.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        out.sub_(out.amax(-1, keepdim=True)).exp_()
        out.div_(out.sum(-1, keepdim=True))
        return loss.transpose(0, 1)                             # [b, s]


def _batch(seed, b=3, s=5, vocab=11):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (b, s), generator=g)
    mask = (torch.rand(b, s, generator=g) > 0.3).float()
    return tokens, torch.arange(s).expand(b, s), torch.roll(tokens, -1, 1), mask


def _expected_accuracy(model, batches):
    correct = total = 0
    with torch.no_grad():
        for tokens, pos, labels, mask in batches:
            pred = model(tokens, pos, None).argmax(-1)          # no labels: untouched logits
            correct += int(((pred == labels) & (mask > 0)).sum())
            total += int((mask > 0).sum())
    return correct, total


def test_hook_feeds_accuracy_before_the_cross_entropy_overwrites_logits():
    torch.manual_seed(0)
    model = _TinyGPT()
    batches = [_batch(i) for i in range(3)]
    acc = Accuracy()
    hook = tm_megatron.LogitsHook(model, acc)
    assert hook.active
    with forbid_device_waits():
        for tokens, pos, labels, mask in batches:
            model(tokens, pos, None, labels=labels, loss_mask=mask)
    correct, total = _expected_accuracy(model, batches)     # calls without labels: not fed
    got = acc.calculate()
    assert (got["correct_tokens"], got["total_tokens"]) == (correct, total)
    assert got["accuracy"] == pytest.approx(correct / total)


def test_hook_without_loss_mask_counts_labels_and_skips_mtp_calls():
    torch.manual_seed(1)
    model = _TinyGPT(mtp=2)
    tokens, pos, labels, mask = _batch(7)
    labels = torch.where(mask > 0, labels, torch.full_like(labels, -100))
    acc = Accuracy()
    with tm_megatron.LogitsHook(model, acc):
        model(tokens, pos, None, None, labels)                 # labels passed positionally
    correct, total = _expected_accuracy(model, [(tokens, pos, labels, mask)])
    got = acc.calculate()
    assert (got["correct_tokens"], got["total_tokens"]) == (correct, total)  # one call, the main head


class HybridModel(_TinyGPT):
    """megatron-core 0.19's HybridModel's flow: MTP heads run (before the main head) only
    where ``mtp_process`` is set, whatever ``config.mtp_num_layers`` says."""

    def __init__(self, mtp_process, **kwargs):
        super().__init__(mtp=1, **kwargs)
        self.mtp_process = mtp_process

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None, *,
                loss_mask=None):
        depth = self.config.mtp_num_layers
        self.config.mtp_num_layers = depth if self.mtp_process else None  # what runs here
        try:
            return super().forward(input_ids, position_ids, attention_mask, decoder_input, labels,
                                   loss_mask=loss_mask)
        finally:
            self.config.mtp_num_layers = depth


@pytest.mark.parametrize("mtp_process", [True, False])
def test_hook_skips_hybrid_model_mtp_calls_only_where_mtp_runs(mtp_process):
    """A stage without MTP (mtp_process False) calls the output layer once, for the main
    head: skipping config.mtp_num_layers calls there, as for GPTModel, would feed nothing."""
    torch.manual_seed(2)
    model = HybridModel(mtp_process)
    tokens, pos, labels, mask = _batch(8)
    acc = Accuracy()
    calls = []
    model.output_layer.register_forward_hook(lambda *a: calls.append(1))
    with tm_megatron.LogitsHook(model, acc):
        model(tokens, pos, None, labels=labels, loss_mask=mask)
    assert len(calls) == (2 if mtp_process else 1)
    correct, total = _expected_accuracy(model, [(tokens, pos, labels, mask)])
    got = acc.calculate()
    assert total > 0 and (got["correct_tokens"], got["total_tokens"]) == (correct, total)


def test_hook_disabled_removed_and_keeps_nothing():
    model = _TinyGPT()
    tokens, pos, labels, mask = _batch(3)
    acc = Accuracy()
    hook = tm_megatron.LogitsHook([model], acc)
    hook.enabled = False
    model(tokens, pos, None, labels=labels, loss_mask=mask)
    assert acc.calculate() == {}
    hook.enabled = True
    seen = []
    model.output_layer.register_forward_hook(lambda m, i, o: seen.append(weakref.ref(o[0])))
    own = labels.clone()
    held = weakref.ref(own)
    model(tokens, pos, None, labels=own, loss_mask=mask)
    del own
    gc.collect()
    assert seen[-1]() is None, "the hook kept a reference to the logits"
    assert held() is None, "the hook kept a reference to the labels"
    hook.remove()
    assert not model._forward_pre_hooks and len(model.output_layer._forward_hooks) == 1
    model(tokens, pos, None, labels=labels, loss_mask=mask)
    assert acc.calculate()["total_tokens"] == int((mask > 0).sum())  # only the enabled call


def test_hook_on_a_stage_without_output_layer_is_inactive_and_rejects_non_metrics():
    class Stage(torch.nn.Module):
        post_process = False

    wrapped = torch.nn.Module()
    wrapped.module = Stage()
    assert not tm_megatron.LogitsHook(wrapped, Accuracy()).active
    with pytest.raises(TypeError, match=r"LogitsHook: expected metrics with accumulate"):
        tm_megatron.LogitsHook(_TinyGPT(), "accuracy")


def test_hook_rejects_gathered_logits_for_vocab_parallel_accuracy():
    model = _TinyGPT()
    model.output_layer.__class__ = type("Sharded", (_OutputLayer,), {"output_size_per_partition": 4})
    tokens, pos, labels, mask = _batch(4)
    with tm_megatron.LogitsHook(model, Accuracy(vocab_parallel=True)):
        with pytest.raises(ValueError, match=r"vocab_parallel=True\) needs the local vocab shard \(4 wide\) "
                                             r"but the output layer returned 11"):
            model(tokens, pos, None, labels=labels, loss_mask=mask)


def test_loss_func_returns_megatron_triple_and_feeds_loss_metric():
    g = torch.Generator().manual_seed(5)
    m = LossMetric(loss_reduction="sum")
    total = count = 0.0
    for _ in range(3):
        losses = torch.rand(2, 7, generator=g, requires_grad=True)
        mask = (torch.rand(2, 7, generator=g) > 0.4).float()
        with forbid_device_waits():
            loss, n, report = partial(tm_megatron.loss_func, mask, metric=m)(losses)
        want = sum(x * k for x, k in zip(losses.detach().flatten().tolist(), mask.flatten().tolist()))
        assert loss.requires_grad and loss.item() == pytest.approx(want, rel=1e-6)
        assert n.dtype == torch.int and int(n) == int(mask.sum())
        assert list(report) == ["lm loss"] and not report["lm loss"].requires_grad
        assert report["lm loss"].tolist() == pytest.approx([want, int(mask.sum())], rel=1e-6)
        loss /= 4  # the schedule divides the returned loss in place when not per-token: report unchanged
        assert report["lm loss"][0].item() == pytest.approx(want, rel=1e-6)
        total, count = total + want, count + int(mask.sum())
    got = m.calculate()
    assert got["loss"] == pytest.approx(total / count, rel=1e-6) and got["num_tokens"] == count


def test_loss_func_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"per-token losses \[2, 3, 5\] do not match loss_mask \[2, 3\]; "
                                         r"call the model with labels="):
        tm_megatron.loss_func(torch.ones(2, 3), torch.zeros(2, 3, 5))


def test_importing_the_package_imports_no_megatron():
    code = ("import sys, twinkle_metrics, twinkle_metrics.integrations.megatron, "
            "twinkle_metrics.integrations.megatron_cpu; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'megatron'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=REPO))
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------- megatron-core, end to end
def _run_case(tmp_path, nproc, *extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    case = os.path.join(REPO, "tests", "megatron_loop_case.py")
    if nproc == 1:
        cmd = [sys.executable, case, str(tmp_path), *extra]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               case, str(tmp_path), *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]
    return ranks


def _check(ranks, tp):
    last = [r for r in ranks if r["last_stage"]]
    assert len(last) == tp and all(r["hook_active"] for r in last)
    assert not any(r["hook_active"] for r in ranks if not r["last_stage"])
    assert all(r["hooks_removed"] for r in ranks)
    # TP ranks of the last stage saw the same per-token losses and full-vocab argmax.
    assert all(r["intervals"][i]["microbatches"] == last[0]["intervals"][i]["microbatches"]
               for r in last for i in range(len(r["intervals"])))
    assert len(last[0]["intervals"]) == 2
    for i, interval in enumerate(last[0]["intervals"]):
        loss_sum = tokens = correct = 0.0
        for mb in interval["microbatches"]:
            for l_row, m_row, y_row, p_row in zip(mb["losses"], mb["mask"], mb["labels"], mb["pred"]):
                for x, m, y, p in zip(l_row, m_row, y_row, p_row):
                    loss_sum += x * m
                    tokens += m
                    correct += m * (p == y)
        got = interval["results"]
        assert got["loss"] == pytest.approx(loss_sum / tokens, rel=1e-6)
        assert got["num_tokens"] == tokens == got["total_tokens"]
        assert got["correct_tokens"] == correct and got["accuracy"] == pytest.approx(correct / tokens)
        assert got["iters"] == 2 * (i + 1) and math.isfinite(got["learning rate"])
        for r in ranks:  # every rank, every stage: the same dict
            assert r["intervals"][i]["results"] == got


@pytest.mark.slow
def test_readme_recipe_in_megatron_training_loop_world1(tmp_path):
    _check(_run_case(tmp_path, 1), tp=1)


@pytest.mark.slow
@pytest.mark.xdist_group("dist")
def test_readme_recipe_in_megatron_training_loop_tp2_pp2(tmp_path):
    _check(_run_case(tmp_path, 4, "--tp", "2", "--pp", "2"), tp=2)


def _has_hybrid_model() -> bool:
    """Whether this megatron-core ships HybridModel (found without importing megatron)."""
    spec = importlib.util.find_spec("megatron")
    return bool(spec and spec.submodule_search_locations) and any(
        os.path.exists(os.path.join(d, "core", "models", "hybrid", "hybrid_model.py"))
        for d in spec.submodule_search_locations)


@pytest.mark.slow
@pytest.mark.skipif(not _has_hybrid_model(), reason="this megatron-core has no HybridModel (0.19 recommends it)")
@pytest.mark.parametrize("extra", [["--mtp", "1"], ["--mtp", "1", "--mtp-config-only"]], ids=["mtp", "no-mtp-stage"])
def test_readme_recipe_with_hybrid_model(tmp_path, extra):
    """The README's recipe in megatron-core's loop with a HybridModel (CPU shim): with an MTP
    depth its heads run first and are skipped; without MTP on the stage (mtp_process False)
    the one output-layer call is the main head's and is fed."""
    ranks = _run_case(tmp_path, 1, "--model", "hybrid", *extra)
    assert ranks[0]["model"] == "HybridModel" and ranks[0]["mtp_process"] == ("--mtp-config-only" not in extra)
    _check(ranks, tp=1)


def test_launch_readme_plain_loop_runs_and_weights_tokens():
    """The plain torch.distributed / Accelerate snippet of launch/README.md, one process."""
    import re

    with open(os.path.join(REPO, "launch", "README.md")) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    code = next(b for b in blocks if "DeviceMesh.current()" in b)
    printed, loader, reference = plain_loop.run(code, "launch/README.md (plain loop)")
    assert [p[0] for p in printed] == [10, 20]
    total, count, correct = reference(loader[10:])  # lr 0: the model never changes
    got = printed[-1][1]
    assert got["loss"] == pytest.approx(total / count, rel=1e-6) and got["num_tokens"] == count
    assert got["accuracy"] == pytest.approx(correct / count) and got["iters"] == 20
