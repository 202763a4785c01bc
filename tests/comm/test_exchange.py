"""Single-process tests of twinkle_metrics.comm.agreement (groups of one rank: no collective)."""
import pytest

from parallel import DeviceMesh
from twinkle_metrics import Accuracy
from twinkle_metrics.comm import agreement as exchange
from twinkle_metrics.testing import state_dict_differences


def test_agree_without_a_group_returns_values_and_records_it():
    m = Accuracy(DeviceMesh.single())
    assert exchange.agree(m, None, values=[3, -3]) == [3, -3]
    assert exchange.agreed(m) == [None]
    with pytest.raises(ValueError, match="at most 3"):
        exchange.agree(m, None, values=[1, 2, 3, 4])


def test_agree_with_an_error_reraises_it_and_join_failed_swallows_it():
    m = Accuracy(DeviceMesh.single())
    err = ValueError("bad input")
    with pytest.raises(ValueError) as got:
        exchange.agree(m, None, error=err)
    assert got.value is err

    class Two(Accuracy):
        def exchange_groups(self):
            return [None, None]

    t = Two(DeviceMesh.single())
    exchange.join_failed(t, err, fresh=True)  # agrees on both, raises nothing
    assert exchange.agreed(t) == [None, None]


def test_guard_reraises_and_leaves_states_alone():
    m = Accuracy(DeviceMesh.single(), vocab_parallel=True)
    before = m.state_dict()
    with pytest.raises(ValueError, match=r"got outputs\['logits'\] but no inputs\['labels'\]"):
        m.accumulate(None, {"logits": __import__("torch").zeros(2, 3, 4)})
    assert not state_dict_differences(before, m.state_dict())


def test_a_communicating_metric_on_a_layout_only_mesh_raises_in_accumulate():
    import torch

    mesh = DeviceMesh.from_sizes(tp_size=2, dp_size=2, create_groups=False)
    m = Accuracy(mesh, vocab_parallel=True)
    with pytest.raises(RuntimeError, match=r"Accuracy.accumulate\(\): .*layout-only"):
        m.accumulate({"labels": torch.zeros(2, 3, dtype=torch.long)}, {"logits": torch.zeros(2, 3, 4)})
