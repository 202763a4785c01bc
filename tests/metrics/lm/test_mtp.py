"""Single-process tests of ``MTPMetric`` (and ``register_mtp_hooks``' refusals)."""
import pytest
import torch

from twinkle_metrics import Accuracy, LossMetric, MetricCollection, MTPMetric
from twinkle_metrics.testing import assert_results_close, forbid_device_waits


def _depth_batch(seed, b=3, s=7, v=9):
    """Labels, mask and logits of one depth, with ties in the logits and some hits planted."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, v, (b, s), generator=g)
    mask = (torch.rand(b, s, generator=g) < 0.7).float()
    logits = (torch.randn(b, s, v, generator=g) * 2).round()
    hit = torch.rand(b, s, generator=g) < 0.5
    logits.scatter_(-1, labels.unsqueeze(-1), torch.where(hit, 9.0, -9.0).unsqueeze(-1))
    losses = torch.rand(b, s, generator=g, dtype=torch.float64) * 4
    return labels, mask, logits, losses


def _reference(batches):
    """Per depth: (correct, total, sum(loss * mask), sum(mask)) over the depth's batches."""
    out = {}
    for k, (labels, mask, logits, losses) in batches:
        c, t, ls, n = out.get(k, (0, 0, 0.0, 0.0))
        valid = mask != 0
        out[k] = (c + int(((logits.argmax(-1) == labels) & valid).sum()), t + int(valid.sum()),
                  ls + float((losses * mask).sum()), n + float(mask.sum()))
    return out


def test_per_depth_counts_and_token_weighted_loss_match_a_recomputation():
    batches = [(1, _depth_batch(0)), (2, _depth_batch(1)), (1, _depth_batch(2, b=1, s=3)), (2, _depth_batch(3))]
    m = MTPMetric(depths=2)
    with forbid_device_waits():
        for k, (labels, mask, logits, losses) in batches:
            m.accumulate({"labels": labels, "completion_mask": mask}, {"mtp_logits": logits, "mtp_losses": losses},
                         depth=k)
    got = m.calculate()
    want = {}
    for k, (c, t, ls, n) in _reference(batches).items():
        want.update({f"mtp/depth{k}/loss": ls / n, f"mtp/depth{k}/num_tokens": int(n),
                     f"mtp/depth{k}/acceptance_rate": c / t, f"mtp/depth{k}/correct_tokens": c,
                     f"mtp/depth{k}/total_tokens": t, f"mtp/depth{k}/cumulative_acceptance_rate": c / t})
    assert_results_close(got, want, rel=1e-12)
    assert type(got["mtp/depth1/correct_tokens"]) is int and 0 < got["mtp/depth1/acceptance_rate"] < 1
    # token-weighted: a batch of 3 positions weighs less than one of 21, not as much
    means = [float((x * w).sum() / w.sum()) for k, (_, w, _, x) in batches if k == 1]
    assert got["mtp/depth1/loss"] != pytest.approx(sum(means) / 2, rel=1e-6)
    later = m.calculate()  # an interval without calls: only the run's rates
    assert later == {k: v for k, v in got.items() if "cumulative" in k} and len(later) == 2


def test_microbatch_lists_equal_the_whole_batch_and_an_empty_stage_adds_nothing():
    labels, mask, logits, losses = _depth_batch(10, b=4)
    whole = MTPMetric(depths=2).accumulate({"labels": labels, "completion_mask": mask},
                                           {"mtp_logits": logits, "mtp_losses": losses}, depth=2).calculate()
    m = MTPMetric(depths=2)
    m.accumulate([], [], depth=2)  # a pipeline stage without the MTP heads
    parts = (slice(0, 1), slice(1, None))
    m.accumulate([{"labels": labels[r], "completion_mask": mask[r]} for r in parts],
                 [{"mtp_logits": logits[r], "mtp_losses": losses[r]} for r in parts], depth=2)
    assert_results_close(m.calculate(), whole, rel=1e-12)


def test_the_three_loss_forms_and_labels_without_a_mask():
    labels, _, logits, losses = _depth_batch(4)
    labels[0, :4] = -100
    weights = (labels != -100).double()
    m = MTPMetric(depths=3, ignore_index=-100)
    m.accumulate({"labels": labels}, {"mtp_losses": losses}, depth=3)
    m.accumulate(None, {"mtp_loss": torch.tensor(6.0), "mtp_num_tokens": 4}, depth=3)
    m.accumulate({"labels": labels}, {"mtp_logits": logits}, depth=3)
    got = m.calculate()
    assert got["mtp/depth3/loss"] == pytest.approx((float((losses * weights).sum()) + 6.0) / (weights.sum() + 4))
    assert got["mtp/depth3/num_tokens"] == int(weights.sum()) + 4
    assert got["mtp/depth3/total_tokens"] == int(weights.sum())
    valid = labels != -100
    assert got["mtp/depth3/correct_tokens"] == int(((logits.argmax(-1) == labels) & valid).sum())
    assert not any("depth1" in k or "depth2" in k for k in got)  # depths that saw nothing report nothing


def test_float_mask_weights_the_loss_and_its_nonzero_positions_count():
    labels = torch.tensor([[0, 1, 2]])
    logits = torch.eye(3).unsqueeze(0)  # argmax == position: every prediction right
    mask = torch.tensor([[0.5, 0.0, 2.0]])
    got = MTPMetric().accumulate({"labels": labels, "completion_mask": mask},
                                 {"mtp_logits": logits, "mtp_losses": torch.tensor([[1.0, 7.0, 3.0]])},
                                 depth=1).calculate()
    assert got["mtp/depth1/loss"] == pytest.approx((0.5 + 6.0) / 2.5)
    assert (got["mtp/depth1/correct_tokens"], got["mtp/depth1/total_tokens"]) == (2, 2)


def test_megatron_keys_are_the_same_numbers_under_megatron_names():
    labels, mask, logits, losses = _depth_batch(5)
    feed = ({"labels": labels, "completion_mask": mask}, {"mtp_logits": logits, "mtp_losses": losses})
    plain = MTPMetric(depths=2).accumulate(*feed, depth=2).calculate()
    both = MTPMetric(depths=2, megatron_keys=True).accumulate(*feed, depth=2).calculate()
    assert {k: v for k, v in both.items() if k.startswith("mtp/")} == plain
    assert both["mtp_2 loss"] == plain["mtp/depth2/loss"]
    assert both["mtp_2_acceptance_rate"] == pytest.approx(100 * plain["mtp/depth2/acceptance_rate"])  # percent
    assert set(both) - set(plain) == {"mtp_2 loss", "mtp_2_acceptance_rate", "mtp_2_cumulative_acceptance_rate"}
    # compute-only: a checkpoint of one loads into the other
    saved = MTPMetric(depths=2).accumulate(*feed, depth=2).state_dict()
    assert MTPMetric(depths=2, megatron_keys=True).load_state_dict(saved).calculate() == both


@pytest.mark.parametrize("depth, error, match", [
    (0, ValueError, r"MTPMetric: depth 0 is out of range: this metric has depths=2 \(1 to 2\)"),
    (3, ValueError, r"depth 3 is out of range"),
    (True, TypeError, r"depth must be the MTP depth as an int from 1 to 2, got True"),
    (1.0, TypeError, r"got 1.0"),
    (None, ValueError, r"got outputs\['mtp_logits'\] but no keyword 'depth'"),
])
def test_depth_out_of_range_or_not_an_int_raises_and_adds_nothing(depth, error, match):
    labels, mask, logits, _ = _depth_batch(6)
    m = MTPMetric(depths=2)
    with pytest.raises(error, match=match):
        m.accumulate({"labels": labels}, {"mtp_logits": logits}, depth=depth)
    assert m.calculate() == {}


def test_logits_labels_and_losses_that_do_not_line_up_raise():
    labels, mask, logits, losses = _depth_batch(7)
    m = MTPMetric()
    with pytest.raises(ValueError, match=r"MTPMetric: labels \[3, 8\] do not line up with the outputs: expected "
                                         r"\[3, 7\].*rolled left by k"):
        m.accumulate({"labels": torch.cat([labels, labels[:, :1]], 1)}, {"mtp_logits": logits}, depth=1)
    with pytest.raises(ValueError, match=r"completion_mask \[3, 6\] do not line up"):
        m.accumulate({"labels": labels, "completion_mask": mask[:, 1:]}, {"mtp_logits": logits}, depth=1)
    with pytest.raises(ValueError, match=r"mtp_losses \[3, 6\] do not line up with mtp_logits \[3, 7, 9\]"):
        m.accumulate({"labels": labels}, {"mtp_logits": logits, "mtp_losses": losses[:, 1:]}, depth=1)
    with pytest.raises(ValueError, match=r"mtp_logits must be \[..., vocab\]"):
        m.accumulate({"labels": labels[0, 0]}, {"mtp_logits": logits[0, 0]}, depth=1)
    with pytest.raises(TypeError, match=r"labels must have an integer dtype"):
        m.accumulate({"labels": labels.float()}, {"mtp_logits": logits}, depth=1)
    with pytest.raises(TypeError, match=r"outputs\['mtp_logits'\] must be a floating tensor"):
        m.accumulate({"labels": labels}, {"mtp_logits": labels}, depth=1)
    with pytest.raises(ValueError, match=r"got outputs\['mtp_logits'\] but no inputs\['labels'\]"):
        m.accumulate({"completion_mask": mask}, {"mtp_logits": logits}, depth=1)
    with pytest.raises(ValueError, match=r"got 2 input microbatches but 1 outputs dicts"):
        m.accumulate([{"labels": labels}, {"labels": labels}], [{"mtp_logits": logits}], depth=1)
    assert m.calculate() == {}


@pytest.mark.parametrize("n, match", [(-1, r"= -1 is not a count"), (2.5, r"= 2.5 is not a count"),
                                      (torch.tensor(-3), r"= -3 is not a count"), (True, r"got a bool")])
def test_a_token_count_that_is_not_a_count_raises(n, match):
    m = MTPMetric()
    with pytest.raises((ValueError, TypeError), match=r"MTPMetric: outputs\['mtp_num_tokens'\]" + ".*" + match):
        m.accumulate(None, {"mtp_loss": 1.0, "mtp_num_tokens": n}, depth=1)
    with pytest.raises(ValueError, match=r"got outputs\['mtp_loss'\] but no outputs\['mtp_num_tokens'\]"):
        m.accumulate(None, {"mtp_loss": 1.0}, depth=1)
    assert m.calculate() == {}


def test_bad_constructor_arguments_raise():
    for depths in (0, -1, True, 1.5, "2"):
        with pytest.raises(ValueError, match=r"MTPMetric: depths must be an int >= 1"):
            MTPMetric(depths=depths)
    with pytest.raises(TypeError, match=r"vocab_parallel must be True or False"):
        MTPMetric(vocab_parallel=1)


def test_labels_past_the_vocab_raise_at_calculate_and_keep_the_interval():
    m = MTPMetric()
    m.accumulate({"labels": torch.tensor([[1, 5]])}, {"mtp_logits": torch.zeros(1, 2, 4)}, depth=1)
    with pytest.raises(ValueError, match=r"MTPMetric: labels reach id 5 but the logits' last dimension is 4"):
        m.calculate()


def test_in_a_collection_the_main_head_and_the_mtp_heads_feed_their_own_metrics():
    labels, mask, logits, losses = _depth_batch(8)
    acc, loss, mtp = Accuracy(), LossMetric(loss_reduction="sum"), MTPMetric(depths=2)
    coll = MetricCollection([acc, loss, mtp])
    coll.accumulate({"labels": labels, "completion_mask": mask}, {"logits": logits, "loss": 3.0, "num_tokens": 2})
    coll.accumulate({"labels": labels, "completion_mask": mask}, {"mtp_logits": logits}, depth=2)
    got = coll.calculate()
    assert got["total_tokens"] == got["mtp/depth2/total_tokens"] == int(mask.sum())  # one call each
    assert got["loss"] == 1.5 and "mtp/depth2/loss" not in got and "mtp/depth1/total_tokens" not in got


def test_state_dict_round_trip_and_the_fingerprint_names_depths():
    labels, mask, logits, losses = _depth_batch(9)
    m = MTPMetric(depths=2, vocab_parallel=False)
    m.accumulate({"labels": labels, "completion_mask": mask}, {"mtp_logits": logits, "mtp_losses": losses}, depth=2)
    saved = m.state_dict()
    assert "depths=2" in saved["__fingerprint__"] and "megatron_keys" not in saved["__fingerprint__"]
    want = m.calculate()
    assert MTPMetric(depths=2).load_state_dict(saved).calculate() == want
    with pytest.raises(ValueError, match=r"depths"):
        MTPMetric(depths=3).load_state_dict(saved)


# ------------------------------------------------------------------ register_mtp_hooks
class _Config:
    def __init__(self, mtp):
        self.mtp_num_layers = mtp


class _Model(torch.nn.Module):
    """Enough of GPTModel for the hook's set-up: config, output layer, stage flag, the loss method."""

    def __init__(self, mtp=2, post_process=True):
        super().__init__()
        self.config, self.post_process = _Config(mtp), post_process
        self.output_layer = torch.nn.Linear(2, 3)

    def forward(self, input_ids, labels=None, loss_mask=None):
        return input_ids

    def compute_language_model_loss(self, labels, logits):
        return torch.zeros_like(labels, dtype=torch.float32)


@pytest.mark.megatron
def test_register_mtp_hooks_refuses_what_cannot_be_fed_and_is_inactive_off_the_last_stage():
    from twinkle_metrics import register_mtp_hooks

    with pytest.raises(TypeError, match=r"register_mtp_hooks: metric must be an MTPMetric, got Accuracy"):
        register_mtp_hooks(_Model(), Accuracy())
    with pytest.raises(ValueError, match=r"when must be one of \['train', 'always'\]"):
        register_mtp_hooks(_Model(), MTPMetric(depths=2), when="eval")
    with pytest.raises(ValueError, match=r"mtp_num_layers=2 but the metric depths=1"):
        register_mtp_hooks(_Model(), MTPMetric())
    with pytest.raises(ValueError, match=r"no multi-token prediction \(config.mtp_num_layers is None\)"):
        register_mtp_hooks(_Model(mtp=None), MTPMetric())
    model = _Model(post_process=False)
    hooks = register_mtp_hooks([model], MTPMetric(depths=2))
    assert not hooks.active and "compute_language_model_loss" not in model.__dict__
    last = _Model()
    with register_mtp_hooks(last, MTPMetric(depths=2)) as hooks:
        assert hooks.active and "compute_language_model_loss" in last.__dict__ and last._forward_pre_hooks
    assert "compute_language_model_loss" not in last.__dict__ and not last._forward_pre_hooks


def test_the_cumulative_rate_runs_over_intervals_and_survives_a_resume_at_another_dp_size():
    """Two DP ranks' metrics (one process each), saved mid-run, resumed in one process."""
    batches = [_depth_batch(20 + i) for i in range(5)]
    ranks = [MTPMetric(depths=1, megatron_keys=True) for _ in range(2)]
    hits = total = 0
    for i, (labels, mask, logits, _) in enumerate(batches[:4]):
        ranks[i % 2].accumulate({"labels": labels, "completion_mask": mask}, {"mtp_logits": logits}, depth=1)
        hits, total = hits + int(((logits.argmax(-1) == labels) & (mask != 0)).sum()), total + int((mask != 0).sum())
        if i == 1:  # an interval ends on both ranks (each calculates alone here: one process)
            for r in ranks:
                r.calculate()
    resumed = MTPMetric(depths=1, megatron_keys=True).load_state_dict([r.state_dict() for r in ranks])
    labels, mask, logits, _ = batches[4]
    resumed.accumulate({"labels": labels, "completion_mask": mask}, {"mtp_logits": logits}, depth=1)
    hits, total = hits + int(((logits.argmax(-1) == labels) & (mask != 0)).sum()), total + int((mask != 0).sum())
    got = resumed.calculate()
    assert got["mtp/depth1/cumulative_acceptance_rate"] == hits / total
    assert got["mtp_1_cumulative_acceptance_rate"] == pytest.approx(100 * hits / total)
    assert got["mtp/depth1/total_tokens"] < total  # the interval's rate is the interval's alone
