"""Print the markdown tables of benchmarks/README.md from benchmarks/results/*.json.

    python -m benchmarks.report
"""
from __future__ import annotations

import json
import os

from benchmarks.common import RESULTS


def _load(name):
    path = os.path.join(RESULTS, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _header(doc):
    v = doc["versions"]
    src = doc.get("source", {})
    note = f"; {src['note']}" if src.get("note") else ""
    return (f"`{doc['command']}` — {doc['date']}, {doc['machine'].get('cpu', '?')} "
            f"({doc['machine'].get('cpus')} cores), torch {v['torch']}, twinkle-kit {v['twinkle-kit']}, "
            f"torchmetrics {v['torchmetrics']}; code: {src.get('head', '?')}{note}")


def calculate(doc):
    lines = [_header(doc), "",
             "| ranks | ours ms | Twinkle ms | TorchMetrics ms | floor (all_reduce) ms | bare all_gather ms "
             "| Twinkle / ours | TorchMetrics / ours | ours / floor | collectives ours / Twinkle / TorchMetrics "
             "| ours, first calculate() |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for world, r in doc["results_by_ranks"].items():
        lat, c, q = r["latency_ms"], r["collectives_calculate"], r["ratio_to_ours"]
        lines.append(f"| {world} | {lat['ours']['median']:.1f} | {lat['twinkle']['median']:.1f} | "
                     f"{lat['torchmetrics']['median']:.1f} | {lat['floor']['median']:.1f} | "
                     f"{lat['floor_gather']['median']:.1f} | **{q['twinkle']:.1f}x** | **{q['torchmetrics']:.1f}x** | "
                     f"**{r['ours_over_floor']:.2f}x** | {c['ours']} / {c['twinkle']} / {c['torchmetrics']} | "
                     f"{r.get('collectives_first_calculate', {}).get('ours', '-')} |")
    return "\n".join(lines)


def accumulate(doc):
    lines = [_header(doc), "",
             "| workload | ours ms | Twinkle ms | Twinkle / ours (p10-p90) |", "|---|---|---|---|"]
    for name, r in doc["accumulate"].items():
        lines.append(f"| {name} | {r['ours_ms']:.2f} | {r['twinkle_ms']:.2f} | "
                     f"**{r['twinkle_over_ours']:.2f}x** ({r['ratio_p10']:.2f}-{r['ratio_p90']:.2f}) |")
    lines += ["", "| metric | device waits per accumulate: ours | Twinkle | Twinkle's calls |", "|---|---|---|---|"]
    for name, row in doc["device_waits"].items():
        extra = []
        for kind, label in (("benchmark_workload", "benchmark workload"), ("ragged_workload", "ragged")):
            if "ours_" + kind in row:
                extra.append(f"{label}: {row['ours_' + kind]['total']} / {row['twinkle_' + kind]['total']}")
        calls = ", ".join(f"{k} {v}" for k, v in sorted(row["twinkle"]["by_call"].items())) or "-"
        more = f" ({'; '.join(extra)})" if extra else ""
        lines.append(f"| {name} | {row['ours']['total']} | {row['twinkle']['total']}{more} | {calls} |")
    return "\n".join(lines)


def baseline(doc):
    """Metrics without a Twinkle peer, against the plain torch work (``--cases baseline``)."""
    lines = [_header(doc), "",
             "| metric | ours ms | baseline (same tensors, same command) | baseline ms | ours / baseline (p10-p90) "
             "| device waits ours / baseline | aten ops ours / baseline |", "|---|---|---|---|---|---|---|"]
    for name, r in doc["baseline_cases"].items():
        for k, b in r["baselines"].items():
            lines.append(f"| {name} | {r['ours_ms']:.2f} | {k} | {b['ms']:.2f} | **{b['ours_over']:.2f}x** "
                         f"({b['p10']:.2f}-{b['p90']:.2f}) | {r['ours']['device_waits']} / {b['device_waits']} | "
                         f"{r['ours']['aten_ops']} / {b['aten_ops']} |")
    lines.append("")
    lines += [f"- {name}: {r['workload']}" + "".join(f"; {k}: {v}" for k, v in r["notes"].items())
              for name, r in doc["baseline_cases"].items()]
    return "\n".join(lines)


def memory(doc):
    b, s, v = doc["shape"]
    lines = [_header(doc), "", f"logits [{b}, {s}, {v}] float32, vocab-sharded over TP",
             "", "| case | TP | implementation | logits per rank MiB | extra MiB | extra / logits |",
             "|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        impl = r["impl"] + (f" (entropy_chunk_size={r['entropy_chunk_size']})" if r.get("entropy_chunk_size") else "")
        lines.append(f"| {r['case']} | {r['tp']} | {impl} | {r['logits_mib_per_rank']:.0f} | "
                     f"{max(r['extra_mib'], 0):.1f} | **{100 * max(r['extra_over_logits'], 0):.1f}%** |")
    return "\n".join(lines)


def scaling(doc):
    res = doc["results_by_ranks"]
    impls = list(next(iter(res.values()))["latency_ms"])
    lines = [_header(doc), "", "| ranks | " + " | ".join(i.replace("_", " ") + " ms" for i in impls) +
             " | ours 9 metrics / floor |", "|---" * (len(impls) + 2) + "|"]
    for world, r in res.items():
        lines.append(f"| {world} | " + " | ".join(f"{r['latency_ms'][i]:.1f}" for i in impls) +
                     f" | {r['over_floor']['ours_9']:.2f}x |")
    return "\n".join(lines)


def main():
    for name, fn in (("calculate", calculate), ("accumulate", accumulate), ("memory", memory),
                     ("scaling", scaling)):
        doc = _load(name)
        print(f"### {name}\n")
        print(fn(doc) if doc and (name != "accumulate" or "accumulate" in doc) else "(not run yet)")
        print()
        if name == "accumulate":
            # a full run holds the baseline cases too; `--cases baseline` writes them apart
            for source in ("accumulate", "accumulate_baseline"):
                other = _load(source)
                if other and "baseline_cases" in other:
                    print(f"### accumulate, metrics against plain torch ({source}.json)\n")
                    print(baseline(other))
                    print()


if __name__ == "__main__":
    main()
