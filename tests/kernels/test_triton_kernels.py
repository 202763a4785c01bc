"""The Triton kernels (entropy partials, argmax) against the torch paths, on CPU.

The kernels run under Triton's interpreter, which ``@triton.jit`` picks when it
decorates (triton's own library functions included, at ``import triton``), so
``TRITON_INTERPRET=1`` must be set before triton is first imported. This module
therefore runs its kernel tests in a child pytest with the variable set (one
extra process) and leaves the parent process's triton untouched. The paths are
chosen through the public switch: ``kernels.backend("triton")`` (the ``triton_path``
fixture) lets CPU tensors take the kernels, so the metrics' real call paths run through
them, and ``kernels.backend("torch")`` gives the torch references.
"""
import importlib.util
import math
import os
import subprocess
import sys
import warnings

import numpy
import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from tests.kernels.interpreted import INTERPRETED, interpreted, run_child  # noqa: E402

kernel_test = interpreted
#: a test that starts its own ``TRITON_INTERPRET=1`` process: run by the parent, beside the child
beside_the_child = pytest.mark.skipif(INTERPRETED, reason="runs in the parent, beside this child")


@pytest.mark.skipif(INTERPRETED, reason="this is the child")
def test_kernels_under_the_interpreter():
    run_child(__file__)


if INTERPRETED:
    from twinkle_metrics.kernels import argmax_triton as TA
    from twinkle_metrics.kernels import dpo_triton as TD
    from twinkle_metrics.kernels import entropy_triton as TE
    from twinkle_metrics.kernels import rl_triton as TR
    from twinkle_metrics.kernels import rollout_triton as TRO
    from twinkle_metrics.metrics.rl.policy.table import KERNEL_COLUMNS

from tests.rlref import make_rl_batch, ragged  # noqa: E402
from twinkle_metrics import Accuracy, CISPOMetric, DPOMetric, GRPOMetric, GSPOMetric, RolloutMismatchMetric  # noqa: E402
from twinkle_metrics.kernels import argmax, backend, entropy  # noqa: E402
from twinkle_metrics.kernels import dispatch as _triton  # noqa: E402


@pytest.fixture
def triton_path():
    """Every tensor takes the kernel paths (CPU ones run by the interpreter) until a kernel
    fails, as on CUDA; the choice before comes back after the test."""
    with backend("triton"):
        yield


@pytest.fixture(params=["lean", "selects"])
def entropy_variant(request, monkeypatch):
    """Each entropy-partials kernel: the default, and the first one (selects on every logit)."""
    monkeypatch.setattr(TE, "VARIANT", request.param)
    return request.param


def _torch_entropy(x2d, t):
    """The torch path's per-row entropy (float64) of ``[rows, V]``."""
    return entropy.token_entropy([x2d], [torch.Size([x2d.shape[0]])], t, None, x2d.device)[0]


def _h(parts):
    return torch.log(parts[:, 1]) - parts[:, 2] / parts[:, 1]


def _logits(rows, v, dtype=torch.float32, seed=0, scale=4.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, v, generator=g, dtype=torch.float64) * scale).to(dtype)


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t", [1.0, 0.6, 1.7])
def test_entropy_partials_match_torch(dtype, t, entropy_variant):
    x = _logits(9, 203, dtype, seed=int(t * 10))  # 203 = 3 tiles of 64 + a ragged tail
    x[2, :150] = float("-inf")                     # masked vocab entries
    x[3, 7] = float("-inf")
    got = _h(TE.triton_token_partials(x, t, block=64))
    want = _torch_entropy(x, t)  # same rounded values, computed in float32 by the torch path
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    # m is the row max of z / T
    torch.testing.assert_close(TE.triton_token_partials(x, t, block=64)[:, 0],
                               (x.float() / t).amax(-1).double(), rtol=1e-6, atol=0)


@kernel_test
def test_entropy_uniform_and_one_hot_rows(entropy_variant):
    x = torch.zeros(2, 100)
    x[1] = float("-inf")
    x[1, 42] = 3.0
    got = _h(TE.triton_token_partials(x, 1.0, block=32))
    assert math.isclose(got[0].item(), math.log(100), rel_tol=1e-6)
    assert got[1].item() == 0.0


@kernel_test
def test_entropy_nan_inf_rows_are_nan_as_in_torch(entropy_variant):
    x = _logits(4, 70)
    x[0, 5] = float("nan")
    x[1, 69] = float("inf")
    x[2] = float("-inf")            # nothing left: 0 / 0
    with warnings.catch_warnings():  # inf - inf is the point here
        warnings.simplefilter("ignore", RuntimeWarning)
        got = _h(TE.triton_token_partials(x, 1.0, block=32))
    want = _torch_entropy(x, 1.0)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.isnan(got[:3]).all() and torch.isfinite(got[3])
    torch.testing.assert_close(got[3], want[3], rtol=1e-5, atol=0)


@kernel_test
def test_entropy_of_extreme_finite_logits(entropy_variant):
    """Rows far below any stand-in for -inf, and a range wider than float32 can subtract."""
    x = _logits(4, 90, seed=5)
    x[0] = x[0] - 3.0e38 / 2             # every logit near -1.5e38
    x[1, :45] = -3.0e38                  # half the row at -3e38, the rest ordinary
    x[2, ::2] = 3.0e38                   # ties at the top, far above the rest
    x[3] = torch.finfo(torch.float32).min  # every logit the lowest float32
    with warnings.catch_warnings():  # gaps overflow to -inf on purpose; the kernels clamp them
        warnings.simplefilter("ignore", RuntimeWarning)
        got = _h(TE.triton_token_partials(x, 1.0, block=32))
    torch.testing.assert_close(got, _torch_entropy(x, 1.0), rtol=1e-5, atol=1e-6)


@kernel_test
def test_entropy_strided_views_read_in_place(entropy_variant):
    big = _logits(24, 150, seed=3)
    sliced = big[:, 20:120]                          # row stride 150, data offset 20
    assert not sliced.is_contiguous()
    want = _torch_entropy(sliced.contiguous(), 0.8)
    torch.testing.assert_close(_h(TE.triton_token_partials(sliced, 0.8, block=32)), want, rtol=1e-5, atol=0)
    # Megatron [s, b, V] seen as [b, s, V], and a [:, :s] slice of [b, S, V]
    sbv = _logits(6, 4 * 50, seed=4).reshape(6, 4, 50)
    bsv = sbv.transpose(0, 1)
    want = _torch_entropy(bsv.reshape(-1, 50), 1.0)
    torch.testing.assert_close(_h(TE.triton_token_partials(bsv, 1.0, block=16)), want, rtol=1e-5, atol=0)
    cut = bsv[:, :4]
    want = _torch_entropy(cut.reshape(-1, 50), 1.0)
    torch.testing.assert_close(_h(TE.triton_token_partials(cut, 1.0, block=16)), want, rtol=1e-5, atol=0)


@kernel_test
@pytest.mark.parametrize("split", [100, 37, 1])
def test_entropy_two_vocab_shards_combine_to_whole(split, entropy_variant):
    x = _logits(8, 200, seed=split)
    x[0, :split] = float("-inf")   # a whole shard masked in one row
    t = 0.7
    a = TE.triton_token_partials(x[:, :split], t, block=32)
    b = TE.triton_token_partials(x[:, split:], t, block=32)
    row_max = torch.maximum(a[:, 0], b[:, 0])
    st = entropy.rescale(a, row_max) + entropy.rescale(b, row_max)
    got = torch.log(st[:, 0]) - st[:, 1] / st[:, 0]
    torch.testing.assert_close(got, _h(TE.triton_token_partials(x, t, block=32)), rtol=1e-5, atol=0)
    torch.testing.assert_close(got, _torch_entropy(x, t), rtol=1e-5, atol=0)


@kernel_test
def test_grpo_entropy_through_triton_path_matches_torch(triton_path, monkeypatch):
    b = make_rl_batch(5)
    z = b["logits"].float()
    base = z.new_empty(z.shape[1], z.shape[0], z.shape[2])
    base.copy_(z.transpose(0, 1))
    strided = base.transpose(0, 1)   # [b, s, V] view of an [s, b, V] tensor
    assert entropy.row_blocks(strided)[0].data_ptr() == strided[0].data_ptr()  # no copy
    calls = []
    real = entropy._triton_partials
    monkeypatch.setattr(entropy, "_triton_partials", lambda cs, t: calls.extend(c.shape for c in cs) or real(cs, t))
    kw = dict(inputs={"labels": b["labels"]}, outputs={"logps": b["logps"], "logits": strided})
    got = GRPOMetric(entropy_from_logits=True, temperature=0.6).accumulate(**kw).calculate()
    assert calls  # the kernel path ran
    backend("torch")
    want = GRPOMetric(entropy_from_logits=True, temperature=0.6).accumulate(**kw).calculate()
    assert math.isclose(got["train/entropy"], want["train/entropy"], rel_tol=1e-5)


def _argmax_cases():
    g = torch.Generator().manual_seed(7)
    ties = torch.randint(0, 3, (6, 130), generator=g).float()       # many ties, across tiles
    ties[0] = 2.0                                                    # all equal: index 0
    ties[1, 100] = 5.0
    ties[1, 129] = 5.0
    ties[2, 64:] = -0.0
    ties[2, :64] = float("-inf")
    ties[2, 70] = 0.0                                                # -0.0 == +0.0: first zero wins
    nan = _logits(5, 130, seed=8)
    nan[0, 90] = float("nan")
    nan[0, 20] = float("nan")                                        # first NaN wins
    nan[1, 129] = float("nan")
    nan[2] = float("-inf")                                           # all -inf: index 0
    nan[3, 3] = float("inf")
    nan[3, 99] = float("nan")                                        # NaN beats +inf
    return [ties, nan, _logits(7, 130, torch.float16, seed=9), _logits(7, 130, torch.bfloat16, seed=10)]


@kernel_test
@pytest.mark.parametrize("case", range(4))
def test_argmax_index_hits_and_keys_match_torch(case):
    x = _argmax_cases()[case]
    want = x.argmax(-1)
    assert torch.equal(TA.triton_argmax(x, block=32), want)
    labels = want.clone()
    labels[::2] = (labels[::2] + 1) % x.shape[-1]
    assert torch.equal(TA.triton_argmax(x, labels, block=32), want == labels)
    # keys of two unequal-width shards: their MAX is the whole vocab's argmax
    v = x.shape[-1]
    for split in (65, 1):
        ka = TA.triton_argmax_keys(x[:, :split], 0, v, block=32)
        kb = TA.triton_argmax_keys(x[:, split:], split, v, block=32)
        assert torch.equal(argmax.argmax_of_keys(torch.maximum(ka, kb), v), want)
        ia = x[:, :split].argmax(-1)
        assert torch.equal(ka, argmax.argmax_keys(x[:, :split].gather(-1, ia[:, None])[:, 0], ia, v))


@kernel_test
def test_argmax_strided_and_batched_views():
    sbv = _logits(5, 3 * 90, seed=11).reshape(5, 3, 90)
    bsv = sbv.transpose(0, 1)[:, :4]
    assert torch.equal(TA.triton_argmax(bsv, block=32), bsv.argmax(-1))
    four = _logits(2 * 3 * 5, 40, seed=12).reshape(2, 3, 5, 40)
    assert torch.equal(TA.triton_argmax(four, block=16), four.argmax(-1))
    with pytest.raises(ValueError, match="labels"):
        TA.triton_argmax(four, torch.zeros(2, 3, dtype=torch.long))


@kernel_test
def test_accuracy_through_triton_path_matches_torch(triton_path, monkeypatch):
    x = _logits(3 * 7, 50, seed=13).reshape(3, 7, 50)
    x[0, 0] = 1.0                                       # a tie row
    labels = x.argmax(-1)
    labels[1] = 0
    labels[2, :3] = -100
    calls = []
    real = TA._launch
    monkeypatch.setattr(TA, "_launch", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = Accuracy().accumulate({"labels": labels}, {"logits": x}).calculate()
    assert calls == [1]
    # three microbatches (one a transposed view): one launch each into one buffer of hits
    feats = [{"labels": labels[:1]}, {"labels": labels[1:2]}, {"labels": labels[2:]}]
    outs = [{"logits": x[:1]}, {"logits": x[1:2].transpose(0, 1).contiguous().transpose(0, 1)}, {"logits": x[2:]}]
    got_mb = Accuracy().accumulate(feats, outs).calculate()
    assert calls == [1] * 4
    backend("torch")
    want = Accuracy().accumulate({"labels": labels}, {"logits": x}).calculate()
    assert got == want == got_mb
    assert torch.equal(argmax.vocab_parallel_argmax([x], None, 0, 1)[0], x.argmax(-1))


# ------------------------------------------------------------------ RL statistics


@pytest.fixture
def fused(triton_path, monkeypatch):
    """The kernel paths for the GRPO family; counts the kernel's calls."""
    calls = []
    real = TR.token_stats
    monkeypatch.setattr(TR, "token_stats", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _same(got, want, rel=1e-9):
    assert got.keys() == want.keys()
    for k, w in want.items():
        g = got[k]
        if k == "_high_kl_records":
            assert len(g) == len(w)
            for a, b in zip(g, w):
                assert a.keys() == b.keys()
                assert all(a[f] == b[f] for f in ("gsi", "pos", "token_id")), (a, b)
                assert all(math.isclose(a[f], b[f], rel_tol=rel) for f in ("kl", "ratio", "logp_new", "logp_old"))
        elif isinstance(w, float) and math.isnan(w):
            assert isinstance(g, float) and math.isnan(g), k
        else:
            assert type(g) is type(w) and math.isclose(g, w, rel_tol=rel, abs_tol=1e-12), (k, g, w)


def _rl_calls(seed):
    """Argument sets covering every input the one-kernel path reads, in both dtypes."""
    b = make_rl_batch(seed, n_seq=6, seq_len=37)
    lab, lp, old, ref, adv = b["labels"], b["logps"], b["old"], b["ref"], b["adv"]
    ent = torch.rand(lp.shape, dtype=torch.float64) * 3
    tok_adv = adv[:, None] + 0.1 * torch.randn(lp.shape, dtype=torch.float64)
    both = {"labels": lab}
    yield both, {"logps": lp}, {}
    yield both, {"logps": lp.float(), "entropies": ent.float()}, dict(old_logps=old.float())
    yield both, {"logps": lp}, dict(old_logps=old, advantages=adv, ref_logps=ref)
    yield both, {"logps": lp, "entropies": ent}, dict(old_logps=old, advantages=tok_adv, ref_logps=ref)
    yield both, {"logps": lp.float()}, dict(advantages=adv.float(), ref_logps=ref.float())
    # two microbatches, a strided [s, b] layout for one of them
    lp_t = lp.t().contiguous().t()
    yield ([{"labels": lab[:2]}, {"labels": lab[2:]}], [{"logps": lp_t[:2]}, {"logps": lp_t[2:]}],
           dict(old_logps=[old[:2], old[2:]], advantages=[adv[:2], adv[2:]]))
    # the middle microbatch's ragged old log-probs take the torch path, the others the kernel
    three = [slice(0, 2), slice(2, 4), slice(4, 6)]
    yield ([{"labels": lab[i]} for i in three], [{"logps": lp[i]} for i in three],
           dict(old_logps=[old[three[0]], ragged(old[three[1]], lab[three[1]]), old[three[2]]],
                advantages=[adv[i] for i in three]))


@kernel_test
@pytest.mark.parametrize("cls", [GRPOMetric, GSPOMetric, CISPOMetric])
@pytest.mark.parametrize("kw", [{}, dict(epsilon=0.1, epsilon_high=0.28, top_k_kl=4)])
def test_rl_one_kernel_path_matches_torch(fused, monkeypatch, cls, kw):
    for inputs, outputs, side in _rl_calls(3):
        fused.clear()
        got = cls(**kw).accumulate(inputs, outputs, **side).calculate()
        assert fused  # the kernel ran
        with backend("torch"):
            want = cls(**kw).accumulate(inputs, outputs, **side).calculate()
        _same(got, want)


@kernel_test
def test_top_k_records_of_many_microbatches_from_one_top_k(fused, monkeypatch):
    """The kernel writes every fused microbatch's candidate fields into one buffer, and one
    top-k over it picks the records: the same records as the torch path's per-microbatch
    candidates, with position ids, features without labels (a completion mask) and a
    microbatch that takes the torch path (ragged old log-probs) among them."""
    b = make_rl_batch(12, n_seq=8, seq_len=19)
    lab, lp, old, adv = b["labels"], b["logps"], b["old"], b["adv"]
    parts = [slice(0, 3), slice(3, 5), slice(5, 8)]
    feats = [{"labels": lab[parts[0]], "position_ids": torch.arange(100, 119)},
             {"completion_mask": lab[parts[1]] != -100},
             {"labels": lab[parts[2]]}]
    olds = [old[parts[0]], old[parts[1]], ragged(old[parts[2]], lab[parts[2]])]
    for k in (5, 200):  # fewer than the tokens, and more than the counted ones
        args = (feats, [{"logps": lp[i]} for i in parts])
        side = dict(old_logps=olds, advantages=[adv[i] for i in parts])
        fused.clear()
        m = GRPOMetric(top_k_kl=k)
        got = m.accumulate(*args, **side).accumulate(*args, **side).calculate()
        assert fused
        with backend("torch"):
            want = GRPOMetric(top_k_kl=k).accumulate(*args, **side).accumulate(*args, **side).calculate()
        _same(got, want)
        recs = got["_high_kl_records"]
        assert len(recs) == min(k, 2 * sum(int((lab[i] != -100).sum()) for i in parts))
        assert {r["pos"] >= 100 for r in recs if r["gsi"] % 8 < 3} <= {True}   # position ids used
        assert any(r["gsi"] >= 8 for r in recs)                                # the second call's sequences


@kernel_test
@pytest.mark.parametrize("nan_policy", ["propagate", "skip"])
@pytest.mark.parametrize("cls", [GRPOMetric, GSPOMetric])
def test_rl_one_kernel_path_nonfinite_tokens(fused, monkeypatch, nan_policy, cls):
    b = make_rl_batch(4, n_seq=5, seq_len=21)
    lab, lp, old, ref, adv = b["labels"], b["logps"].clone(), b["old"].clone(), b["ref"].clone(), b["adv"]
    counted = (lab != -100).nonzero().tolist()
    pad = (lab == -100).nonzero().tolist()
    lp[tuple(pad[0])] = float("nan")        # padding: ignored
    old[tuple(pad[1])] = float("-inf")
    old[tuple(counted[0])] = float("nan")    # counted tokens: non-finite
    ref[tuple(counted[3])] = float("inf")
    lp[tuple(counted[5])] = float("-inf")
    ent = torch.rand(lp.shape, dtype=torch.float64)
    ent[tuple(counted[7])] = float("nan")
    adv = adv[:, None] + torch.zeros_like(lp)  # per token, one NaN among them
    adv[tuple(counted[9])] = float("nan")
    kw = dict(nan_policy=nan_policy, top_k_kl=3)
    args = ({"labels": lab}, {"logps": lp, "entropies": ent})
    side = dict(old_logps=old, advantages=adv, ref_logps=ref)
    with numpy.errstate(invalid="ignore"):  # the interpreter's numpy meets the NaN/inf on purpose
        got = cls(**kw).accumulate(*args, **side).calculate()
    with backend("torch"):
        want = cls(**kw).accumulate(*args, **side).calculate()
    assert want["train/nonfinite_tokens"] == 5
    _same(got, want)
    assert fused


@kernel_test
def test_rl_kernel_k3_to_full_relative_precision():
    from decimal import Decimal, getcontext
    getcontext().prec = 60
    d = torch.tensor([[1e-12, -3e-9, 1e-6, -1e-4, 0.003, -0.2, 0.49, 0.5, -0.51, 2.0, -7.5, 30.0]],
                     dtype=torch.float64)
    m = torch.ones_like(d, dtype=torch.bool)
    for i in range(d.shape[1]):
        one = d[:, i:i + 1]
        r, _, _ = TR.token_stats([dict(lp=one, m=m[:, i:i + 1], old=torch.zeros_like(one))],
                                 columns=KERNEL_COLUMNS, block=16)
        x = Decimal(float(one))
        want = float(x.exp() - 1 - x)
        assert math.isclose(float(r["sum_kl"]), want, rel_tol=1e-14), (float(one), float(r["sum_kl"]), want)
        assert math.isclose(float(r["sum_ratio"]), float(x.exp()), rel_tol=1e-15)


@kernel_test
def test_rl_kernel_columns_carry_the_states_names():
    """One name per column: the kernel's sums and extremes are the policy states it fills, its
    record rows the records' fields."""
    from twinkle_metrics.metrics.rl.policy import records
    from twinkle_metrics.metrics.rl.policy.table import COLUMNS

    assert [c.name for c in COLUMNS if c.fused] == [n for n, _, _ in KERNEL_COLUMNS]
    assert sorted(n for n, _, _ in KERNEL_COLUMNS) == sorted(TR.SUMS + TR.EXTREMES)
    assert TR.RECORD_ROWS == records.FIELDS
    with pytest.raises(ValueError, match="'tokens'"):
        TR.token_stats([dict(lp=torch.zeros(1, 1), m=torch.ones(1, 1, dtype=torch.bool))],
                       columns=[("tokens", "sum", torch.int64)])


@kernel_test
def test_rl_kernel_blocks_rows_and_microbatches():
    """Two microbatches of other lengths, several blocks per row, into one buffer of partials."""
    g = torch.Generator().manual_seed(9)
    mbs, want_d, want_adv = [], [], []
    for b, s in ((3, 70), (2, 17)):
        lp = -torch.rand(b, s, generator=g, dtype=torch.float64)
        old = lp + 0.3 * torch.randn(b, s, generator=g, dtype=torch.float64)
        adv = torch.randn(b, 1, generator=g, dtype=torch.float64)
        m = torch.rand(b, s, generator=g) < 0.7
        mbs.append(dict(lp=lp, m=m, old=old, adv=adv, seq0=10 * len(mbs)))
        if s == 17:  # token ids and position ids of their own (a 1-D row of positions for every sequence)
            mbs[-1].update(tok=torch.randint(0, 1000, (b, s), generator=g),
                           pos=(torch.arange(s) + 5).expand(b, s))
        want_d.append(torch.where(m, lp - old, 0.0))
        want_adv.append(adv.expand(b, s)[m])
    # between them, one without old log-probs (and no counted token): no records of its own
    mbs.insert(1, dict(lp=lp[:, :5], m=torch.zeros_like(m[:, :5]), adv=adv))
    tot, records, rows = TR.token_stats(mbs, columns=KERNEL_COLUMNS, want_rows=True, want_key=True, token_clip=False,
                                        block=16)
    del mbs[1], rows[1]
    assert records.shape == (len(TR.RECORD_ROWS), 3 * 70 + 2 * 17)
    start = 0
    for mb, d, r in zip(mbs, want_d, rows):
        m = mb["m"]
        torch.testing.assert_close(r, torch.stack([d.sum(1), m.sum(1).double(), (mb["adv"] * m).sum(1)], 1),
                                   rtol=1e-13, atol=1e-13)
        b, s = m.shape
        key, seq, pos, tok, ratio, lp, old = records[:, start:start + b * s].view(len(TR.RECORD_ROWS), b, s)
        start += b * s
        k3 = torch.expm1(d) - d
        torch.testing.assert_close(key, torch.where(m & (k3 > 0), k3, -math.inf), rtol=1e-9, atol=0)
        assert torch.equal(lp[m], mb["lp"][m]) and torch.equal(old[m], mb["old"][m])
        torch.testing.assert_close(ratio[m], torch.exp(d)[m], rtol=1e-15, atol=0)
        assert torch.equal(seq, (mb["seq0"] + torch.arange(b, dtype=torch.float64))[:, None].expand(b, s))
        if "pos" in mb:   # given position ids, and token ids
            assert torch.equal(pos, mb["pos"].double()) and torch.equal(tok, mb["tok"].double())
        else:             # the column, and -1 for no labels
            assert torch.equal(pos, torch.arange(s, dtype=torch.float64).expand(b, s))
            assert (tok == -1).all()
    masks = [mb["m"] for mb in mbs]
    d_all = torch.cat([d[m] for d, m in zip(want_d, masks)])
    assert int(tot["n_tok"]) == sum(int(m.sum()) for m in masks) and tot["n_tok"].dtype == torch.int64
    assert float(tot["logr_min"]) == float(d_all.min()) and float(tot["logr_max"]) == float(d_all.max())
    assert float(tot["adv_min"]) == float(torch.cat(want_adv).min())
    assert math.isclose(float(tot["sum_diff"]), float(d_all.sum()), rel_tol=1e-13)
    assert int(tot["clip_low"]) == 0 and int(tot["n_ref"]) == 0 and float(tot["sum_ent"]) == 0.0


@kernel_test
@pytest.mark.parametrize("nan_policy", ["propagate", "skip"])
def test_dpo_through_triton_row_sums_matches_torch(fused, monkeypatch, nan_policy):
    b = make_rl_batch(6, n_seq=8, seq_len=45)
    lab, lp, ref = b["labels"], b["logps"].clone(), b["ref"].float()
    assert (lab[0] == -100).all()
    lp[0, 0] = float("nan")                                  # padding (seq 0 is all padding): ignored
    lp[3, (lab[3] != -100).nonzero()[0, 0]] = float("inf")  # a counted token: pair 1 non-finite
    calls = []
    real = TD.masked_row_sums
    monkeypatch.setattr(TD, "masked_row_sums", lambda *a, **k: calls.append(1) or real(*a, **k))
    lp_strided = lp.t().contiguous().t()
    for args, kw in [(({"labels": lab}, {"logps": lp_strided}), dict(ref_outputs={"logps": ref})),
                     (({"labels": lab}, {"logps": lp.float()}), {}),
                     (([{"labels": lab[:4]}, {"labels": lab[4:]}], [{"logps": lp[:4]}, {"logps": lp[4:]}]),
                      dict(ref_outputs=[{"logps": ref[:4]}, {"logps": ref[4:]}]))]:
        with numpy.errstate(invalid="ignore"):  # the interpreter's numpy meets the inf on purpose
            got = DPOMetric(nan_policy=nan_policy).accumulate(*args, **kw).calculate()
        with backend("torch"):
            want = DPOMetric(nan_policy=nan_policy).accumulate(*args, **kw).calculate()
        _same(got, want, rel=1e-12)
        assert want["logps/nonfinite_pairs"] == 1
    assert calls


@kernel_test
@pytest.mark.parametrize("nan_policy", ["propagate", "skip"])
def test_dpo_pair_statistics_kernel_matches_torch(fused, monkeypatch, nan_policy):
    """Every DPO form's pair statistics in one launch equal the torch path's: pre-summed
    pairs (with and without references, a NaN and an inf pair, ties, a strided view, more
    pairs than one block), quantiles, an empty batch, and a beta that float32 cannot hold."""
    g = torch.Generator().manual_seed(11)
    n = 1500  # more than one 1024-wide block
    c, r, rc, rr = (-50 * torch.rand(n, generator=g, dtype=torch.float64) for _ in range(4))
    r[:7] = c[:7] - rc[:7] + rr[:7]  # ties: chosen reward == rejected reward (not won)
    c[10] = float("nan")
    rr[11] = float("-inf")
    wide = torch.stack([c, r, c, r], 1)[:, ::2]  # a [n, 2] view with a column stride of 2
    calls = []
    real = TD.pair_stats
    monkeypatch.setattr(TD, "pair_stats", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    forms = [dict(chosen_logps=c, rejected_logps=r, ref_chosen_logps=rc, ref_rejected_logps=rr),
             dict(chosen_logps=wide[:, 0], rejected_logps=wide[:, 1]),
             dict(chosen_logps=c[:0], rejected_logps=r[:0], ref_chosen_logps=rc[:0], ref_rejected_logps=rr[:0])]
    for beta in (0.1, 1e-3):
        for outputs in forms:
            for quantiles in (None, (0.5, 0.9)):
                kw = dict(beta=beta, nan_policy=nan_policy, quantiles=quantiles)
                with numpy.errstate(invalid="ignore"):  # the NaN/inf pairs, on purpose
                    got = DPOMetric(**kw).accumulate(None, outputs).calculate()
                with backend("torch"):
                    want = DPOMetric(**kw).accumulate(None, outputs).calculate()
                _same(got, want, rel=1e-12)
                if len(outputs["chosen_logps"]):
                    assert want["logps/nonfinite_pairs"] == (2 if "ref_chosen_logps" in outputs else 1)
    assert len(calls) == 2 * len(forms) * 2
    # the counts themselves, beside the torch path's
    m = DPOMetric(beta=0.1, nan_policy=nan_policy)
    with numpy.errstate(invalid="ignore"):
        m.accumulate(None, forms[0])
    s = m.states
    keep = torch.ones(n, dtype=torch.bool)
    keep[10:12] = False
    won = (0.1 * (c - rc) > 0.1 * (r - rr))
    assert int(s["n_bad"]) == 2
    assert int(s["correct"]) == int((won & keep).sum())
    assert int(s["pairs"]) == (n - 2 if nan_policy == "skip" else n)


def _moe_states_both_paths(monkeypatch, make, calls):
    """(kernel path states, torch path states) after ``calls(metric)``."""
    from twinkle_metrics.kernels import moe_triton as triton_moe
    launched = []
    real = triton_moe.layer_rows
    monkeypatch.setattr(triton_moe, "layer_rows", lambda **k: launched.append(1) or real(**k))
    with backend("triton"):
        fused = make()
        with numpy.errstate(invalid="ignore", divide="ignore", over="ignore"):  # NaN/inf rows, on purpose
            calls(fused)
        assert launched and _triton.failed is None
    with backend("torch"):
        plain = make()
        calls(plain)
    return fused, plain


def _assert_same_states(fused, plain):
    for name, want in plain.states.items():
        got = fused.states[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        if want.is_floating_point():
            torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-9, equal_nan=True, msg=name)
        else:
            assert torch.equal(got, want), (name, got, want)


@kernel_test
@pytest.mark.parametrize("nan_policy", ["propagate", "skip"])
@pytest.mark.parametrize("experts", [6, 16, 60])
def test_moe_routing_kernels_match_torch(monkeypatch, nan_policy, experts):
    """Counts, entropy (from logits, with -inf experts and NaN / +inf / all -inf rows; from
    probabilities, with rows summing to 0), token masks, losses (one NaN), dropped tokens
    (int and tensor): the same states as the torch path, over several calls and layers,
    tokens spread over many programs, every logits dtype."""
    from twinkle_metrics import MoERoutingMetric
    from twinkle_metrics.kernels import moe_triton as triton_moe
    monkeypatch.setattr(triton_moe, "TILE", 256)  # several programs even for small batches,
    monkeypatch.setattr(triton_moe, "ROWS_TILE", 16)  # and their partial rows read over several steps
    g = torch.Generator().manual_seed(experts)
    t = 77
    routing = torch.rand(t, experts, generator=g) < 0.3
    logits = torch.randn(t, experts, generator=g, dtype=torch.float64) * 3
    logits[:, 0] = float("-inf")          # an expert nobody may pick
    logits[3, 2] = float("nan")
    logits[4, 1] = float("inf")
    logits[5] = float("-inf")             # no distribution at all: NaN, as log_softmax gives
    probs = torch.softmax(torch.randn(t, experts, generator=g, dtype=torch.float64), -1)
    probs[probs < 0.05] = 0.0
    probs[7] = 0.0                        # a token every expert dropped: left out
    probs[8, 1] = float("nan")
    mask = torch.rand(t, generator=g) < 0.8
    mask[3:6] = True                     # the three bad rows count

    def calls(m):
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            m.observe(1, routing_map=routing, router_logits=logits.to(dtype), token_mask=mask,
                      aux_loss=torch.tensor(0.25), z_loss=torch.tensor(float("nan")), tokens_dropped=3)
        m.observe(2, routing_map=routing.view(7, 11, experts).to(torch.int32),
                  router_probs=probs.float().view(7, 11, experts), tokens_dropped=torch.tensor(5))
        m.observe(0, router_probs=probs, aux_loss=torch.tensor(1.5, dtype=torch.float64))
        m.observe(3, routing_map=routing[:1])           # one token: one program
        m.observe(3, z_loss=torch.tensor(0.125))        # losses only: no token kernel

    fused, plain = _moe_states_both_paths(
        monkeypatch, lambda: MoERoutingMetric(num_layers=4, num_experts=experts, nan_policy=nan_policy), calls)
    _assert_same_states(fused, plain)
    assert int(plain.states["nonfinite"][1]) == 4 * (3 + 1)  # three bad rows kept by the mask, NaN z
    with numpy.errstate(invalid="ignore"):
        got, want = fused.calculate(), plain.calculate()
    assert got.keys() == want.keys()
    for k, w in want.items():
        assert (math.isnan(w) and math.isnan(got[k])) or math.isclose(got[k], w, rel_tol=1e-5), k


@kernel_test
def test_moe_routing_kernel_takes_the_hooks_fields(monkeypatch):
    """What ``register_router_hooks`` passes (bool routing map, float32 logits, a padding
    mask, 0-d losses, a dropped count as a 0-d tensor): two launches, same states."""
    from twinkle_metrics import MoERoutingMetric
    from twinkle_metrics.kernels import moe_triton as triton_moe
    launches = []
    for name in ("_tokens_kernel", "_rows_kernel"):
        monkeypatch.setattr(triton_moe, name, _launch_allowing_host_reads(getattr(triton_moe, name), launches))
    g = torch.Generator().manual_seed(0)
    routing = torch.rand(512, 8, generator=g) < 0.25
    logits = torch.randn(512, 8, generator=g)
    valid = torch.rand(512, generator=g) < 0.9

    def calls(m):
        m.observe(1, routing_map=routing, router_logits=logits, token_mask=valid, aux_loss=torch.tensor(0.01),
                  z_loss=torch.tensor(0.001), tokens_dropped=routing.sum() - (routing & valid[:, None]).sum())
        # a strided mask (every other flag of a longer one) and an expanded one (one flag for all)
        m.observe(0, routing_map=routing, token_mask=torch.stack([valid, ~valid], 1).reshape(-1)[::2])
        m.observe(0, router_logits=logits, token_mask=torch.tensor([True]).expand(512))

    fused, plain = _moe_states_both_paths(monkeypatch, lambda: MoERoutingMetric(num_layers=2, num_experts=8), calls)
    assert len(launches) == 6  # two a call
    _assert_same_states(fused, plain)
    assert int(fused.states["counts"][1].sum()) == int((routing & valid[:, None]).sum())


def _ppo_calls(seed):
    """PPOValueMetric calls in the forms users pass: dense, per-sequence advantages, ragged
    old values, microbatch lists with a side input missing in one, NaN/inf at counted and at
    masked positions, a value offset that cancels in float32 sums, blocks over several programs."""
    b = make_rl_batch(seed, n_seq=8, seq_len=1100 if seed else 45)
    lab = b["labels"]
    v = (b["logps"] + 1e4).float()         # a large common level: the moments must keep the spread
    ret, old = b["ref"] + 1e4, b["old"] + 1e4
    v[0, 0] = float("nan")                  # seq 0 is all padding: ignored
    counted = (lab[2] != -100).nonzero()[:, 0]
    v[2, counted[0]] = float("inf")
    ret[3, (lab[3] != -100).nonzero()[0, 0]] = float("nan")
    feats = [{"labels": lab[:3]}, {"labels": lab[3:]}]
    return [
        (({"labels": lab}, {"values": v}), dict(old_values=old, returns=ret, advantages=b["adv"])),
        (({"labels": lab}, {"values": v.double()}), dict(old_values=ragged(old, lab), returns=ret)),
        ((feats, [{"values": v[:3]}, {"values": v[3:]}]),
         dict(old_values=[None, old[3:]], returns=[ret[:3], ret[3:]], advantages=[b["adv"][:3], b["adv"][3:]])),
        (({"labels": lab}, {"values": v}), dict(advantages=b["adv"].tolist())),
    ]


@kernel_test
@pytest.mark.parametrize("nan_policy", ["propagate", "skip"])
@pytest.mark.parametrize("seed", [0, 1])
def test_ppo_value_kernels_match_torch(triton_path, monkeypatch, nan_policy, seed):
    from twinkle_metrics import PPOValueMetric
    from twinkle_metrics.kernels import ppo_triton as triton_ppo
    launched = []
    real = triton_ppo.token_stats
    monkeypatch.setattr(triton_ppo, "token_stats", lambda *a, **k: launched.append(1) or real(*a, **k))
    for args, kw in _ppo_calls(seed):
        make = lambda: PPOValueMetric(epsilon=0.1, nan_policy=nan_policy)  # noqa: E731
        fused = make()
        with numpy.errstate(invalid="ignore"):  # the NaN/inf tokens, on purpose
            fused.accumulate(*args, **kw).accumulate(*args, **kw)
        with backend("torch"):
            plain = make().accumulate(*args, **kw).accumulate(*args, **kw)
        for name, want in plain.states.items():
            got = fused.states[name]
            assert got.dtype == want.dtype, name
            if want.is_floating_point():
                torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, equal_nan=True, msg=name)
            else:
                assert torch.equal(got, want), (name, got, want)
        _same(fused.calculate(), plain.calculate(), rel=1e-9)
    assert _triton.failed is None and len(launched) == 2 * len(_ppo_calls(seed))


@kernel_test
def test_rollout_sequence_kernel_matches_torch(monkeypatch):
    """The sequence statistics from per-sequence (sum of d, tokens): sequences without a
    token left out (NaN there too), log-ratio sums of hundreds (the ESS shift), more
    sequences than one block, a NaN and an inf sum, and sequences none of which has a token."""
    g = torch.Generator().manual_seed(3)
    n = 100
    parts = torch.stack([torch.randn(n, generator=g, dtype=torch.float64) * 300,
                         torch.randint(0, 5, (n,), generator=g).double()], 1)
    parts[parts[:, 1] == 0, 0] = 0.0
    parts[7] = torch.tensor([float("nan"), 0.0])   # no token: ignored, NaN and all
    cases = {"plain": parts, "strided": torch.cat([parts, parts], 1)[:, ::2].clone().t().contiguous().t()}
    nan, inf = parts.clone(), parts.clone()
    nan[3] = torch.tensor([float("nan"), 2.0])
    inf[4] = torch.tensor([float("inf"), 1.0])
    cases.update(nan=nan, inf=inf, empty_rows=torch.zeros(5, 2, dtype=torch.float64))
    m = RolloutMismatchMetric()
    for name, x in cases.items():
        with backend("torch"):
            want = m._sequence_sums(x, None)
        with numpy.errstate(invalid="ignore", over="ignore"):
            got = TRO.sequence_stats(x, block=16)
        assert got.keys() == want.keys(), name
        for k in want:
            same = int(got[k]) == int(want[k]) if k == "n_seq" else \
                torch.allclose(got[k], want[k].to(torch.float64), rtol=1e-12, atol=0, equal_nan=True)
            assert same, (name, k, got, want)


@kernel_test
def test_top_kl_record_ties_are_the_same_tokens_on_both_paths(fused):
    """Every token has the same k3: the kernel path (one selection over the call's records)
    and the torch path (one per microbatch, then one over their candidates) keep the same,
    earliest tokens."""
    labs = [torch.ones(2, 40, dtype=torch.long), torch.ones(2, 41, dtype=torch.long)]
    lps = [torch.full(lab.shape, -1.0, dtype=torch.float64) for lab in labs]
    olds = [x - 0.5 for x in lps]

    def records():
        m = GRPOMetric(top_k_kl=3)
        m.accumulate([{"labels": lab} for lab in labs], [{"logps": x} for x in lps], old_logps=olds,
                     advantages=[torch.ones(2), torch.ones(2)])
        return [(r["gsi"], r["pos"]) for r in m.calculate()["_high_kl_records"]]

    got = records()
    assert fused  # the kernel path ran
    with backend("torch"):
        want = records()
    assert got == want == [(0, 0), (0, 1), (0, 2)]


@kernel_test
def test_row_sums_kernel_long_rows_and_views():
    g = torch.Generator().manual_seed(2)
    a = torch.randn(3, 300, generator=g, dtype=torch.float64)
    b = torch.randn(300, 3, generator=g).t()          # float32, transposed view
    m = torch.rand(3, 300, generator=g) < 0.5
    a[~m] = float("nan")                               # never read
    got = TD.masked_row_sums(a, m, b, block=64)        # 5 blocks per row
    want = torch.stack([torch.where(m, a, 0.0).sum(1), torch.where(m, b.double(), 0.0).sum(1)], 1)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(TD.masked_row_sums(a, m), want[:, :1], rtol=1e-13, atol=1e-13)


@beside_the_child  # its own interpreted subprocess: in parallel with the child
def test_gpu_bench_script_runs_end_to_end_dry():
    """The GPU benchmark, whole, at tiny shapes on the CPU: the one GPU call must not be
    the first time it runs. Its results are compared between the two paths."""
    import json
    root = os.path.abspath(os.path.join(__file__, "../../.."))
    env = dict(os.environ, GPU_BENCH_DRY="1", TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "gpu_bench.py")], cwd=root, env=env,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout)
    assert out["triton"] and out["saved"] is None
    assert out["accuracy_equal"] and out["entropy_rel_diff"] < 1e-5
    assert set(out["rl_median_ms"]) == {"one_pass_floor", "grpo_torch", "dpo_torch", "rollout_torch", "ppo_torch",
                                        "moe_layer_torch", "grpo_triton", "dpo_triton", "rollout_triton",
                                        "ppo_triton", "moe_layer_triton", "grpo_triton_new_metric",
                                        "dpo_triton_new_metric"}
    assert {"accuracy_triton", "accuracy_triton_new_metric", "grpo_entropy_triton",
            "grpo_entropy_triton_new_metric"} <= set(out["ratio_to_read_ceiling"])
    assert max(out["rl_max_rel_diff"].values()) < 1e-9 and out["triton_failed"] is None
    assert set(out["rl_max_rel_diff"]) == {"grpo", "dpo", "rollout", "ppo"} and out["moe_max_rel_diff"] < 1e-5


@beside_the_child  # its own interpreted subprocess: in parallel with the child
def test_gpu_tune_script_runs_end_to_end_dry():
    """The GPU tuning sweep, whole, at tiny shapes on the CPU (as gpu_bench above): every
    kernel variant it times runs, and every accumulate it profiles takes the kernel path."""
    import json
    root = os.path.abspath(os.path.join(__file__, "../../.."))
    env = dict(os.environ, GPU_BENCH_DRY="1", TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "gpu_tune.py")], cwd=root, env=env,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.split("\n=====")[0])
    assert set(out["kernels"]["best"]) == {"entropy_lean", "entropy_selects", "argmax_hits"}
    assert all(v["host_ms"] > 0 and v["gpu_event_ms"] > 0 for v in out["accumulate"].values())
    assert out["triton_failed"] is None
    assert r.stdout.count("===== cProfile") == 4


class _Broken:
    """A kernel whose launch fails, as a compile error on an unsupported GPU would."""

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise RuntimeError("PTX target not supported (simulated)")
        return launch


@kernel_test
def test_failed_kernel_falls_back_to_torch_with_one_warning(fused, monkeypatch):
    b = make_rl_batch(8)
    args = ({"labels": b["labels"]}, {"logps": b["logps"]})
    side = dict(old_logps=b["old"], advantages=b["adv"], ref_logps=b["ref"])
    with backend("torch"):
        want = GRPOMetric(top_k_kl=2).accumulate(*args, **side).calculate()
    monkeypatch.setattr(TR, "_rl_kernel", _Broken())
    m = GRPOMetric(top_k_kl=2)
    with pytest.warns(RuntimeWarning, match="Triton kernel path failed .*PTX target not supported"):
        m.accumulate(*args, **side)
    assert _triton.failed is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m.accumulate(*args, **side)      # torch path from now on, silently
    two = GRPOMetric(top_k_kl=2).accumulate(*args, **side).accumulate(*args, **side).calculate()
    got = m.calculate()
    assert got == two                    # nothing lost or counted twice
    assert got["train/approx_kl"] == want["train/approx_kl"] and got["train/clip_ratio"] == want["train/clip_ratio"]


@kernel_test
def test_failed_logits_kernels_fall_back(triton_path, monkeypatch):
    b = make_rl_batch(5)
    kw = dict(inputs={"labels": b["labels"]}, outputs={"logps": b["logps"], "logits": b["logits"].float()})
    with backend("torch"):
        want_h = GRPOMetric(entropy_from_logits=True).accumulate(**kw).calculate()
        want_a = Accuracy().accumulate({"labels": b["labels"]}, {"logits": b["logits"].float()}).calculate()
    monkeypatch.setattr(TE, "_partials_lean_kernel", _Broken())  # the default kernel
    with pytest.warns(RuntimeWarning, match="entropy partials"):
        got_h = GRPOMetric(entropy_from_logits=True).accumulate(**kw).calculate()
    assert math.isclose(got_h["train/entropy"], want_h["train/entropy"], rel_tol=1e-12)
    backend("triton")  # chosen again: the entropy kernel's failure is forgotten
    monkeypatch.setattr(TA, "_argmax_kernel", _Broken())
    with pytest.warns(RuntimeWarning, match="argmax"):
        got_a = Accuracy().accumulate({"labels": b["labels"]}, {"logits": b["logits"].float()}).calculate()
    assert got_a == want_a


@pytest.fixture
def fused_rollout(triton_path, monkeypatch):
    """The kernel paths for RolloutMismatchMetric; records how many microbatches each call
    of the kernel path took."""
    calls = []
    real = TRO.token_stats
    monkeypatch.setattr(TRO, "token_stats", lambda batches, **k: calls.append(len(batches)) or real(batches, **k))
    return calls


def _rollout_calls(seed):
    """(inputs, outputs, rollout_logps, microbatches the kernel should take, non-finite tokens)."""
    b = make_rl_batch(seed, n_seq=6, seq_len=37)
    lab, lp, roll = b["labels"], b["logps"].clone(), b["old"].clone()
    counted = (lab != -100).nonzero().tolist()
    pad = (lab == -100).nonzero().tolist()
    lp[tuple(pad[0])] = float("nan")       # padding: never read
    roll[tuple(pad[1])] = float("-inf")
    lp[tuple(pad[-1])] = float("inf")
    yield {"labels": lab}, {"logps": lp}, roll, 1, 0
    yield {"labels": lab}, {"logps": lp.float()}, roll.float(), 1, 0
    yield {"labels": lab}, {"logps": lp.float()}, roll, 1, 0  # float32 trainer, float64 engine
    # two microbatches, [s, b] layouts (transposed views) for both inputs of the first
    lp_t, roll_t = lp.t().contiguous().t(), roll.float().t().contiguous().t()
    yield ([{"labels": lab[:2]}, {"labels": lab[2:]}], [{"logps": lp_t[:2]}, {"logps": lp[2:]}],
           [roll_t[:2], roll[2:]], 2, 0)
    # the middle microbatch's ragged rollout log-probs take the torch path, the others the kernel
    three = [slice(0, 2), slice(2, 4), slice(4, 6)]
    yield ([{"labels": lab[i]} for i in three], [{"logps": lp[i]} for i in three],
           [roll[three[0]], ragged(roll[three[1]], lab[three[1]]), roll[three[2]].float()], 2, 0)
    # counted non-finite tokens: d = +inf (finite extremes turn inf), then NaN d as well
    lp2, roll2 = lp.clone(), roll.clone()
    roll2[tuple(counted[4])] = float("-inf")
    yield {"labels": lab}, {"logps": lp2}, roll2, 1, 1
    lp2[tuple(counted[11])] = float("nan")
    lp2[tuple(counted[-1])] = float("-inf")
    yield ([{"labels": lab[:3]}, {"labels": lab[3:]}], [{"logps": lp2[:3]}, {"logps": lp2[3:].float()}],
           [roll2[:3], roll2[3:]], 2, 3)


@kernel_test
@pytest.mark.parametrize("nan_policy", ["propagate", "skip"])
@pytest.mark.parametrize("kw", [dict(is_threshold=1.2), dict(is_threshold=1.5, is_threshold_low=0.0)])
def test_rollout_one_kernel_path_matches_torch(fused_rollout, monkeypatch, nan_policy, kw):
    seq_parts = []  # the per-sequence (sum of d, tokens) handed on: in sequence order under CP
    real = RolloutMismatchMetric._sequence_sums
    monkeypatch.setattr(RolloutMismatchMetric, "_sequence_sums",
                        lambda self, parts, group: seq_parts.append(parts) or real(self, parts, group))
    for inputs, outputs, roll, n_fused, n_bad in _rollout_calls(5):
        fused_rollout.clear()
        with numpy.errstate(invalid="ignore"):  # the interpreter's numpy meets the NaN/inf on purpose
            got = RolloutMismatchMetric(nan_policy=nan_policy, **kw).accumulate(
                inputs, outputs, rollout_logps=roll).calculate()
        assert fused_rollout == [n_fused]  # one call of the kernel path, for the dense microbatches
        with backend("torch"):
            want = RolloutMismatchMetric(nan_policy=nan_policy, **kw).accumulate(
                inputs, outputs, rollout_logps=roll).calculate()
        assert want.get("rollout/nonfinite_tokens", 0) == n_bad
        assert 0 < want["rollout/is_fraction_high"] < 1 or n_bad and nan_policy == "propagate"
        _same(got, want)
        torch.testing.assert_close(seq_parts[0], seq_parts[1], rtol=1e-13, atol=1e-13, equal_nan=True)
        seq_parts.clear()


@kernel_test
@pytest.mark.parametrize("skip", [False, True])
def test_rollout_kernel_extremes_and_rows_over_blocks(skip):
    """Two microbatches of other lengths, five blocks per row (some past the shorter
    rows), into one buffer; a NaN and a -inf d in late blocks; padding is NaN."""
    g = torch.Generator().manual_seed(11)
    mbs = []
    for b, s, dtype in ((3, 70, torch.float64), (2, 17, torch.float32)):
        lp = -torch.rand(b, s, generator=g, dtype=torch.float64).to(dtype)
        roll = (lp + 0.6 * torch.randn(b, s, generator=g, dtype=torch.float64)).to(dtype)
        has = torch.rand(b, s, generator=g) < 0.7
        lp[~has] = float("nan")                  # never read
        mbs.append(dict(lp=lp, roll=roll, has=has))
    mbs[0]["has"][1, 66] = mbs[0]["has"][2, 40] = mbs[1]["has"][0, 16] = True
    mbs[0]["lp"][1, 66] = float("nan")           # block 4 of row 1
    mbs[0]["roll"][2, 40] = float("inf")         # d = -inf, block 2 of row 2
    hi, lo = math.log(1.3), math.log(0.8)
    with numpy.errstate(invalid="ignore"):
        tot, rows = TRO.token_stats(mbs, lo=lo, hi=hi, skip=skip, block=16)
    ds, hs = [], []
    for mb, r in zip(mbs, rows):
        lp, roll, has = mb["lp"].double(), mb["roll"].double(), mb["has"]
        bad = has & ~(torch.isfinite(lp) & torch.isfinite(roll))
        if skip:
            has = has & ~bad
        d = torch.where(has, lp - roll, 0.0)
        torch.testing.assert_close(r, torch.stack([d.sum(1), has.sum(1).double()], 1), rtol=1e-13, atol=1e-13,
                                   equal_nan=True)
        ds.append(d[has])
        hs.append(has)
    d = torch.cat(ds)
    assert int(tot["n_tok"]) == d.numel() and tot["n_tok"].dtype == tot["n_bad"].dtype == torch.int64
    assert int(tot["n_bad"]) == 2
    fin = d[~d.isnan()]
    if skip:
        assert not d.isnan().any() and d.isinf().sum() == 0
        assert float(tot["d_min"]) == float(fin.min()) and float(tot["d_max"]) == float(fin.max())
        assert float(tot["abs_max"]) == float(fin.abs().max())
        assert float(tot["n_high"]) == int((fin > hi).sum()) and float(tot["n_low"]) == int((fin < lo).sum())
    else:
        for k in ("abs_max", "d_max", "d_min", "n_high", "n_low", "sum_d", "sum_em"):
            assert math.isnan(float(tot[k])), k
    fin = fin[fin.isfinite()]
    assert 0 < (fin.abs() > 0.5).sum() < fin.numel()  # both branches of expm1 / k3
    if skip:
        assert math.isclose(float(tot["sum_em"]), float(torch.expm1(fin).sum()), rel_tol=1e-13)
        assert math.isclose(float(tot["sum_em2"]), float((torch.expm1(fin) ** 2).sum()), rel_tol=1e-13)
        assert math.isclose(float(tot["sum_k3"]), float((torch.expm1(-fin) + fin).sum()), rel_tol=1e-12)
        assert math.isclose(float(tot["sum_abs"]), float(fin.abs().sum()), rel_tol=1e-13)
        lp_sum = sum(float(torch.where(h, mb["lp"].double(), 0.0).sum()) for mb, h in zip(mbs, hs))
        assert math.isclose(float(tot["sum_lp_train"]), lp_sum, rel_tol=1e-13)


@kernel_test
def test_rollout_kernel_empty_extremes_and_k3_precision():
    """No counted token: neutral extremes; tiny d: k3 to full relative precision."""
    from decimal import Decimal, getcontext
    getcontext().prec = 60
    z = torch.zeros(2, 5, dtype=torch.float64)
    tot, rows = TRO.token_stats([dict(lp=z, roll=z, has=torch.zeros(2, 5, dtype=torch.bool))], lo=-1.0, hi=1.0)
    assert float(tot["abs_max"]) == float(tot["d_max"]) == -math.inf and float(tot["d_min"]) == math.inf
    assert int(tot["n_tok"]) == 0 and rows[0].tolist() == [[0.0, 0.0], [0.0, 0.0]]
    for x in (1e-12, -3e-9, 1e-5, -0.2, 0.49, -0.5, 0.51, 3.0):
        one = torch.tensor([[x]], dtype=torch.float64)
        tot, _ = TRO.token_stats([dict(lp=one, roll=torch.zeros_like(one), has=torch.ones(1, 1, dtype=torch.bool))],
                                 lo=-1.0, hi=1.0)
        dx = Decimal(x)
        assert math.isclose(float(tot["sum_k3"]), float((-dx).exp() - 1 + dx), rel_tol=1e-14), x
        assert math.isclose(float(tot["sum_em"]), float(dx.exp() - 1), rel_tol=1e-15), x


@kernel_test
def test_failed_rollout_kernel_falls_back_to_torch_with_one_warning(fused_rollout, monkeypatch):
    b = make_rl_batch(8)
    args = ({"labels": b["labels"]}, {"logps": b["logps"]})
    side = dict(rollout_logps=b["old"])
    with backend("torch"):
        want = RolloutMismatchMetric().accumulate(*args, **side).calculate()
    monkeypatch.setattr(TRO, "_rollout_kernel", _Broken())
    m = RolloutMismatchMetric()
    with pytest.warns(RuntimeWarning, match="Triton kernel path failed .*rollout.*PTX target not supported"):
        m.accumulate(*args, **side)
    assert _triton.failed is not None and fused_rollout == [1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m.accumulate(*args, **side)      # torch path from now on, silently
    assert fused_rollout == [1]
    two = RolloutMismatchMetric().accumulate(*args, **side).accumulate(*args, **side).calculate()
    got = m.calculate()
    assert got == two                    # nothing lost or counted twice
    assert got["rollout/mismatch_k3_kl"] == want["rollout/mismatch_k3_kl"]
    assert got["rollout/seq_ess"] == want["rollout/seq_ess"]


def _launch_allowing_host_reads(real, launches=None):
    """A kernel as launched, its interpreter's numpy traffic allowed (on CUDA it is one
    launch); each launch is appended to ``launches``."""
    from twinkle_metrics.comm.host import host_reads

    class Interpreted:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                if launches is not None:
                    launches.append(grid)
                with host_reads():
                    return real[grid](*args, **kwargs)
            return launch
    return Interpreted()


@kernel_test
def test_rollout_one_kernel_path_never_waits_for_the_device(fused_rollout, monkeypatch):
    from twinkle_metrics.testing import forbid_device_waits
    monkeypatch.setattr(TRO, "_rollout_kernel", _launch_allowing_host_reads(TRO._rollout_kernel))
    b = make_rl_batch(2, n_seq=6, seq_len=40)
    lab, lp, roll = b["labels"], b["logps"], b["old"]
    m = RolloutMismatchMetric()
    with forbid_device_waits():
        m.accumulate([{"labels": lab[:2]}, {"labels": lab[2:]}], [{"logps": lp[:2]}, {"logps": lp[2:]}],
                     rollout_logps=[roll[:2], roll[2:]])
    assert fused_rollout == [2]
    assert m.calculate()["rollout/seq_ess"] > 0


@kernel_test
def test_float_bounds_reach_the_kernels_as_float64_constants():
    """A runtime Python float argument is float32 on the GPU (the interpreter keeps it a
    double, so no comparison here could show it): the clip and threshold bounds, compared
    with float64 log-ratios, must be constexpr to keep their float64 value."""
    import inspect

    from twinkle_metrics.kernels import ppo_triton as triton_ppo
    from twinkle_metrics.kernels import rollout_triton as triton_rollout
    for kernel, names in ((TR._rl_kernel, ("LO", "HI")), (triton_rollout._rollout_kernel, ("LO", "HI")),
                          (TD._pair_kernel, ("BETA",)), (triton_ppo._tokens_kernel, ("EPS",))):
        params = inspect.signature(kernel.fn).parameters
        assert all("constexpr" in str(params[name].annotation) for name in names), kernel.fn.__name__


@kernel_test
@pytest.mark.parametrize("case", ["grpo-topk", "gspo", "dpo"])
def test_rl_and_dpo_one_kernel_paths_never_wait_for_the_device(fused, monkeypatch, case):
    from twinkle_metrics.testing import forbid_device_waits
    launches = []
    monkeypatch.setattr(TR, "_rl_kernel", _launch_allowing_host_reads(TR._rl_kernel, launches))
    monkeypatch.setattr(TD, "_row_sums_kernel", _launch_allowing_host_reads(TD._row_sums_kernel, launches))
    monkeypatch.setattr(TD, "_pair_kernel", _launch_allowing_host_reads(TD._pair_kernel, launches))
    b = make_rl_batch(3, n_seq=6, seq_len=40)
    lab, lp, old, ref, adv = b["labels"], b["logps"], b["old"], b["ref"], b["adv"]
    feats, outs = [{"labels": lab[:2]}, {"labels": lab[2:]}], [{"logps": lp[:2]}, {"logps": lp[2:]}]
    if case == "dpo":
        m = DPOMetric()
        call = dict(ref_outputs=[{"logps": ref[:2]}, {"logps": ref[2:]}])
    else:
        m = GRPOMetric(top_k_kl=3) if case == "grpo-topk" else GSPOMetric()
        call = dict(old_logps=[old[:2], old[2:]], advantages=[adv[:2], adv[2:]], ref_logps=[ref[:2], ref[2:]])
    with forbid_device_waits():
        m.accumulate(feats, outs, **call)
    # one kernel per microbatch (DPO: and one for the pair statistics of the call)
    assert len(launches) == (3 if case == "dpo" else 2)
    assert m.calculate()


# ------------------------------------------------------- compiled for real GPUs (no GPU needed)
SPILL_BYTES_ALLOWED = 64


@pytest.mark.skipif(INTERPRETED, reason="compiles in the parent; the child interprets")
@pytest.mark.parametrize("arch", [90, 80])
def test_every_kernel_compiles_to_a_cubin_for_hopper_and_ampere(arch, tmp_path, monkeypatch):
    """Every kernel variant the metrics launch goes through triton's whole CUDA pipeline (TTIR,
    TTGIR, LLVM, PTX, ptxas) for sm_90 (H100/H200) and sm_80 (A100): a kernel the
    interpreter runs but the compiler rejects (or whose float64 exp does not link) fails
    here, not on the user's first step. On contiguous rows each must load in vectors and
    keep its working set in registers: a streaming kernel that does neither is far from
    the memory bandwidth it should reach."""
    from triton.backends.compiler import GPUTarget

    from twinkle_metrics.kernels.build import compile_variant, global_loads, narrow_loads, ptxas_report, variants
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # built fresh; nothing written outside the test
    target = GPUTarget("cuda", arch, 32)
    failed, reported = [], 0
    for v in variants():
        label = v.label
        try:
            compiled = compile_variant(v, target)
            assert compiled.asm.get("cubin"), "no cubin"
            ptx = compiled.asm["ptx"]
            spills = ptxas_report(ptx, arch).get("spill_bytes")
            reported += spills is not None
            # a few bytes (a value or three parked around a reduction: up to 20 on sm_80 with
            # Triton 3.9, 24 with the GPU image's 3.6) cost nothing; a kernel that spills its
            # working set would show hundreds
            assert spills is None or spills <= SPILL_BYTES_ALLOWED, f"{spills} bytes of register spills"
            # contiguous rows: every load moves >= 32 bits a thread, some move 128 (a one-program
            # finishing kernel reads a few hundred bytes: only that it compiles counts)
            narrow = sum(narrow_loads(ptx).values())
            assert not v.streaming or narrow <= v.narrow_ok, f"element-wise loads {narrow_loads(ptx)}"
            assert not v.streaming or any(k.startswith("v") for k in global_loads(ptx)), \
                f"no vector load {global_loads(ptx)}"
        except Exception as e:  # noqa: BLE001 - report every variant that fails
            failed.append(f"{label}: {type(e).__name__}: {str(e)[:300]}")
    assert not failed, "\n".join(failed)
    assert reported, "triton's ptxas reported no register use for any kernel: the spill check did not run"


@pytest.mark.skipif(INTERPRETED, reason="compiles in the parent; the child interprets")
def test_default_entropy_kernel_issues_fewer_instructions_per_logit(tmp_path, monkeypatch):
    """The first entropy kernel is bound by instruction issue on an H200 (24 PTX instructions
    per logit take longer than reading the logit); the default one must stay well below it on
    its common path (no rescale), or the kernel loses the point of being the default."""
    from triton.backends.compiler import GPUTarget

    from twinkle_metrics.kernels.build import compile_variant, loop_instructions, variants
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    target = GPUTarget("cuda", 90, 32)
    by_label = {v.label: v for v in variants()}
    lean = loop_instructions(compile_variant(by_label["entropy bf16 scaled=False"], target).asm["ptx"])
    first = loop_instructions(compile_variant(by_label["entropy selects bf16"], target).asm["ptx"])
    assert lean[0] < lean[1]               # the rescale is a branch off the common path
    assert lean[0] < 0.7 * first[0], (lean, first)


@pytest.mark.skipif(INTERPRETED, reason="compiles in the parent; the child interprets")
def test_dpo_beta_reaches_the_pair_kernel_as_a_float64_constant(tmp_path, monkeypatch):
    """beta = 0.1 has no exact float32 value; the rewards and the won/lost compare must use
    its float64 one, as the torch path does."""
    from triton.backends.compiler import GPUTarget

    from twinkle_metrics.kernels.build import compile_variant, variants
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    v = next(v for v in variants() if v.label == "DPO pairs w=4 skip=False")
    assert v.const["BETA"] == 0.1
    ptx = compile_variant(v, GPUTarget("cuda", 90, 32)).asm["ptx"]
    assert "0d3FB999999999999A" in ptx  # 0.1 as a float64 immediate
    assert "0f3DCCCCCD" not in ptx       # not as a float32 one


_CPU_CHECK = r"""
import math, torch
from tests.rlref import make_rl_batch
from twinkle_metrics import Accuracy, DPOMetric, GRPOMetric, RolloutMismatchMetric
from twinkle_metrics.kernels import argmax_triton, dpo_triton, entropy_triton, rl_triton, rollout_triton
from twinkle_metrics.kernels import backend
from twinkle_metrics.kernels import dispatch as _triton
assert backend.current() == "triton", backend.current()
assert _triton.device_ok(torch.zeros(1)), "CPU tensors should take the kernels"
used = []
for mod, name in ((rl_triton, "token_stats"), (dpo_triton, "masked_row_sums"), (rollout_triton, "token_stats"),
                  (entropy_triton, "triton_token_partials"), (argmax_triton, "triton_argmax_hits_joined")):
    def counted(*a, _real=getattr(mod, name), _tag=mod.__name__ + "." + name, **k):
        used.append(_tag)
        return _real(*a, **k)
    setattr(mod, name, counted)
b = make_rl_batch(11, n_seq=6, seq_len=24)
lab, lp, old, ref, adv, z = b["labels"], b["logps"], b["old"], b["ref"], b["adv"], b["logits"].float()
def run():
    out = {}
    out.update(GRPOMetric(entropy_from_logits=True, top_k_kl=2).accumulate(
        {"labels": lab}, {"logps": lp, "logits": z}, old_logps=old, advantages=adv, ref_logps=ref).calculate())
    out.update(DPOMetric().accumulate({"labels": lab}, {"logps": lp}, ref_outputs={"logps": ref}).calculate())
    out.update(RolloutMismatchMetric().accumulate({"labels": lab}, {"logps": lp}, rollout_logps=old).calculate())
    out.update(Accuracy().accumulate({"labels": lab}, {"logits": z}).calculate())
    return out
got = run()
assert _triton.failed is None, _triton.failed
backend("torch")
want = run()
assert got.keys() == want.keys()
for k, w in want.items():
    if isinstance(w, float):
        assert math.isclose(got[k], w, rel_tol=1e-5, abs_tol=1e-12), (k, got[k], w)
print(sorted(set(used)))
"""


@pytest.mark.skipif(INTERPRETED, reason="reads the switches in fresh processes")
@pytest.mark.parametrize("env, chosen", [
    ({}, "auto"),                                                    # the default: the kernels for CUDA
    ({"TWINKLE_METRICS_TRITON": "0"}, "torch"),                      # off everywhere
    ({"TRITON_INTERPRET": "1"}, "auto"),                             # CPU tensors: only by name
    ({"TRITON_INTERPRET": "1", "TWINKLE_METRICS_TRITON": "1"}, "triton"),
])
def test_the_environment_sets_the_starting_backend(env, chosen):
    """CUDA tensors take the kernels unless ``TWINKLE_METRICS_TRITON=0``; CPU tensors take them
    (interpreted) only when both variables ask for it, so an interpreted test process keeps
    its torch-path references on the torch path."""
    root = os.path.abspath(os.path.join(__file__, "../../.."))
    base = {k: v for k, v in os.environ.items() if k not in ("TWINKLE_METRICS_TRITON", "TRITON_INTERPRET")}
    r = subprocess.run([sys.executable, "-c", "from twinkle_metrics.kernels import backend; "
                        "print(backend.current())"], cwd=root, env=dict(base, **env),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == [chosen]


@pytest.mark.skipif(INTERPRETED, reason="starts its own interpreted process")
def test_the_public_switch_runs_the_kernels_on_cpu_under_the_interpreter():
    """``TRITON_INTERPRET=1 TWINKLE_METRICS_TRITON=1``: the metrics' own calls go through
    every kernel on CPU tensors, and agree with the torch paths (how a user without a GPU
    checks the fused paths)."""
    root = os.path.abspath(os.path.join(__file__, "../../.."))
    env = dict(os.environ, TRITON_INTERPRET="1", TWINKLE_METRICS_TRITON="1")
    r = subprocess.run([sys.executable, "-c", _CPU_CHECK], cwd=root, env=env, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.strip() == str(sorted({
        "twinkle_metrics.kernels.rl_triton.token_stats", "twinkle_metrics.kernels.dpo_triton.masked_row_sums",
        "twinkle_metrics.kernels.rollout_triton.token_stats",
        "twinkle_metrics.kernels.entropy_triton.triton_token_partials",
        "twinkle_metrics.kernels.argmax_triton.triton_argmax_hits_joined"})), r.stdout
