"""Megatron-core training entry point with twinkle-metrics fed from the pipeline schedule.

    torchrun --nproc_per_node 8 launch/train_megatron.py --config configs/megatron_demo.json
    python launch/train_megatron.py --set parallel.tp=1 --set parallel.pp=1   # one process

A small ``GPTModel`` (local layer spec, CPU initialisation) learns a synthetic
"arithmetic sequence" task with padded (masked) tails, so microbatches hold different
token counts and a token-weighted loss differs from a mean of means. Per step:

1. ``get_forward_backward_func()`` runs the TP x PP (x virtual PP) schedule over
   ``num_microbatches``; ``loss_func`` feeds logits to the microbatch metrics
   (Accuracy) *before* ``vocab_parallel_cross_entropy`` modifies them in place, and
   returns Megatron's ``(loss_sum, num_tokens, {'lm loss': [sum, count]})``.
2. Gradients: summed over DP x CP and divided by the global token count (what
   Megatron's ``finalize_model_grads`` does with ``calculate_per_token_loss``; done
   here with plain modules because Megatron's DDP wrapper allocates CUDA buffers),
   then the global grad norm (sum of squares over TP x PP, TP-duplicated params
   counted once) and a torch optimizer step.
3. A ``StepGuard`` in the config (the demo's has one) checks the step before the update:
   the loss reports and each rank's own part of the squared grad norm (before it is summed
   over TP x PP, so a rank whose gradients went bad is the one named); every rank gets the
   same verdict and skips the update together (``train.nan_at=STEP:RANK`` makes that rank's
   gradients NaN at that step: ``launch/demo.sh`` does, at step 5 on rank 6).
4. The schedule's report list (``[]`` on non-last stages) and the grad norm go to
   the step metrics (LossMetric, TrainMetric); every ``interval`` steps all ranks call
   ``calculate()`` and the logging rank writes the numbers.

On a machine without CUDA, ``twinkle_metrics.integrations.megatron_cpu`` patches the few CUDA
assumptions of megatron-core's schedules (gloo backend); with CUDA nothing is patched.
"""
from __future__ import annotations

import math
import os
import time
import warnings
from functools import partial

import common  # also puts the repository on sys.path
import torch
import torch.distributed as dist
from common import DebugDump, init_torch_distributed, make_run_dir, print_rank0, read_env

from parallel import DeviceMesh
from twinkle_metrics import StepGuard
from twinkle_metrics.integrations.factory import build_metrics, config_path, split_feeds
from twinkle_metrics.integrations.loggers import Progress, build_loggers

DEFAULT_CONFIG = "megatron_demo.json"
# megatron-core warns at import about missing Apex / Transformer Engine (expected on CPU).
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core.*")


def parse_args(argv=None):
    return common.parse_args(argv, __doc__.splitlines()[0], DEFAULT_CONFIG)


# ----------------------------------------------------------------------------- data
def make_microbatches(step: int, dp_rank: int, cfg: dict):
    """The demo task's microbatches with Megatron's position ids (see common.make_microbatches)."""
    out = []
    for tokens, labels in common.make_microbatches(step, dp_rank, cfg):
        b, s = tokens.shape
        out.append({"tokens": tokens, "labels": labels,
                    "position_ids": torch.arange(s).unsqueeze(0).expand(b, s).contiguous()})
    return out


# ---------------------------------------------------------------------------- model
def build_model(cfg: dict, ps, vpp: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    m, par = cfg["model"], cfg["parallel"]
    config = TransformerConfig(
        num_layers=m["num_layers"], hidden_size=m["hidden_size"],
        num_attention_heads=m["num_attention_heads"], ffn_hidden_size=4 * m["hidden_size"],
        tensor_model_parallel_size=par.get("tp", 1), pipeline_model_parallel_size=par.get("pp", 1),
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        pipeline_dtype=torch.float32, params_dtype=torch.float32,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        calculate_per_token_loss=True, batch_p2p_sync=torch.cuda.is_available(),
        # gloo pairs the messages to one peer in order: with PP = 2 the previous and the next
        # stage are one rank, and a batched send_prev + send_next would swap activations and
        # gradients of one shape (the interleaved schedule sends both). Unbatched p2p keeps
        # the two directions on two groups.
        batch_p2p_comm=torch.cuda.is_available(),
    )
    # Same seed everywhere: DP replicas start equal; CPU init splits one master
    # weight across TP ranks, so TP ranks must draw the same numbers too.
    torch.manual_seed(cfg["train"]["seed"])
    chunks = []
    for vp_stage in range(vpp):
        stage = vp_stage if vpp > 1 else None
        kw = dict(ignore_virtual=vpp == 1, vp_stage=stage)
        model = GPTModel(
            config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=m["vocab_size"], max_sequence_length=m["seq_length"],
            pre_process=ps.is_pipeline_first_stage(**kw), post_process=ps.is_pipeline_last_stage(**kw),
            share_embeddings_and_output_weights=False, vp_stage=stage)
        if torch.cuda.is_available():
            model.cuda()
        chunks.append(model)
    return config, chunks


def make_finalize_grads(ps):
    """``finalize_model_grads_func`` for plain modules: DP x CP grad sum, divide by global tokens."""

    def finalize(model_chunks, num_tokens, pg_collection=None, force_all_reduce=False):
        modules = []
        for chunk in model_chunks:
            modules.extend(chunk if isinstance(chunk, (list, tuple)) else [chunk])
        grads = [p.grad for mod in modules for p in mod.parameters() if p.grad is not None]
        # The schedule counts tokens on the last stage only: share them along the pipeline.
        tokens = torch.as_tensor(num_tokens if num_tokens is not None else 0,
                                 dtype=torch.float64).reshape(1).to(grads[0].device)
        if ps.get_pipeline_model_parallel_world_size() > 1:
            last = ps.get_pipeline_model_parallel_last_rank()
            dist.broadcast(tokens, src=last, group=ps.get_pipeline_model_parallel_group())
        flat = torch.cat([g.reshape(-1).double() for g in grads] + [tokens])
        dp_group = ps.get_data_parallel_group(with_context_parallel=True)
        if dist.get_world_size(dp_group) > 1:
            dist.all_reduce(flat, group=dp_group)  # one fused all-reduce: grads and the token count
        scale = 1.0 / flat[-1].clamp(min=1)
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_((flat[offset:offset + n] * scale).view_as(g))
            offset += n

    return finalize


def grad_norm(model_chunks, ps):
    """Global L2 grad norm: TP-sharded params summed over TP, duplicates counted once, over PP;
    and this rank's own part of its square (before the sum)."""
    tp_rank = ps.get_tensor_model_parallel_rank()
    total = torch.zeros((), dtype=torch.float64)
    for chunk in model_chunks:
        for p in chunk.parameters():
            if p.grad is None:
                continue
            if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
                total = total.to(p.grad.device) + p.grad.double().pow(2).sum()
    mine = total.clone()
    group = ps.get_model_parallel_group()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return total.sqrt(), mine


def lr_at(step: int, t: dict) -> float:
    warm = t.get("warmup_steps", 0)
    if step < warm:
        return t["lr"] * (step + 1) / warm
    progress = (step - warm) / max(1, t["steps"] - warm)
    return t.get("min_lr", 0.0) + 0.5 * (t["lr"] - t.get("min_lr", 0.0)) * (1 + math.cos(math.pi * progress))


# ----------------------------------------------------------------------------- main
def main(argv=None):
    args = parse_args(argv)
    overrides = list(args.overrides) + ([f"train.steps={args.steps}"] if args.steps is not None else [])
    cfg = common.load_run_config(config_path(args.config), overrides,
                                 optional=common.OPTIONAL_KEYS + ("parallel.tp", "parallel.pp", "parallel.vpp",
                                                                  "train.warmup_steps", "train.min_lr",
                                                                  "train.weight_decay", "train.nan_at"))
    env = read_env(args.local_rank)
    init_torch_distributed(env)

    from twinkle_metrics.integrations import megatron_cpu

    on_cpu = megatron_cpu.enable()  # no-op when CUDA is present
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    par = cfg["parallel"]
    tp, pp, vpp = par.get("tp", 1), par.get("pp", 1), par.get("vpp", 1)
    if env.world_size % (tp * pp):
        raise SystemExit(f"world size {env.world_size} is not divisible by tp x pp = {tp * pp}; "
                         "change parallel.tp/pp or the number of processes")
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                                 create_gloo_process_groups=False)
    try:
        run(args, cfg, env, ps, tensor_parallel, get_forward_backward_func, on_cpu, vpp)
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def run(args, cfg, env, ps, tensor_parallel, get_forward_backward_func, on_cpu, vpp):
    t, log_cfg = cfg["train"], cfg.get("logging", {})
    mesh = DeviceMesh.from_megatron()
    run_dir = os.path.abspath(make_run_dir(log_cfg.get("run_root", "runs"), args.run_dir))
    print_rank0(f"[train_megatron] {mesh.describe()}, world {env.world_size}, "
                f"{'CPU/gloo (megatron-core CPU shim on)' if on_cpu else 'CUDA'}; run dir {run_dir}")

    # Metrics: one collection (one fused sync); feeds say which call reaches which metric.
    metrics = build_metrics(cfg["metrics"], mesh)
    step_metrics, microbatch_metrics = split_feeds(cfg["metrics"], metrics)
    guard = next((m for _, m in metrics.members() if isinstance(m, StepGuard)), None)
    nan_step, _, nan_rank = str(t.get("nan_at") or "-1:-1").partition(":")

    config, chunks = build_model(cfg, ps, vpp)
    config.finalize_model_grads_func = make_finalize_grads(ps)
    params = [p for c in chunks for p in c.parameters()]
    optimizer = torch.optim.AdamW(params, lr=t["lr"], weight_decay=t.get("weight_decay", 0.0),
                                  betas=(0.9, 0.95))
    forward_backward = get_forward_backward_func()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    seq = cfg["model"]["seq_length"]
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), 1)[None, None]

    def loss_func(batch, logits):
        labels = batch["labels"]
        # Metrics first: vocab_parallel_cross_entropy modifies fp32 logits in place.
        for metric in microbatch_metrics:
            metric.accumulate({"labels": labels}, {"logits": logits.detach()})
        mask = (labels != -100)
        per_token = tensor_parallel.vocab_parallel_cross_entropy(logits, labels.clamp(min=0))
        loss_sum = (per_token * mask).sum()
        num_tokens = mask.sum().to(torch.int)
        report = torch.stack([loss_sum.detach().double(), num_tokens.double()])
        return loss_sum, num_tokens, {"lm loss": report}

    def forward_step(data_iterator, model):
        batch = {k: v.to(device) for k, v in next(data_iterator).items()}
        logits = model(batch["tokens"], batch["position_ids"], causal)
        return logits, partial(loss_func, batch)

    interval = log_cfg.get("interval", 5)
    logging_rank = mesh.is_logging_rank
    progress = Progress(t["steps"], enabled=logging_rank and log_cfg.get("progress", True))
    sinks = log_cfg.get("sinks", ["console", "jsonl", "tensorboard"])
    logger = build_loggers([s for s in sinks if s != "plot"], run_dir, enabled=logging_rank,
                           progress=progress, config=cfg, console_keys=log_cfg.get("console_keys"))
    debug = DebugDump(run_dir, env.rank, args.debug_dump)
    debug.write("mesh", rank=env.rank, tp_rank=mesh.tp_rank, pp_rank=mesh.pp_rank,
                dp_rank=mesh.dp_rank, is_last_stage=mesh.is_last_stage)
    M, B = t["num_microbatches"], t["micro_batch_size"]
    start = time.time()
    for step in range(t["steps"]):
        lr = lr_at(step, t)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batches = make_microbatches(step, mesh.dp_rank, cfg)
        iters = [iter(batches) for _ in chunks]  # each virtual stage walks the same microbatches
        for c in chunks:
            c.zero_grad(set_to_none=True)
        losses_reduced = forward_backward(
            forward_step_func=forward_step, data_iterator=iters if vpp > 1 else iters[0],
            model=chunks if vpp > 1 else chunks[0], num_microbatches=M, seq_length=seq,
            micro_batch_size=B, forward_only=False)
        if (step + 1, env.rank) == (int(nan_step), int(nan_rank)):  # the demo's fault: this rank's grads
            next(p for p in params if p.grad is not None).grad.view(-1)[0] = float("nan")
        norm, mine = grad_norm(chunks, ps)
        verdict = guard.check(loss=losses_reduced, values=mine, step=step + 1) if guard is not None else None
        if verdict is not None and not verdict.ok:  # the same verdict on every rank: all skip, or all stop
            print_rank0(f"[train_megatron] {verdict}")
            debug.write("verdict", step=step + 1, verdict=str(verdict))
            if verdict.stop:
                break
        else:
            if t.get("clip_grad"):
                torch.nn.utils.clip_grads_with_norm_(params, t["clip_grad"], norm)
            optimizer.step()

        tokens = sum(int((b["labels"] != -100).sum()) for b in batches)
        step_metrics.accumulate(None, losses_reduced, grad_norm=norm, lr=lr, step=(step + 1) * M,
                                gradient_accumulation_steps=M, tokens=tokens, samples=M * B)
        if losses_reduced:
            debug.write("schedule", step=step + 1,
                        pairs=[d["lm loss"].tolist() for d in losses_reduced])
        if (step + 1) % interval == 0 or step + 1 == t["steps"]:
            results = metrics.calculate()  # collective: every rank, every stage
            debug.write("results", step=step + 1, results=results)
            logger.log(results, step + 1)
            progress.update(1, **{k: results[k] for k in ("loss", "accuracy") if k in results})
        else:
            progress.update(1)
    progress.close()
    logger.close()
    debug.close()
    common.finish_run("train_megatron", t["steps"], start, run_dir, sinks, logging_rank,
                      title=f"Megatron demo, {mesh.describe()}")
    dist.barrier()


if __name__ == "__main__":
    main()
