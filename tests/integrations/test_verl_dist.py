"""verl's data path on 8 real gloo ranks (TP2 x PP2 x DP2): the exports go through verl's
own ``allgather_dict_into_dict``, its mini-batch flattening and ``append_to_dict``; the
driver (this process, no process group) reduces the dict the trainer receives with
``integrations.verl.reduce_metrics``: the exports give what one process holding the whole
batch gives, every other key what verl's own ``reduce_metrics`` gives."""
import copy

import pytest

from parallel import DeviceMesh
from tests import verlref
from tests.controllerref import feed, make_metrics, whole
from twinkle_metrics.integrations.verl import reduce_metrics
from twinkle_metrics.testing import assert_results_close

pytestmark = pytest.mark.xdist_group("dist")

#: per mini-batch, the micro-batch sizes of DP rank 0 and DP rank 1 (4 sequences each): the
#: same count (verl's Metric.aggregate_dp demands it), other sizes
MICRO = {0: [1, 3], 1: [2, 2]}


def _micro_rows(mini, dp_rank):
    """The sequences of each micro-batch of ``dp_rank`` in mini-batch ``mini``."""
    mine = [r for r in range(mini * 8, mini * 8 + 8) if r % 2 == dp_rank]
    out, at = [], 0
    for n in MICRO[dp_rank]:
        out.append(mine[at:at + n])
        at += n
    return out


def case_verl_update():
    """One verl update (two mini-batches) on every rank; the source ranks' metrics dict."""
    gather, append, VerlMetric = verlref.worker_helpers()
    mesh = DeviceMesh.from_sizes(tp_size=2, pp_size=2, dp_size=2)
    coll = make_metrics(mesh)
    source = mesh.tp_rank == 0 and mesh.is_last_stage  # verl's is_mp_src_rank_with_outputs
    step = {}
    for mini in range(2):
        engine = {}  # engine.train_batch: append_to_dict of each micro-batch's metrics
        for rows in _micro_rows(mini, mesh.dp_rank):
            if mesh.is_last_stage:
                feed(coll, rows)
            clip = VerlMetric("mean", float(len(rows)) / 4)
            append(engine, {"pg_loss": [float(sum(rows))], "pg_clipfrac": clip, "ratio_max": [1.0 + rows[0]]})
        engine["twinkle"] = [coll.export()]  # every rank, once per train_batch
        if source:  # _postprocess_output, then train_mini_batch's flattening and append_to_dict
            final = gather(engine, group=mesh.dp_group)
            final["loss"] = 0.5 * (mini + 1)
            append(step, verlref.flatten_mini_batch(final, VerlMetric))
    return step if source else None


def test_verl_reduce_metrics_merges_exports_exactly(dist_pool):
    verl = verlref.metric_utils()
    outputs = [o for o in dist_pool.run(case_verl_update) if o is not None]
    assert len(outputs) == 2  # DP ranks 0 and 1 of the last stage, TP rank 0
    received = {f"actor/{k}": v for k, v in outputs[0].items()}  # collect_nd_compute: the first; rename_dict
    assert len(received["actor/twinkle"]) == 4  # 2 DP ranks x 2 mini-batches, flat
    theirs = {k: v for k, v in copy.deepcopy(received).items() if k != "actor/twinkle"}
    want = verl.reduce_metrics(theirs)
    got = reduce_metrics(received)
    ours = {k[len("actor/twinkle/"):]: v for k, v in got.items() if k.startswith("actor/twinkle/")}
    assert_results_close(ours, whole())
    assert {k: v for k, v in got.items() if not k.startswith("actor/twinkle/")} == want
    assert set(want) == {"actor/pg_loss", "actor/pg_clipfrac", "actor/ratio_max", "actor/loss"}
