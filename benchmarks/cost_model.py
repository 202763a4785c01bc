"""Benchmark 16, a MODEL (not a measurement): the library's cost at 1k, 4k and 16k ranks.

    .venv/bin/python -m benchmarks.cost_model          # instant; prints the markdown tables

Extrapolates from what was measured here and from published figures, and labels each input:

* the store requests, sockets, groups and value bytes of an eager gloo group of n ranks, per
  rank: 2n + 1, n, 1, (n + 1)(154 + 8n), checked against ``results/footprint.json`` (the
  library's mesh build at 4 to 32 ranks: a data twin of n = ranks / 2 and a TP twin of 2);
* a lazily connected gloo group (``TORCH_GLOO_LAZY_INIT=1``, torch >= 2.8), per rank: 1 set
  when made, 2 waits and 2 gets when a ring collective first connects its two neighbours,
  3 sockets (measured on torch 2.13 at 4 ranks; ``/work/shared/reference/scale.md``);
* gloo's ring hop over TCP: ``results/ring.json`` at 2 ranks, best block (loopback on this VM), and
  25 us and 175 us for a hop between hosts (175: pytorch/gloo#158, a 1 KB ring all_reduce
  over TCP between two servers took 0.354 ms, 2 hops);
* NCCL's own latency model, ``src/graph/tuning.cc`` of NCCL 2.30 (``ncclTunerConstantsDefaults``,
  ``ncclTopoTuneModel``): what NCCL itself predicts when it picks an algorithm, LL protocol
  (PAT: Simple), a topology latency of 0 and an x86 Intel host (1 us net overhead per step);
* the host's work of ``calculate()`` for the 7 core metrics: ``results/sync_scaling.json``
  (written on the library of a5c23d4, 824 packed bytes then).

Layouts (8 GPUs per node, TP inside the node, megatron-core's order tp-cp-ep-dp-pp, CP 1):
``TP8 x PP8`` (DP = ranks / 64: every data group has one GPU per node) and ``TP8 x PP1``
(DP = ranks / 8, issue 39's). Bandwidth terms use 25 GB/s per GPU (a 200 Gb/s NIC).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Dict, List, Tuple

from benchmarks import common

GPUS_PER_NODE = 8
NET_GBPS = 25.0
REDUCE_ABOVE_TODAY = 512
#: the 7 core metrics: packed buffer and the reduce path's self-merged columns, bytes per rank
#: (``bench_sync_scaling``'s first line on the library of e33c75a: 111 float64, 8 self-merged)
PACKED_B, OWN_B = 888, 64

# ---------------------------------------------------------------------------------- NCCL
# NCCL 2.30 src/graph/tuning.cc, ncclTunerConstantsDefaults (us): baseLatencies and the
# hwLatencies of the LL protocol (PAT runs Simple only).
BASE = {"tree": 6.8, "ring": 6.6, "pat": 8.0}
NVLINK_LL = {"tree": 0.6, "ring": 0.6}
PCI_LL = {"tree": 1.0, "ring": 1.0}
NET_LL = {"tree": 5.0, "ring": 2.7}
NET_TREE_SIMPLE = 14.0
NET_OVERHEAD = 1.0  # getNetOverhead(): x86 Intel, per ring step once the ring leaves the node


def _nodes(n: int, ppn: int) -> int:
    return max(1, n // ppn)


def nccl_all_reduce(n: int, ppn: int, intra: Dict[str, float] = NVLINK_LL) -> Tuple[float, str]:
    """(us, algorithm): NCCL's latency of a small all_reduce over n ranks, ppn per node,
    ``intra`` the hop latencies inside a node (NVLink unless given)."""
    nodes = _nodes(n, ppn)
    if nodes == 1:
        return BASE["ring"] + 2 * (n - 1) * intra["ring"], "ring (NVLink)"
    inter_ring = NET_LL["tree"] if ppn == 1 else NET_LL["ring"]  # ppn 1: the tree's net latency
    inter_steps = 2 * (nodes - 1)
    ring = (BASE["ring"] + (2 * (n - 1) - inter_steps) * max(intra["ring"], NET_OVERHEAD)
            + inter_steps * inter_ring)
    tree = BASE["tree"] + 2 * ((ppn - 1) * intra["tree"] + int(math.log2(nodes)) * NET_LL["tree"])
    return min((tree, "tree"), (ring, "ring"))


def nccl_all_gather(n: int, ppn: int, nbytes: int) -> Tuple[float, str]:
    """(us, algorithm): NCCL's time of an all_gather of ``nbytes`` per rank: ring, or PAT
    where NCCL enables it (one rank per node); the received bytes at ``NET_GBPS``."""
    nodes = _nodes(n, ppn)
    wire = n * nbytes / (NET_GBPS * 1e3)
    if nodes == 1:
        return BASE["ring"] + (n - 1) * NVLINK_LL["ring"] + wire, "ring (NVLink)"
    inter = NET_LL["tree"] if ppn == 1 else NET_LL["ring"]
    ring = BASE["ring"] + (n - nodes) * max(NVLINK_LL["ring"], NET_OVERHEAD) + (nodes - 1) * inter
    options = [(ring + wire, "ring")]
    if ppn == 1:  # ncclPatEnable: PAT only with one rank per node
        options.append((BASE["pat"] + int(math.log2(nodes)) * NET_TREE_SIMPLE / 3.5 + 2.8 * n + wire, "PAT"))
    return min(options)


# ------------------------------------------------------------------------------- layouts
def layouts(world: int) -> List[Dict[str, int]]:
    out = []
    for tp, pp in ((8, 8), (8, 1)):
        out.append({"name": f"TP{tp} x PP{pp}", "world": world, "tp": tp, "pp": pp, "dp": world // (tp * pp),
                    "mp": tp * pp, "dp_ppn": 1, "mp_ppn": min(tp * pp, GPUS_PER_NODE)})
    return out


def eager_group(n: int) -> Dict[str, int]:
    """Per rank: what an eager (full-mesh) gloo group of n ranks costs to make."""
    return {"requests": 2 * n + 1, "sockets": n, "bytes": (n + 1) * (154 + 8 * n), "groups": 1}


def library_groups_today(lay: Dict[str, int]) -> List[int]:
    """The sizes of the gloo twins a rank gets at mesh build today (``parallel/bounded.py``:
    dp_cp, dp, tp, cp, mp, one per distinct set of ranks, groups of one rank skipped)."""
    sizes = {("dp", lay["dp"]), ("tp", lay["tp"])}
    if lay["pp"] > 1:
        sizes.add(("mp", lay["mp"]))
    return sorted(n for _, n in sizes if n > 1)


def store_table(worlds) -> List[str]:
    lines = ["| ranks | layout | DP | today, per rank: sockets / store requests / groups | today: "
             "new_group calls per rank | today: value bytes per rank | today: requests at the store | "
             "after, per rank | after: requests at the store |", "|---|---|---|---|---|---|---|---|---|"]
    for world in worlds:
        for lay in layouts(world):
            cost = [eager_group(n) for n in library_groups_today(lay)]
            req = sum(c["requests"] for c in cost)
            calls = world // lay["dp"] + world // lay["tp"] + (world // lay["mp"] if lay["pp"] > 1 else 0)
            after_req = 1 + 2 + 2  # one lazy TP group, connected by its first ring collective
            lines.append(
                f"| {world:,} | {lay['name']} | {lay['dp']:,} | {sum(c['sockets'] for c in cost):,} / {req:,} / "
                f"{len(cost)} | {calls:,} | {sum(c['bytes'] for c in cost) / 1024:,.0f} KiB | "
                f"{world * req / 1e6:,.2f} M | 3 / {after_req} / 1 (at the first agreement) | "
                f"{world * after_req / 1e3:,.0f} k |")
    return lines


# ------------------------------------------------------------------------- critical path
def _host_ms(sync: Dict, n: int, reduce: bool) -> float:
    """The host's work of one calculate() (pack + merge or reduce unpack, measured on one
    CPU core), interpolated in the data-group size."""
    key = "reduce_host_ms" if reduce else "gather_merge_ms"
    pts = sorted((int(k), v[key]) for k, v in sync["results_by_ranks"].items())
    pack = sync["pack_us"] / 1e3
    for (a, ya), (b, yb) in zip(pts, pts[1:]):
        if a <= n <= b:
            return pack + ya + (yb - ya) * (n - a) / (b - a)
    return pack + (pts[0][1] if n < pts[0][0] else pts[-1][1])


def gloo_hops(lay: Dict[str, int], reduce_above: int) -> Tuple[int, str]:
    """Dependent ring hops of one calculate() on gloo twins, and the path."""
    n, m = lay["dp"], lay["mp"] if lay["pp"] > 1 else lay["tp"]
    share = m - 1
    if n > reduce_above:  # 3 all_reduce (int MAX, float SUM, int SUM) + all_gather of the self-merged
        return 3 * 2 * (n - 1) + (n - 1) + share, "reduce"
    return (n - 1) + share, "gather"


def nccl_path(lay: Dict[str, int], reduce_above: int, own: bool = True) -> Tuple[float, str]:
    """us of one calculate()'s collectives on NCCL device groups (NCCL's model), and what ran."""
    n, m = lay["dp"], lay["mp"] if lay["pp"] > 1 else lay["tp"]
    share, share_algo = nccl_all_gather(m, lay["mp_ppn"], PACKED_B)
    if n > reduce_above:
        ar, ar_algo = nccl_all_reduce(n, lay["dp_ppn"])
        t, what = 3 * ar, f"3 all_reduce ({ar_algo})"
        if own:
            ag, ag_algo = nccl_all_gather(n, lay["dp_ppn"], OWN_B)
            t, what = t + ag, what + f" + all_gather {OWN_B} B ({ag_algo})"
    else:
        t, algo = nccl_all_gather(n, lay["dp_ppn"], PACKED_B)
        what = f"all_gather ({algo})"
    return t + share, f"{what}; TP x PP all_gather ({share_algo})"


def path_table(worlds, hop_here_us: float, sync: Dict) -> List[str]:
    lines = ["| ranks | layout | DP | today (gloo twins): path, hops | today at "
             f"{hop_here_us:.0f} / 25 / 175 us a hop | host, measured | after (NCCL model), same threshold "
             "| after: collectives | after, threshold 64, states made reducible |", "|---" * 9 + "|"]
    for world in worlds:
        for lay in layouts(world):
            hops, path = gloo_hops(lay, REDUCE_ABOVE_TODAY)
            times = " / ".join(_ms(hops * h / 1e3) for h in (hop_here_us, 25, 175))
            host = _host_ms(sync, lay["dp"], path == "reduce")
            t_after, what = nccl_path(lay, REDUCE_ABOVE_TODAY)
            t64, _ = nccl_path(lay, 64, own=False)
            lines.append(f"| {world:,} | {lay['name']} | {lay['dp']:,} | {path}, {hops:,} | {times} | "
                         f"{_ms(host)} | {_ms(t_after / 1e3)} | {what} | {_ms(t64 / 1e3)} |")
    return lines


def threshold_table(sizes=(16, 32, 64, 128, 256, 512, 2048, 8192, 16384)) -> List[str]:
    lines = [f"| data group | ppn | gather path: 1 all_gather of {PACKED_B} B | reduce path: 3 all_reduce | "
             f"reduce path with self-merged states (+ all_gather of {OWN_B} B) |", "|---|---|---|---|---|"]
    for ppn in (1, 8):
        for n in sizes:
            if n < ppn:
                continue
            ag, ag_algo = nccl_all_gather(n, ppn, PACKED_B)
            ar, ar_algo = nccl_all_reduce(n, ppn)
            own, _ = nccl_all_gather(n, ppn, OWN_B)
            lines.append(f"| {n:,} | {ppn} | {ag:,.0f} us ({ag_algo}) | {3 * ar:,.0f} us ({ar_algo}) | "
                         f"{3 * ar + own:,.0f} us |")
    return lines


def _ms(ms: float) -> str:
    return f"{ms * 1e3:.0f} us" if ms < 1 else f"{ms:,.1f} ms" if ms < 1000 else f"{ms / 1e3:,.1f} s"


def check_footprint(doc: Dict) -> List[str]:
    """The eager-group formula against the measured mesh builds (TP2: twins of ranks/2 and 2)."""
    out = []
    for config, by_world in doc["results"].items():
        for world, res in by_world.items():
            want = [eager_group(n) for n in (int(world) // 2, 2)]  # the data twin, the TP twin
            got = res["summary"]["mesh"]
            ok = all(got[f]["max"] == got[f]["min"] == sum(c[k] for c in want)
                     for f, k in (("store_requests", "requests"), ("sockets", "sockets"), ("store_bytes", "bytes")))
            out.append(f"{config} {world}: {'matches' if ok else 'DIFFERS'}")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ring", default="ring", help="the results/<name>.json of bench_ring to read")
    p.add_argument("--footprint", default="footprint", help="the results/<name>.json of bench_footprint")
    args = p.parse_args(argv)
    load = lambda name: json.load(open(os.path.join(common.RESULTS, f"{name}.json")))  # noqa: E731
    ring, sync = load(args.ring), load("sync_scaling")
    # the one point with no more ranks than cores: 2 ranks, best block (above, the fit mostly
    # measures the scheduler)
    two = ring["results_by_ranks"]["2"]
    hop = min(two[op]["best_us_per_hop"] for op in ("all_reduce", "all_gather"))
    worlds = (1024, 4096, 16384)
    # NVIDIA/nccl#757: 8 B all_reduce, 2 nodes x 8 GPUs on PCIe, 100G NIC: 29.8 us (nccl-tests)
    print(f"NCCL model vs NVIDIA/nccl#757 (8 B all_reduce, 2 x 8 GPUs, PCIe): "
          f"{nccl_all_reduce(16, 8, PCI_LL)[0]:.1f} us modelled, 29.8 us measured")
    print("Eager gloo group formula vs results/footprint.json: "
          + "; ".join(check_footprint(load(args.footprint))))
    print(f"\ngloo hop here (2 ranks, best block, {ring['date']}): {hop:.0f} us\n")
    print("\n".join(store_table(worlds)))
    print()
    print("\n".join(path_table(worlds, hop, sync)))
    print()
    print("\n".join(threshold_table()))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
