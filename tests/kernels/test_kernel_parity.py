"""One parity harness for every kernel pair: the torch reference and the Triton version
(``twinkle_metrics.kernels.PAIRS``) on random inputs of a few shapes and dtypes, equal
within tight tolerances.

Driven by the registry: each row of ``PAIRS`` has one case below (``CASES[op]``), which
builds its inputs and calls the op's entry point; the harness runs it under
``kernels.backend("torch")`` (the torch reference) and ``kernels.backend("triton")`` (CPU
tensors take the kernels, run by Triton's interpreter), checks that the row's Triton
function ran and nothing fell back, and compares the results. A new op is one row in ``PAIRS`` and one case here.

As in ``test_triton_kernels.py``, ``TRITON_INTERPRET=1`` must be set before triton is first
imported, so the comparisons run in one child pytest with it set; the parent only starts it.
Shapes stay small: the interpreter runs each program in Python.
"""
import importlib.util
import math
import sys

import numpy
import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from tests.kernels.interpreted import INTERPRETED, interpreted, run_child  # noqa: E402,F401
from tests.rlref import make_rl_batch  # noqa: E402
from twinkle_metrics.kernels import PAIRS, backend, dispatch  # noqa: E402

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@pytest.mark.skipif(INTERPRETED, reason="this is the child")
def test_parity_under_the_interpreter():
    run_child(__file__)


# ------------------------------------------------------------------ the cases, one per op
# Each case(seed) yields (label, call, rtol): ``call()`` runs the op's entry point and returns
# what to compare (tensors, numbers, or dicts / lists of them). ``_direct(on)`` cases call the
# torch reference or the Triton function themselves (``on``: which one).


def _logits(shape, dtype, seed, scale=4.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)
    x.view(-1, shape[-1])[1, : shape[-1] // 2] = float("-inf")  # masked vocab entries
    return x


def _ties(shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 3, shape, generator=g).float()  # many ties across tiles
    x.view(-1, shape[-1])[0, 5] = float("nan")            # NaN wins, as in torch
    return x


def _entropy(seed):
    from twinkle_metrics.kernels import entropy
    for shape in ((3, 5, 37), (4, 130)):
        for dtype in FLOATS:
            for t in (1.0, 0.7):
                x = _logits(shape, dtype, seed)
                rows = x.reshape(-1, shape[-1])
                yield (f"{tuple(shape)} {dtype} T={t}",
                       lambda rows=rows, x=x, t=t: entropy.token_entropy([rows], [x.shape[:-1]], t, None, x.device),
                       1e-5)  # float32 compute on both sides, summed in another order


def _argmax(seed):
    from twinkle_metrics.kernels import argmax
    for x in (_logits((4, 37), torch.float32, seed), _logits((2, 3, 50), torch.float16, seed),
              _logits((5, 70), torch.bfloat16, seed), _ties((6, 130), seed)):
        yield f"{tuple(x.shape)} {x.dtype}", lambda x=x: argmax.local_argmax(x), 0.0


def _argmax_hits(seed):
    from twinkle_metrics.kernels import argmax
    for dtype in FLOATS:
        xs = [_logits((2, 7, 40), dtype, seed), _logits((3, 40), dtype, seed + 1)]
        pairs = []
        for x in xs:
            labels = x.argmax(-1)
            labels.view(-1)[::2] = 0
            pairs.append((x, labels))
        yield f"{dtype}", lambda pairs=pairs: argmax.joined_hits(pairs), 0.0


def _argmax_keys(seed):
    from twinkle_metrics.kernels import argmax
    for x in (_logits((4, 37), torch.float32, seed), _logits((3, 50), torch.bfloat16, seed), _ties((5, 64), seed)):
        def call(on, x=x, offset=64, vocab=256):
            if on:
                from twinkle_metrics.kernels.argmax_triton import triton_argmax_keys
                return triton_argmax_keys(x, offset, vocab)
            i = x.argmax(-1)
            return argmax.argmax_keys(x.gather(-1, i[:, None])[:, 0], i + offset, vocab)
        yield f"{tuple(x.shape)} {x.dtype}", _direct(call), 0.0


def _direct(call):
    call.direct = True
    return call


def _states(metric):
    return metric.states


def _rl(seed):
    from twinkle_metrics import CISPOMetric, GRPOMetric, GSPOMetric
    for n_seq, seq_len, dtype in ((4, 37, torch.float64), (3, 70, torch.float32)):
        b = make_rl_batch(seed, n_seq=n_seq, seq_len=seq_len)
        lab, lp, old, ref, adv = b["labels"], b["logps"].to(dtype), b["old"].to(dtype), b["ref"].to(dtype), b["adv"]
        for cls, kw in ((GRPOMetric, dict(top_k_kl=2)), (GSPOMetric, {}), (CISPOMetric, dict(nan_policy="skip"))):
            yield (f"{cls.__name__} {n_seq}x{seq_len} {dtype}",
                   lambda cls=cls, kw=kw, lab=lab, lp=lp, old=old, ref=ref, adv=adv: _states(cls(**kw).accumulate(
                       {"labels": lab}, {"logps": lp}, old_logps=old, advantages=adv, ref_logps=ref)),
                   1e-9)


def _dpo_row_sums(seed):
    from twinkle_metrics import DPOMetric
    for n_seq, seq_len, dtype in ((4, 37, torch.float64), (6, 20, torch.float32)):
        b = make_rl_batch(seed, n_seq=n_seq, seq_len=seq_len)
        lab, lp, ref = b["labels"], b["logps"].to(dtype), b["ref"].to(dtype)
        yield (f"{n_seq}x{seq_len} {dtype}",
               lambda lab=lab, lp=lp, ref=ref: _states(DPOMetric().accumulate(
                   {"labels": lab}, {"logps": lp}, ref_outputs={"logps": ref})),
               1e-12)


def _dpo_pairs(seed):
    from twinkle_metrics import DPOMetric
    g = torch.Generator().manual_seed(seed)
    for n in (5, 300):
        c, r, rc, rr = (-20 * torch.rand(n, generator=g, dtype=torch.float64) for _ in range(4))
        for form in (dict(chosen_logps=c, rejected_logps=r, ref_chosen_logps=rc, ref_rejected_logps=rr),
                     dict(chosen_logps=c, rejected_logps=r)):
            yield (f"{n} pairs, {len(form)} columns",
                   lambda form=form: _states(DPOMetric(beta=0.1).accumulate(None, form)), 1e-12)


def _rollout(seed):
    from twinkle_metrics import RolloutMismatchMetric
    for n_seq, seq_len, dtype in ((4, 37, torch.float64), (3, 70, torch.float32)):
        b = make_rl_batch(seed, n_seq=n_seq, seq_len=seq_len)
        lab, lp, roll = b["labels"], b["logps"].to(dtype), b["old"]
        for kw in (dict(is_threshold=1.2), dict(is_threshold=1.5, is_threshold_low=0.8, nan_policy="skip")):
            yield (f"{n_seq}x{seq_len} {dtype} {kw}",
                   lambda kw=kw, lab=lab, lp=lp, roll=roll: _states(RolloutMismatchMetric(**kw).accumulate(
                       {"labels": lab}, {"logps": lp}, rollout_logps=roll)),
                   1e-12)


def _rollout_sequences(seed):
    from twinkle_metrics import RolloutMismatchMetric
    g = torch.Generator().manual_seed(seed)
    for n in (6, 150):
        parts = torch.stack([torch.randn(n, generator=g, dtype=torch.float64) * 30,
                             torch.randint(0, 5, (n,), generator=g).double()], 1)
        parts[parts[:, 1] == 0, 0] = 0.0
        yield (f"{n} sequences", lambda parts=parts: RolloutMismatchMetric()._sequence_sums(parts, None), 1e-12)


def _ppo(seed):
    from twinkle_metrics import PPOValueMetric
    for n_seq, seq_len, dtype in ((4, 37, torch.float32), (3, 70, torch.float64)):
        b = make_rl_batch(seed, n_seq=n_seq, seq_len=seq_len)
        lab, v = b["labels"], (b["logps"] + 10).to(dtype)
        for nan_policy in ("propagate", "skip"):
            yield (f"{n_seq}x{seq_len} {dtype} {nan_policy}",
                   lambda nan_policy=nan_policy, lab=lab, v=v, b=b: _states(PPOValueMetric(
                       epsilon=0.1, nan_policy=nan_policy).accumulate(
                       {"labels": lab}, {"values": v}, old_values=b["old"] + 10, returns=b["ref"] + 10,
                       advantages=b["adv"])),
                   1e-9)


def _moe(seed):
    from twinkle_metrics import MoERoutingMetric
    g = torch.Generator().manual_seed(seed)
    for tokens, experts, dtype in ((64, 6, torch.float32), (100, 16, torch.bfloat16), (40, 8, torch.float64)):
        routing = torch.rand(tokens, experts, generator=g) < 0.25
        logits = torch.randn(tokens, experts, generator=g, dtype=torch.float64).to(dtype)
        valid = torch.rand(tokens, generator=g) < 0.9

        def call(routing=routing, logits=logits, valid=valid, experts=experts):
            m = MoERoutingMetric(num_layers=2, num_experts=experts)
            m.observe(1, routing_map=routing, router_logits=logits, token_mask=valid, aux_loss=torch.tensor(0.01),
                      z_loss=torch.tensor(0.002), tokens_dropped=3)
            m.observe(0, routing_map=routing, router_probs=logits.float().softmax(-1))
            return _states(m)
        yield f"{tokens} tokens x {experts} experts {dtype}", call, 1e-6  # float32 entropy, summed in another order


CASES = {"entropy": _entropy, "argmax": _argmax, "argmax_hits": _argmax_hits, "argmax_keys": _argmax_keys,
         "rl": _rl, "dpo_row_sums": _dpo_row_sums, "dpo_pairs": _dpo_pairs, "rollout": _rollout,
         "rollout_sequences": _rollout_sequences, "ppo": _ppo, "moe": _moe}


def test_every_pair_has_one_case():
    assert [p.op for p in PAIRS] == list(dict.fromkeys(p.op for p in PAIRS)), "an op listed twice"
    assert set(CASES) == {p.op for p in PAIRS}


# ------------------------------------------------------------------------- the harness


def _assert_same(got, want, rtol, where):
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for k in want:
            _assert_same(got[k], want[k], rtol, f"{where}[{k}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            _assert_same(a, b, rtol, f"{where}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape, \
            (where, got, want)
        if want.is_floating_point() and rtol:
            torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * 1e-3, equal_nan=True, msg=where)
        else:
            assert torch.equal(got, want) or (want.is_floating_point() and torch.equal(got.isnan(), want.isnan())
                                              and torch.equal(got.nan_to_num(), want.nan_to_num())), \
                (where, got, want)
    elif isinstance(want, float) and math.isnan(want):
        assert isinstance(got, float) and math.isnan(got), where
    else:
        assert type(got) is type(want), where
        assert got == want or math.isclose(got, want, rel_tol=rtol, abs_tol=rtol * 1e-3), (where, got, want)


@interpreted
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("pair", PAIRS, ids=[p.op for p in PAIRS])
def test_torch_and_triton_agree(pair, seed, monkeypatch):
    module, _, name = pair.triton.partition(":")
    module = sys.modules.get(module) or importlib.import_module(module)
    ran = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: ran.append(1) or real(*a, **k))
    cases = list(CASES[pair.op](seed))
    assert cases
    for label, call, rtol in cases:
        direct = getattr(call, "direct", False)
        with backend("torch"):
            want = call(False) if direct else call()
        ran.clear()
        with backend("triton"), numpy.errstate(invalid="ignore", divide="ignore", over="ignore"):
            got = call(True) if direct else call()
            assert dispatch.failed is None, (label, dispatch.failed)
        assert ran, f"{pair.op} {label}: {pair.triton} did not run"
        _assert_same(got, want, rtol, f"{pair.op} {label}")
