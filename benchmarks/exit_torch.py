"""The plain-torch side of ``benchmarks/bench_exit.py``: a 4-rank gloo script with the shape
of collectives of ``tests/exit_case.py`` (three ``new_group``, all_reduce, all_gather,
all_gather_object, three intervals), ending with ``destroy_process_group()``. It imports
nothing of the library.

Run by ``bench_exit`` with ``RANK``/``WORLD_SIZE`` and a rendezvous in the environment;
each rank writes its results to ``$EXIT_CASE_OUT.<rank>``, last line ``done``, as
``tests/exit_case.py`` does.
"""
import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    everyone = list(range(world))
    groups = [dist.new_group(everyone, timeout=timedelta(seconds=60)) for _ in range(3)]
    g = torch.Generator().manual_seed(rank)
    results = []
    for _ in range(3):
        states = torch.randn(64, generator=g, dtype=torch.float64)
        dist.all_reduce(states, group=groups[0])
        rows = torch.empty(world * 64, dtype=torch.float64)
        dist.all_gather_into_tensor(rows, states, group=groups[1])
        keys = [None] * world
        dist.all_gather_object(keys, sorted(str(k) for k in range(8)), group=groups[2])
        results.append(float(rows.sum()))
    with open(f"{os.environ['EXIT_CASE_OUT']}.{rank}", "w") as f:
        f.write(json.dumps(results) + "\ndone\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
