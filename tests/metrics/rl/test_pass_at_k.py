"""PassAtKMetric in one process: against brute-force references, input forms, bad input,
bounds, slicing, the bootstrap intervals and the device-wait guard."""
import math
import random

import pytest
import torch

from tests.passref import brute_majority, make_samples, reference
from twinkle_metrics.metrics.rl.keyed_tables import id_key, merge_rows, tensor_keys
from twinkle_metrics.metrics.rl.pass_at_k import PassAtKMetric
from twinkle_metrics.metrics.rl.subset_estimators import majority_at_k
from twinkle_metrics.testing import forbid_device_waits

KS = (1, 2, 3, 5)


def _feed(m, samples, calls=3, tensors=False, **extra):
    """``samples`` over ``calls`` calls (lists, or tensors for correct and rewards)."""
    for part in (samples[i::calls] for i in range(calls)):
        if not part:
            continue
        kw = dict(prompt_ids=[s["prompt"] for s in part], **extra)
        if tensors:
            kw["correct"] = torch.tensor([s["correct"] for s in part])
        else:
            kw["correct"] = [s["correct"] for s in part]
        if m.with_answers:
            kw["answers"] = [s["answer"] for s in part]
        if m.with_rewards:
            r = [s["reward"] for s in part]
            kw["rewards"] = torch.tensor(r, dtype=torch.float64) if tensors else r
        m.accumulate(None, None, **kw)
    return m


def _close(got, want, keys=None):
    for key in keys or want:
        assert math.isclose(got[key], want[key], rel_tol=1e-12, abs_tol=1e-12), (key, got[key], want[key])


@pytest.mark.parametrize("tensors", [False, True])
def test_every_key_matches_brute_force(tensors):
    samples = make_samples(3)
    m = _feed(PassAtKMetric(k=KS, with_answers=True, with_rewards=True, max_prompts=16, max_samples=128),
              samples, tensors=tensors)
    out = m.calculate()
    want = reference(samples, KS, answers=True, rewards=True)
    _close(out, want)
    assert out["num_prompts"] == want["num_prompts"] and out["num_samples"] == len(samples)
    for key in want:
        if "@" in key or "^" in key:
            assert out[f"{key}_ci_low"] <= out[key] <= out[f"{key}_ci_high"], key
    assert 0 < out["maj@3"] < 1 and out["worst@2"] < out["best@2"]  # the comparison can fail


def test_majority_matches_enumeration_on_random_answer_counts():
    rng = random.Random(5)
    for _ in range(60):
        groups = []
        for _ in range(rng.randint(1, 4)):
            a = rng.randint(1, 4)
            groups.append((a, rng.choice([0, a, rng.randint(0, a)])))
        n = sum(a for a, _ in groups)
        for k in range(1, n + 1):
            assert math.isclose(majority_at_k(groups, k), brute_majority(groups, k), rel_tol=1e-12,
                                abs_tol=1e-15), (groups, k)


def test_majority_win_shares_add_up_to_one():
    # every answer correct: some answer wins each subset, so maj@k is 1 exactly
    assert majority_at_k([(3, 3), (2, 2), (2, 2), (1, 1)], 4) == 1.0
    assert majority_at_k([(2, 0), (2, 2)], 2) == 0.5  # an even split: a tie, broken fairly


def test_order_and_calls_do_not_change_anything():
    samples = make_samples(4)
    a = _feed(PassAtKMetric(k=KS, with_answers=True, with_rewards=True), samples, calls=1).calculate()
    shuffled = list(samples)
    random.Random(1).shuffle(shuffled)
    b = _feed(PassAtKMetric(k=KS, with_answers=True, with_rewards=True), shuffled, calls=5, tensors=True).calculate()
    assert a == b  # intervals included: the prompts' order in the state is by key


def test_int_tensor_ids_are_the_list_ids():
    ids = [0, 1, 5, 2 ** 62 - 2, 2 ** 62 - 1, 2 ** 62, 2 ** 63 - 1, -1, -(2 ** 63), -12345]
    assert tensor_keys(torch.tensor(ids)).tolist() == [id_key(v) for v in ids]
    keys = [id_key(v) for v in ids] + [id_key(s) for s in ("1", "", "q0", "é")] + [id_key(2 ** 70)]
    assert all(0 < key < 2 ** 63 for key in keys) and len(set(keys)) == len(keys)
    assert id_key(1) != id_key("1") and id_key("-1") != id_key(-1)
    assert id_key("q0") == 8913273745419622051  # blake2b, not the per-process salted hash()
    ints = PassAtKMetric(k=2, num_bootstrap=0)
    ints.accumulate(prompt_ids=torch.tensor([3, 3, 9, 9]), correct=torch.tensor([1, 0, 1, 1]))
    ints.accumulate(prompt_ids=[9, 3], correct=[0, 1])
    assert ints.calculate() == {"num_prompts": 2, "num_samples": 6, "pass@2": 1.0,
                                "pass^2": (1 / 3 + 1 / 3) / 2}


def test_one_and_string_one_are_different_prompts():
    m = PassAtKMetric(num_bootstrap=0)
    m.accumulate(prompt_ids=[1, "1"], correct=[1, 0])
    assert m.calculate() == {"num_prompts": 2, "num_samples": 2, "pass@1": 0.5, "pass^1": 0.5}


def test_merge_rows_keeps_a_fixed_shape_and_counts_what_it_leaves_out():
    keys = torch.tensor([5, 0, 3, 5, 9, 3, 0])
    rows = torch.stack([keys, torch.ones(7, dtype=torch.int64), torch.arange(7)], 1)
    out = merge_rows(rows, 1, 2, True)
    assert out.tolist() == [[3, 2, 2 + 5], [5, 2, 0 + 3], [1, 0, 0]]  # key 9 left out
    out = merge_rows(rows, 1, 8, False)
    assert out.shape == (9, 3) and out[:5, 0].tolist() == [3, 3, 5, 5, 9] and out[8, 0] == 0


def test_accumulate_never_waits_for_the_device():
    samples = make_samples(6)
    m = PassAtKMetric(k=KS, with_answers=True, with_rewards=True)
    with forbid_device_waits():
        _feed(m, samples, tensors=True)
        _feed(m, samples, tensors=False)
        m.accumulate(None, None, prompt_ids=torch.tensor([1, 2]), correct=torch.tensor([True, False]),
                     answers=torch.tensor([4, 4]), rewards=torch.tensor([0.5, 1.0]))
    assert m.calculate()["num_samples"] == 2 * len(samples) + 2


def test_inputs_and_outputs_are_not_read_and_no_prompt_ids_is_nothing():
    m = PassAtKMetric(num_bootstrap=0)
    m.accumulate([], {})  # a non-last pipeline stage
    m.accumulate([{"labels": torch.tensor([[1]])}], [{"logps": torch.zeros(1, 1)}])
    assert m.calculate() == {}
    m.accumulate({"x": 1}, None, prompt_ids=("a",), correct=(True,))
    assert m.calculate()["pass@1"] == 1.0


def _states(m):
    return {k: v.clone() for k, v in m.states.items()}


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(prompt_ids=[1, 2], correct=[1]), ValueError, ["correct has 1 entries", "prompt_ids has 2"]),
    (dict(prompt_ids=[1, [2]], correct=[1, 0]), TypeError, ["prompt_ids[1] is a list", "not hashable"]),
    (dict(prompt_ids=[1, 2.5], correct=[1, 0]), TypeError, ["prompt_ids[1] is a float", "int or a str"]),
    (dict(prompt_ids=[True], correct=[1]), TypeError, ["prompt_ids[0] is a bool"]),
    (dict(prompt_ids=torch.tensor([1.0]), correct=[1]), TypeError, ["prompt_ids must be an integer tensor"]),
    (dict(prompt_ids=torch.zeros(2, 2, dtype=torch.long), correct=[1, 0]), ValueError, ["shape [2, 2]"]),
    (dict(prompt_ids="abc", correct=[1, 0, 1]), TypeError, ["prompt_ids must be a list"]),
    (dict(prompt_ids=[1, 2]), ValueError, ["got keyword 'prompt_ids' but no keyword 'correct'"]),
    (dict(correct=[1, 0]), ValueError, ["got keyword 'correct' but no keyword 'prompt_ids'"]),
    (dict(prompt_ids=[1, 2], correct=[1, 2]), ValueError, ["correct[1] is 2", "bool or 0/1"]),
    (dict(prompt_ids=[1, 2], correct=torch.ones(3)), ValueError, ["correct has 3 entries"]),
    (dict(prompt_ids=[1, 2], correct=[1, 0], answers=["a"]), ValueError, ["answers has 1 entries"]),
    (dict(prompt_ids=[1, 2], correct=[1, 0], answers=["a", None]), TypeError, ["answers[1] is a NoneType"]),
    (dict(prompt_ids=[1, 2], correct=[1, 0], answers=["a", "b"]), ValueError, ["answers is required"]),
    (dict(prompt_ids=[1, 2], correct=[1, 0], answers=["a", "b"], rewards=[0.5]), ValueError,
     ["rewards has 1 entries"]),
    (dict(prompt_ids=[1, 2], correct=[1, 0], answers=["a", "b"], rewards=[0.5, "x"]), TypeError,
     ["rewards[1] is 'x'"]),
])
def test_bad_input_raises_and_changes_no_state(kwargs, error, words):
    m = PassAtKMetric(k=(1, 2), with_answers=True, with_rewards=True, max_samples=64, max_prompts=8)
    m.accumulate(prompt_ids=["p", "p"], correct=[1, 0], answers=["a", "b"], rewards=[0.1, 0.2])
    before = _states(m)
    if words == ["answers is required"]:  # a metric built without answers
        m = PassAtKMetric(max_prompts=8)
        before = _states(m)
        words = ["built without with_answers=True"]
    with pytest.raises(error) as e:
        m.accumulate(None, None, **kwargs)
    assert "PassAtKMetric" in str(e.value) and all(w in str(e.value) for w in words), str(e.value)
    after = _states(m)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_answers_and_rewards_are_required_when_built_to_take_them():
    m = PassAtKMetric(with_answers=True, with_rewards=True)
    with pytest.raises(ValueError, match="with_answers=True, so every call needs answers"):
        m.accumulate(prompt_ids=[1], correct=[1], rewards=[1.0])
    with pytest.raises(ValueError, match="with_rewards=True, so every call needs rewards"):
        m.accumulate(prompt_ids=[1], correct=[1], answers=[1])
    with pytest.raises(ValueError, match="built without with_rewards=True"):
        PassAtKMetric().accumulate(prompt_ids=[1], correct=[1], rewards=[1.0])


@pytest.mark.parametrize("kwargs,words", [
    (dict(k=0), "k must hold ints >= 1, got 0"), (dict(k=(1, 2.0)), "got 2.0"), (dict(k=True), "True"),
    (dict(k=()), "non-empty"), (dict(k="4"), "k must be an int"), (dict(max_prompts=0), "max_prompts"),
    (dict(max_samples=-1), "max_samples"), (dict(num_bootstrap=1.5), "num_bootstrap"),
    (dict(confidence=1.0), "confidence"), (dict(bootstrap_seed="x"), "bootstrap_seed"),
])
def test_bad_construction_raises(kwargs, words):
    with pytest.raises((ValueError, TypeError), match="PassAtKMetric") as e:
        PassAtKMetric(**kwargs)
    assert words in str(e.value)


def test_k_above_every_prompt_raises_at_calculate_and_keeps_the_interval():
    m = PassAtKMetric(k=(1, 4))
    m.accumulate(prompt_ids=[1, 1, 2], correct=[1, 0, 1])
    with pytest.raises(ValueError, match=r"PassAtKMetric: k=4 is larger than every prompt's number of samples "
                                         r"\(the largest n seen is 2"):
        m.calculate()
    m.accumulate(prompt_ids=[1, 1], correct=[1, 1])  # the interval was kept: prompt 1 now has 4
    out = m.calculate()
    assert out["pass^4"] == 0.0 and out["pass@4"] == 1.0 and out["pass@1"] == (3 / 4 + 1) / 2


def test_prompts_with_fewer_samples_than_k_do_not_count_for_it():
    m = PassAtKMetric(k=(1, 3), num_bootstrap=0)
    m.accumulate(prompt_ids=["a"] * 3 + ["b"], correct=[0, 0, 1, 0])
    out = m.calculate()
    assert out["pass@1"] == (1 / 3 + 0) / 2 and out["pass@3"] == 1.0 and out["pass^3"] == 0.0


def test_more_prompts_than_max_prompts_raises():
    m = PassAtKMetric(max_prompts=4)
    with pytest.raises(ValueError, match="5 distinct prompt_ids, more than max_prompts=4"):
        m.accumulate(prompt_ids=[1, 2, 3, 4, 5], correct=[1] * 5)
    m.accumulate(prompt_ids=[1, 2, 3], correct=[1] * 3)
    m.accumulate(prompt_ids=torch.tensor([3, 4, 5, 6]), correct=[1] * 4)  # over the calls together
    for _ in range(2):  # kept: it raises again until reset
        with pytest.raises(ValueError, match=r"more than max_prompts=4 distinct prompts .*at least 2 more.*"
                                             r"larger max_prompts"):
            m.calculate()
    m.reset()
    m.accumulate(prompt_ids=[1, 2, 3, 4, 1], correct=[1] * 5)  # exactly the bound
    assert m.calculate()["num_prompts"] == 4


def test_more_answers_or_rewards_than_max_samples_raises():
    m = PassAtKMetric(with_answers=True, max_samples=3)
    m.accumulate(prompt_ids=[1, 1, 2], correct=[1, 0, 1], answers=["a", "b", "a"])
    m.accumulate(prompt_ids=[2], correct=[1], answers=["b"])
    with pytest.raises(ValueError, match="more than max_samples=3 distinct \\(prompt, answer\\) pairs"):
        m.calculate()
    m = PassAtKMetric(with_rewards=True, max_samples=3)
    with pytest.raises(ValueError, match="4 rewarded samples, more than max_samples=3"):
        m.accumulate(prompt_ids=[1, 1, 1, 1], correct=[1] * 4, rewards=[0.0] * 4)
    m.accumulate(prompt_ids=[1, 1], correct=[1] * 2, rewards=[0.0] * 2)
    m.accumulate(prompt_ids=[1, 1], correct=[1] * 2, rewards=[0.0] * 2)
    with pytest.raises(ValueError, match="more than max_samples=3 rewarded samples"):
        m.calculate()


def test_slice_by_data_source_equals_one_metric_per_source():
    samples = make_samples(8, n_prompts=10)
    make = dict(k=KS, with_answers=True, with_rewards=True, max_prompts=16, max_samples=128)
    sliced = PassAtKMetric(slice_by="data_source", **make)
    for part in (samples[:20], samples[20:]):
        sliced.accumulate({"data_source": [s["source"] for s in part]}, None,
                          prompt_ids=[s["prompt"] for s in part], correct=torch.tensor([s["correct"] for s in part]),
                          answers=[s["answer"] for s in part], rewards=[s["reward"] for s in part])
    out = sliced.calculate()
    whole = _feed(PassAtKMetric(**make), samples).calculate()
    for source in ("gsm8k", "math"):
        alone = _feed(PassAtKMetric(**make), [s for s in samples if s["source"] == source]).calculate()
        assert alone == {key[:-len(source) - 1]: v for key, v in out.items() if key.endswith("/" + source)}
    assert whole == {key: v for key, v in out.items() if "/" not in key}


def test_bootstrap_intervals():
    samples = make_samples(9, n_prompts=12)
    out = _feed(PassAtKMetric(k=(1, 2), num_bootstrap=200, bootstrap_seed=3), samples).calculate()
    again = _feed(PassAtKMetric(k=(1, 2), num_bootstrap=200, bootstrap_seed=3), samples).calculate()
    other = _feed(PassAtKMetric(k=(1, 2), num_bootstrap=200, bootstrap_seed=4), samples).calculate()
    assert out == again and out["pass@1_ci_low"] != other["pass@1_ci_low"]
    for key in ("pass@1", "pass^1", "pass@2", "pass^2"):
        assert out[f"{key}_ci_low"] < out[key] < out[f"{key}_ci_high"]
    narrow = _feed(PassAtKMetric(k=(1, 2), num_bootstrap=200, bootstrap_seed=3, confidence=0.5), samples).calculate()
    assert out["pass@1_ci_low"] < narrow["pass@1_ci_low"] < narrow["pass@1_ci_high"] < out["pass@1_ci_high"]
    none = _feed(PassAtKMetric(k=(1, 2), num_bootstrap=0), samples).calculate()
    assert not [key for key in none if "_ci_" in key] and none["pass@1"] == out["pass@1"]
    m = PassAtKMetric(k=1)
    m.accumulate(prompt_ids=[1, 2, 3], correct=[1, 1, 1])  # every prompt alike: a point interval
    assert m.calculate()["pass@1_ci_low"] == 1.0


def test_small_case_by_hand():
    m = PassAtKMetric(k=(1, 2), with_answers=True, with_rewards=True, num_bootstrap=0)
    m.accumulate(prompt_ids=["a", "a", "a"], correct=[1, 0, 0], answers=["x", "y", "y"], rewards=[1.0, 0.0, 0.5])
    out = m.calculate()
    assert math.isclose(out["maj@1"], 1 / 3)
    assert math.isclose(out["maj@2"], 1 / 3 * 0 + 2 / 3 * 0.5)  # {x,y}: tie, half; {y,y}: wrong
    assert math.isclose(out["best@2"], (1.0 + 1.0 + 0.5) / 3) and math.isclose(out["worst@2"], (0.5 + 0 + 0) / 3)
