"""The reduce path's pack and unpack against the gather path's merge, in one process.

Several simulated ranks pack their buffers (``twinkle_metrics.comm.codec.Codec``); what
their collectives would return (MAX and SUM over ranks, the gathered rows) is computed here
with torch, and the unpacked row must equal what the gather path's merge makes of the
gathered buffers. The real collectives run in tests/comm/test_sync_reduce_dist.py.
"""
import math

import pytest
import torch

from parallel import DeviceMesh
from tests.metrics.rl.test_metrics_rl_dist import N_SEQ, SEED, SEQ_LEN, _accumulate, _metrics
from tests.refmetric import TokenStats, dp_shards, make_batch, shard_for_rank
from tests.rlref import make_rl_batch
from twinkle_metrics import Metric, State
from twinkle_metrics.comm import fused
from twinkle_metrics.comm.codec import Codec
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


def _codec_and_buffers(ranks):
    configs = tuple(m.fingerprint() for m in ranks[0])
    ranks = [[interval_of(m) for m in ms] for ms in ranks]  # what the sync is handed
    codec = Codec(ranks[0], configs)
    return codec, [codec.pack(ms) for ms in ranks]


def _collectives(parts):
    """What the reduce path's collectives return on every rank, from each rank's pack."""
    top = torch.stack([p[0] for p in parts]).amax(0)
    sums = [torch.stack([p[k] for p in parts]).sum(0) if parts[0][k] is not None else None for k in (1, 2)]
    rows = torch.stack([p[3] for p in parts]) if parts[0][3] is not None else None
    return top, sums[0], sums[1], rows


def test_reduce_path_equals_gather_path():
    ranks = _ranks()
    codec, bufs = _codec_and_buffers(ranks)
    # the RL set's GRPO top-k records and reward moments are gathered; all else is reduced
    assert 0 < codec.reduce_sizes[3] < codec.length
    gathered = codec.merge(torch.stack(bufs))
    reduced = codec.reduce_receive(bufs[0], *_collectives([codec.reduce_send(b) for b in bufs]))
    assert not codec.needs_layout(reduced)
    ints = codec.int_columns()
    got, want = codec.states_of(reduced), codec.states_of(gathered)
    assert torch.equal(got.view(torch.int64)[ints], want.view(torch.int64)[ints])
    assert torch.allclose(got[~ints], want[~ints], rtol=1e-12, atol=0, equal_nan=True)
    # the unpacked states give every metric the same results as the gather path's
    for iv, a, b in zip(codec.intervals, codec.unpack(reduced), codec.unpack(gathered)):
        assert_results_close(iv.owner.compute(a), iv.owner.compute(b), rel=1e-12)
    ext = codec.unpack(reduced)[-1]
    assert math.isnan(ext["f_max"]) and ext["f_min"] == 0.0 and math.copysign(1, ext["f_min"]) == -1
    assert ext["i_max"] == 2 ** 62 + 9 and ext["i_min"] == -(2 ** 63) + 1
    # zeros keep their sign through the keys and the negation of minima
    assert [math.copysign(1, ext[k]) for k in ("z_min", "z_max")] == [1, -1]


def test_a_rank_without_a_layout_or_with_another_flags_a_new_one():
    ranks = _ranks()
    codec, bufs = _codec_and_buffers(ranks)
    other_ranks = [list(ms) for ms in ranks]
    other_ranks[1] = other_ranks[1][:-1]  # another set of metrics: another layout, same widths
    other = Codec([interval_of(m) for m in other_ranks[1]], tuple(m.fingerprint() for m in other_ranks[1]))
    for odd in (codec.reduce_send(need=True), other.reduce_send(other.pack())):
        parts = [codec.reduce_send(b) for b in bufs[:-1]]
        if odd[0].shape != parts[0][0].shape:  # the channel pads every rank's keys to one width
            odd = (torch.nn.functional.pad(odd[0], (0, parts[0][0].numel() - odd[0].numel()),
                                           value=-(2 ** 63)),) + tuple(parts[0][1:])
        parts.append(odd)
        assert codec.needs_layout(codec.reduce_receive(bufs[0], *_collectives(parts)))


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
    assert fused.env_threshold(512) == 4096
    monkeypatch.delenv("TWINKLE_METRICS_REDUCE_ABOVE")
    assert fused.env_threshold(512) == 512
    monkeypatch.setenv("TWINKLE_METRICS_REDUCE_ABOVE", "1k")
    with pytest.raises(ValueError, match="TWINKLE_METRICS_REDUCE_ABOVE must be a number of ranks, got '1k'"):
        fused.env_threshold(512)


def test_host_pieces_travel_in_one_copy_in_order(monkeypatch):
    """Packing on an accelerator: the CPU pieces (header, CPU-resident states) are moved in one
    copy and put back in their places; pieces already on the device are untouched."""
    from twinkle_metrics.inputs import checks
    copies = []  # the host-to-device copies (checks.from_host, under from_host_all)
    monkeypatch.setattr(checks, "from_host", lambda t, device: copies.append(t.numel()) or t * 1.0)
    a, c, d = torch.arange(4.0), torch.arange(10.0, 13.0), torch.tensor([7.0])
    b = torch.empty(5, device="meta")  # stands for a state already on the device
    out = fused.host_pieces_to([a, b, c, d], torch.device("meta"))
    assert copies == [8]
    assert out[1] is b
    assert [x.tolist() for x in (out[0], out[2], out[3])] == [a.tolist(), c.tolist(), d.tolist()]
