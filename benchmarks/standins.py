"""Stand-in metrics on the declared-state base, used only until the real ones land.

Each mirrors the state layout the real metric needs (the numerators, denominators,
max/min the definitions in metric-definitions.md call for) and does the same kind
of device work in ``update``, with no device waits. Their numbers are not checked
here: the benchmarks only need the same sync payload and a comparable amount of
per-microbatch work. ``suite.ours_classes()`` prefers the real class of the same
name from ``twinkle_metrics`` as soon as it exists, and every result file records
which one ran.
"""
from __future__ import annotations

import math

import torch

from twinkle_metrics import Metric, State, microbatches

_I = torch.int64
_NEG, _POS = -math.inf, math.inf


def _f(x):
    return torch.as_tensor(x, dtype=torch.float64)


class LossMetric(Metric):
    loss_sum = State("sum")
    num_tokens = State("sum", _I)
    calls = State("sum", _I)
    mean_sum = State("sum")
    grad_norm = State("max", default=0.0, local="last")

    def update(self, inputs, outputs, *, loss_reduction="mean", grad_norm=None, **kwargs):
        out = {}
        if outputs is None or outputs.get("loss") is None:
            return out
        loss = _f(outputs["loss"]).sum()
        out.update(loss_sum=loss, mean_sum=loss, calls=1)
        if outputs.get("num_tokens") is not None:
            out["num_tokens"] = torch.as_tensor(outputs["num_tokens"]).sum()
        if grad_norm is not None:
            out["grad_norm"] = _f(grad_norm)
        return out

    def compute(self, s):
        if not s["calls"]:
            return {}
        loss = s["loss_sum"] / s["num_tokens"] if s["num_tokens"] else s["mean_sum"] / s["calls"]
        return {"loss": loss, "grad_norm": s["grad_norm"]}


class Accuracy(Metric):
    correct = State("sum", _I)
    total = State("sum", _I)

    def __init__(self, device_mesh=None, process_group=None, ignore_index=-100, vocab_parallel=False):
        super().__init__(device_mesh, process_group)
        self.ignore_index, self.vocab_parallel = ignore_index, vocab_parallel

    def update(self, inputs, outputs, **kwargs):
        correct = total = 0
        for feat, o in microbatches("Accuracy", inputs, outputs, ("logits",)):
            if "logits" not in o:
                continue
            pred = o["logits"].argmax(-1)
            labels = torch.as_tensor(feat["labels"])[..., -pred.shape[-1]:]
            m = labels != self.ignore_index
            correct = correct + ((pred == labels) & m).sum()
            total = total + m.sum()
        return {"correct": correct, "total": total}

    def compute(self, s):
        if not s["total"]:
            return {}
        return {"accuracy": s["correct"] / s["total"], "correct_tokens": s["correct"],
                "total_tokens": s["total"]}


class TrainMetric(Metric):
    steps = State("max", _I, default=0, local="last")
    tokens = State("sum", _I)
    samples = State("sum", _I)
    lr = State("max", default=0.0, local="last")
    peak_memory = State("max", default=0.0)

    def __init__(self, device_mesh=None, process_group=None, gradient_accumulation_steps=1):
        super().__init__(device_mesh, process_group)
        self.gas = gradient_accumulation_steps

    def update(self, inputs, outputs, *, lr=None, step=None, num_tokens=None, num_samples=None, **kwargs):
        out = {}
        if lr is not None:
            out["lr"] = float(lr[0] if isinstance(lr, list) else lr)
        if step is not None:
            out["steps"] = int(step)
        if num_tokens is not None:
            out["tokens"] = num_tokens
        if num_samples is not None:
            out["samples"] = num_samples
        return out

    def compute(self, s):
        return {"learning rate": s["lr"], "iters": s["steps"] // self.gas, "tokens": s["tokens"]}


class CompletionRewardMetric(Metric):
    length_n = State("sum", _I)
    length_sum = State("sum")
    length_min = State("min")
    length_max = State("max")
    gen_time = State("sum")
    gen_n = State("sum", _I)
    sync_time = State("sum")
    sync_n = State("sum", _I)
    groups = State("sum", _I)
    groups_zero_std = State("sum", _I)

    def __init__(self, device_mesh=None, process_group=None, reward_names=("accuracy", "format")):
        super().__init__(device_mesh, process_group)
        self.reward_names = tuple(reward_names)
        for name in self.reward_names:
            for suffix, st in (("n", State("sum", _I)), ("sum", State("sum")), ("sumsq", State("sum")),
                               ("min", State("min")), ("max", State("max"))):
                self.add_state(f"{name}_{suffix}", st)

    def update(self, inputs=None, outputs=None, *, rewards=None, completion_lengths=None,
               generate_time=None, weight_sync_time=None, **kwargs):
        out = {}
        for name, values in (rewards or {}).items():
            v = _f(values)
            out.update({f"{name}_n": v.numel(), f"{name}_sum": v.sum(), f"{name}_sumsq": (v * v).sum(),
                        f"{name}_min": v.amin(), f"{name}_max": v.amax()})
        if completion_lengths is not None:
            v = _f(completion_lengths)
            out.update(length_n=v.numel(), length_sum=v.sum(), length_min=v.amin(), length_max=v.amax())
        if generate_time is not None:
            out.update(gen_time=generate_time, gen_n=1)
        if weight_sync_time is not None:
            out.update(sync_time=weight_sync_time, sync_n=1)
        return out

    def compute(self, s):
        res = {}
        for name in self.reward_names:
            n = s[f"{name}_n"]
            if n:
                mean = s[f"{name}_sum"] / n
                var = (s[f"{name}_sumsq"] - n * mean * mean) / (n - 1) if n > 1 else 0.0
                res[f"train/{name}_reward"] = mean
                res[f"train/{name}_reward_std"] = math.sqrt(max(var, 0.0))
        if s["length_n"]:
            res["train/completion_length"] = s["length_sum"] / s["length_n"]
        return res


class DPOMetric(Metric):
    pairs = State("sum", _I)
    chosen = State("sum")
    rejected = State("sum")
    ref_pairs = State("sum", _I)
    ref_chosen = State("sum")
    ref_rejected = State("sum")
    reward_chosen = State("sum")
    reward_rejected = State("sum")
    margin = State("sum")
    correct = State("sum", _I)

    def __init__(self, device_mesh=None, process_group=None, ignore_index=-100, beta=0.1):
        super().__init__(device_mesh, process_group)
        self.ignore_index, self.beta = ignore_index, beta

    def update(self, inputs, outputs, *, ref_outputs=None, **kwargs):
        labels = torch.as_tensor(inputs["labels"])
        m = (labels != self.ignore_index).to(torch.float64)
        seq = (outputs["logps"].to(torch.float64) * m).sum(-1)
        c, r = seq[0::2], seq[1::2]
        out = {"pairs": c.numel(), "chosen": c.sum(), "rejected": r.sum()}
        if ref_outputs is not None and ref_outputs.get("logps") is not None:
            ref = (ref_outputs["logps"].to(torch.float64) * m).sum(-1)
            rc, rr = self.beta * (c - ref[0::2]), self.beta * (r - ref[1::2])
            out.update(ref_pairs=c.numel(), ref_chosen=ref[0::2].sum(), ref_rejected=ref[1::2].sum(),
                       reward_chosen=rc.sum(), reward_rejected=rr.sum(), margin=(rc - rr).sum(),
                       correct=(rc > rr).sum())
        return out

    def compute(self, s):
        if not s["pairs"]:
            return {}
        n = s["pairs"]
        res = {"logps/chosen": s["chosen"] / n, "logps/rejected": s["rejected"] / n}
        if s["ref_pairs"]:
            k = s["ref_pairs"]
            res.update({"rewards/chosen": s["reward_chosen"] / k, "rewards/margins": s["margin"] / k,
                        "rewards/accuracies": s["correct"] / k})
        return res


class GRPOMetric(Metric):
    n = State("sum", _I)
    sum_new = State("sum")
    n_old = State("sum", _I)
    sum_old = State("sum")
    sum_diff = State("sum")
    sum_kl = State("sum")
    kl_max = State("max")
    ratio_max = State("max")
    ratio_min = State("min")
    n_ent = State("sum", _I)
    sum_ent = State("sum")
    clip_low = State("sum")
    clip_high = State("sum")
    clip_n = State("sum")
    adv_sum = State("sum")
    adv_min = State("min")
    adv_max = State("max")

    def __init__(self, device_mesh=None, process_group=None, ignore_index=-100, epsilon=0.2,
                 epsilon_high=None, **kwargs):
        super().__init__(device_mesh, process_group)
        self.ignore_index = ignore_index
        self.eps_lo, self.eps_hi = epsilon, epsilon if epsilon_high is None else epsilon_high

    def _clip(self, r, adv, m):
        low = (r < 1 - self.eps_lo) & (adv < 0)
        high = (r > 1 + self.eps_hi) & (adv > 0)
        return (low & m).sum(), (high & m).sum(), m.sum()

    def update(self, inputs, outputs, *, old_logps=None, advantages=None, **kwargs):
        labels = torch.as_tensor(inputs["labels"])
        m = labels != self.ignore_index
        mf = m.to(torch.float64)
        lp = outputs["logps"].to(torch.float64)
        out = {"n": m.sum(), "sum_new": (lp * mf).sum()}
        ent = outputs.get("entropies")
        if ent is not None:
            out.update(n_ent=m.sum(), sum_ent=(ent.to(torch.float64) * mf).sum())
        if old_logps is not None:
            old = old_logps.to(torch.float64)
            d = torch.where(m, lp - old, 0.0)
            r = torch.exp(d)
            k3 = r - d - 1.0
            out.update(n_old=m.sum(), sum_old=(old * mf).sum(), sum_diff=d.sum(), sum_kl=k3.sum(),
                       kl_max=torch.where(m, k3, _NEG).amax(), ratio_max=torch.where(m, r, _NEG).amax(),
                       ratio_min=torch.where(m, r, _POS).amin())
            if advantages is not None:
                adv = torch.as_tensor(advantages, dtype=torch.float64)
                adv_tok = adv.unsqueeze(-1) if adv.dim() == 1 else adv
                low, high, n = self._clip(r, adv_tok, m)
                out.update(clip_low=low, clip_high=high, clip_n=n, adv_sum=adv.sum(), adv_min=adv.amin(),
                           adv_max=adv.amax())
        return out

    def compute(self, s):
        if not s["n"]:
            return {}
        res = {"train/mean_new_logp": s["sum_new"] / s["n"],
               "train/policy_confidence": math.exp(s["sum_new"] / s["n"])}
        if s["n_old"]:
            k = s["n_old"]
            res.update({"train/mean_old_logp": s["sum_old"] / k, "train/logp_diff_mean": s["sum_diff"] / k,
                        "train/approx_kl": s["sum_kl"] / k, "train/token_kl_max": s["kl_max"],
                        "train/token_ratio_max": s["ratio_max"]})
        if s["n_ent"]:
            res["train/entropy"] = s["sum_ent"] / s["n_ent"]
        if s["clip_n"]:
            res.update({"train/clip_ratio_low": s["clip_low"] / s["clip_n"],
                        "train/clip_ratio_high": s["clip_high"] / s["clip_n"],
                        "train/clip_ratio": (s["clip_low"] + s["clip_high"]) / s["clip_n"]})
        return res


class GSPOMetric(GRPOMetric):
    def _clip(self, r, adv, m):
        n_tok = m.sum(-1)
        seq_r = torch.exp(torch.log(r).sum(-1) / n_tok.clamp(min=1))
        seq_adv = adv.reshape(adv.shape[0], -1)[:, 0]
        valid = n_tok > 0
        low = (seq_r < 1 - self.eps_lo) & (seq_adv < 0) & valid
        high = (seq_r > 1 + self.eps_hi) & (seq_adv > 0) & valid
        return low.sum(), high.sum(), valid.sum()


class CISPOMetric(GRPOMetric):
    def _clip(self, r, adv, m):
        return ((r < 1 - self.eps_lo) & m).sum(), ((r > 1 + self.eps_hi) & m).sum(), m.sum()


class EmbeddingMetric(Metric):
    pos_sum = State("sum")
    pos_n = State("sum", _I)
    pos_min = State("min")
    pos_max = State("max")
    neg_sum = State("sum")
    neg_n = State("sum", _I)
    top1 = State("sum", _I)
    margin_sum = State("sum")
    loss_sum = State("sum")
    loss_n = State("sum", _I)
    grad_norm = State("max", default=0.0, local="last")

    def update(self, inputs, outputs, *, grad_norm=None, **kwargs):
        emb = torch.nn.functional.normalize(outputs["embeddings"].to(torch.float64), dim=-1)
        # Fixed layout [a1, p1, a2, p2, ...]: anchors and positives by stride, no data-dependent shape.
        a, p = emb[0::2], emb[1::2]
        sim = a @ p.T
        pos = sim.diagonal()
        eye = torch.eye(sim.shape[0], dtype=torch.bool)
        neg = torch.where(eye, _NEG, sim)
        out = {"pos_sum": pos.sum(), "pos_n": pos.numel(), "pos_min": pos.amin(), "pos_max": pos.amax(),
               "neg_sum": torch.where(eye, 0.0, sim).sum(), "neg_n": sim.numel() - sim.shape[0],
               "top1": (pos > neg.amax(-1)).sum(), "margin_sum": (pos - neg.amax(-1)).sum()}
        if outputs.get("loss") is not None:
            out.update(loss_sum=_f(outputs["loss"]), loss_n=1)
        if grad_norm is not None:
            out["grad_norm"] = _f(grad_norm)
        return out

    def compute(self, s):
        if not s["pos_n"]:
            return {}
        return {"pos_sim": s["pos_sum"] / s["pos_n"], "pos_sim_min": s["pos_min"],
                "pos_sim_max": s["pos_max"], "neg_sim": s["neg_sum"] / max(s["neg_n"], 1)}


NAMES = ("LossMetric", "Accuracy", "TrainMetric", "EmbeddingMetric", "CompletionRewardMetric",
         "DPOMetric", "GRPOMetric", "GSPOMetric", "CISPOMetric")
