"""Exit beside plain torch: how often a 4-rank script dies at exit, after its results, under load.

    .venv/bin/python -m benchmarks.bench_exit [--runs 24] [--busy 3] [--world 4]

Each of ``--runs`` pairs runs, interleaved in this one command (the order within a pair
alternates), two 4-rank gloo scripts that end with their own ``destroy_process_group()``:

* library: ``tests/exit_case.py`` (a MetricCollection of sliced Accuracy,
  CompletionRewardMetric with quantiles and GRPOMetric on ``DeviceMesh.from_sizes``,
  three synchronous intervals of accumulate + calculate), its collection held until the
  interpreter exits (``EXIT_CASE_KEEP=1``, as a script or a trainer holds its metrics;
  ``--no-keep`` lets it go when ``main()`` returns);
* torch: ``benchmarks/exit_torch.py``, the same shape of collectives in plain torch
  (three ``new_group``, all_reduce, all_gather, all_gather_object per interval).

``--busy`` python processes spin on the cores meanwhile (the rate of aborts at exit grows
with load). Each job gets its own store (``twinkle_metrics.testing.Rendezvous``: no
free-port race). A run *died at exit* when every rank wrote its results and some rank then
exited nonzero (SIGABRT: -6) or printed ``terminate called without an active exception``;
a run that failed before its results is counted apart. This is a measurement, not a test:
it prints the counts and writes ``benchmarks/results/exit.json``.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

from benchmarks import common
from twinkle_metrics.testing import Rendezvous

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = {"library": os.path.join(common.ROOT, "tests", "exit_case.py"),
           "torch": os.path.join(HERE, "exit_torch.py")}
TERMINATE = "terminate called without an active exception"


def run_job(side: str, world: int, out: str, keep: bool = True, timeout: float = 300) -> dict:
    """One job of ``side`` on ``world`` ranks: each rank's exit code, whether it wrote its
    results, and whether it printed ``TERMINATE``."""
    with Rendezvous() as rdzv:
        procs = []
        for rank in range(world):
            env = dict(os.environ, **rdzv.env(), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                       OMP_NUM_THREADS="1", EXIT_CASE_OUT=out, EXIT_CASE_ASYNC="0", EXIT_CASE_DESTROY="end",
                       EXIT_CASE_KEEP="1" if keep else "0")
            env.pop("EXIT_CASE_STORE_PORT", None)
            procs.append(subprocess.Popen([sys.executable, SCRIPTS[side]], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        codes, logs = [], []
        for p in procs:
            try:
                text, _ = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                text, _ = p.communicate()
            codes.append(p.returncode)
            logs.append(text)
    wrote = []
    for rank in range(world):
        try:
            with open(f"{out}.{rank}") as f:
                wrote.append(f.read().splitlines()[-1:] == ["done"])
        except OSError:
            wrote.append(False)
    return {"codes": codes, "wrote": wrote, "terminate": [TERMINATE in log for log in logs],
            "log": next((log[-1500:] for log, c in zip(logs, codes) if c != 0), "")}


def verdict(job: dict) -> str:
    """``ok``, ``died_at_exit`` (results written, then a nonzero exit or terminate),
    ``timed_out`` (results written, but a rank still running when the job's time ran out:
    this harness killed it, -9), or ``failed`` (some rank never wrote its results)."""
    if not all(job["wrote"]):
        return "failed"
    if any(c == -9 for c in job["codes"]) and not any(job["terminate"]):
        return "timed_out"
    if any(c != 0 for c in job["codes"]) or any(job["terminate"]):
        return "died_at_exit"
    return "ok"


def busy_loops(n: int) -> list:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=24, help="pairs (library, torch)")
    p.add_argument("--busy", type=int, default=3, help="busy loops on the cores meanwhile")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--no-keep", action="store_true", help="the library's script drops its collection "
                   "when main() returns")
    p.add_argument("--job-timeout", type=float, default=300, help="seconds a job may run before its "
                   "ranks are killed (counted as timed out)")
    p.add_argument("--out", default="exit")
    args = p.parse_args(argv)
    counts = {side: {"ok": 0, "died_at_exit": 0, "timed_out": 0, "failed": 0} for side in SCRIPTS}
    deaths = {side: [] for side in SCRIPTS}
    loops = busy_loops(args.busy)
    t0 = time.time()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for run in range(args.runs):
                order = list(SCRIPTS) if run % 2 == 0 else list(SCRIPTS)[::-1]
                for side in order:
                    job = run_job(side, args.world, os.path.join(tmp, f"{side}{run}"), keep=not args.no_keep,
                                  timeout=args.job_timeout)
                    v = verdict(job)
                    counts[side][v] += 1
                    if v != "ok":
                        deaths[side].append({"run": run, "verdict": v, "codes": job["codes"],
                                             "terminate": job["terminate"], "log": job["log"]})
                line = "  ".join(f"{s} {c['died_at_exit']} died / {c['timed_out']} timed out / {c['failed']} failed"
                                 for s, c in counts.items())
                print(f"run {run + 1}/{args.runs}: {line}", flush=True)
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    for side, c in counts.items():
        print(f"{side}: {c['died_at_exit']} of {args.runs} runs died at exit after their results "
              f"({c['timed_out']} ran past the job's {args.job_timeout:g} s, {c['failed']} failed before them)")
    command = "python -m benchmarks.bench_exit " + " ".join(argv if argv is not None else sys.argv[1:])
    path = common.save(args.out, {"runs": args.runs, "busy_loops": args.busy, "world": args.world,
                                  "library_keeps_collection": not args.no_keep,
                                  "counts": counts, "deaths": deaths, "wall_s": round(time.time() - t0, 1)},
                       command.strip())
    print("wrote", path)


if __name__ == "__main__":
    main()
