"""A 4-rank script that returns without ``destroy_process_group()`` (as many training
scripts do): sliced Accuracy, CompletionReward with quantiles and GRPO in one collection,
three intervals, synchronous or (``EXIT_CASE_ASYNC=1``) asynchronous calculate;
``EXIT_CASE_DESTROY=1``: the script calls ``destroy_process_group()`` before waiting.

Run by ``tests/test_clean_exit_e2e.py`` as 4 processes with ``env://`` rendezvous; each
rank writes its results to ``$EXIT_CASE_OUT.<rank>`` and its last line is ``done``.
"""
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel import DeviceMesh  # noqa: E402
from twinkle_metrics import Accuracy, CompletionRewardMetric, GRPOMetric, MetricCollection  # noqa: E402


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    coll = MetricCollection({"acc": Accuracy(slice_by="source"),
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
    if os.environ.get("EXIT_CASE_DESTROY") == "1":  # with the handles still pending
        dist.destroy_process_group()
    results += [h.wait() for h in handles]
    with open(f"{os.environ['EXIT_CASE_OUT']}.{rank}", "w") as f:
        f.write(json.dumps([sorted(r) for r in results]) + "\ndone\n")


if __name__ == "__main__":
    main()
