"""The names a failed wait gives: absent ranks as ranges, read back exactly; the answer
every rank reads from the store, whenever it comes; what a rank that came late says."""
import re
from datetime import timedelta

import pytest
import torch.distributed as dist

from twinkle_metrics.comm.waits import Roll, message, ranges, unranges

BOUND = timedelta(seconds=10)


@pytest.mark.parametrize("ranks,text", [([1, 2, 3, 5], "1-3, 5"), ([7], "7"), ([], ""),
                                        (list(range(16384)), "0-16383"), ([0, 2, 4], "0, 2, 4")])
def test_absent_ranks_travel_as_ranges(ranks, text):
    assert ranges(ranks) == text
    assert unranges(text or "-") == ranks


def _roll(store):
    return Roll(store, "twinkle_metrics/calls/c/1", range(4), "mesh from sizes (ranks 0-3)")


def test_one_answer_for_every_rank_and_the_late_rank_finds_itself_in_it():
    """Ranks 1 and 2 of 0-3 come; rank 1 gives up first and writes the answer; rank 0
    comes after that, before rank 2 has read it; rank 3 never comes."""
    store = dist.HashStore()
    _roll(store).mark(1)
    _roll(store).mark(2)
    first = _roll(store).absent(0.01)
    assert first[0] == [0, 3]
    _roll(store).mark(0)  # too late to count
    late, second = _roll(store).absent(0.01), _roll(store).absent(0.01)
    assert late == first and second == first  # the same ranks and the same time, on every rank


def _ranks(pattern, text):
    found = re.search(pattern, text)
    assert found, text
    return set(unranges(found.group(1)))


def test_the_ranks_that_came_name_the_absent_ones():
    text = message("calculate()", BOUND, 10.0, _roll(None), 2, ([0, 3], 100.0), 90.0)
    assert _ranks(r"; ranks ([0-9, -]+) of the mesh", text) == {0, 3}, text
    assert "did not arrive" in text and "this is rank 2" in text, text


@pytest.mark.parametrize("late,when", [(12.0, "about 12 s before"), (0.2, "less than a second before"),
                                       (-0.3, "less than a second before")])
def test_a_late_rank_says_who_gave_up_and_when_never_naming_itself(late, when):
    text = message("calculate()", BOUND, 0.0, _roll(None), 0, ([0, 3], 100.0), 100.0 + late)
    assert _ranks(r"^calculate\(\): ranks ([0-9, -]+) of the mesh from sizes \(ranks 0-3\) gave up", text) == {1, 2}
    assert f"{when} this rank (0) came" in text, text
    assert _ranks(r"\(rank ([0-9, -]+) had not come either\)", text) == {3}, text
    assert "restart the job" in text and "did not arrive" not in text and "waited" not in text, text


def test_a_late_rank_alone_absent_names_no_one_else():
    text = message("calculate()", BOUND, 0.0, _roll(None), 3, ([3], 100.0), 105.0)
    assert "ranks 0-2 of the mesh" in text and "either" not in text and "3 of the" not in text, text


class _DeviceWork:
    """A device work as the host sees it: ``is_completed`` turns true after ``polls`` polls
    (never, for None); ``wait()`` (no timeout) is recorded, a timeout refused."""

    def __init__(self, polls=None):
        self.polls, self.left, self.waits = 0, polls, []

    def is_completed(self):
        self.polls += 1
        return self.left is not None and self.polls > self.left

    def wait(self, *timeout):
        assert not timeout, "a bounded Work.wait(timeout) on a group the library did not make"
        self.waits.append(())
        return True

    def get_future(self):  # a device work's future completes at once: never a host bound
        raise AssertionError("a device work's completion is polled, not read from its future")


def test_a_device_work_is_polled_until_it_completes_and_a_stuck_one_gives_up():
    from twinkle_metrics.comm.waits import completion

    work = _DeviceWork(polls=3)
    assert completion(work, on_host=False)(30.0) and work.polls == 4
    stuck = _DeviceWork()
    assert not completion(stuck, on_host=False)(0.01) and stuck.polls >= 1


def test_a_host_work_completes_through_its_future_from_another_thread():
    import threading

    import torch

    from twinkle_metrics.comm.waits import completion

    class HostWork:
        def __init__(self):
            self.future = torch.futures.Future()

        def get_future(self):
            return self.future

    work = HostWork()
    done = completion(work, on_host=True)
    assert not done(0.01)
    threading.Timer(0.01, lambda: work.future.set_result(None)).start()
    assert done(30.0) and done(0.0)  # once complete, every later wait returns at once


def test_a_completed_device_work_is_waited_on_without_a_timeout():
    from twinkle_metrics.comm import waits

    class Group:  # a group of the job's: weakly referenceable, no store without torch.distributed
        pass

    work = _DeviceWork(polls=0)
    waits.wait(work, Group(), "calculate()", lambda: "data group", BOUND, on_host=False)
    assert work.waits == [()]
