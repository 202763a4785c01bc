"""The reduce path's pack and unpack against the gather path's merge, in one process.

Several simulated ranks pack their buffers; what their collectives would return
(MAX and SUM over ranks, the gathered rows) is computed here with torch, and the
unpacked row must equal what ``sync._merge`` makes of the gathered buffers. The real
collectives run in tests/comm/test_sync_reduce_dist.py.
"""
import math

import pytest
import torch

from parallel import DeviceMesh
from tests.metrics.rl.test_metrics_rl_dist import N_SEQ, SEED, SEQ_LEN, _accumulate, _metrics
from tests.refmetric import TokenStats, dp_shards, make_batch, shard_for_rank
from tests.rlref import make_rl_batch
from twinkle_metrics import Metric, State
from twinkle_metrics.comm import fused as sync
from twinkle_metrics.comm.order import from_ordered_f64, ordered_f64
from twinkle_metrics.core.state import interval_of
from twinkle_metrics.testing import assert_results_close

RANKS = 4


class Extremes(Metric):
    f_max = State("max")
    f_min = State("min")
    i_max = State("max", torch.int64)
    i_min = State("min", torch.int64)
    z_min = State("min")  # +0.0 on every rank
    z_max = State("max")  # -0.0 on every rank

    def update(self, inputs, outputs, **kwargs):
        return dict(outputs)

    def compute(self, s):
        return dict(s)


def _ranks():
    """Per simulated rank: its metrics (RL set, TokenStats, Extremes), each fed its shard."""
    b = make_rl_batch(SEED, N_SEQ, SEQ_LEN)
    labels, values = make_batch(3)
    out = []
    for r in range(RANKS):
        coll = _metrics(DeviceMesh.single())
        rows = dp_shards(N_SEQ, RANKS)[r]
        pairs = dp_shards(N_SEQ // 2, RANKS)[r]
        _accumulate(coll, b, rows, torch.arange(SEQ_LEN), range(2 * pairs.start, 2 * pairs.stop), 1.0 + r)
        tokens = TokenStats()
        feats, outs = shard_for_rank(labels, values, RANKS, r, 1, 0)
        tokens.accumulate(feats, {"values": outs})
        ext = Extremes().accumulate(None, {
            "f_max": math.nan if r == 2 else -1.5 * r, "f_min": -0.0 if r == 0 else 2.0 ** -1074 * r,
            "i_max": 2 ** 62 + 3 * r, "i_min": -(2 ** 63) + 1 + 5 * r, "z_min": 0.0, "z_max": -0.0})
        out.append(list(coll) + [tokens, ext])
    return out


def _plan_and_buffers(ranks):
    configs = tuple(m.fingerprint() for m in ranks[0])
    ranks = [[interval_of(m) for m in ms] for ms in ranks]  # what the sync is handed
    metrics = ranks[0]
    plan = sync._Plan(metrics, [sorted(m.specs) for m in metrics], configs)
    cpu = torch.device("cpu")
    bufs = [sync._pack(plan, ms, plan.length, cpu, cpu, need=False, is_source=True, pp_rank=0)
            for ms in ranks]
    return plan, metrics, bufs


def _collectives(parts):
    """What the reduce path's collectives return on every rank, from each rank's pack."""
    top = torch.stack([p[0] for p in parts]).amax(0)
    sums = [torch.stack([p[k] for p in parts]).sum(0) if parts[0][k] is not None else None for k in (1, 2)]
    rows = torch.stack([p[3] for p in parts]) if parts[0][3] is not None else None
    return top, sums[0], sums[1], rows


def test_reduce_path_equals_gather_path():
    ranks = _ranks()
    plan, metrics, bufs = _plan_and_buffers(ranks)
    # the RL set's GRPO top-k records and reward moments are gathered; all else is reduced
    assert 0 < plan.reduce_sizes[3] < plan.length
    gathered = sync._merge(plan, metrics, torch.stack(bufs))
    top, sf, si, rows = _collectives([sync._reduce_pack(plan, b, plan.reduce_sizes) for b in bufs])
    reduced = sync._reduce_unpack(plan, metrics, bufs[0], top, sf, si, rows)
    assert reduced[sync._H_PLAN].item() == plan.hash and reduced[sync._H_NEED].item() == 0
    h = sync._HEADER
    ints = torch.zeros(plan.length, dtype=torch.bool)
    for entries in plan.entries:
        for _, spec, offset in entries:
            ints[offset:offset + spec.numel] = spec.dtype == torch.int64
    assert torch.equal(reduced[h:].view(torch.int64)[ints], gathered[h:].view(torch.int64)[ints])
    assert torch.allclose(reduced[h:][~ints], gathered[h:][~ints], rtol=1e-12, atol=0, equal_nan=True)
    # the unpacked states give every metric the same results as the gather path's
    for m, a, b in zip(metrics, sync._unpack(reduced, plan, metrics), sync._unpack(gathered, plan, metrics)):
        assert_results_close(m.owner.compute(a), m.owner.compute(b), rel=1e-12)
    ext = sync._unpack(reduced, plan, metrics)[-1]
    assert math.isnan(ext["f_max"]) and ext["f_min"] == 0.0 and math.copysign(1, ext["f_min"]) == -1
    assert ext["i_max"] == 2 ** 62 + 9 and ext["i_min"] == -(2 ** 63) + 1
    # zeros keep their sign through the keys and the negation of minima
    assert [math.copysign(1, ext[k]) for k in ("z_min", "z_max")] == [1, -1]


def test_a_rank_without_a_plan_or_with_another_flags_a_new_plan():
    ranks = _ranks()
    plan, metrics, bufs = _plan_and_buffers(ranks)
    cpu = torch.device("cpu")
    bare = sync._pack(plan, metrics, plan.length, cpu, cpu, need=True, is_source=True, pp_rank=0)
    other = bufs[1].clone()
    other[sync._H_PLAN] = plan.hash - 1  # same sizes, another plan
    for odd, odd_plan in ((bare, None), (other, plan)):
        parts = [sync._reduce_pack(plan, b, plan.reduce_sizes) for b in bufs[:-1]]
        parts.append(sync._reduce_pack(odd_plan, odd, plan.reduce_sizes))
        assert [p[0].shape for p in parts[:1]] == [p[0].shape for p in parts[-1:]]  # sizes match
        for p in (plan, None):
            vec = sync._reduce_unpack(p, metrics, bufs[0], *_collectives(parts))
            assert vec[sync._H_NEED].item() == 1


def test_ordered_keys_round_trip_and_order():
    vals = torch.tensor([-math.inf, -1e300, -2.0, -2.0 ** -1074, -0.0, 0.0, 2.0 ** -1074, 3.5, math.inf,
                         math.nan], dtype=torch.float64)
    keys = ordered_f64(vals)
    assert (keys[1:] >= keys[:-1]).all() and keys[4] == keys[5] and keys[-1] > keys[-2]
    back = from_ordered_f64(keys)
    assert torch.equal(back[:-1], vals[:-1]) and math.isnan(back[-1].item())
    # min as the max of negated keys: NaN still wins, as amin propagates it
    neg = -from_ordered_f64(ordered_f64(-vals).amax().unsqueeze(0))
    assert math.isnan(neg.item())
    assert -from_ordered_f64(ordered_f64(-vals[:-1]).amax().unsqueeze(0)).item() == -math.inf


def test_threshold_from_the_environment(monkeypatch):
    monkeypatch.setenv("TWINKLE_METRICS_REDUCE_ABOVE", "4096")
    assert sync._threshold(512) == 4096
    monkeypatch.delenv("TWINKLE_METRICS_REDUCE_ABOVE")
    assert sync._threshold(512) == 512
    monkeypatch.setenv("TWINKLE_METRICS_REDUCE_ABOVE", "1k")
    with pytest.raises(ValueError, match="TWINKLE_METRICS_REDUCE_ABOVE must be a number of ranks, got '1k'"):
        sync._threshold(512)


def test_host_pieces_travel_in_one_copy_in_order(monkeypatch):
    """_pack on an accelerator: the CPU pieces (header, CPU-resident states) are moved in one
    copy and put back in their places; pieces already on the device are untouched."""
    from twinkle_metrics.comm import fused as sync
    from twinkle_metrics.inputs import checks as _checks
    copies = []  # the host-to-device copies (_checks.from_host, under from_host_all)
    monkeypatch.setattr(_checks, "from_host", lambda t, device: copies.append(t.numel()) or t * 1.0)
    a, c, d = torch.arange(4.0), torch.arange(10.0, 13.0), torch.tensor([7.0])
    b = torch.empty(5, device="meta")  # stands for a state already on the device
    out = sync._host_pieces_to([a, b, c, d], torch.device("meta"))
    assert copies == [8]
    assert out[1] is b
    assert [x.tolist() for x in (out[0], out[2], out[3])] == [a.tolist(), c.tolist(), d.tolist()]
