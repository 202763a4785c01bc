"""From the merged states of ``MoERoutingMetric`` to its keys: per-layer statistics of the
count matrix and losses, their mean over layers, and the percentiles. Plain Python on the
reduced numbers (``compute`` runs after the sync), so nothing here touches a device."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Tuple


def summarize(s: Mapping[str, Any], num_layers: int, num_experts: int, percentiles: Optional[Tuple[float, ...]],
              per_layer: bool) -> Dict[str, Any]:
    """The keys ``MoERoutingMetric`` reports from its merged states ``s`` (see its docstring):
    each ``moe/{name}`` over layers is written once below, from the per-layer ``name`` of
    ``_layer_stats``."""
    per = [(i, r) for i, r in ((i, _layer_stats(s, i, num_experts)) for i in range(num_layers)) if r]
    if not per:
        return {}
    qs = percentiles or ()
    for i, r in per:  # each routed layer's percentiles of its experts' token counts
        if qs and "load_imbalance" in r:
            counts = sorted(s["counts"][i])
            r.update({f"tokens_per_expert_{_suffix(q)}": _percentile(counts, q) for q in qs})

    def mean(name: str) -> Optional[float]:
        """The mean over the layers that report ``name`` (None: no layer does)."""
        vals = [r[name] for _, r in per if name in r]
        return sum(vals) / len(vals) if vals else None

    def across(name: str, q: float) -> Optional[float]:
        """The ``q``-th percentile across the layers that report ``name``."""
        vals = sorted(r[name] for _, r in per if name in r)
        return _percentile(vals, q) if vals else None

    out: Dict[str, Any] = {}
    out["moe/load_imbalance"] = mean("load_imbalance")
    out["moe/cv"] = mean("cv")
    out["moe/dead_expert_fraction"] = mean("dead_expert_fraction")
    out["moe/router_entropy"] = mean("router_entropy")
    out["moe/aux_loss"] = mean("aux_loss")
    out["moe/z_loss"] = mean("z_loss")
    for q in qs:
        out[f"moe/tokens_per_expert_{_suffix(q)}"] = mean(f"tokens_per_expert_{_suffix(q)}")
    for name in ("load_imbalance", "cv", "dead_expert_fraction", "router_entropy", "aux_loss", "z_loss",
                 "drop_fraction") if qs else ():
        for q in qs:
            out[f"moe/{name}_{_suffix(q)}"] = across(name, q)
    imbalance = [r["load_imbalance"] for _, r in per if "load_imbalance" in r]
    out["moe/load_imbalance_max"] = max(imbalance) if imbalance else None
    routed = sum(sum(s["counts"][i]) for i, _ in per)
    dropped = sum(s["dropped"][i] for i, _ in per)
    if s["drop_reports"] and (routed or dropped):
        out["moe/tokens_dropped"] = dropped
        out["moe/drop_fraction"] = dropped / (routed + dropped)
    out["moe/nonfinite"] = sum(s["nonfinite"]) or None
    if per_layer:
        for i, r in per:
            out.update({f"moe/layer{i}/{k}": v for k, v in r.items()})
    return {k: v for k, v in out.items() if v is not None}


def _layer_stats(s: Mapping[str, Any], i: int, E: int) -> Dict[str, float]:
    out: Dict[str, float] = {}
    c = s["counts"][i]
    total, dropped = sum(c), s["dropped"][i]
    if total:
        mean = total / E
        var = sum((x - mean) ** 2 for x in c) / E
        out["load_imbalance"] = max(c) / mean
        out["cv"] = math.sqrt(var) / mean
        out["dead_expert_fraction"] = sum(1 for x in c if x == 0) / E
    if s["drop_reports"] and (total or dropped):
        out["tokens_dropped"] = dropped
        out["drop_fraction"] = dropped / (total + dropped)
    if s["entropy_tokens"][i]:
        out["router_entropy"] = s["entropy_sum"][i] / s["entropy_tokens"][i]
    if s["aux_calls"][i]:
        out["aux_loss"] = s["aux_sum"][i] / s["aux_calls"][i]
    if s["z_calls"][i]:
        out["z_loss"] = s["z_sum"][i] / s["z_calls"][i]
    return out


def check_percentiles(name: str, percentiles: Any) -> Optional[Tuple[float, ...]]:
    """``percentiles`` as a tuple of numbers in [0, 100], or None."""
    if percentiles is None:
        return None
    if isinstance(percentiles, (str, bytes)) or not hasattr(percentiles, "__iter__"):
        raise TypeError(f"{name}: percentiles must be a sequence of numbers in [0, 100], got "
                        f"{type(percentiles).__name__}; pass e.g. percentiles=(0, 50, 90, 100)")
    out = []
    for q in percentiles:
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 <= q <= 100:
            raise ValueError(f"{name}: percentiles must each be a number in [0, 100], got {q!r}; pass e.g. "
                             "percentiles=(0, 50, 90, 100)")
        out.append(float(q))
    if not out or len({_suffix(q) for q in out}) != len(out):
        raise ValueError(f"{name}: percentiles must be non-empty without duplicates, got {percentiles!r}")
    return tuple(out)


def _suffix(q) -> str:
    """``p50`` for 50 (or 50.0), ``p99.9`` for 99.9."""
    text = repr(float(q))
    return f"p{text[:-2] if text.endswith('.0') else text}"


def _percentile(ordered: List[float], q: float) -> float:
    """The ``q``-th percentile of sorted values, interpolated linearly (numpy's default);
    NaN when one is NaN (``sorted`` does not order NaN)."""
    if any(x != x for x in ordered):
        return math.nan
    pos = q / 100 * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
