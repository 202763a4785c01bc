"""Benchmark 14: what the library adds to a rank, beside megatron-core, at 4 to 32 ranks.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_footprint            # ~10 min on 2 busy cores

Counts only, no timing (so more ranks than cores is fine). Each rank starts its default
group over a counting store (``footprint.CountingStore`` around the parent's TCPStore) and
measures four phases, each as a delta after a barrier: megatron-core's
``initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)``,
the library's ``DeviceMesh.from_megatron()``, a dozen accumulate + ``calculate()`` of the 7
core metrics (Accuracy vocab-parallel), and a dozen more. Per phase: sockets opened and still
open, and those of earlier phases closed (``/proc/self/fd``), store requests by kind and their
value bytes, process groups (torch's registry), threads. Two configurations of the job:

* ``standin``: the default group on ``twinkle_metrics.testing.standin`` (gloo inside,
  another name outside), so megatron-core's groups are device groups to the library, as
  NCCL's are; the library's bound is the default group's timeout (600 s).
* ``gloo``: plain gloo, init timeout 600 s, megatron-core's groups 30 min, the library's
  bound 30 s (``TWINKLE_METRICS_TIMEOUT_S``): the groups' timeouts are longer than the bound.

Writes ``results/<out>.json`` (every rank's deltas, each different result once with its ranks)
and ``results/<out>.md`` (the tables).
"""
from __future__ import annotations

import argparse
import functools
import sys
import time
from typing import Any, Dict, List

from benchmarks import common, footprint

#: configuration -> (the default group's backend, the library's bound in seconds or None)
CONFIGS = {"standin": ("standin", None), "gloo": ("gloo", 30.0)}
#: modules the fork server imports once, for every rank (see ``common.run_ranks``)
PRELOAD = ("torch", "torch.distributed", "megatron.core.parallel_state", "twinkle_metrics", "parallel",
           "benchmarks.suite", "benchmarks.footprint")
FIELDS = ("sockets", "sockets_closed", "store_requests", "groups", "new_groups_over_world", "threads", "store_bytes",
          "store_marks")
LABELS = {"megatron": "megatron-core initialize_model_parallel", "mesh": "library: DeviceMesh.from_megatron()",
          "calculate": "library: collection + {n} x (accumulate + calculate())",
          "calculate_more": "library: {n} more"}


def summarise(per_rank: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per phase and field: min and max over the ranks, the sum (what the one store served)."""
    out = {}
    for phase in footprint.PHASES:
        rows = [r["deltas"][phase] for r in per_rank]
        out[phase] = {f: {"min": min(r[f] for r in rows), "max": max(r[f] for r in rows),
                          "all_ranks": sum(r[f] for r in rows)} for f in FIELDS}
        kinds = sorted({k for r in rows for k in r["store_by_kind"]})
        out[phase]["store_by_kind_max"] = {k: max(r["store_by_kind"].get(k, 0) for r in rows) for k in kinds}
    return out


def _cell(stat: Dict[str, int]) -> str:
    return str(stat["max"]) if stat["min"] == stat["max"] else f"{stat['min']}-{stat['max']}"


def distinct(per_rank: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The ranks' results, each different one once, with the ranks that gave it."""
    out: List[Dict[str, Any]] = []
    for rank, res in enumerate(per_rank):
        same = next((d for d in out if d["result"] == res), None)
        if same is None:
            out.append({"ranks": [rank], "result": res})
        else:
            same["ranks"].append(rank)
    return out


def _standin_line(by_world: Dict[str, Any]) -> str:
    """What the stand-in recorded the library doing on groups it did not make, in one line."""
    per_rank = [r.get("standin_calls", []) for res in by_world.values() for r in res["per_rank"]]
    sizes: Dict[tuple, set] = {}
    for recorded in per_rank:
        for c in recorded:
            sizes.setdefault((c["what"], c["where"]), set()).add(len(c["ranks"]))
    found = "; ".join(f"{what} at {where}, on groups of {', '.join(map(str, sorted(n)))} ranks"
                      for (what, where), n in sorted(sizes.items()))
    return (f"Calls the stand-in recorded on groups the library did not make: up to {max(map(len, per_rank))} "
            f"per rank{': ' + found if found else ''}.")


def tables(results: Dict[str, Dict[str, Any]], calls: int) -> str:
    """The markdown: per configuration, one summary row per world size (sockets / store
    requests / groups per rank, max over ranks), then the details."""
    lines = []
    for config, by_world in results.items():
        backend, bound = CONFIGS[config]
        lines += [f"**{config}** (default group `{backend}`, library bound "
                  f"{f'{bound:g} s' if bound else 'the default group timeout, 600 s'}, TP2): per rank, "
                  "sockets opened / store requests / groups (a range where ranks differ)", "",
                  f"| ranks | megatron init | library: mesh build | library: {calls} calculate() | "
                  f"library: {calls} more | library total |", "|---|---|---|---|---|---|"]
        for world, res in by_world.items():
            s = res["summary"]
            cells = [" / ".join(_cell(s[p][f]) for f in ("sockets", "store_requests", "groups"))
                     for p in footprint.PHASES]
            total = [sum(r["deltas"][p][f] for p in footprint.PHASES[1:]) for r in res["per_rank"]
                     for f in ("sockets", "store_requests", "groups")]
            tot = " / ".join(_cell({"min": min(total[i::3]), "max": max(total[i::3])}) for i in range(3))
            lines.append(f"| {world} | " + " | ".join(cells) + f" | {tot} |")
        if backend == "standin":
            lines += ["", _standin_line(by_world)]
        lines += ["", "Details (max over ranks; store requests by kind; all ranks: what the one store served):", "",
                  "| ranks | phase | sockets opened (closed) | threads | groups | new_group over WORLD | "
                  "store requests (by kind) | value bytes | library's own keys | requests, all ranks |",
                  "|---" * 10 + "|"]
        for world, res in by_world.items():
            for phase in footprint.PHASES:
                s = res["summary"][phase]
                kinds = ", ".join(f"{k} {v}" for k, v in s["store_by_kind_max"].items())
                closed = f" ({_cell(s['sockets_closed'])})" if s["sockets_closed"]["max"] else ""
                lines.append(f"| {world} | {LABELS[phase].format(n=calls)} | {_cell(s['sockets'])}{closed} | "
                             f"{_cell(s['threads'])} | {_cell(s['groups'])} | {_cell(s['new_groups_over_world'])} | "
                             f"{_cell(s['store_requests'])}"
                             f"{f' ({kinds})' if kinds else ''} | {_cell(s['store_bytes'])} | "
                             f"{_cell(s['store_marks'])} | {s['store_requests']['all_ranks']} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--calls", type=int, default=12)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per job")
    p.add_argument("--out", default="footprint")
    args = p.parse_args(argv)
    t_start = time.time()
    results: Dict[str, Dict[str, Any]] = {}
    for config in args.configs:
        backend, bound = CONFIGS[config]
        init = functools.partial(footprint.counting_init, backend=backend, timeout_s=600)
        results[config] = {}
        for world in args.ranks:
            t0 = time.time()
            per_rank = common.run_ranks(world, footprint.rank_phases, args.tp, args.calls, bound,
                                        timeout=args.timeout, init=init, preload=PRELOAD)
            results[config][str(world)] = {"summary": summarise(per_rank), "per_rank": per_rank,
                                           "wall_s": round(time.time() - t0, 1)}
            s = results[config][str(world)]["summary"]
            print(f"{config} ranks={world:2d} ({time.time() - t0:.0f} s): " + "  ".join(
                f"{ph} {_cell(s[ph]['sockets'])}/{_cell(s[ph]['store_requests'])}/{_cell(s[ph]['groups'])}"
                for ph in footprint.PHASES))
            sys.stdout.flush()
    md = tables(results, args.calls)
    print(md)
    for by_world in results.values():  # the file keeps each different rank's result once
        for res in by_world.values():
            res["per_rank"] = distinct(res["per_rank"])
    command = "PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_footprint " + " ".join(argv or sys.argv[1:])
    path = common.save(args.out, {"tp": args.tp, "calls": args.calls, "configs": {c: CONFIGS[c] for c in args.configs},
                                  "results": results, "wall_s": round(time.time() - t_start, 1)}, command.strip())
    with open(path[:-len(".json")] + ".md", "w") as f:
        f.write(md + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
