"""The rendezvous of the ranks tests start: ``twinkle_metrics.testing.rendezvous`` and
``DistPool``'s world per job.

A ``Rendezvous`` holds its port for as long as it lives (no other process can bind it), and
ranks that call a plain ``init_process_group("gloo")`` join it as clients, rank 0 included:
were torch to stop reading the variable that says so, rank 0 would try to host a store on
the held port and fail, and so would this test.
"""
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from twinkle_metrics.testing.rendezvous import Rendezvous

pytestmark = pytest.mark.xdist_group("dist")
ROOT = os.path.abspath(os.path.join(__file__, "../../.."))

_RANK = r"""
from datetime import timedelta
import torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=timedelta(seconds=120))
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print("sum", int(t.item()), flush=True)
dist.destroy_process_group()
"""


def test_the_port_is_held_while_the_rendezvous_lives():
    with Rendezvous() as a, Rendezvous() as b:
        assert a.port != b.port and a.port > 0
        with socket.socket() as s, pytest.raises(OSError):
            s.bind((a.host, a.port))


def test_env_ranks_join_the_store_as_clients(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    with Rendezvous() as rdzv:
        procs = [subprocess.Popen([sys.executable, str(script)], cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True,
                                  env=dict(os.environ, **rdzv.env(), RANK=str(r), WORLD_SIZE="2",
                                           OMP_NUM_THREADS="1"))
                 for r in range(2)]
        try:
            outs = [p.communicate(timeout=300)[0] for p in procs]
        finally:
            for p in procs:
                p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0 and "sum 3" in out, out


def case_group_named_by_its_ranks():
    """A group torch names by its ranks and the number of groups held (the same name in
    every job); rank 1 comes late, so rank 0 reads the store first."""
    if dist.get_rank() == 1:
        time.sleep(2)
    if dist.get_rank() > 1:
        return None
    group = dist.new_group([0, 1], use_local_synchronization=True)
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    return float(t)


def test_a_later_job_does_not_read_an_earlier_jobs_addresses(dist_pool):
    """On one store for every job, the second job's rank 0 read the address rank 1's group
    had in the first job and connected to a port nobody (or another process) listened on."""
    for _ in range(2):
        assert dist_pool.run(case_group_named_by_its_ranks)[:2] == [2.0, 2.0]
