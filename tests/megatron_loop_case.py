"""The README's Megatron recipe, run verbatim in megatron-core's simple training loop on CPU.

    python tests/megatron_loop_case.py OUT_DIR                          # one process
    torchrun --nproc_per_node 4 tests/megatron_loop_case.py OUT_DIR --tp 2 --pp 2
    python tests/megatron_loop_case.py OUT_DIR --model hybrid --mtp 1   # megatron-core 0.19+

Builds a small ``GPTModel`` (local layer spec; or 0.19's ``HybridModel`` with attention
layers of that spec, ``--mtp N`` multi-token-prediction depths in its pattern, or only in
its config with ``--mtp-config-only``) that returns per-token losses, executes the
two ``python`` blocks of the README's "## Megatron" section (metrics, ``LogitsHook``,
``forward_step_func``; then the training loop) and records, next to each ``calculate()``
result, the raw data of its interval for an independent check: the per-token losses the
schedule handed to ``loss_func``, the loss masks and labels, and the argmax of the full
(TP-gathered) logits taken by a hook of the test's own. Each rank writes
``OUT_DIR/rank<R>.json``; ``tests/integrations/test_megatron_loop.py`` compares.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import warnings

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core.*")

VOCAB, SEQ, MBS, NUM_MB, STEPS, INTERVAL = 64, 16, 2, 2, 4, 2


def section_blocks(path: str, heading: str):
    """The ``python`` blocks of the ``## heading`` section of ``path`` (from the repository's
    root), in order."""
    with open(os.path.join(REPO, path)) as f:
        text = f.read()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def readme_blocks():
    """The ``python`` blocks of the README's "## Megatron" section, in order."""
    return section_blocks("README.md", "Megatron")


def microbatch(step: int, mb: int):
    """Deterministic per (step, microbatch), the same on TP ranks; labels stay valid ids at
    masked positions (Megatron's convention: the loss mask says what counts)."""
    g = torch.Generator().manual_seed(1000 * step + mb)
    tokens = torch.randint(0, 8, (MBS, SEQ), generator=g)  # few ids: a learnable argmax
    labels = torch.roll(tokens, -1, 1)
    loss_mask = torch.ones(MBS, SEQ)
    for row in range(MBS):
        loss_mask[row, int(torch.randint(SEQ // 2, SEQ + 1, (1,), generator=g)):] = 0.0
    return {"tokens": tokens, "position_ids": torch.arange(SEQ).expand(MBS, SEQ).contiguous(),
            "attention_mask": None,  # the causal mask megatron builds itself (CPU shim path)
            "labels": labels, "loss_mask": loss_mask}



class Batches:
    """Every microbatch of every step, in order (``offset`` added to the step: other data
    on each data rank); ``peek`` is the one handed out last."""

    def __init__(self, offset: int = 0):
        self.i, self.peek, self.offset = 0, None, offset

    def __iter__(self):
        return self

    def __next__(self):
        self.peek = microbatch(self.i // NUM_MB + self.offset, self.i % NUM_MB)
        self.i += 1
        return self.peek


class Recording:
    """``metrics`` with each ``calculate()`` kept in ``intervals``: its results, and what
    ``take()`` returns then (what the case recorded over the interval)."""

    def __init__(self, metrics, take=dict):
        self.metrics, self.take, self.intervals = metrics, take, []

    def calculate(self):
        results = self.metrics.calculate()
        self.intervals.append({"results": results, **self.take()})
        return results


def drained(records: list) -> list:
    """A copy of ``records``, which is emptied."""
    out = list(records)
    records.clear()
    return out

def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--model", choices=("gpt", "hybrid"), default="gpt")
    p.add_argument("--mtp", type=int, default=0)
    p.add_argument("--mtp-config-only", action="store_true",
                   help="config.mtp_num_layers set, no MTP in the hybrid pattern: no MTP head runs")
    args = p.parse_args()
    torch.set_num_threads(1)
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("gloo")
    else:  # one process: no port
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    from twinkle_metrics.integrations import megatron_cpu

    megatron_cpu.enable()  # before model_parallel_cuda_manual_seed
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(args.tp, args.pp, create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(123)
    config = TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=4, use_cpu_initialization=True,
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
        pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        batch_p2p_sync=False, mtp_num_layers=args.mtp or None)
    torch.manual_seed(0)  # CPU init splits one master weight over TP: same draws on TP ranks
    if args.model == "hybrid":
        model = hybrid_model(config, args.mtp if not args.mtp_config_only else 0)
    else:
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                         max_sequence_length=SEQ, pre_process=ps.is_pipeline_first_stage(),
                         post_process=ps.is_pipeline_last_stage(), share_embeddings_and_output_weights=False)

    # The test's own record: full-vocab argmax (gathered over TP, a copy: test only) of the
    # main head, the last output-layer call of each forward (MTP heads come first).
    preds, records, heads = [], [], []

    def reference_hook(module, inputs, output):
        logits = output[0].detach().clone()
        if args.tp > 1:
            parts = [torch.empty_like(logits) for _ in range(args.tp)]
            dist.all_gather(parts, logits, group=ps.get_tensor_model_parallel_group())
            logits = torch.cat(parts, -1)
        heads.append(logits.argmax(-1).transpose(0, 1))  # [b, s]

    def main_head(module, inputs, output):
        preds.append(heads[-1])
        heads.clear()

    if ps.is_pipeline_last_stage():
        model.output_layer.register_forward_hook(reference_hook)
        model.register_forward_hook(main_head)

    setup, loop = readme_blocks()[:2]  # the recipe: metrics and hook, then the loop
    ns = {"model": model}
    exec(compile(setup, "README.md (Megatron setup)", "exec"), ns)
    readme_forward_step = ns["forward_step_func"]

    def forward_step_func(data_iterator, model):
        output_tensor, loss_fn = readme_forward_step(data_iterator, model)
        batch = data_iterator.peek

        def recording_loss(out):
            records.append({"losses": out.detach().double().tolist(), "mask": batch["loss_mask"].tolist(),
                            "labels": batch["labels"].tolist(), "pred": preds.pop(0).tolist()})
            return loss_fn(out)
        return output_tensor, recording_loss

    recording = Recording(ns["metrics"], lambda: {"microbatches": drained(records)})
    ns.update(forward_step_func=forward_step_func, metrics=recording, train_iters=STEPS,
              log_interval=INTERVAL, forward_backward_func=get_forward_backward_func(),
              train_iterator=Batches(), num_microbatches=NUM_MB, seq_length=SEQ, micro_batch_size=MBS,
              optimizer=torch.optim.Adam(model.parameters(), lr=0.02), print=lambda *a: None)
    exec(compile(loop, "README.md (Megatron loop)", "exec"), ns)
    active = ns["hook"].active
    ns["hook"].remove()
    removed = not model._forward_pre_hooks and (
        not ps.is_pipeline_last_stage() or len(model.output_layer._forward_hooks) == 1)  # ours stays
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"rank": dist.get_rank(), "tp_rank": ps.get_tensor_model_parallel_rank(),
                   "last_stage": ps.is_pipeline_last_stage(), "hook_active": active, "hooks_removed": removed,
                   "intervals": recording.intervals, "model": type(model).__name__,
                   "mtp_process": getattr(model, "mtp_process", None)}, f)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def hybrid_model(config, mtp_depths: int):
    """megatron-core 0.19's ``HybridModel``: two attention layers (``"**"``) of the local GPT
    layer spec, then ``mtp_depths`` MTP depths of one attention layer each; one process."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock,
        MultiTokenPredictionBlockSubmodules,
        MultiTokenPredictionLayer,
        MultiTokenPredictionLayerSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    mtp_layer = ModuleSpec(module=MultiTokenPredictionLayer, submodules=MultiTokenPredictionLayerSubmodules(
        enorm=WrappedTorchNorm, hnorm=WrappedTorchNorm, eh_proj=ColumnParallelLinear, mtp_model_layer=None,
        layer_norm=WrappedTorchNorm))
    stack = ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(
        attention_layer=get_gpt_layer_local_spec(),
        mtp_block_spec=ModuleSpec(module=MultiTokenPredictionBlock,
                                  submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[mtp_layer]))))
    return HybridModel(config=config, hybrid_stack_spec=stack, vocab_size=VOCAB, max_sequence_length=SEQ,
                       hybrid_layer_pattern="**" + "/*" * mtp_depths,
                       position_embedding_type="learned_absolute")


if __name__ == "__main__":
    main()
