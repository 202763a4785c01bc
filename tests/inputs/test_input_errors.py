"""Bad input raises an error that names the metric and the field, and changes nothing.

Each case is one call that a user could plausibly make by mistake: complex or bool
tensors where real values belong, ragged or string host lists, a vocab of size 0,
counts beyond 64 bits. The call must raise (never give a finite, wrong number), the
message must name the metric and the field, and the metric's state must be unchanged.
"""
import pytest
import torch

import twinkle_metrics as tm
from twinkle_metrics.testing import state_dict_differences

LAB = torch.tensor([[1, 2, 3], [0, 1, -100]])
LP = -torch.rand(2, 3)
CPLX = torch.complex(LP, LP)


def _cases():
    logits = torch.randn(2, 3, 5)
    return {
        "grpo logps complex": (tm.GRPOMetric, lambda m: m.accumulate({"labels": LAB}, {"logps": CPLX}),
                               "outputs['logps']"),
        "grpo old_logps bool": (tm.GRPOMetric, lambda m: m.accumulate({"labels": LAB}, {"logps": LP},
                                                                        old_logps=LP > -0.5), "old_logps"),
        "grpo advantages complex": (tm.CISPOMetric, lambda m: m.accumulate(
            {"labels": LAB}, {"logps": LP}, old_logps=LP, advantages=torch.ones(2, dtype=torch.complex64)),
            "advantages"),
        "grpo entropies complex": (tm.GRPOMetric, lambda m: m.accumulate(
            {"labels": LAB}, {"logps": LP, "entropies": CPLX}), "outputs['entropies']"),
        "grpo entropies str": (tm.GRPOMetric, lambda m: m.accumulate(
            {"labels": LAB}, {"logps": LP, "entropies": "abc"}), "outputs['entropies']"),
        "grpo vocab 0": (lambda: tm.GRPOMetric(entropy_from_logits=True), lambda m: m.accumulate(
            {"labels": LAB}, {"logps": LP, "logits": torch.zeros(2, 3, 0)}), "outputs['logits']"),
        "grpo ragged mask": (tm.GRPOMetric, lambda m: m.accumulate(
            {"completion_mask": [[1, 1, 1], [1]]}, {"logps": LP}), "completion_mask"),
        "dpo logps complex": (tm.DPOMetric, lambda m: m.accumulate({"labels": LAB}, {"logps": CPLX}),
                              "outputs['logps']"),
        "dpo pair sums [n, s]": (tm.DPOMetric, lambda m: m.accumulate(
            None, {"chosen_logps": LP, "rejected_logps": LP}), "outputs['chosen_logps']"),
        "ppo values complex": (tm.PPOValueMetric, lambda m: m.accumulate(
            {"labels": LAB}, {"values": CPLX}, returns=LP), "outputs['values']"),
        "rollout logps complex": (tm.RolloutMismatchMetric, lambda m: m.accumulate(
            {"labels": LAB}, {"logps": LP}, rollout_logps=CPLX), "rollout_logps"),
        "reward complex": (tm.CompletionRewardMetric, lambda m: m.accumulate(
            rewards={"acc": torch.ones(2, dtype=torch.complex64)}), "rewards['acc']"),
        "lengths complex": (tm.CompletionRewardMetric, lambda m: m.accumulate(
            rewards=[1.0], completion_lengths=torch.ones(1, dtype=torch.complex64)), "completion_lengths"),
        "accuracy ragged labels": (tm.Accuracy, lambda m: m.accumulate({"labels": [[1, 2, 3], [1]]},
                                                                        {"logits": logits}), "labels"),
        "accuracy str labels": (tm.Accuracy, lambda m: m.accumulate({"labels": "abc"}, {"logits": logits}),
                                "labels"),
        "accuracy ragged mask": (tm.Accuracy, lambda m: m.accumulate(
            {"labels": LAB, "completion_mask": [[1, 1, 1], [1, 1]]}, {"logits": logits}), "completion_mask"),
        "accuracy vocab 0": (tm.Accuracy, lambda m: m.accumulate({"labels": LAB}, {"logits": torch.zeros(2, 3, 0)}),
                             "logits"),
        "loss complex": (tm.LossMetric, lambda m: m.accumulate(None, {"loss": 1 + 2j}), "outputs['loss']"),
        "grad_norm complex": (tm.LossMetric, lambda m: m.accumulate(None, None, grad_norm=1j), "grad_norm"),
        "num_tokens 10**400": (lambda: tm.LossMetric(loss_reduction="sum"), lambda m: m.accumulate(
            None, {"loss": 1.0, "num_tokens": 10 ** 400}), "outputs['num_tokens']"),
        "step 2**64": (tm.TrainMetric, lambda m: m.accumulate(None, None, step=2 ** 64), "step"),
        "tokens_dropped 2**64": (lambda: tm.MoERoutingMetric(num_layers=1, num_experts=2), lambda m: m.accumulate(
            None, {"tokens_dropped": 2 ** 64}, layer=0), "tokens_dropped"),
        "accuracy outputs without inputs": (tm.Accuracy, lambda m: m.accumulate([], {"logits": logits}),
                                            "outputs['logits']"),
        "grpo outputs without inputs": (tm.GRPOMetric, lambda m: m.accumulate([], [{"logps": LP}]),
                                        "outputs['logps']"),
        "dpo pair sums as a list": (tm.DPOMetric, lambda m: m.accumulate(
            None, [{"chosen_logps": LP[:, 0], "rejected_logps": LP[:, 1]}]), "per-pair sums"),
        "embedding loss complex": (tm.EmbeddingMetric, lambda m: m.accumulate(
            {"labels": torch.tensor([1, 0])}, {"embeddings": torch.randn(2, 3), "loss": 1j}), "outputs['loss']"),
    }


CASES = _cases()


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_names_metric_and_field_and_changes_nothing(name):
    make, call, field = CASES[name]
    m = make()
    before = m.state_dict()
    with pytest.raises((TypeError, ValueError)) as info:
        call(m)
    msg = str(info.value)
    assert msg.startswith(type(m).__name__ + ":") and field in msg, msg
    assert state_dict_differences(before, m.state_dict()) == []
