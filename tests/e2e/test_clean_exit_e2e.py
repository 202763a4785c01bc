"""A script that used the library and ends with ``destroy_process_group()`` exits 0 on
every rank, with asynchronous handles pending too, and the script's own exit handlers
run their collectives (end-to-end tier: real interpreters exiting, many times).

The library adds nothing to the exit: no handler, no wrapper around torch's functions;
its groups are torch's (``new_group``), so ``destroy_process_group()`` ends them with the
user's. ``TWINKLE_METRICS_EXIT_RUNS`` sets the runs per mode (default 2; the issue's
check is 8 runs beside two busy loops).
"""
import os
import subprocess
import sys

import pytest
from torch.distributed import TCPStore

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("dist")]

HERE = os.path.dirname(os.path.abspath(__file__))
RUNS = int(os.environ.get("TWINKLE_METRICS_EXIT_RUNS", "2"))
WORLD = 4


def _launch(tmp_path, asynchronous: bool, run: int, how: str):
    # the store is this process's: its port is taken while the ranks run (no free-port race)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    out = tmp_path / f"{how}{int(asynchronous)}run{run}"
    procs = []
    for rank in range(WORLD):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                   EXIT_CASE_STORE_PORT=str(store.port), OMP_NUM_THREADS="1",
                   EXIT_CASE_OUT=str(out), EXIT_CASE_ASYNC="1" if asynchronous else "0",
                   EXIT_CASE_DESTROY=how)
        procs.append(subprocess.Popen([sys.executable, os.path.join(os.path.dirname(HERE), "exit_case.py")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    codes, logs = [], []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
        codes.append(p.returncode)
        logs.append(text)
    return codes, logs, [out.with_name(f"{out.name}.{r}") for r in range(WORLD)]


@pytest.mark.parametrize("asynchronous,how", [(False, "end"), (True, "end"), (True, "pending"), (False, "atexit")],
                         ids=["sync", "async", "async-destroy-pending", "user-atexit"])
def test_scripts_ending_with_destroy_process_group_exit_zero(tmp_path, asynchronous, how):
    for run in range(RUNS if how in ("end",) else 1):
        codes, logs, files = _launch(tmp_path, asynchronous, run, how)
        for rank, (code, log, path) in enumerate(zip(codes, logs, files)):
            assert code == 0, f"run {run} rank {rank} exited {code}:\n{log[-2000:]}"
            lines = path.read_text().splitlines()
            assert lines[-1] == "done" and len(lines) == 2, (run, rank, lines)
            if how == "atexit":  # the script's handler ran its barrier: the library left the group alone
                assert path.with_name(path.name + ".atexit").read_text() == "barrier\n", (run, rank)
        results = [f.read_text().splitlines()[0] for f in files]
        assert len(set(results)) == 1, "ranks reported different keys"
