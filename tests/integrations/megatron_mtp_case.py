"""docs/megatron.md's MTP block in the README's Megatron recipe, in megatron-core's own training
loop on CPU, beside megatron-core's MTP tracker.

    python tests/integrations/megatron_mtp_case.py OUT_DIR                      # one process
    torchrun --nproc_per_node 4 tests/integrations/megatron_mtp_case.py OUT_DIR --tp 2   # TP2 x DP2

Builds a tiny ``GPTModel`` with ``mtp_num_layers=2`` (local layer spec), executes the README's
"## Megatron" set-up block, then the "## Multi-token prediction" block of docs/megatron.md
(``MTPMetric`` and ``register_mtp_hooks``), then the README's loop. After each
``forward_backward_func`` it runs megatron-core's ``MTPLossLoggingHelper.track_mtp_metrics`` (as
Megatron-LM's ``training_log`` does every iteration) and keeps the tracker's reduced counts,
cumulative counts and losses; a recording wrapper of the test's own (installed before the
hooks) and an output-layer hook keep, for an independent check, each MTP call's labels,
per-token losses and full-vocab argmax (gathered over TP: test only). Each rank writes
``OUT_DIR/rank<R>.json``; ``tests/integrations/test_megatron_mtp.py`` compares.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

REPO = os.path.abspath(os.path.join(__file__, "../../.."))
sys.path.insert(0, REPO)
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core.*")
warnings.filterwarnings("ignore", category=DeprecationWarning)  # 0.19 recommends HybridModel

from tests.megatron_loop_case import (  # noqa: E402
    MBS,
    NUM_MB,
    SEQ,
    STEPS,
    VOCAB,
    Batches,
    Recording,
    drained,
    readme_blocks,
    section_blocks,
)

DEPTHS, INTERVAL = 2, 2


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--tp", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(1)
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    from twinkle_metrics.integrations import megatron_cpu

    megatron_cpu.enable()
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(args.tp, 1, create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(123)
    config = TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=4, use_cpu_initialization=True,
        tensor_model_parallel_size=args.tp, pipeline_dtype=torch.float32, hidden_dropout=0.0,
        attention_dropout=0.0, mtp_num_layers=DEPTHS)
    torch.manual_seed(0)
    spec = get_gpt_layer_local_spec()
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False),
                     share_embeddings_and_output_weights=False)
    tp_group = ps.get_tensor_model_parallel_group()

    # The test's own record of every MTP call: labels and per-token losses (a wrapper the
    # hooks wrap in turn) and the full-vocab argmax of the logits (an output-layer hook).
    calls, preds = [], []
    real = model.compute_language_model_loss

    def recording_loss(labels, logits):
        loss = real(labels, logits)
        calls.append({"labels": labels.tolist(), "losses": loss.detach().double().tolist()})
        return loss

    def argmax_hook(module, inputs, output):
        logits = output[0].detach().clone()
        if args.tp > 1:
            parts = [torch.empty_like(logits) for _ in range(args.tp)]
            dist.all_gather(parts, logits, group=tp_group)
            logits = torch.cat(parts, -1)
        preds.append(logits.argmax(-1).transpose(0, 1).tolist())  # [b, s]

    model.compute_language_model_loss = recording_loss
    model.output_layer.register_forward_hook(argmax_hook)

    setup, loop = readme_blocks()[:2]
    ns = {"model": model, "config": config}
    exec(compile(setup, "README.md (Megatron setup)", "exec"), ns)
    mtp = section_blocks("docs/megatron.md", "Multi-token prediction")[0]
    exec(compile(mtp, "docs/megatron.md (MTP)", "exec"), ns)
    readme_forward_step = ns["forward_step_func"]
    microbatches = []

    def forward_step_func(data_iterator, model):
        out, loss_fn = readme_forward_step(data_iterator, model)
        batch = data_iterator.peek
        microbatches.append({"labels": batch["labels"].tolist(), "mask": batch["loss_mask"].tolist()})
        return out, loss_fn

    tracker = MTPLossLoggingHelper.tracker
    has_counts = hasattr(MTPLossLoggingHelper, "save_metrics_to_tracker")  # 0.19: acceptance counts
    steps = []
    fbf = get_forward_backward_func()

    def forward_backward_func(**kw):
        losses_reduced = fbf(**kw)
        before = [tracker[k].tolist() if k in tracker else [0.0] * DEPTHS
                  for k in ("cumulative_correct_values", "cumulative_total_values")]
        total_loss_dict = {}
        MTPLossLoggingHelper.track_mtp_metrics(1.0 / NUM_MB, len(steps) + 1, None, None, total_loss_dict)
        step = {"loss": [float(total_loss_dict[f"mtp_{k} loss"]) for k in range(1, DEPTHS + 1)],
                "microbatches": list(microbatches), "calls": list(calls), "preds": list(preds)}
        if has_counts:
            after = [tracker[k].tolist() for k in ("cumulative_correct_values", "cumulative_total_values")]
            step["correct"] = [a - b for a, b in zip(after[0], before[0])]
            step["total"] = [a - b for a, b in zip(after[1], before[1])]
            step["cumulative"] = after
        steps.append(step)
        microbatches.clear()
        calls.clear()
        preds.clear()
        return losses_reduced

    recording = Recording(ns["metrics"], lambda: {"steps": drained(steps)})
    ns.update(forward_step_func=forward_step_func, metrics=recording, train_iters=STEPS,
              log_interval=INTERVAL, forward_backward_func=forward_backward_func,
              train_iterator=Batches(100 * ps.get_data_parallel_rank()),
              num_microbatches=NUM_MB, seq_length=SEQ, micro_batch_size=MBS,
              optimizer=torch.optim.Adam(model.parameters(), lr=0.02), print=lambda *a: None)
    exec(compile(loop, "README.md (Megatron loop)", "exec"), ns)
    hooks = ns["mtp_hooks"]
    active = hooks.active
    hooks.remove()
    ns["hook"].remove()
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"rank": dist.get_rank(), "tp_rank": ps.get_tensor_model_parallel_rank(),
                   "dp_rank": ps.get_data_parallel_rank(), "hooks_active": active,
                   "restored": model.__dict__.get("compute_language_model_loss") is recording_loss,
                   "has_counts": has_counts, "intervals": recording.intervals}, f)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
