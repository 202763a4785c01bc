"""docs/megatron.md's guarded loop ("## Skipping a bad step") after the README's Megatron set-up,
run verbatim in megatron-core's schedule on CPU, with a NaN in one rank's loss at one step.

    torchrun --nproc_per_node 4 tests/integrations/megatron_guard_case.py OUT_DIR --tp 2 --pp 2 --nan 3:2,3

``--nan STEP:RANKS``: at that step (1-based) the per-token losses of those last-stage ranks
(comma-separated) are NaN, so their loss reports and gradients are: both TP ranks of a stage, as
megatron-core's vocab-parallel cross entropy spreads a NaN over TP. Each rank writes ``OUT_DIR/rank<R>.json``:
its verdicts, whether its parameters changed at each step, the results of each ``calculate()``
and its host; ``tests/integrations/test_megatron_guard.py`` compares.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core.*")

from tests.megatron_loop_case import MBS, NUM_MB, SEQ, VOCAB, Batches, readme_blocks, section_blocks  # noqa: E402

STEPS, INTERVAL = 4, 2


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--nan", default="3:0", help="STEP:RANKS whose loss is NaN")
    args = p.parse_args()
    nan_step, nan_ranks = args.nan.split(":")
    nan_step, nan_ranks = int(nan_step), {int(r) for r in nan_ranks.split(",")}
    torch.set_num_threads(1)
    dist.init_process_group("gloo")

    from twinkle_metrics.integrations import megatron_cpu

    megatron_cpu.enable()
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(args.tp, args.pp, create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(123)
    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4, use_cpu_initialization=True,
                               tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                               pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
                               batch_p2p_sync=False)
    torch.manual_seed(0)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ, pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage(), share_embeddings_and_output_weights=False)
    rank = dist.get_rank()
    iteration = [0]
    if ps.is_pipeline_last_stage() and rank in nan_ranks:  # this rank's per-token losses go NaN
        model.register_forward_hook(lambda mod, inp, out: out * float("nan") if iteration[0] == nan_step else out)

    setup = readme_blocks()[0]
    ns = {"model": model}
    exec(compile(setup, "README.md (Megatron setup)", "exec"), ns)

    class Counted(torch.optim.Adam):
        """Adam that counts the loop's iterations (one zero_grad each)."""

        def zero_grad(self, *a, **k):
            iteration[0] += 1
            return super().zero_grad(*a, **k)

    params = list(model.parameters())
    snapshots, verdicts, printed, results = [], [], [], []

    class Recording:  # wraps the collection the block builds, at each call
        def __init__(self, inner):
            self.inner = inner

        def calculate(self):
            results.append(self.inner.calculate())
            return results[-1]

    from twinkle_metrics import StepGuard

    real_check = StepGuard.check

    def check(self, *a, **k):  # the guard the block builds, observed: the params as it checks, its verdict
        snapshots.append([p.detach().clone() for p in params])
        verdict = real_check(self, *a, **k)
        verdicts.append(repr(verdict))
        return verdict

    StepGuard.check = check
    ns.update(forward_backward_func=get_forward_backward_func(), train_iterator=Batches(), train_iters=STEPS,
              log_interval=INTERVAL, num_microbatches=NUM_MB, seq_length=SEQ, micro_batch_size=MBS,
              optimizer=Counted(params, lr=0.02), print=lambda *a: printed.append(" ".join(map(str, a))))
    loop = section_blocks("docs/megatron.md", "Skipping a bad step")[0]
    loop = loop.replace("metrics.calculate()", "Recording(metrics).calculate()")
    exec(compile(loop, "docs/megatron.md (Skipping a bad step)", "exec"), dict(ns, Recording=Recording))
    snapshots.append([p.detach().clone() for p in params])
    # whether the update of step k (1-based) changed this rank's parameters
    stepped = [any(not torch.equal(a, b) for a, b in zip(x, y)) for x, y in zip(snapshots, snapshots[1:])]
    finite = all(bool(torch.isfinite(p).all()) for p in params)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "host": socket.gethostname(), "verdicts": verdicts, "stepped": stepped,
                   "printed": printed, "results": results, "finite": finite,
                   "last_stage": ps.is_pipeline_last_stage()}, f)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
