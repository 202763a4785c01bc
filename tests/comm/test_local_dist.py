"""Local means local (real gloo ranks): a metric over a group of this rank alone, or over
a group of some ranks, never enters a collective over the other ranks of the world.

Rank 0 alone (or ranks 0 and 1) builds, feeds and calculates while every other rank
waits in the store for it to finish: a metric that reached WORLD would wait for them,
and raise at the groups' own timeout instead of returning.
"""
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from parallel import DeviceMesh
from parallel import groups as G
from tests.rlref import make_rl_batch
from twinkle_metrics import CompletionRewardMetric, GRPOMetric, LossMetric, MetricCollection
from twinkle_metrics.metrics.rl.pass_at_k import PassAtKMetric
from twinkle_metrics.testing import CollectiveCounter, assert_results_close

pytestmark = pytest.mark.xdist_group("dist")

#: the other ranks wait this long in the store (far past the pool's 60 s group timeout)
WAIT_S = 600
N_SEQ = 8


def _metrics(mesh, group):
    """The four metrics of the report, over ``group`` (``process_group=``) or ``mesh``."""
    return {
        "loss": LossMetric(mesh, group, loss_reduction="sum"),
        "grpo": GRPOMetric(mesh, group),
        "reward": CompletionRewardMetric(mesh, group, reward_names=["acc"]),
        "pass": PassAtKMetric(mesh, group, k=(1, 2), num_bootstrap=20),
    }


def _feed(metrics, rows):
    """Feed ``metrics`` the sequences ``rows`` of one fixed batch."""
    b = make_rl_batch(5, N_SEQ)
    rows = list(rows)
    idx = torch.tensor(rows)
    lab = b["labels"][idx]
    metrics["loss"].accumulate(None, [{"lm loss": torch.stack(
        [(b["logps"][idx] * (lab != -100)).sum().neg(), (lab != -100).sum().double()])}])
    metrics["grpo"].accumulate({"labels": lab}, {"logps": b["logps"][idx]}, old_logps=b["old"][idx],
                               advantages=b["adv"][idx])
    metrics["reward"].accumulate(rewards={"acc": [float(r % 3 == 0) for r in rows]},
                                 completion_lengths=[r + 1 for r in rows])
    metrics["pass"].accumulate(None, None, prompt_ids=[r // 2 for r in rows], correct=[r % 3 != 1 for r in rows])


def _calculate(metrics):
    return {name: m.calculate() for name, m in metrics.items()}


def _whole():
    metrics = _metrics(DeviceMesh.single(), None)
    _feed(metrics, range(N_SEQ))
    return _calculate(metrics)


def _while_others_wait(ranks, fn):
    """``fn()`` on ``ranks`` while every other rank waits in the store until they are done."""
    store = G.group_store(dist.group.WORLD)
    me = dist.get_rank()
    if me not in ranks:
        store.wait(["local: done"], timedelta(seconds=WAIT_S))
        return None
    try:
        return fn()
    finally:
        if store.add("local: finished", 1) == len(ranks):
            store.set("local: done", "1")


def case_one_rank_group():
    """Rank 0 alone: a group of itself, built on rank 0 only."""
    def run():
        group = dist.new_group([0], use_local_synchronization=True)
        with CollectiveCounter() as counter:
            metrics = _metrics(None, group)
            _feed(metrics, range(N_SEQ))
            got = _calculate(metrics)
            single = PassAtKMetric(DeviceMesh.single(), k=(1, 2), num_bootstrap=20)
            _feed({**metrics, "pass": single}, range(N_SEQ))
            got["single"] = single.calculate()
            # the same metrics in a collection, and calculated in the background
            coll = MetricCollection(_metrics(None, group))
            _feed({name: coll[name] for name in ("loss", "grpo", "reward", "pass")}, range(N_SEQ))
            got["async"] = coll.calculate(async_op=True).wait()
        return got, counter.total, _whole()
    return _while_others_wait({0}, run)


def test_a_one_rank_group_runs_no_collective_while_the_others_wait(dist_pool):
    out = dist_pool.run(case_one_rank_group)
    assert out[1:] == [None] * (len(out) - 1)
    got, collectives, whole = out[0]
    assert collectives == 0
    for name in ("loss", "grpo", "reward", "pass"):
        assert got[name], name
        assert_results_close(got[name], whole[name])
    assert_results_close(got["single"], whole["pass"])
    coll_want = {f"{name}/{k}": v for name in ("loss", "grpo", "reward", "pass") for k, v in whole[name].items()}
    assert_results_close(got["async"], coll_want)


def case_two_rank_group():
    """Ranks 0 and 1: a group of the two, each holding half of the batch."""
    def run():
        group = dist.new_group([0, 1], use_local_synchronization=True)
        metrics = _metrics(None, group)
        _feed(metrics, range(dist.get_rank(), N_SEQ, 2))
        return _calculate(metrics)
    return _while_others_wait({0, 1}, run)


def test_a_group_of_some_ranks_reduces_over_them_alone(dist_pool):
    out = dist_pool.run(case_two_rank_group)
    assert out[2:] == [None] * (len(out) - 2)
    whole = _whole()
    for got in out[:2]:
        for name in whole:
            assert_results_close(got[name], whole[name])


def case_mesh_of_the_group():
    """What ``DeviceMesh.current(group)`` gives, on the ranks of ``group`` alone."""
    def run():
        group = dist.new_group([0], use_local_synchronization=True)
        with CollectiveCounter() as counter:
            mesh = DeviceMesh.current(group)
            place = (mesh.data_size, mesh.dp_size, mesh.tp_size, mesh.pp_size, mesh.data_group, mesh.source)
        return place, counter.total
    return _while_others_wait({0}, run)


def test_the_mesh_of_a_one_rank_group_holds_no_group(dist_pool):
    out = dist_pool.run(case_mesh_of_the_group)
    assert out[0] == ((1, 1, 1, 1, None, "process_group"), 0)
