"""Synthetic MoE routing and a plain-Python reference of MoERoutingMetric's results."""
import math
import random
from typing import Dict, List

import torch


def make_layer(seed: int, tokens: int, experts: int, topk: int, *, drop: float = 0.2,
               pad: float = 0.15, skew: float = 1.5) -> Dict[str, torch.Tensor]:
    """One layer's routing of ``tokens`` tokens: float64 logits (skewed so that some
    experts are hot and some may stay dead), the top-k map with a share of the
    assignments dropped (as capacity dropping does), and a padding mask."""
    g = torch.Generator().manual_seed(seed)
    bias = torch.linspace(skew, -skew, experts, dtype=torch.float64)
    logits = torch.randn(tokens, experts, generator=g, dtype=torch.float64) + bias
    top = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, logits.topk(topk, -1).indices, True)
    kept = top & (torch.rand(tokens, experts, generator=g) >= drop)
    valid = torch.rand(tokens, generator=g) >= pad
    return {"router_logits": logits, "routing_map": kept, "token_mask": valid,
            "tokens_dropped": int((top & ~kept & valid[:, None]).sum())}


def piece(layer: Dict[str, torch.Tensor], rows: List[int], topk: int) -> Dict[str, object]:
    """The fields of ``rows`` of a layer, as one call would pass them."""
    idx = torch.tensor(rows, dtype=torch.long)
    rm, valid = layer["routing_map"][idx], layer["token_mask"][idx]
    dropped = int(topk * valid.sum()) - int((rm & valid[:, None]).sum())
    return {"routing_map": rm, "router_logits": layer["router_logits"][idx], "token_mask": valid,
            "tokens_dropped": dropped}


def losses(seed: int, layer: int, index: int) -> Dict[str, float]:
    rng = random.Random(seed * 1000 + layer * 37 + index)
    return {"aux_loss": 1.0 + rng.random(), "z_loss": 3.0 + 2 * rng.random()}


def feed_layers(m, shard, num_layers: int = 4, num_experts: int = 6, topk: int = 2, tokens: int = 40,
                chunks: int = 4) -> None:
    """A layout-harness feed of MoERoutingMetric: stage p routes layers p, p + pp, ...; the data
    ranks (DP x CP) share out ``chunks`` fixed chunks of each layer's tokens; TP replicas route
    the same tokens."""
    me, n = shard.dp_rank * shard.cp_size + shard.cp_rank, shard.dp_size * shard.cp_size
    for layer in range(shard.pp_rank, num_layers, shard.pp_size):
        data = make_layer(100 * shard.interval + layer, tokens, num_experts, topk)
        for c in range(me, chunks, n):
            rows = torch.arange(tokens).tensor_split(chunks)[c].tolist()
            m.observe(layer, **piece(data, rows, topk), **losses(shard.interval, layer, c))


def reference(calls: List[tuple], num_layers: int, num_experts: int, per_layer: bool = True) -> dict:
    """Results from ``[(layer, fields)]`` by plain Python: lists, loops and ``math``."""
    E = num_experts
    counts = [[0] * E for _ in range(num_layers)]
    dropped = [0] * num_layers
    reported = False  # whether any call reported drops: else they were not measured
    ent = [[0.0, 0] for _ in range(num_layers)]
    aux = [[0.0, 0] for _ in range(num_layers)]
    z = [[0.0, 0] for _ in range(num_layers)]
    for layer, f in calls:
        mask = f["token_mask"].tolist() if "token_mask" in f else None
        if "routing_map" in f:
            for t, row in enumerate(f["routing_map"].tolist()):
                if mask is None or mask[t]:
                    for e in range(E):
                        counts[layer][e] += int(bool(row[e]))
        if "expert_counts" in f:
            for e, c in enumerate(f["expert_counts"].tolist()):
                counts[layer][e] += c
        if "router_logits" in f:
            for t, row in enumerate(f["router_logits"].tolist()):
                if mask is None or mask[t]:
                    top = max(row)
                    lse = top + math.log(sum(math.exp(x - top) for x in row))
                    ent[layer][0] -= sum(math.exp(x - lse) * (x - lse) for x in row)
                    ent[layer][1] += 1
        if "router_probs" in f:
            for t, row in enumerate(f["router_probs"].tolist()):
                s = sum(row)
                if (mask is None or mask[t]) and s != 0:
                    ent[layer][0] -= sum(p / s * math.log(p / s) for p in row if p > 0)
                    ent[layer][1] += 1
        dropped[layer] += int(f.get("tokens_dropped", 0))
        reported = reported or "tokens_dropped" in f
        for key, acc in (("aux_loss", aux), ("z_loss", z)):
            if key in f:
                acc[layer][0] += float(f[key])
                acc[layer][1] += 1
    per = {}
    for i in range(num_layers):
        r = {}
        c = counts[i]
        n = sum(c)
        if n:
            mean = n / E
            r["load_imbalance"] = max(c) / mean
            r["cv"] = math.sqrt(sum((x - mean) ** 2 for x in c) / E) / mean
            r["dead_expert_fraction"] = sum(x == 0 for x in c) / E
        if reported and (n or dropped[i]):
            r["tokens_dropped"] = dropped[i]
            r["drop_fraction"] = dropped[i] / (n + dropped[i])
        for name, acc in (("router_entropy", ent), ("aux_loss", aux), ("z_loss", z)):
            if acc[i][1]:
                r[name] = acc[i][0] / acc[i][1]
        if r:
            per[i] = r
    out = {}
    for name in ("load_imbalance", "cv", "dead_expert_fraction", "router_entropy", "aux_loss", "z_loss"):
        vals = [r[name] for r in per.values() if name in r]
        if vals:
            out[f"moe/{name}"] = sum(vals) / len(vals)
            if name == "load_imbalance":
                out["moe/load_imbalance_max"] = max(vals)
    routed = sum(sum(counts[i]) for i in per)
    drops = sum(dropped[i] for i in per)
    if reported and (routed or drops):
        out["moe/tokens_dropped"] = drops
        out["moe/drop_fraction"] = drops / (routed + drops)
    if per_layer:
        for i, r in per.items():
            out.update({f"moe/layer{i}/{k}": v for k, v in r.items()})
    return out
