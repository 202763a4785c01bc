"""A 4-rank script that ends as torch asks scripts to end, with ``destroy_process_group()``:
sliced Accuracy, CompletionReward with quantiles and GRPO in one collection, three
intervals, synchronous or (``EXIT_CASE_ASYNC=1``) asynchronous calculate.

``EXIT_CASE_DESTROY``: ``end`` (default) destroys the default group after the results;
``pending`` destroys it with the asynchronous handles still pending, then waits on them:
each gives its results (its sync finished first) or raises (``MetricSyncError``, or the
mesh's check that its groups are gone); ``atexit`` leaves it to an ``atexit`` handler the script registers before
it imports the library, which first runs a collective of its own (a checkpoint barrier)
and writes ``$EXIT_CASE_OUT.<rank>.atexit``.

``EXIT_CASE_KEEP=1``: the collection stays referenced until the interpreter exits (a
module-level object, as a script or a trainer holds its metrics), so whatever it holds
outlives ``destroy_process_group()`` unless the library lets it go there.

Run by ``tests/e2e/test_clean_exit_e2e.py`` and ``benchmarks/bench_exit.py`` as 4 processes; each rank
writes its results to ``$EXIT_CASE_OUT.<rank>`` and its last line is ``done``.
"""
import atexit
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

HOW = os.environ.get("EXIT_CASE_DESTROY", "end")
KEPT = None  # the collection, with EXIT_CASE_KEEP=1
OUT = os.environ["EXIT_CASE_OUT"]


def _user_exit_handler():
    """The script's own: a last collective on the default group, then destroy it."""
    dist.barrier()
    with open(f"{OUT}.{dist.get_rank()}.atexit", "w") as f:
        f.write("barrier\n")
    dist.destroy_process_group()


if HOW == "atexit":
    atexit.register(_user_exit_handler)  # before the library is imported

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel import DeviceMesh  # noqa: E402
from twinkle_metrics import Accuracy, CompletionRewardMetric, GRPOMetric, MetricCollection  # noqa: E402


def main():
    if "EXIT_CASE_STORE_PORT" in os.environ:  # the test keeps the store's listening socket
        store = dist.TCPStore("127.0.0.1", int(os.environ["EXIT_CASE_STORE_PORT"]), is_master=False,
                              timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timedelta(seconds=60))
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    global KEPT
    rank = dist.get_rank()
    KEPT = coll = MetricCollection({"acc": Accuracy(slice_by="source"),
                             "rew": CompletionRewardMetric(quantiles=(0.5, 0.9)),
                             "grpo": GRPOMetric()}, device_mesh=DeviceMesh.from_sizes(dp_size=dist.get_world_size()))
    asynchronous = os.environ.get("EXIT_CASE_ASYNC") == "1"
    g = torch.Generator().manual_seed(rank)
    results, handles = [], []
    for _ in range(3):
        for _ in range(2):
            lp = -torch.rand(4, 16, generator=g)
            coll.accumulate({"labels": torch.randint(0, 50, (4, 16), generator=g), "source": ["a", "b", "a", "b"]},
                            {"logits": torch.randn(4, 16, 50, generator=g), "logps": lp},
                            rewards=[0.1, 0.5, 0.9, 0.3], completion_lengths=[3, 4, 5, 6], old_logps=lp + 0.01,
                            advantages=torch.randn(4, generator=g))
        if asynchronous:
            handles.append(coll.calculate(async_op=True))
        else:
            results.append(coll.calculate())
    if HOW == "pending":
        dist.destroy_process_group()
    for h in handles:
        try:
            results.append(h.wait())
        except RuntimeError:  # the groups went (here, or a peer's first): MetricSyncError, check_live
            if HOW != "pending":
                raise
    keys = [sorted(r) for r in results] if HOW != "pending" else "destroyed"
    with open(f"{OUT}.{rank}", "w") as f:
        f.write(json.dumps(keys) + "\ndone\n")
    if HOW == "end":
        dist.destroy_process_group()
    if os.environ.get("EXIT_CASE_KEEP") != "1":
        KEPT = None


if __name__ == "__main__":
    main()
