"""``StepGuard`` on 8 real ranks, TP2 x PP2 x DP2 with megatron-core's groups, on gloo and on
the device-backend stand-in (``testing.standin``: the library sees device groups, and a
bounded wait, abort, barrier or destroy on one of them fails the job).

Every rank must return the same verdict at the same step, naming the rank that saw a NaN
(its host and device); the first of two is named; a spike in every rank's loss is found and
a fixed-seed run of 240 steps has no other verdict; a healthy step is one collective."""
import math
import random
import socket

import pytest
import torch
import torch.distributed as dist

from parallel import DeviceMesh
from tests.dist import megatron_tp2_pp2, sync_error
from twinkle_metrics import LossMetric, MetricCollection, StepGuard
from twinkle_metrics.testing import CollectiveCounter

pytestmark = [pytest.mark.xdist_group("dist"), pytest.mark.megatron]

BACKENDS = ["gloo", "standin"]
TOKENS = 40.0
NAN = float("nan")


def _loss(step, dp_rank, spike_at=None):
    """A decaying, noisy per-token loss of one data shard at ``step`` (fixed seed)."""
    rng = random.Random(1000 * step + dp_rank)
    loss = 3.0 * math.exp(-step / 150) + 0.5 + rng.gauss(0, 0.03)
    return loss * (3.0 if step == spike_at else 1.0)


def _step(mesh, step, nan=None, spike_at=None):
    """This rank's check() arguments: Megatron's reports on the last stage ([] elsewhere), a
    grad norm, per-token values; a NaN where ``nan`` ({step: {rank: input}}) says."""
    rank = dist.get_rank()
    bad = (nan or {}).get(step, {}).get(rank)
    pair = torch.tensor([_loss(step, mesh.dp_rank, spike_at) * TOKENS, TOKENS], dtype=torch.float64)
    if bad == "loss":
        pair[0] = NAN
    reports = [{"lm loss": pair / 2}, {"lm loss": pair / 2}] if mesh.is_last_stage else []
    values = torch.ones(4, 8)
    if bad == "values":
        values[2, 3] = NAN
    return dict(loss=reports, grad_norm=math.inf if bad == "grad_norm" else 1.0, values=values, step=step)


def case_verdicts(nan, steps, spike_at=None, warmup=20):
    """Every verdict of a run on megatron-core's TP2 x PP2 x DP2, the interval's results, the
    collectives of a healthy step and of a bad one, and this host."""
    with megatron_tp2_pp2() as mesh:
        guard = StepGuard(mesh, warmup=warmup)
        metrics = MetricCollection([LossMetric(mesh, loss_reduction="sum"), guard], device_mesh=mesh)
        verdicts, counted = [], {}
        for step in range(steps):
            kwargs = _step(mesh, step, nan, spike_at)
            with CollectiveCounter() as counter:
                verdict = guard.check(**kwargs)
            counted.setdefault(verdict.ok, counter.total)
            verdicts.append(verdict)
            if verdict.ok:
                metrics.accumulate(None, kwargs["loss"])
        return verdicts, metrics.calculate(), counted, socket.gethostname()


def _same_everywhere(out):
    verdicts = [o[0] for o in out]
    for rank, mine in enumerate(verdicts):  # as text: a NaN loss is not equal to itself
        assert repr(mine) == repr(verdicts[0]), f"rank {rank} got other verdicts"
    results = [o[1] for o in out]
    assert all(r == results[0] for r in results)
    return verdicts[0], results[0], out[0][2], out[0][3]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nan_on_one_rank_is_the_same_verdict_on_every_rank_naming_it(dist_pool, backend):
    nan = {6: {3: "values"}, 9: {6: "loss"}, 10: {1: "grad_norm"}, 14: {5: "loss", 2: "values"}}
    out = dist_pool.run(case_verdicts, nan, 16, backend=backend)
    verdicts, results, counted, host = _same_everywhere(out)
    assert [(v.step, v.action) for v in verdicts if not v.ok] == [(6, "skip"), (9, "skip"), (10, "skip"),
                                                                  (14, "skip")]
    named = {v.step: (v.bad.rank, v.bad.fields, v.bad.host, v.bad.device) for v in verdicts if v.bad}
    assert named == {6: (3, ("values",), host, "cpu"), 9: (6, ("loss",), host, "cpu"),
                     10: (1, ("grad_norm",), host, "cpu"), 14: (2, ("values",), host, "cpu")}
    assert verdicts[14].bad_ranks == 2 and verdicts[14].nonfinite["loss"] == 1
    assert verdicts[9].bad.local_rank == 6  # the pool's LOCAL_RANK
    # NaNs at two steps in a row: the run's first is named at the second, and by the interval
    assert verdicts[10].first.rank == 6 and verdicts[10].first.step == 9 and verdicts[10].streak == 2
    assert (results["guard/first_bad_rank"], results["guard/first_bad_step"]) == (3, 6)
    assert (results["guard/skipped"], results["guard/nonfinite_steps"], results["guard/steps"]) == (4, 4, 16)
    assert counted == {True: 1, False: 2}  # a healthy step: one collective; a bad one: one more


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_spike_in_every_ranks_loss_is_found_and_a_long_run_has_no_other_verdict(dist_pool, backend):
    out = dist_pool.run(case_verdicts, None, 240, 200, backend=backend)
    verdicts, results, _, _ = _same_everywhere(out)
    assert [(v.step, v.action, v.reason) for v in verdicts if not v.ok] == [(200, "skip", "spike")]
    spike = verdicts[200]
    assert spike.ratio > 2 and spike.z > 6 and spike.baseline_steps == 200
    want = sum(_loss(200, d, 200) * TOKENS for d in range(2)) / (2 * TOKENS)
    assert spike.loss == pytest.approx(want, rel=1e-12)  # token-weighted over the data shards, once each
    assert results["guard/spikes"] == 1 and results["guard/nonfinite_steps"] == 0


def case_disagree(kind):
    with megatron_tp2_pp2() as mesh:
        rank = dist.get_rank()
        guard = StepGuard(mesh, warmup=6 if kind == "policy" and rank == 5 else 5)
        step = 4 if kind == "step" and rank == 2 else 3
        loss = torch.zeros(3) if kind == "input" and rank == 4 else None
        try:
            guard.check(loss=loss, step=step)
        except Exception as e:  # noqa: BLE001 - the error each rank raises
            return type(e).__name__, str(e), guard.state_dict()["steps"].item()
        return None


@pytest.mark.parametrize("kind", ["policy", "step", "input"])
def test_ranks_that_disagree_or_reject_their_input_raise_on_every_rank(dist_pool, kind):
    out = dist_pool.run(case_disagree, kind, backend="standin")
    odd = {"policy": 5, "step": 2, "input": 4}[kind]
    for rank, (name, text, folded) in enumerate(out):
        assert folded == 0, rank  # nothing folded anywhere
        if kind == "input":
            if rank == odd:
                assert name == "ValueError" and "loss is a torch.float32 tensor" in text
            else:
                assert name == "MetricSyncError" and f"rank {odd} rejected its input" in text, text
            continue
        assert name == "MetricSyncError" and "do not agree on the guard or the step" in text, text
        others = "0-4, 6-7" if kind == "policy" else "0-1, 3-7"
        assert f"rank {odd} holds" in text and f"ranks {others} hold" in text, text
        assert ("warmup=6" in text) if kind == "policy" else ("at step 4" in text), text


def case_halves():
    """Two meshes over halves of the world (pure DP of 4), the same checks on each."""
    rank = dist.get_rank()
    halves = [dist.new_group([0, 1, 2, 3]), dist.new_group([4, 5, 6, 7])]
    mesh = DeviceMesh({"dp": halves[rank // 4]})
    guard = StepGuard(mesh)
    out = []
    for step in range(3):
        bad = step == 1 and rank in (2, 6)
        pair = torch.tensor([NAN if bad else 1.0, 1.0])
        out.append(guard.check(loss=pair, grad_norm=NAN if step == 2 and rank == 7 else 1.0))
    return out


def test_meshes_over_part_of_the_world_judge_their_own_ranks(dist_pool):
    out = dist_pool.run(case_halves, backend="standin")
    for rank, verdicts in enumerate(out):
        assert repr(verdicts) == repr(out[rank // 4 * 4])
        assert [(v.action, v.bad and v.bad.rank) for v in verdicts] == (
            [("ok", None), ("skip", 2), ("ok", None)] if rank < 4 else [("ok", None), ("skip", 6), ("skip", 7)])


def case_only_some_check():
    with megatron_tp2_pp2():
        guard = StepGuard(DeviceMesh.from_megatron(timeout=3))
        if dist.get_rank() >= 4:
            return sync_error(lambda: guard.check(loss=None))
        return None


def test_a_rank_that_never_checks_is_named_by_the_ranks_that_did(dist_pool):
    out = dist_pool.run(case_only_some_check, backend="standin", timeout=120)
    for rank, text in enumerate(out):
        if rank < 4:
            assert text is None
        else:
            assert "StepGuard.check()" in text and "ranks 0-3" in text and "did not arrive" in text, text
