"""The metric suites under test, built the way a user of each library would.

* ``OursSuite``: every metric in one ``twinkle_metrics.MetricCollection``
  (one fused sync: 1 all_gather over the data group); ``ours_default`` builds it without a
  mesh, as most scripts do (each metric resolves ``DeviceMesh.current()``).
* ``TwinkleSuite``: ModelScope Twinkle's ``twinkle.metric`` classes, given a real
  data group (Twinkle only gathers when both ``device_mesh`` and
  ``process_group`` are set); one pickled ``all_gather_object`` per metric.
* ``TorchMetricsSuite``: one TorchMetrics Mean/Sum/Max/Min metric per reported
  quantity in a ``torchmetrics.MetricCollection``; ``compute()`` syncs each state.
* ``Floor``: one bare ``all_reduce`` of as many bytes as our packed state.

All suites see the same per-rank data (``make_batch``) through the same calls.
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

import torch

CORE = ("LossMetric", "Accuracy", "TrainMetric", "EmbeddingMetric", "CompletionRewardMetric",
        "DPOMetric", "GRPOMetric")
ALL = CORE + ("GSPOMetric", "CISPOMetric")


# ------------------------------------------------------------------------ data
def make_batch(seed: int, n_seq: int = 8, seq_len: int = 256, vocab: int = 1024, dim: int = 64,
               step: int = 1) -> Dict[str, Any]:
    """One rank's microbatch for every metric (small: calculate() does not depend on it)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (n_seq, seq_len), generator=g)
    keep = torch.rand(n_seq, seq_len, generator=g) < 0.8
    labels = torch.where(keep, labels, torch.full_like(labels, -100))
    logps = -torch.rand(n_seq, seq_len, generator=g) * 3
    old = logps + 0.1 * torch.randn(n_seq, seq_len, generator=g)
    adv = torch.randn(n_seq, generator=g)
    anchors = torch.zeros(n_seq, dtype=torch.long)
    anchors[0::2] = 1
    return {
        "feat": {"labels": labels},
        "logits": torch.randn(2, 64, vocab, generator=g),
        "acc_feat": {"labels": labels[:2, :64]},
        "logps": logps, "old_logps": old, "advantages": adv,
        "entropies": torch.rand(n_seq, seq_len, generator=g) * 2,
        "ref_logps": logps + 0.05 * torch.randn(n_seq, seq_len, generator=g),
        "loss_sum": (logps * keep).sum(), "num_tokens": keep.sum(),
        "emb_feat": {"labels": anchors},
        "embeddings": torch.randn(n_seq, dim, generator=g),
        "rewards": {"accuracy": torch.rand(n_seq, generator=g).tolist(),
                    "format": (torch.rand(n_seq, generator=g) > 0.5).double().tolist()},
        "completion_lengths": keep.sum(-1).tolist(),
        "grad_norm": 1.0 + seed * 0.01, "lr": 1e-5, "step": step,
    }


# ------------------------------------------------------------------------ ours
def ours_classes(names: Sequence[str]) -> Dict[str, type]:
    """The twinkle_metrics class of each name."""
    import twinkle_metrics

    return {name: getattr(twinkle_metrics, name) for name in names}


def implementation(names: Sequence[str]) -> Dict[str, str]:
    return {n: c.__module__ for n, c in ours_classes(names).items()}


class OursSuite:
    label = "ours"

    def __init__(self, names: Sequence[str], mesh=None):
        from twinkle_metrics import MetricCollection

        classes = ours_classes(names)
        self.names = list(names)
        self.collection = MetricCollection({n: classes[n]() for n in names}, device_mesh=mesh)

    def accumulate(self, b):
        for name, m in zip(self.names, self.collection):
            _accumulate_ours(name, m, b)

    def calculate(self):
        return self.collection.calculate()

    def packed_bytes(self) -> int:
        """Bytes one rank contributes to the fused all_gather (header + states)."""
        from twinkle_metrics.comm.fused import _HEADER

        return 8 * (_HEADER + sum(spec.numel for m in self.collection for spec in m.declarations.values()))


def _accumulate_ours(name, m, b):
    if name == "LossMetric":
        m.accumulate(b["feat"], {"loss": b["loss_sum"], "num_tokens": b["num_tokens"]},
                     loss_reduction="sum", grad_norm=b["grad_norm"])
    elif name == "Accuracy":
        m.accumulate(b["acc_feat"], {"logits": b["logits"]})
    elif name == "TrainMetric":
        m.accumulate(None, None, lr=b["lr"], step=b["step"], gradient_accumulation_steps=1)
    elif name == "EmbeddingMetric":
        m.accumulate(b["emb_feat"], {"embeddings": b["embeddings"], "loss": b["loss_sum"]},
                     grad_norm=b["grad_norm"])
    elif name == "CompletionRewardMetric":
        m.accumulate(rewards=b["rewards"], completion_lengths=b["completion_lengths"],
                     generate_time=1.5, weight_sync_time=0.3)
    elif name == "DPOMetric":
        m.accumulate(b["feat"], {"logps": b["logps"]}, ref_outputs={"logps": b["ref_logps"]})
    else:  # GRPO family
        m.accumulate(b["feat"], {"logps": b["logps"], "entropies": b["entropies"]},
                     old_logps=b["old_logps"], advantages=b["advantages"])


# --------------------------------------------------------------------- twinkle
class TwinkleSuite:
    label = "twinkle"

    def __init__(self, names: Sequence[str], world: int = 1, group=None):
        import twinkle.metric as tm
        from twinkle.utils import DeviceMesh as TwinkleMesh

        mesh = TwinkleMesh.from_sizes(world_size=world, dp_size=world, device_type="cpu")
        if group is None and world > 1:
            import torch.distributed as dist
            group = dist.group.WORLD
        self.names = list(names)
        self.metrics = [getattr(tm, n)(mesh, group) for n in names]

    def accumulate(self, b):
        for name, m in zip(self.names, self.metrics):
            _accumulate_twinkle(name, m, b)

    def calculate(self):
        out = {}
        for name, m in zip(self.names, self.metrics):
            out.update({f"{name}/{k}": v for k, v in m.calculate().items()})
        return out


def _accumulate_twinkle(name, m, b):
    if name == "GRPOMetric" or name in ("GSPOMetric", "CISPOMetric"):
        # Twinkle reads advantages only as a per-sequence list; old_logps as a tensor of
        # the logps' shape takes its fast path (no per-row scatter).
        m.accumulate(b["feat"], {"logps": b["logps"], "entropies": b["entropies"]},
                     old_logps=b["old_logps"], advantages=b["advantages"].tolist())
    elif name == "Accuracy":
        m.accumulate(b["acc_feat"], {"logits": b["logits"]})
    else:
        _accumulate_ours(name, m, b)


# ---------------------------------------------------------------- torchmetrics
# One TorchMetrics metric per quantity a user would log, as (kind, value getter, weight getter).
def _tm_spec(b) -> Dict[str, Dict[str, tuple]]:
    m = (b["feat"]["labels"] != -100).double()
    n = m.sum()
    lp = b["logps"].double()
    old = b["old_logps"].double()
    d = (lp - old) * m
    r = torch.exp(d)
    k3 = r - d - 1
    seq = (lp * m).sum(-1)
    ref = (b["ref_logps"].double() * m).sum(-1)
    rc, rr = 0.1 * (seq[0::2] - ref[0::2]), 0.1 * (seq[1::2] - ref[1::2])
    adv = b["advantages"].double().unsqueeze(-1)
    emb = torch.nn.functional.normalize(b["embeddings"].double(), dim=-1)
    sim = emb[0::2] @ emb[1::2].T
    pos = sim.diagonal()
    acc_m = b["acc_feat"]["labels"] != -100
    correct = ((b["logits"].argmax(-1) == b["acc_feat"]["labels"]) & acc_m).sum()
    rew = torch.tensor(b["rewards"]["accuracy"], dtype=torch.float64)
    lens = torch.tensor(b["completion_lengths"], dtype=torch.float64)
    return {
        "LossMetric": {"loss": ("mean", b["loss_sum"] / b["num_tokens"], b["num_tokens"]),
                       "grad_norm": ("max", torch.tensor(b["grad_norm"]), None)},
        "Accuracy": {"accuracy": ("mean", correct / acc_m.sum(), acc_m.sum()),
                     "correct_tokens": ("sum", correct, None), "total_tokens": ("sum", acc_m.sum(), None)},
        "TrainMetric": {"tokens": ("sum", b["num_tokens"], None), "samples": ("sum", torch.tensor(8), None),
                        "lr": ("max", torch.tensor(b["lr"]), None)},
        "EmbeddingMetric": {"pos_sim": ("mean", pos.mean(), pos.numel()), "pos_sim_min": ("min", pos.amin(), None),
                            "pos_sim_max": ("max", pos.amax(), None), "neg_sim": ("mean", sim.mean(), sim.numel()),
                            "loss": ("mean", b["loss_sum"], 1),
                            "grad_norm": ("max", torch.tensor(b["grad_norm"]), None)},
        "CompletionRewardMetric": {"reward": ("mean", rew.mean(), rew.numel()),
                                   "reward_sq": ("mean", (rew * rew).mean(), rew.numel()),
                                   "completion_length": ("mean", lens.mean(), lens.numel()),
                                   "length_min": ("min", lens.amin(), None), "length_max": ("max", lens.amax(), None),
                                   "generate_time": ("mean", torch.tensor(1.5), 1),
                                   "weight_sync_time": ("mean", torch.tensor(0.3), 1)},
        "DPOMetric": {k: ("mean", v.mean(), v.numel()) for k, v in {
            "logps/chosen": seq[0::2], "logps/rejected": seq[1::2], "logps/ref_chosen": ref[0::2],
            "logps/ref_rejected": ref[1::2], "rewards/chosen": rc, "rewards/rejected": rr,
            "rewards/margins": rc - rr, "rewards/accuracies": (rc > rr).double()}.items()},
        "GRPOMetric": {"mean_new_logp": ("mean", (lp * m).sum() / n, n),
                       "mean_old_logp": ("mean", (old * m).sum() / n, n),
                       "logp_diff_mean": ("mean", d.sum() / n, n), "approx_kl": ("mean", k3.sum() / n, n),
                       "entropy": ("mean", (b["entropies"] * m).sum() / n, n),
                       "token_kl_max": ("max", k3.amax(), None), "token_ratio_max": ("max", (r * m).amax(), None),
                       "clip_ratio_low": ("mean", (((r < 0.8) & (adv < 0)) * m).sum() / n, n),
                       "clip_ratio_high": ("mean", (((r > 1.2) & (adv > 0)) * m).sum() / n, n),
                       "clip_ratio": ("mean", ((((r < 0.8) & (adv < 0)) | ((r > 1.2) & (adv > 0))) * m).sum() / n, n)},
    }


class TorchMetricsSuite:
    label = "torchmetrics"

    def __init__(self, names: Sequence[str]):
        import torchmetrics as tmx

        kinds = {"mean": tmx.MeanMetric, "sum": tmx.SumMetric, "max": tmx.MaxMetric, "min": tmx.MinMetric}
        # GSPO/CISPO log the same quantities as GRPO.
        self.entries = [(n, "GRPOMetric" if n in ("GSPOMetric", "CISPOMetric") else n) for n in names]
        spec = _tm_spec(make_batch(0))
        members = {}
        for name, src in self.entries:
            for key, (kind, _, _) in spec[src].items():
                members[_tm_key(name, key)] = kinds[kind]()
        self.collection = tmx.MetricCollection(members, compute_groups=False)
        self.members = dict(self.collection.items(keep_base=True))

    def accumulate(self, b):
        spec = _tm_spec(b)
        for name, src in self.entries:
            for key, (kind, value, weight) in spec[src].items():
                metric = self.members[_tm_key(name, key)]
                if kind == "mean":
                    metric.update(value, weight)
                else:
                    metric.update(value)

    def calculate(self):
        out = self.collection.compute()
        self.collection.reset()
        return out


def _tm_key(name, key):
    return f"{name}__{key}".replace("/", "_")


# ----------------------------------------------------------------------- floor
class Floor:
    """One bare all_reduce of ``nbytes`` (float64): the least any synced metric can cost."""

    label = "floor"

    def __init__(self, nbytes: int, group=None):
        self.buf = torch.zeros(max(1, nbytes // 8), dtype=torch.float64)
        self.group = group

    def accumulate(self, b):
        self.buf.fill_(1.0)

    def calculate(self):
        import torch.distributed as dist

        dist.all_reduce(self.buf, group=self.group)
        return {}


class GatherFloor(Floor):
    """One bare all_gather of ``nbytes`` per rank: the collective our fused sync issues,
    without any of its packing, merging or compute (isolates our Python overhead)."""

    label = "floor_gather"

    def calculate(self):
        import torch.distributed as dist

        from parallel.groups import all_gather_rows
        all_gather_rows(self.buf, self.group or dist.group.WORLD)
        return {}


class PythonFloor:
    """The least a sync of the same states, written in Python, can cost: what ours would
    cost with all of its machinery gone. The states sit in one block laid out by our plan
    (so packing is writing the 4-number header); one ``all_gather`` of it, waited on as ours
    waits (the work's future releasing a lock); our merge of the rows (each kind's span by
    one reduction, each self-merged state by its declared reduction) and our read of the
    merged row; each metric's ``compute``; a reset by one copy of the block. No mesh, no
    plan agreement, no checks, no bookkeeping, no interval objects. Its states are those of
    the first microbatch, held (the reset copies into a scratch block of the same size)."""

    label = "floor_python"
    #: where ``calculate`` may stop (``upto``), in order: what ``bench_python_floor`` times
    STEPS = ("gather", "merge by kind", "merge", "compute", "reset")

    def __init__(self, names: Sequence[str], group=None, upto: str = "reset"):
        from parallel import DeviceMesh
        from twinkle_metrics.comm import fused
        from twinkle_metrics.core.state import interval_of

        self.fused, self.group, self.ready = fused, group, False
        self.upto = self.STEPS.index(upto)
        self.local = OursSuite(names, mesh=DeviceMesh.single())
        self.metrics = list(self.local.collection)
        self.intervals = [interval_of(m) for m in self.metrics]

    def _prepare(self, b):
        import copy

        import torch

        self.local.accumulate(b)  # the states a microbatch creates on the fly (reward names)
        ivs, cpu = self.intervals, torch.device("cpu")
        self.plan = self.fused._Plan(ivs, [sorted(iv.specs) for iv in ivs],
                                     tuple(m.sync_fingerprint() for m in self.metrics))
        self.by_kind = copy.copy(self.plan)  # "merge by kind": the plan less its self-merged states
        self.by_kind.custom = []
        self.block = self.fused._pack(self.plan, ivs, self.plan.length, cpu, cpu, need=False, is_source=True,
                                      pp_rank=0)
        self.head, self.defaults, self.scratch = self.block[:4].clone(), self.block.clone(), self.block.clone()
        self.ready = True

    def accumulate(self, b):
        if not self.ready:
            self._prepare(b)

    def calculate(self):
        import torch.distributed as dist

        from parallel.groups import all_gather_rows
        from twinkle_metrics.comm.waits import completion

        fused, step = self.fused, self.STEPS[self.upto]
        self.block[:4].copy_(self.head)
        def wait(work):  # as ours waits on host tensors: the work's future releases a lock
            if not completion(work, True)(600):
                raise RuntimeError("floor_python: the all_gather did not finish within 600 s")
            work.wait()

        rows = all_gather_rows(self.block, self.group or dist.group.WORLD, wait=wait)
        if step == "gather":
            return {}
        vec = fused._merge(self.plan if step != "merge by kind" else self.by_kind, self.intervals, rows)
        if step in ("merge by kind", "merge"):
            return {}
        results = {}
        for m, states in zip(self.metrics, fused._unpack(vec, self.plan, self.intervals)):
            results.update(m.compute(states))
        if step == "reset":
            self.scratch.copy_(self.defaults)
        return results


def build(impls: List[str], names: Sequence[str], world: int):
    from parallel import DeviceMesh

    suites = {}
    ours = OursSuite(names, mesh=DeviceMesh.from_sizes(dp_size=world) if world > 1 else DeviceMesh.single())
    if "ours" in impls:
        suites["ours"] = ours
    if "ours_default" in impls:  # no mesh given: each metric resolves DeviceMesh.current()
        suites["ours_default"] = OursSuite(names)
    if "twinkle" in impls:
        suites["twinkle"] = TwinkleSuite(names, world=world)
    if "torchmetrics" in impls:
        suites["torchmetrics"] = TorchMetricsSuite(names)
    if "floor" in impls:
        suites["floor"] = Floor(ours.packed_bytes())
    if "floor_gather" in impls:
        suites["floor_gather"] = GatherFloor(ours.packed_bytes())
    if "floor_python" in impls:
        suites["floor_python"] = PythonFloor(names)
    return suites, ours.packed_bytes()
