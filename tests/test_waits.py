"""The names a failed wait gives: absent ranks as ranges, read back exactly."""
import pytest

from twinkle_metrics.comm.waits import _unranges, ranges


@pytest.mark.parametrize("ranks,text", [([1, 2, 3, 5], "1-3, 5"), ([7], "7"), ([], ""),
                                        (list(range(16384)), "0-16383"), ([0, 2, 4], "0, 2, 4")])
def test_absent_ranks_travel_as_ranges(ranks, text):
    assert ranges(ranks) == text
    assert _unranges(text or "-") == ranks
