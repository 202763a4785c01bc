"""accumulate() of the metrics Twinkle has no peer for, against the plain torch work they
cannot avoid (benchmark 2, ``--cases baseline``).

Each case builds its tensors once and returns callables on the same tensors: ``ours``
(the real metric's accumulate) and one or more baselines (a few torch ops computing the
same statistics, or what the training framework already runs). ``bench_accumulate``
times them interleaved in blocks, in the same command, and reports the median per-block
cost multiple ``ours / baseline`` (1.0x: as cheap as the plain ops). Needs neither
twinkle-kit nor torchmetrics; megatron-core is optional (its row is skipped, with the
reason, when it cannot run).

Also counted per call: device waits (``waits.count_device_waits``) and aten operators
dispatched (views excluded), a proxy for GPU kernel launches: on CPU a call costs about
the arithmetic, on a GPU a call of many small operators costs about their launches.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Dict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks import common
from benchmarks.waits import count_device_waits


def _completion_labels(g: torch.Generator, b: int, s: int) -> torch.Tensor:
    """Labels of ``b`` rows of ``s`` tokens: one prompt then one completion per row
    (the RL workloads of ``bench_accumulate``), -100 elsewhere."""
    prompt = torch.randint(128, 1024, (b, 1), generator=g)
    length = torch.randint(256, s, (b, 1), generator=g)
    pos = torch.arange(s).unsqueeze(0)
    completion = (pos >= prompt) & (pos < prompt + length)
    return torch.where(completion, torch.randint(0, 32000, (b, s), generator=g), torch.full((b, s), -100))


# ------------------------------------------------------------------ RolloutMismatchMetric
def rollout_mismatch(seed: int = 0) -> Dict[str, Any]:
    from twinkle_metrics import RolloutMismatchMetric

    g = torch.Generator().manual_seed(seed)
    b, s = 16, 2048
    labels = _completion_labels(g, b, s)
    train = -torch.rand(b, s, generator=g) * 4
    rollout = train + 0.05 * torch.randn(b, s, generator=g)
    metric = RolloutMismatchMetric()

    def ours():
        metric.accumulate({"labels": labels}, {"logps": train}, rollout_logps=rollout)

    def naive(dtype):
        # mean |d|, mean and max of exp(d), k3: what a user would write over the same tokens
        def fn():
            mask = labels != -100
            n = mask.sum()
            d = torch.where(mask, train.to(dtype) - rollout.to(dtype), 0.0)
            w = torch.exp(d)
            return torch.stack([d.abs().sum() / n, torch.where(mask, w, 0.0).sum() / n,
                                torch.where(mask, w, -math.inf).amax(),
                                (torch.expm1(-d) + d).sum() / n])  # k3, 0 where d = 0
        return fn

    def naive_every_key():
        # every key the metric reports, in float64, straight from the definitions (no
        # mergeable states, no NaN accounting): what the metric's extra statistics cost
        mask = labels != -100
        n = mask.sum()
        lp, roll = train.double(), rollout.double()
        d = torch.where(mask, lp - roll, 0.0)
        w = torch.exp(d)
        wm = torch.where(mask, w, 0.0)
        mean_w = wm.sum() / n
        seq_d, seq_n = d.sum(1), mask.sum(1)
        valid = seq_n > 0
        sw = torch.where(valid, torch.exp(seq_d - torch.where(valid, seq_d, -math.inf).amax()), 0.0)
        return torch.stack([
            d.abs().sum() / n, torch.where(mask, d.abs(), -math.inf).amax(), mean_w,
            (torch.where(mask, (w - mean_w) ** 2, 0.0).sum() / n).sqrt(),
            torch.where(mask, w, math.inf).amin(), torch.where(mask, w, -math.inf).amax(),
            ((w > 2.0) & mask).sum() / n, ((w < 0.5) & mask).sum() / n,
            wm.sum() ** 2 / (n * (wm * wm).sum()), -d.sum() / n, (torch.expm1(-d) + d).sum() / n,
            torch.exp(-torch.where(mask, lp, 0.0).sum() / n), torch.exp(-torch.where(mask, roll, 0.0).sum() / n),
            sw.sum() ** 2 / (valid.sum() * (sw * sw).sum()),
            torch.where(valid, (seq_d / seq_n.clamp(min=1)).abs(), 0.0).sum() / valid.sum()])

    return {"workload": f"[{b}, {s}] fp32 trainer and rollout logps, "
                        f"{int((labels != -100).sum())} counted tokens",
            "fns": {"ours": ours, "naive fp32": naive(torch.float32), "naive fp64": naive(torch.float64),
                    "naive fp64, every key": naive_every_key},
            "reset": metric.reset, "notes": {}}


# ------------------------------------------------------------------------ ModelNormMetric
class _Layer(torch.nn.Module):
    """A transformer-like layer's parameter structure: one big matrix, a bias, a norm.
    ``layer_number`` (as megatron-core's TransformerLayer) gives the metric its groups."""

    def __init__(self, number: int, width: int):
        super().__init__()
        self.layer_number = number
        self.linear = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)


def model_norm(seed: int = 0, layers: int = 24, width: int = 1024) -> Dict[str, Any]:
    from twinkle_metrics import ModelNormMetric

    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[_Layer(i + 1, width) for i in range(layers)])
    params = list(model.parameters())
    with torch.no_grad():
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
    metric = ModelNormMetric(model=model)
    grads = [p.grad for p in params]

    def ours():
        metric.accumulate(None, None)

    def grad_norm64():
        return torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]))

    def same_stats64():
        # the totals ours reports (grad and param norms, zero grads), one op per tensor
        gsq = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]).square().sum()
        psq = torch.stack([torch.linalg.vector_norm(p.detach(), dtype=torch.float64)
                           for p in params]).square().sum()
        zeros = torch.stack([torch.count_nonzero(g) for g in grads]).sum()
        return gsq.sqrt(), psq.sqrt(), zeros

    fns = {"ours": ours, "grad norm fp64": grad_norm64, "same stats fp64": same_stats64}
    notes = {"params": sum(p.numel() for p in params), "tensors": len(params)}
    close = _megatron_grad_norm(grads, fns, notes)
    return {"workload": f"{layers} x (Linear {width}x{width} + LayerNorm), {notes['params'] / 1e6:.1f}M fp32 "
                        f"params in {len(params)} tensors, grads set",
            "fns": fns, "reset": metric.reset, "notes": notes, "close": close}


def _megatron_grad_norm(grads, fns: Dict[str, Callable], notes: Dict[str, Any]) -> Callable[[], None]:
    """Add megatron-core's ``get_grad_norm_fp32`` (what its optimizer clips with) when it
    can run here; record why not otherwise. Returns the cleanup."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
            from megatron.core.optimizer import clip_grads
    except Exception as e:  # noqa: BLE001 - optional peer
        notes["megatron"] = f"not importable: {type(e).__name__}: {e}"
        return lambda: None
    try:
        clip_grads.get_grad_norm_fp32(grads[:1])
        notes["megatron_unpatched"] = "runs"
    except Exception as e:  # noqa: BLE001 - expected on CPU-only torch
        notes["megatron_unpatched"] = f"{type(e).__name__}: {e}"
    if torch.cuda.is_available():
        return lambda: None  # the unpatched call above is the real one; not timed here
    # On CPU: with the project's shim (device='cuda' literals sent to the CPU) and a
    # 1-rank gloo group for its all_reduce, as tests/metrics/system/test_norms_dist.py runs it.
    import torch.distributed as dist

    from twinkle_metrics.integrations import megatron_cpu

    own_group = not dist.is_initialized()
    if own_group:  # one process: an in-memory store, no port
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    megatron_cpu.enable()
    saved = clip_grads.torch
    clip_grads.torch = megatron_cpu._CpuTorch()
    fns["megatron-core get_grad_norm_fp32 (CPU shim)"] = lambda: clip_grads.get_grad_norm_fp32(grads)
    notes["megatron"] = ("timed with twinkle_metrics.integrations.megatron_cpu's shim and a 1-rank gloo group; "
                         "no Apex/Transformer Engine: megatron-core's local multi_tensor_l2norm fallback")

    def close():
        clip_grads.torch = saved
        if own_group:
            dist.destroy_process_group()

    return close


# ----------------------------------------------------------------------- MoERoutingMetric
def moe_routing(seed: int = 0, layers: int = 8, tokens: int = 4096, experts: int = 64,
                topk: int = 8) -> Dict[str, Any]:
    from twinkle_metrics import MoERoutingMetric

    g = torch.Generator().manual_seed(seed)
    logits = [torch.randn(tokens, experts, generator=g) for _ in range(layers)]
    maps = []
    for x in logits:
        m = torch.zeros(tokens, experts, dtype=torch.bool)
        maps.append(m.scatter_(1, x.topk(topk, dim=-1).indices, True))
    metric = MoERoutingMetric(num_layers=layers, num_experts=experts)

    def ours():
        for i in range(layers):
            metric.observe(i, routing_map=maps[i], router_logits=logits[i])

    def naive():
        out = []
        for i in range(layers):
            logp = torch.log_softmax(logits[i], dim=-1)
            out.append((maps[i].sum(0), -(logp.exp() * logp).sum(-1).mean()))
        return out

    return {"workload": f"{layers} layers x {tokens} tokens x {experts} experts (top-{topk}): "
                        "routing_map + fp32 router_logits per layer, one observe per layer",
            "fns": {"ours": ours, "counts + softmax entropy": naive}, "reset": metric.reset, "notes": {}}


CASES = {"RolloutMismatchMetric": (rollout_mismatch, 12, 10),  # (builder, blocks, calls per block)
         "ModelNormMetric": (model_norm, 6, 2),
         "MoERoutingMetric": (moe_routing, 10, 5)}


# -------------------------------------------------------------------------- PassAtKMetric
def pass_at_k(seed: int = 0, prompts: int = 256, samples: int = 16) -> Dict[str, Any]:
    from twinkle_metrics.metrics.rl.pass_at_k import PassAtKMetric

    g = torch.Generator().manual_seed(seed)
    n = prompts * samples
    index = torch.randperm(n, generator=g) % prompts  # each prompt's samples spread over the batch
    ids = index.tolist()  # host prompt ids, as an eval loop has them
    correct = torch.rand(n, generator=g) < 0.4
    metric = PassAtKMetric(k=(1, 4, 8))

    def ours():
        metric.accumulate(None, None, prompt_ids=ids, correct=correct)

    def scatter():
        # the unavoidable work: per-prompt sample and correct counts, by prompt index
        counts = torch.zeros(prompts, 2, dtype=torch.int64)
        return counts.index_add_(0, index, torch.stack([torch.ones_like(index), correct.long()], 1))

    def host_index_scatter():
        # the same, with the host ids mapped to row indices first (a dict, as a user would)
        rows: Dict[Any, int] = {}
        idx = torch.tensor([rows.setdefault(p, len(rows)) for p in ids])
        counts = torch.zeros(len(rows), 2, dtype=torch.int64)
        return counts.index_add_(0, idx, torch.stack([torch.ones_like(idx), correct.long()], 1))

    return {"workload": f"{prompts} prompts x {samples} samples per call (host int ids, bool correct), "
                        "k=(1, 4, 8), max_prompts=1024",
            "fns": {"ours": ours, "scatter-add by prompt index": scatter,
                    "host id->index + scatter-add": host_index_scatter},
            "reset": metric.reset, "notes": {}}


CASES["PassAtKMetric"] = (pass_at_k, 10, 5)


# ------------------------------------------------------------------------ StalenessMetric
def staleness(seed: int = 0) -> Dict[str, Any]:
    from twinkle_metrics.metrics.rl.staleness import StalenessMetric

    g = torch.Generator().manual_seed(seed)
    b, s, policy = 16, 2048, 100
    labels = _completion_labels(g, b, s)
    # partial rollouts: each token's behaviour-policy version, up to 8 behind
    versions = policy - torch.randint(0, 9, (b, s), generator=g)
    metric = StalenessMetric(max_staleness=4)

    def ours():
        metric.accumulate({"labels": labels}, None, policy_version=policy, rollout_versions=versions, in_flight=3)

    def naive():
        # masked mean / min / max of policy - versions: what a user would write over the same tokens
        mask = labels != -100
        st = policy - versions
        return torch.stack([torch.where(mask, st, 0).sum() / mask.sum(), torch.where(mask, st, policy).amin(),
                            torch.where(mask, st, -1).amax()])

    return {"workload": f"[{b}, {s}] int64 per-token rollout versions (completion labels), max_staleness=4, "
                        "p50/p90/p99 histogram",
            "fns": {"ours": ours, "masked mean/min/max": naive}, "reset": metric.reset, "notes": {}}


CASES["StalenessMetric"] = (staleness, 10, 5)


# ---------------------------------------------------------- GRPOMetric:seq-mean-token-mean
def grpo_seq_mean(seed: int = 0) -> Dict[str, Any]:
    from benchmarks.bench_accumulate import workloads
    from twinkle_metrics import GRPOMetric

    w = workloads(seed)["GRPOMetric"]  # the GRPOMetric benchmark's tensors
    inputs, outputs, kw = w["inputs"], w["outputs"], w["kwargs"]
    seq, token = GRPOMetric(loss_agg_mode="seq-mean-token-mean"), GRPOMetric()

    def ours():
        seq.accumulate(inputs, outputs, **kw)

    def default():
        token.accumulate(inputs, outputs, **kw)

    def naive():
        # per-sequence token means of the mode's main keys, then their mean over sequences:
        # what a user would write over the same tokens (no mergeable states, no NaN accounting)
        m = inputs["labels"] != -100
        n = m.sum(1)
        live = n > 0
        d = torch.where(m, outputs["logps"].double() - kw["old_logps"].double(), 0.0)
        r = torch.exp(d)
        adv = kw["advantages"][:, None]
        clip = ((r < 0.8) & (adv < 0)) | ((r > 1.2) & (adv > 0))
        cols = torch.stack([(clip & m).sum(1).double(), torch.where(m, r - d - 1, 0.0).sum(1),
                            torch.where(m, r, 0.0).sum(1), d.sum(1),
                            torch.where(m, outputs["entropies"].double(), 0.0).sum(1),
                            torch.where(m, outputs["logps"].double(), 0.0).sum(1)], 1)
        per_seq = cols / n.clamp(min=1)[:, None]
        return torch.where(live[:, None], per_seq, 0.0).sum(0) / live.sum()

    return {"workload": f"[16, 2048] fp32 logps, old logps, entropies, per-sequence advantages (the "
                        f"GRPOMetric case's), {int((inputs['labels'] != -100).sum())} counted tokens",
            "fns": {"ours": ours, "GRPOMetric token-mean (default)": default,
                    "plain torch per-sequence means": naive},
            "reset": lambda: (seq.reset(), token.reset()), "notes": {}}


CASES["GRPOMetric:seq-mean-token-mean"] = (grpo_seq_mean, 10, 5)


# ---------------------------------------------------------------------------- measuring
class _OpCounter(TorchDispatchMode):
    """aten operators dispatched, views excluded (they launch nothing)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def _profile(fn) -> Dict[str, Any]:
    with count_device_waits() as c:
        fn()
    with _OpCounter() as ops:
        fn()
    return {"device_waits": c.total, "by_call": dict(c.counts), "host_reads": c.host_reads,
            "aten_ops": ops.ops}


def run_case(name: str, scale: float = 1.0) -> Dict[str, Any]:
    builder, blocks, per_block = CASES[name]
    case = builder()
    try:
        fns = case["fns"]
        for fn in fns.values():  # warm-up
            fn()
        blocks = max(2, int(blocks * scale))
        timed = common.time_rotating(fns, blocks, per_block, lambda blk: case["reset"]())
        per_call = {k: [t[k] for t in timed] for k in fns}
        ratios = {k: [t["ours"] / t[k] for t in timed] for k in fns if k != "ours"}
        profile = {k: _profile(fn) for k, fn in fns.items()}
    finally:
        case.get("close", lambda: None)()
    return {"workload": case["workload"], "notes": case["notes"], "blocks": blocks, "calls_per_block": per_block,
            "ours_ms": 1e3 * common.median(per_call["ours"]), "ours": profile["ours"],
            "baselines": {k: {"ms": 1e3 * common.median(per_call[k]),
                              "ours_over": common.median(ratios[k]),
                              "p10": common.quantile(ratios[k], 0.1), "p90": common.quantile(ratios[k], 0.9),
                              **profile[k]} for k in ratios}}
