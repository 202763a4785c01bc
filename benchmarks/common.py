"""Shared harness: gloo rank launcher, collective counter, timing, JSON results.

Benchmarks report *ratios* measured in the same run, interleaved iteration by
iteration (the machine is shared and noisy, so absolute times drift; two peers
timed back to back see the same noise).
"""
from __future__ import annotations

import contextlib
import datetime
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from twinkle_metrics import testing  # noqa: E402


# --------------------------------------------------------------------- environment
def versions() -> Dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("torch", "twinkle-kit", "torchmetrics", "twinkle-metrics"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def machine() -> Dict[str, Any]:
    info = {"platform": platform.platform(), "cpus": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            info["mem_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    return info


def source_tree() -> Dict[str, str]:
    """Which code was measured: the commit of the tree the benchmark imported from."""
    import subprocess

    import twinkle_metrics

    tree = os.path.dirname(os.path.dirname(os.path.abspath(twinkle_metrics.__file__)))
    try:
        head = subprocess.run(["git", "-C", tree, "log", "-1", "--format=%h %s"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", tree, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        head, dirty = "unknown", ""
    out = {"path": tree, "head": head, "modified": bool(dirty)}
    if os.environ.get("BENCH_SOURCE_NOTE"):
        out["note"] = os.environ["BENCH_SOURCE_NOTE"]
    return out


def save(name: str, payload: Dict[str, Any], command: str) -> str:
    os.makedirs(RESULTS, exist_ok=True)
    doc = {"benchmark": name, "command": command,
           "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
           "machine": machine(), "versions": versions(), "source": source_tree(), **payload}
    path = os.path.join(RESULTS, f"{name}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)
        f.write("\n")
    return path


def median(xs: List[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def quantile(xs: List[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


# The collective counter lives with the other test helpers.
CollectiveCounter = testing.CollectiveCounter


# ------------------------------------------------------------------ rank launcher
def time_rotating(fns: Dict[str, Callable[[], Any]], blocks: int, per_block: int,
                  after_block: Callable[[int], None] = lambda blk: None) -> List[Dict[str, float]]:
    """Seconds per call of each of ``fns``, per block: ``per_block`` calls each, the
    implementations in a rotating order (block ``b`` starts at the ``b``-th), so that
    within a block they share the same noise; ``after_block(b)`` runs after block ``b``."""
    order = list(fns)
    out = []
    for blk in range(blocks):
        shift = blk % len(order)
        got = {}
        for impl in order[shift:] + order[:shift]:
            t0 = time.perf_counter()
            for _ in range(per_block):
                fns[impl]()
            got[impl] = (time.perf_counter() - t0) / per_block
        out.append(got)
        after_block(blk)
    return out


def gloo_init(rank: int, world: int, host: str, port: int) -> None:
    """The ranks' default start: gloo, over the parent's store (see ``run_ranks``)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=300)
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)


def _rank_main(rank, world, host, port, fn, args, results, init):
    os.environ.update(OMP_NUM_THREADS="1", MASTER_ADDR=host, MASTER_PORT=str(port),
                      RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        init(rank, world, host, port)
        try:
            results.put((rank, True, fn(*args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, traceback.format_exc()))


def run_ranks(world: int, fn: Callable, *args, timeout: float = 600, init: Callable = gloo_init,
              preload: Sequence[str] = ()) -> List[Any]:
    """Run ``fn(*args)`` on ``world`` fresh ranks; return the results in rank order.

    ``init(rank, world, host, port)`` starts each rank's default group over the store this
    process hosts (``gloo_init`` unless given; a module-level function or a ``partial`` of
    one). ``preload``: modules a fork server imports once, the ranks then forked from it
    share their pages (32 ranks that each import megatron-core fit in memory); without it
    every rank is spawned afresh.
    """
    if preload:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(preload))
    else:
        ctx = mp.get_context("spawn")
    results = ctx.Queue()
    rdzv = testing.Rendezvous()  # a store on a port no other process can take
    procs = [ctx.Process(target=_rank_main, args=(r, world, rdzv.host, rdzv.port, fn, args, results, init),
                         daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    got: Dict[int, Any] = {}
    try:
        deadline = time.monotonic() + timeout
        while len(got) < world:
            rank, ok, value = results.get(timeout=max(1.0, deadline - time.monotonic()))
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            got[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        rdzv.close()
    return [got[r] for r in range(world)]


def pool_run(world: int, fn: Callable, *args, timeout: float, backend: str = "gloo") -> List[Any]:
    """``fn(*args)`` on a fresh ``DistPool`` of ``world`` ranks whose default group is on
    ``backend`` (``"standin"``: the device-backend stand-in); the results in rank order."""
    from twinkle_metrics.testing.pool import DistPool

    pool = DistPool(world, timeout_s=120)
    try:
        return pool.run(fn, *args, timeout=timeout, backend=backend)
    finally:
        pool.close()


def slowest(everyone: Sequence[Dict[str, List[float]]], keys: Sequence[str], iters: int) -> Dict[str, List[float]]:
    """Per key, each iteration's time on the slowest rank (``everyone``: each rank's times by key)."""
    return {k: [max(r[k][i] for r in everyone) for i in range(iters)] for k in keys}


@contextlib.contextmanager
def timer(out: List[float]):
    t0 = time.perf_counter()
    yield
    out.append(time.perf_counter() - t0)


def moe_layer_call():
    """(make, step) of one MoE layer's router outputs (2048 tokens, 16 experts, aux and z
    losses), as ``register_router_hooks`` feeds them: one layer's call."""
    import torch

    from twinkle_metrics import MoERoutingMetric
    g = torch.Generator().manual_seed(0)
    routing = torch.rand(2048, 16, generator=g) < 0.125
    logits = torch.randn(2048, 16, generator=g)
    aux, z = torch.tensor(0.01), torch.tensor(0.001)
    return (lambda: MoERoutingMetric(num_layers=4, num_experts=16),
            lambda m: m.observe(1, routing_map=routing, router_logits=logits, aux_loss=aux, z_loss=z))
