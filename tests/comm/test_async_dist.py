"""Asynchronous calculate() on 8 real gloo ranks: equal to the synchronous one, exactly;
errors from wait() on every rank; processes exit with syncs still pending."""
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from parallel import DeviceMesh
from tests.dist import sync_error
from tests.metrics.rl.test_metrics_rl_dist import N_SEQ, SEED, SEQ_LEN, _accumulate, _metrics
from tests.refmetric import cp_slice, dp_shards
from tests.rlref import make_rl_batch
from twinkle_metrics import LossMetric
from twinkle_metrics.testing.rendezvous import Rendezvous

pytestmark = pytest.mark.xdist_group("dist")


def _feed(coll, mesh, b, part):
    """Interval ``part`` (0, 1, 2): a third of every rank's sequences and pairs."""
    if not mesh.is_last_stage:
        for m in coll:
            m.accumulate([], {})
        return
    rows = list(dp_shards(N_SEQ, mesh.dp_size)[mesh.dp_rank])
    pairs = list(dp_shards(N_SEQ // 2, mesh.dp_size)[mesh.dp_rank])
    rows = rows[part::3] or rows[:1]
    pairs = pairs[part::3] or pairs[:1]
    dpo_rows = [r for p in pairs for r in (2 * p, 2 * p + 1)]
    _accumulate(coll, b, rows, cp_slice(SEQ_LEN, mesh.cp_size, mesh.cp_rank), dpo_rows, 1.0 + part)


def case_async_equals_sync(sizes):
    mesh = DeviceMesh.from_sizes(**{f"{k}_size": v for k, v in sizes.items()})
    b = make_rl_batch(SEED, N_SEQ, SEQ_LEN)
    sync, asyn = _metrics(mesh), _metrics(mesh)
    expected, handles = [], []
    for part in range(3):
        _feed(sync, mesh, b, part)
        _feed(asyn, mesh, b, part)
        handles.append(asyn.calculate(async_op=True))   # two pending before the first wait
        expected.append(sync.calculate())              # the training groups, meanwhile
    got = [h.wait(timeout=120) for h in handles]
    return got, expected, asyn.calculate()


@pytest.mark.parametrize("sizes,backend", [(dict(tp=2, pp=2, dp=2), "gloo"), (dict(tp=2, cp=2, dp=2), "gloo"),
                                           (dict(tp=2, pp=2, dp=2), "standin")])
def test_async_equals_sync_on_every_rank(dist_pool, sizes, backend):
    out = dist_pool.run(case_async_equals_sync, sizes, backend=backend)
    for got, expected, after in out:
        assert got == expected  # exactly: same buffer, same merge, same compute
        assert after == {}
        assert len(expected[0]) > 20
    assert all(o[0] == out[0][0] for o in out)


def case_sync_error_from_wait():
    mesh = DeviceMesh.from_sizes(tp_size=2, pp_size=2, dp_size=2)
    m = LossMetric(mesh, loss_reduction="sum" if dist.get_rank() == 5 else "mean")
    m.accumulate({"labels": torch.tensor([[1, 2]])}, {"loss": torch.tensor(1.0)})
    handle = m.calculate(async_op=True)
    return sync_error(lambda: handle.wait(timeout=120))


@pytest.mark.parametrize("backend", ["gloo", "standin"])
def test_sync_error_surfaces_from_wait_on_every_rank(dist_pool, backend):
    for err in dist_pool.run(case_sync_error_from_wait, backend=backend):
        assert err is not None and "ranks hold different metrics or arguments" in err, err


def case_failed_async_sync_keeps_the_interval_and_raises_on_every_rank():
    """Ranks that disagree (rank 5's nan_policy): the logger of every rank, logging
    or not, raises the MetricSyncError at close(); the interval is folded back into the
    metric, so the same interval is reported once the metric is fixed."""
    import tempfile

    from twinkle_metrics.integrations.loggers import build_loggers

    mesh = DeviceMesh.from_sizes(tp_size=2, pp_size=2, dp_size=2)
    rank = dist.get_rank()
    m = LossMetric(mesh, nan_policy="skip" if rank == 5 else "propagate")
    with tempfile.TemporaryDirectory() as run_dir:
        logger = build_loggers(["jsonl"], run_dir, enabled=mesh.is_logging_rank)
        if mesh.is_last_stage:
            m.accumulate({"labels": torch.tensor([[1, 2]])}, {"loss": torch.tensor(1.0 + mesh.dp_rank)})
        logger.log(m.calculate(async_op=True), 1)
        err = sync_error(logger.close)
    m.nan_policy = "propagate"
    return err, m.calculate()


def test_failed_async_sync_keeps_the_interval_and_raises_on_every_rank(dist_pool):
    for err, got in dist_pool.run(case_failed_async_sync_keeps_the_interval_and_raises_on_every_rank):
        assert err is not None and "ranks hold different metrics or arguments" in err, err
        assert got == {"loss": 1.5}


_EXIT_SCRIPT = r"""
import atexit, os, sys, torch, torch.distributed as dist
from datetime import timedelta
# The script's own exit handler: it runs once the interpreter has waited for the library's
# thread (which runs only while syncs are pending, each bounded by TWINKLE_METRICS_TIMEOUT_S),
# and ends the process without torch's teardown of gloo groups left undestroyed, which aborts
# now and then on its own ("terminate called without an active exception"; seen with a bare
# init_process_group + all_reduce script and no twinkle_metrics at all).
atexit.register(lambda: (print("exit handlers done", flush=True), os._exit(0)))
# An hour: a process that waited for the group's timeout would not exit before the test gives up.
dist.init_process_group("gloo", timeout=timedelta(seconds=3600))
from twinkle_metrics import LossMetric
m = LossMetric()
m.accumulate({"labels": torch.tensor([[1]])}, {"loss": torch.tensor(1.0)})
assert m.calculate(async_op=True).wait(timeout=60) == {"loss": 1.0}
m.accumulate({"labels": torch.tensor([[1]])}, {"loss": torch.tensor(2.0)})
if dist.get_rank() == 0 or sys.argv[1] == "all":
    m.calculate(async_op=True)   # never waited on; in "rank0" rank 1 never joins its sync
print("exiting", flush=True)
"""


@pytest.mark.parametrize("who", ["all", "rank0"])
def test_processes_exit_with_pending_handles(tmp_path, who):
    script = tmp_path / "exit.py"
    script.write_text(_EXIT_SCRIPT)
    root = os.path.abspath(os.path.join(__file__, "../../.."))
    procs = []
    with Rendezvous() as rdzv:
        for rank in range(2):
            env = dict(os.environ, **rdzv.env(), RANK=str(rank), WORLD_SIZE="2", PYTHONPATH=root,
                       TWINKLE_METRICS_TIMEOUT_S="2", OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen([sys.executable, str(script), who], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        for p in procs:
            out, _ = p.communicate(timeout=300)  # exits within the 2 s bound, not the hour
            assert p.returncode == 0, out
            assert "exiting" in out and "exit handlers done" in out and "Traceback" not in out, out


NAMES_ALL = ("LossMetric", "Accuracy", "TrainMetric", "EmbeddingMetric", "CompletionRewardMetric", "DPOMetric",
             "GRPOMetric", "GSPOMetric", "CISPOMetric")


def _all_metrics(mesh):
    """Every metric of the package in one collection (what benchmarks/gpu_check.py's async
    section measures), fed one small microbatch per call."""
    from twinkle_metrics import (
        Accuracy,
        CISPOMetric,
        CompletionRewardMetric,
        DPOMetric,
        EmbeddingMetric,
        GRPOMetric,
        GSPOMetric,
        MetricCollection,
        TrainMetric,
    )

    return MetricCollection({"LossMetric": LossMetric(), "Accuracy": Accuracy(), "TrainMetric": TrainMetric(),
                             "EmbeddingMetric": EmbeddingMetric(), "CompletionRewardMetric": CompletionRewardMetric(),
                             "DPOMetric": DPOMetric(), "GRPOMetric": GRPOMetric(), "GSPOMetric": GSPOMetric(),
                             "CISPOMetric": CISPOMetric()}, device_mesh=mesh)


def _feed_all(coll, seed, n_seq=8, seq_len=32, vocab=64):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (n_seq, seq_len), generator=g)
    keep = torch.rand(n_seq, seq_len, generator=g) < 0.8
    labels = torch.where(keep, labels, torch.full_like(labels, -100))
    logps = -torch.rand(n_seq, seq_len, generator=g) * 3
    feat = {"labels": labels}
    for name, m in zip(NAMES_ALL, coll):
        if name == "LossMetric":
            m.accumulate(feat, {"loss": (logps * keep).sum(), "num_tokens": keep.sum()}, loss_reduction="sum",
                         grad_norm=1.0 + seed)
        elif name == "Accuracy":
            m.accumulate(feat, {"logits": torch.randn(n_seq, seq_len, vocab, generator=g)})
        elif name == "TrainMetric":
            m.accumulate(None, None, lr=1e-5, step=seed + 1, gradient_accumulation_steps=1)
        elif name == "EmbeddingMetric":
            m.accumulate({"labels": torch.arange(n_seq) % 2}, {"embeddings": torch.randn(n_seq, 16, generator=g),
                                                              "loss": 0.5})
        elif name == "CompletionRewardMetric":
            m.accumulate(rewards={"accuracy": torch.rand(n_seq, generator=g).tolist()},
                         completion_lengths=keep.sum(-1).tolist(), generate_time=1.5, weight_sync_time=0.3)
        elif name == "DPOMetric":
            m.accumulate(feat, {"logps": logps}, ref_outputs={"logps": logps + 0.05 * torch.randn(
                n_seq, seq_len, generator=g)})
        else:  # the GRPO family
            m.accumulate(feat, {"logps": logps, "entropies": torch.rand(n_seq, seq_len, generator=g)},
                         old_logps=logps + 0.1 * torch.randn(n_seq, seq_len, generator=g),
                         advantages=torch.randn(n_seq, generator=g))


def case_all_metrics_async_behind_queued_compute():
    """Every metric in one collection on a DP8 mesh: calculate(async_op=True) called while
    matmuls are queued, more queued behind it, equals calculate() of a twin collection fed the
    same microbatches (less TrainMetric's clock readings: two collections, two clocks)."""
    mesh = DeviceMesh.from_sizes(dp_size=8)
    rank = dist.get_rank()
    sync, asyn = _all_metrics(mesh), _all_metrics(mesh)
    a = torch.randn(64, 64)
    out = []
    for interval in range(3):
        for coll in (sync, asyn):
            _feed_all(coll, 10 * rank + interval)
        expected = sync.calculate()
        for _ in range(5 * interval):
            a @ a  # compute "queued" before the call (on CPU it has already run)
        handle = asyn.calculate(async_op=True)
        for _ in range(5):
            a @ a  # the next step's work, behind the call
        got = handle.wait(timeout=120)
        out.append(({k: v for k, v in got.items() if not k.startswith("TrainMetric/")},
                    {k: v for k, v in expected.items() if not k.startswith("TrainMetric/")}, sorted(got)))
    return out


def test_all_metrics_async_behind_queued_compute(dist_pool):
    out = dist_pool.run(case_all_metrics_async_behind_queued_compute)
    for rank_out in out:
        for got, expected, keys in rank_out:
            assert got == expected  # exactly
            assert {k.split("/")[0] for k in keys} == set(NAMES_ALL)
    assert all(o == out[0] for o in out)  # every rank reports the same
