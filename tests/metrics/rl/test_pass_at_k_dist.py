"""PassAtKMetric on real gloo ranks: samples of one prompt on several ranks and calls merge
exactly, on every layout, and bad intervals raise on every rank."""
import math

import pytest
import torch
import torch.distributed as dist

from parallel import DeviceMesh
from tests.passref import make_samples, reference
from twinkle_metrics import MetricCollection
from twinkle_metrics.metrics.rl.pass_at_k import PassAtKMetric
from twinkle_metrics.testing import assert_layout_invariant, forbid_device_waits

pytestmark = pytest.mark.xdist_group("dist")

KS = (1, 2, 4)
N_PROMPTS, N_SAMPLES = 6, 8


def _acceptance_correct(p, j):
    return (p * 5 + j * 3) % 8 < p + 1  # prompt p: p + 1 of its 8 samples correct


def case_acceptance():
    """6 prompts x 8 samples over 4 DP ranks (TP replicas of each) and two calls: sample j of
    every prompt on DP rank j % 4, in call j // 4."""
    mesh = DeviceMesh.from_sizes(tp_size=2, dp_size=4)
    m = PassAtKMetric(mesh, k=(1, 4))
    with forbid_device_waits():
        for call in range(2):
            js = [mesh.dp_rank + 4 * call]
            ids = [p if p % 2 else f"prompt-{p}" for p in range(N_PROMPTS) for _ in js]
            flags = torch.tensor([_acceptance_correct(p, j) for p in range(N_PROMPTS) for j in js])
            m.accumulate(None, None, prompt_ids=ids, correct=flags)
    return m.calculate()


def test_acceptance_six_prompts_over_four_ranks_and_two_calls(dist_pool):
    c = [sum(_acceptance_correct(p, j) for j in range(N_SAMPLES)) for p in range(N_PROMPTS)]
    assert c == [1, 2, 3, 4, 5, 6]
    n = N_SAMPLES
    want = {"pass@1": sum(ci / n for ci in c) / N_PROMPTS,
            "pass@4": sum(1 - math.comb(n - ci, 4) / math.comb(n, 4) for ci in c) / N_PROMPTS,
            "pass^4": sum(math.comb(ci, 4) / math.comb(n, 4) for ci in c) / N_PROMPTS}
    results = dist_pool.run(case_acceptance)
    for out in results:
        assert out == results[0]  # every rank, the same numbers
        assert out["num_prompts"] == N_PROMPTS and out["num_samples"] == N_PROMPTS * N_SAMPLES
        for key, value in want.items():
            assert abs(out[key] - value) <= 1e-9, (key, out[key], value)
            assert out[f"{key}_ci_low"] <= out[key] <= out[f"{key}_ci_high"], key
            assert out[f"{key}_ci_low"] < out[f"{key}_ci_high"]


def make_metrics(mesh):
    kw = dict(k=KS, with_answers=True, with_rewards=True, max_prompts=32, max_samples=256, num_bootstrap=100)
    return MetricCollection({"all": PassAtKMetric(**kw),
                             "src": PassAtKMetric(slice_by="data_source", **kw)}, device_mesh=mesh)


def feed(coll, shard):
    """This DP rank's samples (every prompt's samples spread over the DP ranks), in two calls,
    one with lists and one with tensors; CP and TP peers pass the same samples; a non-last
    pipeline stage passes what a schedule gives it."""
    if not shard.is_last_stage:
        for m in coll:
            m.accumulate([], {})
        return
    mine = make_samples(40 + shard.interval)[shard.dp_rank::shard.dp_size]
    for i, part in enumerate((mine[0::2], mine[1::2])):
        as_tensor = (lambda x, **kw: torch.tensor(x, **kw)) if i else (lambda x, **kw: x)
        kw = dict(prompt_ids=[s["prompt"] for s in part], correct=as_tensor([s["correct"] for s in part]),
                  answers=[s["answer"] for s in part],
                  rewards=as_tensor([s["reward"] for s in part], dtype=torch.float64))
        for m in coll:
            m.accumulate({"data_source": [s["source"] for s in part]}, None, **kw)


def test_sharded_equals_whole_on_every_layout(dist_pool):
    report = assert_layout_invariant(make_metrics, feed, ["dp2", "tp2xdp2", "pp2xdp2", "cp2xdp2"], pool=dist_pool)
    for interval, got in enumerate(report.reference):
        samples = make_samples(40 + interval)
        want = reference(samples, KS, answers=True, rewards=True)
        for key, value in want.items():
            assert math.isclose(got[f"all/{key}"], value, rel_tol=1e-12, abs_tol=1e-12), key
        for source in ("gsm8k", "math"):
            part = reference([s for s in samples if s["source"] == source], KS, answers=True, rewards=True)
            for key, value in part.items():
                assert math.isclose(got[f"src/{key}/{source}"], value, rel_tol=1e-12, abs_tol=1e-12), key


def case_bad_intervals():
    """Every rank within max_prompts, the ranks together over it; then k above every prompt's
    sample count. Both raise at calculate() on every rank."""
    mesh = DeviceMesh.from_sizes(dp_size=8)
    rank = dist.get_rank()
    m = PassAtKMetric(mesh, k=(1, 2), max_prompts=8)
    m.accumulate(prompt_ids=[f"r{rank}", f"r{rank}", rank], correct=[1, 0, 1])  # 16 prompts in all
    errors = []
    for _ in range(2):
        try:
            m.calculate()
        except ValueError as e:
            errors.append(str(e))
    m.reset()
    m.accumulate(prompt_ids=[rank], correct=[1])  # one sample per prompt, k=2
    try:
        m.calculate()
    except ValueError as e:
        errors.append(str(e))
    m.reset()
    m.accumulate(prompt_ids=[rank % 4], correct=[rank < 4])  # 4 prompts of 2 samples, on two ranks each
    return errors, m.calculate()


def test_bad_intervals_raise_on_every_rank(dist_pool):
    for errors, last in dist_pool.run(case_bad_intervals):
        assert len(errors) == 3
        assert all("more than max_prompts=8 distinct prompts" in e and "larger max_prompts" in e for e in errors[:2])
        assert "k=2 is larger than every prompt's number of samples (the largest n seen is 1" in errors[2]
        assert last["num_prompts"] == 4 and last["pass@1"] == 0.5 and last["pass@2"] == 1.0
