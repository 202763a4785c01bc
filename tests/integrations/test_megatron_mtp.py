"""``MTPMetric`` fed by ``register_mtp_hooks`` from megatron-core's own MTP heads: a tiny GPT with
``mtp_num_layers=2`` in megatron-core's training loop on CPU (``megatron_mtp_case.py``, the
docs/megatron.md block inside the README's recipe), one process and TP2 x DP2.

Per interval and depth, the metric's correct and total counts equal megatron-core 0.19's
tracker counts (``MTPLossLoggingHelper``, reduced over DP x CP as ``track_mtp_metrics`` does)
and a plain-Python recomputation from the labels, the loss masks and the full-vocab argmax the
case recorded; its loss equals the token-weighted recomputation from megatron-core's per-token
losses. megatron-core 0.16 has MTP but tracks no acceptance counts: there the recomputation
alone is the reference.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.megatron
REPO = os.path.abspath(os.path.join(__file__, "../../.."))
DEPTHS = 2


def _run_case(tmp_path, nproc, *extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    case = os.path.join(REPO, "tests", "integrations", "megatron_mtp_case.py")
    cmd = [sys.executable, case, str(tmp_path), *extra] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), case,
         str(tmp_path), *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]


def _rolled(rows, k):
    """megatron-core's ``roll_tensor`` applied ``k`` times without CP: left by ``k``, the last
    ``k`` positions zero."""
    return [row[k:] + [0] * k for row in rows]


def _recomputed(step, depth):
    """(correct, total, loss sum, tokens) of one rank's step at ``depth``, from the raw record."""
    correct = total = 0
    loss_sum = tokens = 0.0
    for m, mb in enumerate(step["microbatches"]):
        at = m * (DEPTHS + 1) + depth - 1  # each forward: the MTP depths, then the main head
        labels, mask = _rolled(mb["labels"], depth), _rolled(mb["mask"], depth)
        assert step["calls"][at]["labels"] == labels  # megatron-core's depth labels are these
        for y_row, w_row, p_row, l_row in zip(labels, mask, step["preds"][at], step["calls"][at]["losses"]):
            for y, w, p, x in zip(y_row, w_row, p_row, l_row):
                correct += int(w != 0 and p == y)
                total += int(w != 0)
                loss_sum += x * w
                tokens += w
    return correct, total, loss_sum, tokens


def _check(ranks, tp):
    assert all(r["hooks_active"] and r["restored"] for r in ranks)
    data = {r["dp_rank"]: r for r in ranks if r["tp_rank"] == 0}  # TP replicas count once
    assert len(data) == len(ranks) // tp
    first = ranks[0]
    assert len(first["intervals"]) == 2
    run = {k: [0, 0] for k in range(1, DEPTHS + 1)}  # correct, total since the start
    for i, interval in enumerate(first["intervals"]):
        got = interval["results"]
        for r in ranks:  # every rank: the same dict
            assert r["intervals"][i]["results"] == got
        for k in range(1, DEPTHS + 1):
            sums = [0, 0, 0.0, 0.0]
            for r in data.values():
                for step in r["intervals"][i]["steps"]:
                    sums = [a + b for a, b in zip(sums, _recomputed(step, k))]
            correct, total, loss_sum, tokens = sums
            assert total > 0 and got[f"mtp/depth{k}/num_tokens"] == tokens
            assert (got[f"mtp/depth{k}/correct_tokens"], got[f"mtp/depth{k}/total_tokens"]) == (correct, total)
            assert got[f"mtp/depth{k}/acceptance_rate"] == correct / total
            assert got[f"mtp_{k}_acceptance_rate"] == pytest.approx(100 * correct / total, rel=1e-12)
            assert got[f"mtp/depth{k}/loss"] == pytest.approx(loss_sum / tokens, rel=1e-6)
            assert got[f"mtp_{k} loss"] == got[f"mtp/depth{k}/loss"]
            run[k] = [run[k][0] + correct, run[k][1] + total]
            assert got[f"mtp/depth{k}/cumulative_acceptance_rate"] == run[k][0] / run[k][1]
            if first["has_counts"]:  # megatron-core 0.19's tracker, reduced over DP x CP per step
                steps = interval["steps"]
                assert correct == sum(s["correct"][k - 1] for s in steps)
                assert total == sum(s["total"][k - 1] for s in steps)
                cumulative = steps[-1]["cumulative"]  # the tracker's, since the process started
                assert run[k] == [cumulative[0][k - 1], cumulative[1][k - 1]]
                assert got[f"mtp_{k}_cumulative_acceptance_rate"] == pytest.approx(
                    100 * cumulative[0][k - 1] / cumulative[1][k - 1], rel=1e-12)
    hits = sum(iv["results"][f"mtp/depth{k}/correct_tokens"] for iv in first["intervals"] for k in (1, 2))
    assert hits > 0  # the argmax path is exercised, not only misses


@pytest.mark.slow
def test_mtp_metric_in_megatron_training_loop_world1(tmp_path):
    ranks = _run_case(tmp_path, 1)
    _check(ranks, tp=1)
    # megatron-core's loss is a mean of per-microbatch means; ours weights each token once
    steps = ranks[0]["intervals"][0]["steps"]
    mean_of_means = sum(s["loss"][0] for s in steps) / len(steps)
    got = ranks[0]["intervals"][0]["results"]["mtp/depth1/loss"]
    assert not math.isclose(got, mean_of_means, rel_tol=1e-6)


@pytest.mark.slow
@pytest.mark.xdist_group("dist")
def test_mtp_metric_in_megatron_training_loop_tp2_dp2(tmp_path):
    _check(_run_case(tmp_path, 4, "--tp", "2"), tp=2)
