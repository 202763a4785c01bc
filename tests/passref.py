"""Plain-Python references for PassAtKMetric: every key by brute-force enumeration of the
k-subsets of each prompt's samples (itertools), independent of the metric's formulas."""
from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from typing import Dict, List, Sequence


def make_samples(seed: int, n_prompts: int = 8, max_n: int = 8, sources=("gsm8k", "math")) -> List[dict]:
    """Samples of ``n_prompts`` prompts (ids ints and strs, 1..max_n samples each), shuffled:
    prompt, correct, answer (correct answers are 'A'), reward, data source."""
    rng = random.Random(seed)
    out = []
    for p in range(n_prompts):
        pid = p * 7 if p % 2 else f"q{p}"
        n = rng.randint(1, max_n) if p else max_n  # one prompt always has max_n samples
        src = sources[p % len(sources)]
        for _ in range(n):
            answer = rng.choice(["A", "B", "C", 7]) if p % 3 else rng.choice(["A", "B"])
            out.append({"prompt": pid, "correct": answer == "A", "answer": answer,
                        "reward": round(rng.uniform(-1, 1), 3), "source": src})
    rng.shuffle(out)
    return out


def per_prompt(samples: Sequence[dict]) -> Dict[object, List[dict]]:
    groups: Dict[object, List[dict]] = {}
    for s in samples:
        groups.setdefault((type(s["prompt"]).__name__, s["prompt"]), []).append(s)
    return groups


def prompt_values(group: Sequence[dict], k: int) -> Dict[str, float]:
    """Every key of one prompt by enumerating its k-subsets."""
    subsets = list(itertools.combinations(range(len(group)), k))
    answers = Counter(s["answer"] for s in group)
    right = Counter(s["answer"] for s in group if s["correct"])
    quality = {a: right[a] / answers[a] for a in answers}  # an answer's correctness
    out = {"pass": 0.0, "pass^": 0.0, "maj": 0.0, "best": 0.0, "worst": 0.0}
    for sub in subsets:
        picked = [group[i] for i in sub]
        out["pass"] += any(s["correct"] for s in picked)
        out["pass^"] += all(s["correct"] for s in picked)
        votes = Counter(s["answer"] for s in picked)
        top = max(votes.values())
        tied = [a for a, v in votes.items() if v == top]
        out["maj"] += sum(quality[a] for a in tied) / len(tied)  # a tie split uniformly
        out["best"] += max(s["reward"] for s in picked)
        out["worst"] += min(s["reward"] for s in picked)
    return {key: v / len(subsets) for key, v in out.items()}


def reference(samples: Sequence[dict], ks: Sequence[int], answers: bool = False, rewards: bool = False) -> dict:
    """The metric's keys (without the confidence intervals) over ``samples``."""
    groups = per_prompt(samples)
    out = {"num_prompts": len(groups), "num_samples": len(samples)}
    for k in sorted(set(ks)):
        rows = [prompt_values(g, k) for g in groups.values() if len(g) >= k]
        names = ["pass", "pass^"] + (["maj"] if answers else []) + (["best", "worst"] if rewards else [])
        for name in names:
            key = f"{name}@{k}" if name != "pass^" else f"pass^{k}"
            out[key] = math.fsum(r[name] for r in rows) / len(rows)
    return out


def brute_majority(groups, k: int) -> float:
    """maj@k of one prompt given ``(samples, correct)`` per answer, by enumeration."""
    samples = [{"answer": i, "correct": j < c} for i, (a, c) in enumerate(groups) for j in range(a)]
    return prompt_values([dict(s, reward=0.0) for s in samples], k)["maj"]
