"""The forward overlap's link model (launcher/comm/schedule.py) against figures worked out by hand."""

from __future__ import annotations

import math

import pytest

from launcher.comm.schedule import SLACK_CHUNKS, Schedule

MB = 1_000_000


def test_rate_is_the_busiest_stretch_not_the_average():
    """Three 4 MB buckets at 0, 100 and 150 ms, the last allreduce done at 250 ms: the link idled early on (4 MB in
    the first 100 ms is not its rate); the last two buckets' 8 MB in 150 ms, the last one's 4 MB in 100 ms: the
    busiest stretch is 8 MB / 0.15 s. The slower of two warm-up passes (done at 300 ms) is not the one used."""
    schedule = Schedule.agree([[0.1, 0.15, 0.3], [0.1, 0.15, 0.25]], [4 * MB] * 3, MB, None, world_size=1)
    assert schedule.rate == pytest.approx(8 * MB / 0.15)
    assert schedule.events == [0.0, 0.1, 0.15]
    assert schedule.slack == pytest.approx(SLACK_CHUNKS * MB / schedule.rate)
    assert schedule.tail is None


def test_launch_windows_and_the_tail_overtaking():
    """Tail chunks ready at a quarter, half and all of the way from the second-to-last event to the last: before
    the last bucket's event the window closes at the tail's first chunk, when the tail is expected."""
    schedule = Schedule.agree([[0.1, 0.2, 0.3]], [MB] * 3, MB, [0.25, 0.5, 1.0], world_size=1)
    assert schedule.tail == pytest.approx([0.125, 0.15, 0.2])
    assert schedule.at_event(0, tail_expected=True) == (0.0, 0.1)
    assert schedule.at_event(1, tail_expected=True) == (0.1, pytest.approx(0.125))
    assert schedule.at_event(1, tail_expected=False) == (0.1, 0.2)
    assert schedule.at_event(2, tail_expected=True) == (0.0, math.inf)  # the last event: everything
    assert schedule.after_tail_chunk(0) == pytest.approx((0.125, 0.15))
    assert schedule.after_tail_chunk(2) == pytest.approx((0.2, 0.2))  # then the last event's time


def test_a_chunk_fits_while_the_modelled_queue_ends_by_the_window_plus_slack():
    schedule = Schedule(rate=MB / 0.01, slack=0.01, events=[0.0, 0.05], tail=None)  # 10 ms per MB, one chunk
    assert schedule.carried(free=0.0, now=0.02, size=MB) == pytest.approx(0.03)  # an idle link starts now
    assert schedule.carried(free=0.04, now=0.02, size=MB) == pytest.approx(0.05)  # a busy one when free
    assert schedule.fits(free=0.04, now=0.0, until=0.05, size=MB)  # done at 0.05 <= 0.05 + 0.01
    assert schedule.fits(free=0.05, now=0.0, until=0.05, size=MB)  # 0.06: within the slack
    assert not schedule.fits(free=0.051, now=0.0, until=0.05, size=MB)
    assert schedule.fits(free=10.0, now=0.0, until=math.inf, size=MB)  # no window: everything goes
