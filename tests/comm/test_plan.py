"""The sync's buffer holds states kind by kind (``comm/plan.py``): a collection whose
self-merged states mix float64 and int64 (GRPO's top-k records, Chan moments, PassAtK's
int64 tables) returns what each metric returns alone."""
import torch

from parallel import DeviceMesh
from tests.rlref import make_rl_batch
from twinkle_metrics import CompletionRewardMetric, GRPOMetric, LossMetric, MetricCollection
from twinkle_metrics.comm.codec import Codec
from twinkle_metrics.core.state import interval_of
from twinkle_metrics.metrics.rl.pass_at_k import PassAtKMetric
from twinkle_metrics.testing import assert_results_close

N_SEQ = 8


def _metrics():
    mesh = DeviceMesh.single()
    return {"loss": LossMetric(mesh, loss_reduction="sum"), "grpo": GRPOMetric(mesh),
            "reward": CompletionRewardMetric(mesh, reward_names=["acc"]),
            "pass": PassAtKMetric(mesh, k=(1, 2), num_bootstrap=20)}


def _feed(metrics):
    b = make_rl_batch(5, N_SEQ)
    lab = b["labels"]
    metrics["loss"].accumulate(None, [{"lm loss": torch.stack([(b["logps"] * (lab != -100)).sum().neg(),
                                                                (lab != -100).sum().double()])}])
    metrics["grpo"].accumulate({"labels": lab}, {"logps": b["logps"]}, old_logps=b["old"], advantages=b["adv"])
    metrics["reward"].accumulate(rewards={"acc": [float(r % 3 == 0) for r in range(N_SEQ)]},
                                 completion_lengths=[r + 1 for r in range(N_SEQ)])
    metrics["pass"].accumulate(None, None, prompt_ids=[r // 2 for r in range(N_SEQ)],
                               correct=[r % 3 != 1 for r in range(N_SEQ)])


def _alone():
    metrics = _metrics()
    _feed(metrics)
    return {f"{name}/{k}": v for name, m in metrics.items() for k, v in m.calculate().items()}


def test_a_collection_mixing_int_and_float_self_merged_states_equals_its_members_alone():
    want = _alone()
    for async_op in (False, True):
        metrics = _metrics()
        coll = MetricCollection(metrics)
        _feed(metrics)
        got = coll.calculate(async_op=True).wait() if async_op else coll.calculate()
        assert_results_close(got, want)
        assert type(got["pass/num_samples"]) is int and got["pass/num_samples"] == N_SEQ


def test_the_self_merged_kind_of_that_collection_holds_both_dtypes():
    # the case above reaches the mixed kind: the test fails if the plan stops building one
    metrics = _metrics()
    _feed(metrics)
    codec = Codec([interval_of(m) for m in metrics.values()])
    assert {dtype for _, dtype in codec.self_merged} == {torch.float64, torch.int64}


def test_states_on_several_devices_pack_state_by_state_into_the_same_buffer():
    # metrics on different devices pack one piece per state, each on its own device; the
    # buffer is the one the runs of scalars make (the CPU stands in for the other device)
    metrics = _metrics()
    _feed(metrics)
    intervals = [interval_of(m) for m in metrics.values()]
    codec = Codec(intervals)
    runs = codec.pieces()
    intervals[0].device = torch.device("meta")  # its tensors stay where they are
    try:
        pieces = codec.pieces()
    finally:
        intervals[0].device = torch.device("cpu")
    assert len(pieces) == len(codec.order) > len(runs)
    assert torch.equal(torch.cat(pieces).view(torch.int64), torch.cat(runs).view(torch.int64))
    assert torch.cat(runs).numel() == codec.length
