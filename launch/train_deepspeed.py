"""DeepSpeed pipeline training entry point with twinkle-metrics.

    deepspeed --num_gpus 4 launch/train_deepspeed.py --config configs/deepspeed_demo.json
    torchrun --nproc_per_node 4 launch/train_deepspeed.py          # also works
    python launch/train_deepspeed.py --set parallel.pp=1          # one process

A ``PipelineModule`` (embedding, causal blocks, head) trained by ``engine.train_batch``
on PP x DP (PP2 x DP2 with 4 processes). The mesh comes from
``DeviceMesh.from_deepspeed(engine)``.

DeepSpeed's own loss (``train_batch``'s return value) is the unweighted mean of
per-microbatch losses, averaged unweighted over DP ranks. Our ``loss_fn`` also
records each microbatch's ``[loss_sum, num_tokens]`` and LossMetric reduces those, so
the logged ``loss`` is the true token-weighted mean; ``deepspeed_loss`` (the mean of
DeepSpeed's per-step numbers over the interval) is logged next to it to show the gap.
Values also go to DeepSpeed's monitor (``tensorboard`` / ``csv_monitor`` / ``wandb``
blocks of the DeepSpeed config) through ``engine.monitor.write_events``.
"""
from __future__ import annotations

import os
import time
import warnings

import common  # also puts the repository on sys.path
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from common import DebugDump, make_run_dir, print_rank0, read_env

from parallel import DeviceMesh
from twinkle_metrics.core.compat import skip_deepspeed_shm_op  # noqa: E402
from twinkle_metrics.integrations.factory import build_metrics, config_path, load_config, split_feeds
from twinkle_metrics.integrations.loggers import LoggerGroup, MonitorLogger, Progress, build_loggers

DEFAULT_CONFIG = "deepspeed_demo.json"
warnings.filterwarnings("ignore", category=UserWarning)


def parse_args(argv=None):
    return common.parse_args(argv, __doc__.splitlines()[0], DEFAULT_CONFIG, allow_unknown=True)


# ---------------------------------------------------------------------------- model
class Embed(nn.Module):
    def __init__(self, vocab: int, hidden: int, seq: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)

    def forward(self, tokens):
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tok(tokens) + self.pos(pos)[None]


class CausalBlock(nn.Module):
    """Pre-norm block: a causal depthwise convolution (token mixing) and an MLP."""

    def __init__(self, hidden: int, kernel: int = 4):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.mix = nn.Conv1d(hidden, hidden, kernel, groups=hidden)
        self.kernel = kernel
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x):
        h = self.norm1(x).transpose(1, 2)
        h = self.mix(F.pad(h, (self.kernel - 1, 0))).transpose(1, 2)  # left pad: causal
        x = x + h
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, x):
        return self.out(self.norm(x))


class TokenLoss:
    """``loss_fn`` for the PipelineModule: DeepSpeed's per-microbatch mean for backward,
    and the exact ``[loss_sum, num_tokens]`` plus logits for the metrics on the side."""

    def __init__(self, microbatch_metrics):
        self.microbatch_metrics = microbatch_metrics
        self.reports = []  # one Megatron-style {'lm loss': [sum, count]} per microbatch

    def __call__(self, logits, labels):
        for metric in self.microbatch_metrics:
            metric.accumulate({"labels": labels}, {"logits": logits.detach()})
        mask = labels != -100
        per_token = F.cross_entropy(logits.float().flatten(0, 1), labels.clamp(min=0).flatten(),
                                    reduction="none").view_as(labels)
        loss_sum = (per_token * mask).sum()
        count = mask.sum()
        self.reports.append({"lm loss": torch.stack([loss_sum.detach().double(), count.double()])})
        return loss_sum / count.clamp(min=1)  # what DeepSpeed averages over microbatches

    def pop(self):
        out, self.reports = self.reports, []
        return out


def global_grad_norm(params, group):
    """L2 norm of all gradients across pipeline stages (after DeepSpeed's DP reduction)."""
    sq = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is not None:
            sq = sq.to(p.grad.device) + p.grad.double().pow(2).sum()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sq, group=group)
    return sq.sqrt()


# ----------------------------------------------------------------------------- main
def main(argv=None):
    args = parse_args(argv)
    overrides = list(args.overrides) + ([f"train.steps={args.steps}"] if args.steps is not None else [])
    cfg = common.load_run_config(config_path(args.config), overrides,
                                 optional=common.OPTIONAL_KEYS + ("parallel.pp",))
    env = read_env(args.local_rank)
    if not env.distributed:  # DeepSpeed reads its rank from the environment
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "gloo":
        skip_deepspeed_shm_op()
    if not env.distributed:  # one process needs no rendezvous; init_distributed wraps this group
        common.init_torch_distributed(env, backend)
    deepspeed.init_distributed(dist_backend=backend)

    t, m, log_cfg = cfg["train"], cfg["model"], cfg.get("logging", {})
    pp = cfg["parallel"].get("pp", 1)
    if env.world_size % pp:
        raise SystemExit(f"world size {env.world_size} is not divisible by parallel.pp = {pp}")
    dp = env.world_size // pp
    run_dir = os.path.abspath(make_run_dir(log_cfg.get("run_root", "runs"), args.run_dir))

    ds_config = load_config(config_path(cfg["deepspeed_config"]))
    # DeepSpeed clips before the optimizer's pre-step hook runs, so a norm taken there would
    # be the clipped one: we take clipping over (measure the true norm, then clip).
    clip = float(t.get("clip_grad", ds_config.pop("gradient_clipping", 0.0)) or 0.0)
    ds_config.pop("gradient_clipping", None)
    ds_config.update(train_micro_batch_size_per_gpu=t["micro_batch_size"],
                     gradient_accumulation_steps=t["num_microbatches"],
                     train_batch_size=t["micro_batch_size"] * t["num_microbatches"] * dp)
    for block in ("tensorboard", "csv_monitor"):  # DeepSpeed's monitor writes inside the run dir
        if ds_config.get(block, {}).get("enabled"):
            ds_config[block]["output_path"] = os.path.join(run_dir, "deepspeed_monitor")

    torch.manual_seed(t["seed"])
    layers = ([LayerSpec(Embed, m["vocab_size"], m["hidden_size"], m["seq_length"])]
              + [LayerSpec(CausalBlock, m["hidden_size"]) for _ in range(m["num_layers"])]
              + [LayerSpec(Head, m["hidden_size"], m["vocab_size"])])
    loss_fn = TokenLoss([])  # metrics attached once the mesh exists
    module = PipelineModule(layers=layers, num_stages=pp, loss_fn=loss_fn,
                            partition_method="uniform")
    optimizer = torch.optim.AdamW(module.parameters(), lr=t["lr"], betas=(0.9, 0.95))
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=ds_config,
                                           model_parameters=module.parameters())

    mesh = DeviceMesh.from_deepspeed(engine)
    print_rank0(f"[train_deepspeed] {mesh.describe()}, world {env.world_size}, backend {backend}; "
                f"run dir {run_dir}")
    metrics = build_metrics(cfg["metrics"], mesh)
    step_metrics, microbatch_metrics = split_feeds(cfg["metrics"], metrics)
    loss_fn.microbatch_metrics = microbatch_metrics

    # DeepSpeed steps the optimizer inside train_batch, after its DP gradient reduction:
    # measure the global norm just before the step, then clip (see `clip` above).
    norms = []

    def measure_and_clip(*_):
        norm = global_grad_norm(module.parameters(), mesh.pp_group)
        norms.append(norm)
        if clip > 0:
            scale = (clip / (norm + 1e-6)).clamp(max=1.0)
            for p in module.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale.to(p.grad.dtype))

    optimizer.register_step_pre_hook(measure_and_clip)

    logging_rank = mesh.is_logging_rank
    interval = log_cfg.get("interval", 5)
    progress = Progress(t["steps"], enabled=logging_rank and log_cfg.get("progress", True))
    sinks = log_cfg.get("sinks", ["console", "jsonl"])
    logger = build_loggers([s for s in sinks if s not in ("plot", "deepspeed_monitor")], run_dir,
                           enabled=logging_rank, progress=progress, config=cfg,
                           console_keys=log_cfg.get("console_keys"))
    if logging_rank and "deepspeed_monitor" in sinks and engine.monitor.enabled:
        logger = LoggerGroup([logger, MonitorLogger(engine.monitor)])
    debug = DebugDump(run_dir, env.rank, args.debug_dump)
    debug.write("mesh", rank=env.rank, pp_rank=mesh.pp_rank, dp_rank=mesh.dp_rank,
                tp_rank=mesh.tp_rank, is_last_stage=mesh.is_last_stage)
    ds_losses = []
    start = time.time()
    for step in range(t["steps"]):
        batches = common.make_microbatches(step, mesh.dp_rank, cfg)
        ds_loss = engine.train_batch(iter(batches))  # unweighted mean (DeepSpeed's number)
        ds_losses.append(float(ds_loss))
        reports = loss_fn.pop()  # [] on stages other than the last
        tokens = sum(int((lab != -100).sum()) for _, lab in batches)
        norm = norms.pop() if norms else None
        step_metrics.accumulate(None, reports, grad_norm=norm, lr=engine.get_lr()[0],
                                step=(step + 1) * t["num_microbatches"],
                                gradient_accumulation_steps=t["num_microbatches"], tokens=tokens,
                                samples=t["num_microbatches"] * t["micro_batch_size"])
        if reports:
            debug.write("schedule", step=step + 1, pairs=[r["lm loss"].tolist() for r in reports],
                        deepspeed_loss=ds_losses[-1])
        if (step + 1) % interval == 0 or step + 1 == t["steps"]:
            results = metrics.calculate()  # collective: every rank, every stage
            results["deepspeed_loss"] = sum(ds_losses) / len(ds_losses)
            ds_losses = []
            debug.write("results", step=step + 1, results=results)
            logger.log(results, step + 1)
            progress.update(1, **{k: results[k] for k in ("loss", "deepspeed_loss") if k in results})
        else:
            progress.update(1)
    progress.close()
    logger.close()
    debug.close()
    common.finish_run("train_deepspeed", t["steps"], start, run_dir, sinks, logging_rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
