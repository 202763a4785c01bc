"""Module paths of earlier releases import as the modules they moved to."""
import importlib
import subprocess
import sys

import pytest

import twinkle_metrics


@pytest.mark.parametrize("old, new", sorted(twinkle_metrics.MOVED.items()))
def test_old_path_is_the_new_module(old, new):
    moved = importlib.import_module(f"twinkle_metrics.{old}")
    assert moved is importlib.import_module(f"twinkle_metrics.{new}")
    assert moved.__spec__.name == f"twinkle_metrics.{new}"  # the alias does not replace the module's spec


def test_attributes_set_through_an_old_path_are_seen_through_the_new(monkeypatch):
    import twinkle_metrics.metrics.system.train as new
    import twinkle_metrics.train as old

    monkeypatch.setattr(old, "_RANK_BITS", 21)
    assert new._RANK_BITS == 21


def test_documented_entry_points_still_run():
    out = subprocess.run([sys.executable, "-m", "twinkle_metrics.plot", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "jsonl" in out.stdout
    from twinkle_metrics.megatron import loss_func  # noqa: F401
    from twinkle_metrics.megatron_cpu import enable  # noqa: F401
    from twinkle_metrics.testing import forbid_device_waits  # noqa: F401
