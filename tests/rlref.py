"""Plain-Python reference implementations and batch builders for the RL metric tests.

The references loop over tokens with Python floats, independent of the metrics'
tensor code, so a test comparing the two can fail.
"""
from __future__ import annotations

import math
import statistics

import torch


def make_rl_batch(seed: int, n_seq: int = 12, seq_len: int = 8, vocab: int = 11):
    """labels (ragged, seq 0 fully masked), logps, old, ref, per-seq advantages, logits."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (n_seq, seq_len), generator=g)
    keep = torch.rand(n_seq, seq_len, generator=g) < 0.75
    keep[0] = False
    labels = torch.where(keep, labels, torch.full_like(labels, -100))
    logps = -torch.rand(n_seq, seq_len, generator=g, dtype=torch.float64) * 2
    old = logps + 0.3 * torch.randn(n_seq, seq_len, generator=g, dtype=torch.float64)
    ref = logps + 0.2 * torch.randn(n_seq, seq_len, generator=g, dtype=torch.float64)
    adv = torch.randn(n_seq, generator=g, dtype=torch.float64)
    logits = 3 * torch.randn(n_seq, seq_len, vocab, generator=g, dtype=torch.float64)
    pos = torch.arange(seq_len).expand(n_seq, seq_len).clone()
    return dict(labels=labels, logps=logps, old=old, ref=ref, adv=adv, logits=logits, pos=pos)


def ragged(values, labels):
    """Twinkle's per-sequence form: one 1-D tensor of valid-token values per sequence."""
    return [values[i][labels[i] != -100].clone() for i in range(labels.shape[0])]


def ref_grpo(b, kind="grpo", eps=0.2, eps_high=None, old_mask=None, top_k=0, entropy=None):
    """Reference values of the GRPO family; old_mask marks tokens that have old logps."""
    eps_high = eps if eps_high is None else eps_high
    labels, lp, old, ref, adv = b["labels"], b["logps"], b["old"], b["ref"], b["adv"]
    n_seq, s = labels.shape
    toks, olds, recs = [], [], []
    seqs = []
    for i in range(n_seq):
        sd, sn = 0.0, 0
        for t in range(s):
            if labels[i, t] == -100:
                continue
            x = float(lp[i, t])
            toks.append(x)
            if old_mask is not None and not old_mask[i, t]:
                continue
            o = float(old[i, t])
            d = x - o
            r = math.exp(d)
            k3 = r - d - 1
            olds.append((o, d, r, k3, float(adv[i]), float(ref[i, t]) - x))
            sd += d
            sn += 1
            if k3 > 0:
                recs.append({"kl": k3, "gsi": i, "pos": int(b["pos"][i, t]), "token_id": int(labels[i, t]),
                             "ratio": r, "logp_new": x, "logp_old": o})
        if sn:
            seqs.append((math.exp(sd / sn), float(adv[i])))
    out = {"train/mean_new_logp": sum(toks) / len(toks)}
    out["train/policy_confidence"] = math.exp(out["train/mean_new_logp"])
    n = len(olds)
    out.update({
        "train/mean_old_logp": sum(o[0] for o in olds) / n,
        "train/logp_diff_mean": sum(o[1] for o in olds) / n,
        "train/approx_kl": sum(o[3] for o in olds) / n,
        "train/token_kl_max": max(o[3] for o in olds),
        "train/token_ratio_max": max(o[2] for o in olds),
        "train/ratio_mean": sum(o[2] for o in olds) / n,
        "train/ratio_min": min(o[2] for o in olds),
        "train/ratio_max": max(o[2] for o in olds),
        "train/advantage_mean": sum(o[4] for o in olds) / n,
        "train/advantage_min": min(o[4] for o in olds),
        "train/advantage_max": max(o[4] for o in olds),
        "train/ref_kl": sum(math.exp(o[5]) - o[5] - 1 for o in olds) / n,
    })
    if kind == "gspo":
        units = seqs
    else:
        units = [(o[2], o[4]) for o in olds]
    if kind == "cispo":
        low = sum(1 for r, a in units if r < 1 - eps)
        high = sum(1 for r, a in units if r > 1 + eps_high)
    else:
        low = sum(1 for r, a in units if r < 1 - eps and a < 0)
        high = sum(1 for r, a in units if r > 1 + eps_high and a > 0)
    out["train/clip_ratio_low"] = low / len(units)
    out["train/clip_ratio_high"] = high / len(units)
    out["train/clip_ratio"] = (low + high) / len(units)
    if entropy is not None:
        out["train/entropy"] = entropy
    if top_k:
        out["_high_kl_records"] = sorted(recs, key=lambda r: -r["kl"])[:top_k]
    return out


def ref_entropy(logits, labels, temperature=1.0):
    """Mean full-vocab entropy over masked tokens (float64 softmax of the whole row)."""
    z = logits.to(torch.float64) / temperature
    p = torch.softmax(z, -1)
    h = -(p * torch.log_softmax(z, -1)).sum(-1)
    m = labels != -100
    return float(h[m].sum() / m.sum())


def ref_dpo(b, beta=0.1):
    labels, lp, ref = b["labels"], b["logps"], b["ref"]
    seq = [sum(float(lp[i, t]) for t in range(labels.shape[1]) if labels[i, t] != -100)
           for i in range(labels.shape[0])]
    rseq = [sum(float(ref[i, t]) for t in range(labels.shape[1]) if labels[i, t] != -100)
            for i in range(labels.shape[0])]
    c, r, rc, rr = seq[0::2], seq[1::2], rseq[0::2], rseq[1::2]
    n = len(c)
    wc = [beta * (a - b_) for a, b_ in zip(c, rc)]
    wr = [beta * (a - b_) for a, b_ in zip(r, rr)]
    return {"logps/chosen": sum(c) / n, "logps/rejected": sum(r) / n,
            "logps/ref_chosen": sum(rc) / n, "logps/ref_rejected": sum(rr) / n,
            "rewards/chosen": sum(wc) / n, "rewards/rejected": sum(wr) / n,
            "rewards/margins": sum(a - b_ for a, b_ in zip(wc, wr)) / n,
            "rewards/accuracies": sum(1 for a, b_ in zip(wc, wr) if a > b_) / n}


def ref_rewards(rewards, lengths, max_len, num_generations, gen_times):
    out = {}
    for name, vals in rewards.items():
        vals = [v for v in vals if v == v]
        out[f"train/{name}_reward"] = statistics.fmean(vals)
        out[f"train/{name}_reward_std"] = statistics.stdev(vals)
    out["train/completion_length"] = statistics.fmean(lengths)
    out["train/completion_length_min"] = float(min(lengths))
    out["train/completion_length_max"] = float(max(lengths))
    out["train/completion_clipped_ratio"] = sum(1 for x in lengths if x >= max_len) / len(lengths)
    total = [sum(vals) for vals in zip(*rewards.values())]
    groups = [total[i:i + num_generations] for i in range(0, len(total), num_generations)]
    out["train/frac_reward_zero_std"] = sum(1 for g in groups if max(g) == min(g)) / len(groups)
    out["profiling/Time taken: generate"] = statistics.fmean(gen_times)
    return out


def make_ppo_batch(seed: int, n_seq: int = 12, seq_len: int = 8, offset: float = 0.0):
    """labels (ragged, seq 0 fully masked), critic values, old values, returns (around
    ``offset``), per-token advantages, trainer and rollout log-probs."""
    g = torch.Generator().manual_seed(seed)
    labels = make_rl_batch(seed, n_seq, seq_len)["labels"]
    values = offset + torch.randn(n_seq, seq_len, generator=g, dtype=torch.float64)
    old = values + 0.25 * torch.randn(n_seq, seq_len, generator=g, dtype=torch.float64)
    returns = values + 0.5 * torch.randn(n_seq, seq_len, generator=g, dtype=torch.float64)
    adv = torch.randn(n_seq, seq_len, generator=g, dtype=torch.float64)
    train = -torch.rand(n_seq, seq_len, generator=g, dtype=torch.float64) * 3
    rollout = train + 0.4 * torch.randn(n_seq, seq_len, generator=g, dtype=torch.float64)
    return dict(labels=labels, values=values, old=old, returns=returns, adv=adv, train=train, rollout=rollout)


def _tokens(labels, *tensors):
    """Per valid token, the Python floats of each tensor ([n_seq, seq] or [n_seq] per sequence)."""
    out = []
    for i in range(labels.shape[0]):
        for t in range(labels.shape[1]):
            if labels[i, t] != -100:
                out.append(tuple(float(x[i, t]) if x.dim() == 2 else float(x[i]) for x in tensors))
    return out


def ref_ppo_value(labels, values, old, returns, adv=None, eps=0.2):
    """Twinkle's PPOValueMetric definitions with Python floats and exact (Fraction-based)
    population variances from ``statistics``."""
    toks = _tokens(labels, values, old, returns)
    v = [t[0] for t in toks]
    r = [t[2] for t in toks]
    out = {"train/value_mean": statistics.fmean(v), "train/return_mean": statistics.fmean(r),
           "train/value_clip_ratio": sum(1 for x, o, _ in toks if abs(x - o) > eps) / len(toks),
           "train/explained_variance":
               1 - statistics.pvariance([b - a for a, b in zip(v, r)]) / max(statistics.pvariance(r), 1e-8)}
    if adv is not None:
        a = [t[0] for t in _tokens(labels, adv)]
        out["train/advantage_mean"] = statistics.fmean(a)
        out["train/advantage_std"] = statistics.pstdev(a)
    return out


def ref_rollout(labels, train, rollout, high=2.0, low=None):
    """RolloutMismatchMetric's definitions token by token; the sequence ESS in ``decimal``
    (60 digits), so sequence log-ratios of any size neither overflow nor underflow."""
    import decimal

    low = 1 / high if low is None else low
    toks, seqs = [], []
    for i in range(labels.shape[0]):
        ds = [float(train[i, t]) - float(rollout[i, t]) for t in range(labels.shape[1]) if labels[i, t] != -100]
        toks += [(float(train[i, t]), float(rollout[i, t])) for t in range(labels.shape[1])
                 if labels[i, t] != -100]
        if ds:
            seqs.append(ds)
    d = [a - b for a, b in toks]
    w = [math.exp(x) for x in d]
    n = len(d)
    mean_train = statistics.fmean(a for a, _ in toks)
    mean_rollout = statistics.fmean(b for _, b in toks)
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        ws = [decimal.Decimal(math.fsum(s)).exp() for s in seqs]
        seq_ess = float(sum(ws) ** 2 / (len(ws) * sum(x * x for x in ws)))
    return {
        "rollout/logp_abs_diff_mean": statistics.fmean(abs(x) for x in d),
        "rollout/logp_abs_diff_max": max(abs(x) for x in d),
        "rollout/is_ratio_mean": statistics.fmean(w),
        "rollout/is_ratio_std": statistics.pstdev(w),
        "rollout/is_ratio_min": min(w),
        "rollout/is_ratio_max": max(w),
        "rollout/is_fraction_high": sum(1 for x in w if x > high) / n,
        "rollout/is_fraction_low": sum(1 for x in w if x < low) / n,
        "rollout/token_ess": sum(w) ** 2 / (n * sum(x * x for x in w)),
        "rollout/seq_ess": seq_ess,
        "rollout/mismatch_kl": statistics.fmean(-x for x in d),
        "rollout/mismatch_k3_kl": statistics.fmean(math.exp(-x) + x - 1 for x in d),
        "rollout/training_ppl": math.exp(-mean_train),
        "rollout/rollout_ppl": math.exp(-mean_rollout),
        "rollout/ppl_ratio": math.exp(-mean_train) / math.exp(-mean_rollout),
        "rollout/log_ppl_abs_diff": statistics.fmean(abs(statistics.fmean(-x for x in s)) for s in seqs),
    }


def verl_agg_loss(values, mask, mode, dp_size=1, batch_num_tokens=None, global_batch_size=None,
                  loss_scale_factor=None):
    """verl 0.9.1's ``agg_loss`` (``verl/trainer/ppo/core_algos.py``) on one rank's rows, with
    Python floats: ``values`` and ``mask`` (0/1) are lists of equal-length rows. Over DP ranks
    verl passes the global token count and batch size with ``dp_size``, and FSDP averages the
    ranks' losses; in one process it passes neither (the batch's own counts)."""
    width = len(mask[0])
    sums = [sum(v * m for v, m in zip(vr, mr)) for vr, mr in zip(values, mask)]
    counts = [sum(mr) for mr in mask]
    if mode == "token-mean":
        total_tokens = sum(counts) if batch_num_tokens is None else batch_num_tokens
        return sum(sums) / total_tokens * dp_size
    live = [1.0 if c > 0 else 0.0 for c in counts]
    seqs = sum(live) if global_batch_size is None else global_batch_size
    if mode == "seq-mean-token-mean":
        per = [s / (c + 1e-8) for s, c in zip(sums, counts)]  # verl's epsilon
        return sum(p * w for p, w in zip(per, live)) / seqs * dp_size
    loss = sum(s * w for s, w in zip(sums, live)) / seqs * dp_size
    if mode == "seq-mean-token-sum-norm":
        loss /= width if loss_scale_factor is None else loss_scale_factor
    return loss


def verl_agg_loss_over_dp(values, mask, mode, shards, loss_scale_factor=None):
    """``verl_agg_loss`` as verl's trainer runs it over DP ranks (``shards``: each rank's row
    indices): each rank with the global counts and ``dp_size``, then the mean over ranks (the
    gradient average); the global batch size counts the sequences that have a token (in a real
    batch every response has one, so it is the configured mini-batch size)."""
    dp = len(shards)
    tokens = sum(sum(r) for r in mask)
    seqs = sum(1 for r in mask if sum(r) > 0)
    per_rank = [verl_agg_loss([values[i] for i in rows], [mask[i] for i in rows], mode, dp, tokens, seqs,
                              loss_scale_factor) for rows in shards]
    return sum(per_rank) / dp


def verl_clip_tokens(kind, lp, old, adv, mask, eps=0.2, eps_high=None, clip_ratio_c=3.0):
    """Per token (rows of 0/1), verl 0.9.1's ``pg_clipfrac`` and ``pg_clipfrac_lower`` indicators,
    written as its policy losses compare them (``compute_policy_loss_vanilla`` for ``'ppo'``,
    ``_gspo``, ``_cispo``): lists of rows of Python floats, advantages per token."""
    eps_high = eps if eps_high is None else eps_high
    clipped, lower = [], []
    for i in range(len(mask)):
        d = [x - o for x, o in zip(lp[i], old[i])]
        if kind == "gspo":  # the sequence's mean log-ratio at every token, clamped above at 10
            n = max(sum(mask[i]), 1)
            seq = sum(x * m for x, m in zip(d, mask[i])) / n
            ratios = [math.exp(min(seq, 10.0))] * len(d)
        else:
            ratios = [math.exp(min(max(x, -20.0), 20.0)) for x in d]
        c_row, l_row = [], []
        for r, a in zip(ratios, adv[i]):
            r_clip = min(max(r, 1 - eps), 1 + eps_high)
            if kind == "cispo":
                c_row.append(float(r != r_clip))
                l_row.append(0.0)
                continue
            pg1, pg2 = -a * r, -a * r_clip
            c_row.append(float(pg2 > pg1))
            pg3 = -a * clip_ratio_c
            l_row.append(float(max(pg1, pg2) > pg3 and a < 0) if kind == "ppo" else 0.0)
        clipped.append(c_row)
        lower.append(l_row)
    return clipped, lower
