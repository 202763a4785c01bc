"""The Triton kernels (entropy partials, argmax) against the torch paths, on CPU.

The kernels run under Triton's interpreter, which ``@triton.jit`` picks when it
decorates (triton's own library functions included, at ``import triton``), so
``TRITON_INTERPRET=1`` must be set before triton is first imported. This module
therefore runs its kernel tests in a child pytest with the variable set (one
extra process) and leaves the parent process's triton untouched. The ``wired``
fixture lets the CPU count as a Triton device, so the metrics' real call paths
run through the kernels.
"""
import importlib.util
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
kernel_test = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child")


@pytest.mark.skipif(INTERPRETED, reason="this is the child")
def test_kernels_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                        "-W", "error::RuntimeWarning", os.path.abspath(__file__)],
                       cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-6000:] + r.stderr[-3000:]


if INTERPRETED:
    from twinkle_metrics.kernels import triton_argmax as TA
    from twinkle_metrics.kernels import triton_entropy as TE

from tests.rlref import make_rl_batch  # noqa: E402
from twinkle_metrics import Accuracy, GRPOMetric  # noqa: E402
from twinkle_metrics.kernels import _triton, argmax, entropy  # noqa: E402


@pytest.fixture
def wired(monkeypatch):
    monkeypatch.setattr(_triton, "applies", lambda x: x.dtype in _triton.DTYPES)


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
def test_entropy_partials_match_torch(dtype, t):
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
def test_entropy_uniform_and_one_hot_rows():
    x = torch.zeros(2, 100)
    x[1] = float("-inf")
    x[1, 42] = 3.0
    got = _h(TE.triton_token_partials(x, 1.0, block=32))
    assert math.isclose(got[0].item(), math.log(100), rel_tol=1e-6)
    assert got[1].item() == 0.0


@kernel_test
def test_entropy_nan_inf_rows_are_nan_as_in_torch():
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
def test_entropy_strided_views_read_in_place():
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
def test_entropy_two_vocab_shards_combine_to_whole(split):
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
def test_grpo_entropy_through_triton_path_matches_torch(wired, monkeypatch):
    b = make_rl_batch(5)
    z = b["logits"].float()
    base = z.new_empty(z.shape[1], z.shape[0], z.shape[2])
    base.copy_(z.transpose(0, 1))
    strided = base.transpose(0, 1)   # [b, s, V] view of an [s, b, V] tensor
    assert entropy.row_blocks(strided)[0].data_ptr() == strided[0].data_ptr()  # no copy
    calls = []
    real = entropy._triton_partials
    monkeypatch.setattr(entropy, "_triton_partials", lambda c, t: calls.append(c.shape) or real(c, t))
    kw = dict(inputs={"labels": b["labels"]}, outputs={"logps": b["logps"], "logits": strided})
    got = GRPOMetric(entropy_from_logits=True, temperature=0.6).accumulate(**kw).calculate()
    assert calls  # the kernel path ran
    monkeypatch.setattr(_triton, "applies", lambda x: False)
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
def test_accuracy_through_triton_path_matches_torch(wired, monkeypatch):
    x = _logits(3 * 7, 50, seed=13).reshape(3, 7, 50)
    x[0, 0] = 1.0                                       # a tie row
    labels = x.argmax(-1)
    labels[1] = 0
    labels[2, :3] = -100
    calls = []
    real = TA.triton_argmax
    monkeypatch.setattr(TA, "triton_argmax", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = Accuracy().accumulate({"labels": labels}, {"logits": x}).calculate()
    assert calls
    monkeypatch.setattr(_triton, "applies", lambda x: False)
    want = Accuracy().accumulate({"labels": labels}, {"logits": x}).calculate()
    assert got == want
    assert torch.equal(argmax.vocab_parallel_argmax([x], None, 0, 1)[0], x.argmax(-1))
