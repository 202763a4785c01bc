"""Expectations over k of a prompt's n samples drawn without replacement, exactly:
``pass_at_k`` (Chen et al. 2021), ``pass_hat_k``, ``expected_max`` / ``expected_min``
(best@k / worst@k) and ``majority_at_k`` (maj@k, a dynamic programme in exact integers).
Pure functions of host numbers: what ``PassAtKMetric.compute`` averages over prompts.
"""
from __future__ import annotations

import math
from fractions import Fraction
from math import comb
from typing import Dict, Sequence, Tuple


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. (2021): 1 - C(n - c, k) / C(n, k), exact in integers, then rounded."""
    total = comb(n, k)
    return (total - comb(n - c, k)) / total


def pass_hat_k(n: int, c: int, k: int) -> float:
    """pass^k: the chance that k samples drawn without replacement are all correct."""
    return comb(c, k) / comb(n, k)


def expected_max(rewards: Sequence[float], k: int) -> float:
    """E[max of k rewards drawn without replacement] = sum_i r_(i) C(i-1, k-1) / C(n, k)
    over the ascending order statistics."""
    r, total = sorted(rewards), comb(len(rewards), k)
    return sum(x * (comb(i, k - 1) / total) for i, x in enumerate(r))


def expected_min(rewards: Sequence[float], k: int) -> float:
    """E[min of k rewards drawn without replacement] = sum_i r_(i) C(n-i, k-1) / C(n, k)."""
    r, total = sorted(rewards), comb(len(rewards), k)
    n = len(r)
    return sum(x * (comb(n - 1 - i, k - 1) / total) for i, x in enumerate(r))


def _win_ways(a: int, others: Sequence[int], k: int, scale: int) -> int:
    """``scale`` times the number of k-subsets (of the prompt's samples) in which one given
    answer holding ``a`` samples has the most votes, each subset weighted 1/(number of
    answers tied at the top) (a tie is broken uniformly at random). ``scale`` is a multiple
    of 1..k, so the count stays an exact integer."""
    total = 0
    for t in range(1, min(a, k) + 1):  # the answer's votes in the subset
        rest = k - t
        smax = rest // t  # other answers that can tie with t votes
        # ways[d][s]: ways to draw d samples from the answers seen so far with none above t
        # votes and s of them at exactly t
        ways = [[0] * (smax + 1) for _ in range(rest + 1)]
        ways[0][0] = 1
        for b in others:
            new = [[0] * (smax + 1) for _ in range(rest + 1)]
            picks = [comb(b, x) for x in range(min(b, t - 1, rest) + 1)]
            tie = comb(b, t) if b >= t else 0
            for d in range(rest + 1):
                row = ways[d]
                for s in range(smax + 1):
                    w = row[s]
                    if not w:
                        continue
                    for x, p in enumerate(picks[:rest - d + 1]):
                        new[d + x][s] += w * p
                    if tie and d + t <= rest and s < smax:
                        new[d + t][s + 1] += w * tie
            ways = new
        total += comb(a, t) * sum(w * (scale // (s + 1)) for s, w in enumerate(ways[rest]))
    return total


def majority_at_k(groups: Sequence[Tuple[int, int]], k: int) -> float:
    """maj@k of one prompt, exactly: the expected correctness of the majority answer of k
    samples drawn without replacement, over all C(n, k) subsets.

    ``groups``: one ``(samples, correct samples)`` pair per distinct answer. A tie at the
    top is broken uniformly at random (each tied answer wins 1/|tie| of the subset); an
    answer is correct with weight ``correct / samples`` (1 or 0 when its samples agree).
    Computed per answer by a dynamic programme over the other answers' vote counts, in
    exact integers (``_win_ways``).
    """
    counts = [a for a, _ in groups]
    n = sum(counts)
    scale = math.lcm(*range(1, k + 1))
    denom = scale * comb(n, k)
    won: Dict[int, int] = {}
    result = Fraction(0)
    for i, (a, c) in enumerate(groups):
        if not c:
            continue
        if a not in won:
            won[a] = _win_ways(a, counts[:i] + counts[i + 1:], k, scale)
        result += Fraction(c * won[a], a * denom)
    return float(result)
