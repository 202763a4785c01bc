"""Single-process tests of MoERoutingMetric against a plain-Python reference."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tests.moeref import losses, make_layer, piece, reference
from twinkle_metrics import MetricCollection, MoERoutingMetric
from twinkle_metrics.testing import (
    DeviceWaitError,
    assert_results_close,
    forbid_device_waits,
    state_dict_differences,
)

L, E, K, T = 4, 6, 2, 40
ROOT = os.path.abspath(os.path.join(__file__, "../../../.."))


def _calls(seed=0):
    """Two calls (microbatches) per layer; layer 3 is a dense layer and gets nothing."""
    calls = []
    for layer in range(3):
        data = make_layer(seed + layer, T, E, K, skew=2.5 if layer == 2 else 1.0)
        for j, rows in enumerate((range(0, 25), range(25, T))):
            f = piece(data, list(rows), K)
            f.update(losses(seed, layer, j))
            calls.append((layer, f))
    return calls


def test_matches_plain_python_reference_without_device_waits():
    calls = _calls()
    m = MoERoutingMetric(num_layers=L, num_experts=E)
    with forbid_device_waits():
        for layer, f in calls:
            m.observe(layer, **f)
    got = m.calculate()
    want = reference(calls, L, E)
    # the comparison can fail: a dead expert, drops, and layers that differ
    assert want["moe/layer2/dead_expert_fraction"] > 0 and want["moe/tokens_dropped"] > 0
    assert want["moe/layer0/load_imbalance"] != want["moe/layer2/load_imbalance"]
    assert not any(k.startswith("moe/layer3/") for k in got)
    assert_results_close(got, want, rel=1e-12)
    assert type(got["moe/tokens_dropped"]) is int


def test_float32_logits_and_probs_entropy():
    data = make_layer(5, T, E, K)
    logits32 = data["router_logits"].float()
    probs = torch.softmax(data["router_logits"], -1)
    probs[3] = 0.0  # a token every expert dropped: no distribution, left out
    m = MoERoutingMetric(num_layers=2, num_experts=E)
    m.observe(0, router_logits=logits32)
    m.observe(1, router_probs=probs * 0.5)  # rows are normalised
    got = m.calculate()
    want = reference([(0, {"router_logits": logits32.double()}), (1, {"router_probs": probs})], 2, E)
    assert_results_close(got, want, rel=1e-6)


def test_sigmoid_scores_normalised_and_masked_experts():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(10, E, generator=g, dtype=torch.float64)
    masked = logits.clone()
    masked[:, :2] = -math.inf  # experts outside the selected groups: p = 0, 0 log 0 = 0
    m = MoERoutingMetric(num_layers=2, num_experts=E)
    m.observe(0, router_probs=torch.sigmoid(logits))
    m.observe(1, router_logits=masked)
    got = m.calculate()
    want = reference([(0, {"router_probs": torch.sigmoid(logits)}),
                      (1, {"router_logits": logits[:, 2:]})], 2, E)  # same distribution, fewer experts
    assert_results_close({k: v for k, v in got.items() if "entropy" in k},
                         {k: v for k, v in want.items() if "entropy" in k}, rel=1e-12)


def test_count_matrix_equals_per_layer_maps():
    calls = _calls(7)
    per_layer = MoERoutingMetric(num_layers=L, num_experts=E)
    matrix = MoERoutingMetric(num_layers=L, num_experts=E)
    counts = torch.zeros(L, E, dtype=torch.int64)
    dropped = torch.zeros(L, dtype=torch.int64)
    for layer, f in calls:
        per_layer.observe(layer, routing_map=f["routing_map"], token_mask=f["token_mask"],
                          tokens_dropped=f["tokens_dropped"])
        counts[layer] += (f["routing_map"] & f["token_mask"][:, None]).sum(0)
        dropped[layer] += f["tokens_dropped"]
    with forbid_device_waits():
        matrix.accumulate(None, {"expert_counts": counts, "tokens_dropped": dropped})
    assert_results_close(matrix.calculate(), per_layer.calculate(), rel=0)


def test_overall_is_mean_over_layers_and_per_layer_optional():
    m = MoERoutingMetric(num_layers=3, num_experts=4, per_layer=False)
    m.accumulate(None, {"expert_counts": torch.tensor([[4, 4, 4, 4], [8, 0, 0, 0], [0, 0, 0, 0]])})
    got = m.calculate()
    # layer 0 balanced (1, 0, 0), layer 1 collapsed onto one expert (4, sqrt(3), 3/4); layer 2 empty
    assert_results_close(got, {"moe/load_imbalance": 2.5, "moe/load_imbalance_max": 4.0,
                               "moe/cv": math.sqrt(3) / 2, "moe/dead_expert_fraction": 0.375})
    # drops are reported only when measured: a call that reports 0 says none were dropped
    m.accumulate(None, {"expert_counts": torch.tensor([[4, 4, 4, 4], [8, 0, 0, 0], [0, 0, 0, 0]]),
                        "tokens_dropped": torch.tensor([0, 2, 0])})
    got = m.calculate()
    assert got["moe/tokens_dropped"] == 2 and got["moe/drop_fraction"] == 2 / 26
    assert m.calculate() == {}  # reset after calculate; nothing since


def test_collection_passes_other_outputs_through():
    m = MoERoutingMetric(num_layers=1, num_experts=E)
    coll = MetricCollection([m])
    coll.accumulate({"labels": torch.zeros(2, 3, dtype=torch.long)}, {"logits": torch.zeros(2, 3, 5)})
    assert coll.calculate() == {}


@pytest.mark.parametrize("policy", ["propagate", "skip"])
def test_nan_policy(policy):
    data = make_layer(2, 12, E, K)
    logits = data["router_logits"].clone()
    logits[4, 1] = math.nan
    m = MoERoutingMetric(num_layers=1, num_experts=E, nan_policy=policy)
    with forbid_device_waits():
        m.observe(0, router_logits=logits, aux_loss=math.inf, z_loss=torch.tensor(2.0))
        m.observe(0, aux_loss=torch.tensor(1.0))
    got = m.calculate()
    assert got["moe/nonfinite"] == 2  # one token, one loss value
    if policy == "propagate":
        assert math.isnan(got["moe/router_entropy"]) and math.isinf(got["moe/aux_loss"])
    else:
        keep = [i for i in range(12) if i != 4]
        want = reference([(0, {"router_logits": data["router_logits"][keep]})], 1, E)
        assert math.isclose(got["moe/router_entropy"], want["moe/router_entropy"], rel_tol=1e-12)
        assert got["moe/aux_loss"] == 1.0
    assert got["moe/z_loss"] == 2.0


def test_scope_follows_sequence_parallel():
    plain = MoERoutingMetric(num_layers=2, num_experts=3)
    sp = MoERoutingMetric(num_layers=2, num_experts=3, sequence_parallel=True)
    assert {s.scope for s in plain.declarations.values()} == {"stage"}
    assert {s.scope for s in sp.declarations.values()} == {"model"}
    assert plain.fingerprint() != sp.fingerprint()
    assert plain.counts.shape == (2, 3) and plain.counts.dtype == torch.int64


BAD = [
    (dict(layer=4, routing_map=torch.ones(3, E, dtype=torch.bool)), ValueError, "layer must be an int in [0, 4)"),
    (dict(layer=0, routing_map=torch.ones(3, E + 1, dtype=torch.bool)), ValueError,
     "routing_map'] must be [..., num_experts=6], got shape [3, 7]"),
    (dict(layer=0, routing_map=torch.ones(3, E)), TypeError, "routing_map'] must be bool or integer"),
    (dict(layer=0, routing_map=torch.ones(3, E, dtype=torch.bool), router_logits=torch.zeros(4, E)),
     ValueError, "router_logits'] has tokens [4] but routing_map has [3]"),
    (dict(layer=0, routing_map=torch.ones(3, E, dtype=torch.bool), token_mask=torch.ones(4, dtype=torch.bool)),
     ValueError, "token_mask'] has shape [4], expected [3]"),
    (dict(layer=0, router_logits=torch.zeros(3, E, dtype=torch.long)), TypeError, "must be a floating tensor"),
    (dict(layer=0, router_logits=torch.zeros(3, E), router_probs=torch.ones(3, E)), ValueError, "pass one"),
    (dict(layer=0, expert_counts=torch.ones(L, E, dtype=torch.long)), ValueError,
     "expert_counts'] must be an integer tensor of shape [6] (one layer), got torch.int64 [4, 6]"),
    (dict(layer=None, expert_counts=torch.ones(E, dtype=torch.long)), ValueError,
     "shape [4, 6] (every layer)"),
    (dict(layer=None, routing_map=torch.ones(3, E, dtype=torch.bool)), ValueError,
     "belongs to one layer but no layer was given"),
    (dict(layer=0, aux_loss=torch.ones(2)), ValueError, "aux_loss'] must be one float value"),
    (dict(layer=0, z_loss="big"), TypeError, "z_loss'] must be a number or a 0-d tensor, got str"),
    (dict(layer=0, tokens_dropped=1.5), TypeError, "tokens_dropped'] must be an int"),
    (dict(layer=0, routing_mpa=torch.ones(3, E, dtype=torch.bool)), ValueError,
     "outputs hold 'routing_mpa', which no metric of this call reads: did you mean 'routing_map'?"),
]


@pytest.mark.parametrize("fields,exc,text", BAD, ids=[b[2][:30] for b in BAD])
def test_bad_input_names_field_and_changes_nothing(fields, exc, text):
    m = MoERoutingMetric(num_layers=L, num_experts=E)
    m.observe(1, routing_map=torch.ones(2, E, dtype=torch.bool), aux_loss=0.3)
    before = m.state_dict()
    fields = dict(fields)
    layer = fields.pop("layer")
    with pytest.raises(exc) as err:
        m.accumulate(None, fields, layer=layer)
    assert text in str(err.value) and "MoERoutingMetric" in str(err.value)
    assert not state_dict_differences(before, m.state_dict())


def test_constructor_checks():
    with pytest.raises(ValueError, match="num_experts must be a positive int, got 0"):
        MoERoutingMetric(num_layers=2, num_experts=0)
    with pytest.raises(ValueError, match="nan_policy"):
        MoERoutingMetric(num_layers=2, num_experts=2, nan_policy="drop")


def test_device_wait_guard_would_catch_a_host_read():
    # the guard is live around accumulate: a host read of a routing tensor raises
    with forbid_device_waits(), pytest.raises(DeviceWaitError):
        torch.ones(3, E, dtype=torch.bool).sum().item()


# ------------------------------------------------------------ a real megatron-core model
@pytest.mark.megatron
@pytest.mark.parametrize("mtp", [False, True], ids=["decoder", "mtp"])
def test_router_hooks_on_a_tiny_megatron_moe_model(mtp):
    """register_router_hooks on a 2-layer GPT with 4 experts (top-2, capacity 1.0, aux and z
    losses), with one multi-token-prediction layer or without, CPU, one process: the metric
    equals what the routers themselves returned and what megatron-core's aux-loss tracker
    holds, layer by layer (the MTP layer in the tracker's slot, after the decoder's), with no
    warning from the library's own calls (0.19 deprecates the tracker getter 0.16 has). Runs
    in a child process (it needs torch.distributed and megatron-core's global state)."""
    pytest.importorskip("megatron.core")
    proc = subprocess.run([sys.executable, "-m", "tests.metrics.system.moe_model_case"] + ["--mtp"] * mtp, cwd=ROOT,
                          capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    got, want = out["got"], out["want"]
    assert_results_close(got, want, rel=1e-6)
    layers = [0, 1, 2] if mtp else [0, 1]
    assert out["dropped_any"] and out["layers"] == layers and out["warnings"] == []
    assert {f"moe/layer{i}/aux_loss" for i in layers} <= set(got)
    assert out["eval_results"] == {}          # when='train': an eval forward is not counted
    assert out["after_remove"] == {} and out["gating_restored"]


def test_documented_example_runs_as_written():
    from tests.docs.test_readme import blocks

    block = next(code for _, _, code in blocks("docs/metrics.md") if "MoERoutingMetric(num_layers" in code)
    scope = {}
    exec(block, scope)  # noqa: S102 - the documented example, run as a user would copy it
    assert math.isclose(scope["results"]["moe/router_entropy"], math.log(4), rel_tol=1e-6)  # float32 logits


def _np_percentile(values, q):
    """numpy.percentile's default (linear) written out: position q / 100 * (n - 1)."""
    x = sorted(values)
    pos = q / 100 * (len(x) - 1)
    lo = int(math.floor(pos))
    return x[lo] + (x[min(lo + 1, len(x) - 1)] - x[lo]) * (pos - lo)


def test_percentiles_of_tokens_per_expert_and_across_layers_match_a_plain_reference():
    qs = (0, 50, 90, 100, 99.9)
    m = MoERoutingMetric(num_layers=L, num_experts=E, percentiles=qs)
    plain = MoERoutingMetric(num_layers=L, num_experts=E)
    g = torch.Generator().manual_seed(4)
    counts = {0: torch.randint(0, 30, (E,), generator=g), 2: torch.randint(0, 30, (E,), generator=g),
              3: torch.tensor([0, 0, 9, 0, 1, 0])}
    for metric in (m, plain):
        for layer, c in counts.items():
            with forbid_device_waits():
                metric.observe(layer, expert_counts=c, aux_loss=0.1 * layer, tokens_dropped=layer)
    got, base = m.calculate(), plain.calculate()
    assert {k: got[k] for k in base} == base  # today's keys and values unchanged
    want = {}
    for q in qs:
        p = f"p{q:g}"
        per_layer = [_np_percentile(c.tolist(), q) for c in counts.values()]
        for layer, v in zip(counts, per_layer):
            want[f"moe/layer{layer}/tokens_per_expert_{p}"] = v
        want[f"moe/tokens_per_expert_{p}"] = sum(per_layer) / len(per_layer)
        for name in ("load_imbalance", "cv", "dead_expert_fraction", "aux_loss", "drop_fraction"):
            want[f"moe/{name}_{p}"] = _np_percentile([base[f"moe/layer{i}/{name}"] for i in counts], q)
    assert_results_close({k: got[k] for k in want}, want, rel=1e-12)
    assert set(got) == set(base) | set(want)
    assert got["moe/load_imbalance_p100"] == got["moe/load_imbalance_max"]
    assert got["moe/layer3/tokens_per_expert_p0"] == 0 and got["moe/layer3/tokens_per_expert_p100"] == 9


def test_percentiles_argument_is_checked_and_keeps_checkpoints_loadable():
    for bad, exc in ((101, ValueError), ((50, 50.0), ValueError), ((), ValueError), ("50", TypeError),
                     ((True,), ValueError)):
        with pytest.raises(exc, match="MoERoutingMetric: percentiles"):
            MoERoutingMetric(num_layers=1, num_experts=2, percentiles=bad if isinstance(bad, (tuple, str)) else (bad,))
    a = MoERoutingMetric(num_layers=1, num_experts=2, percentiles=(50, 90))
    b = MoERoutingMetric(num_layers=1, num_experts=2)
    assert a.sync_fingerprint() != b.sync_fingerprint()  # ranks must agree on the keys
    assert a.fingerprint() == b.fingerprint()  # a checkpoint of either loads into the other
    b.observe(0, expert_counts=torch.tensor([1, 3]))
    assert a.load_state_dict(b.state_dict()).calculate()["moe/layer0/tokens_per_expert_p50"] == 2.0


def test_percentiles_across_layers_propagate_a_nan_layer():
    m = MoERoutingMetric(num_layers=2, num_experts=2, percentiles=(50,))
    m.observe(0, routing_map=torch.tensor([[True, False]]), router_logits=torch.tensor([[math.nan, 0.0]]))
    m.observe(1, routing_map=torch.tensor([[False, True]]), router_logits=torch.tensor([[1.0, 0.0]]))
    got = m.calculate()
    assert math.isnan(got["moe/router_entropy_p50"]) and got["moe/load_imbalance_p50"] == 2.0
