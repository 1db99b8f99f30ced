"""asyncrl.throughput: the running total and the windowed token rate."""

from __future__ import annotations

import pytest

from asyncrl.throughput import Throughput


def test_rate_counts_only_the_window_and_total_counts_everything():
    t = Throughput(window_s=10.0)
    t._since = 0.0  # the window opened at t=0
    t.add(100, now=1.0)
    t.add(50, now=5.0)
    assert t.rate(now=5.0) == pytest.approx(150 / 5.0)  # younger than the window: its age
    assert t.rate(now=10.0) == pytest.approx(150 / 10.0)
    assert t.rate(now=11.5) == pytest.approx(50 / 10.0)  # the event at 1.0 left the window
    t.add(30, now=12.0)
    assert t.rate(now=14.9) == pytest.approx(80 / 10.0)
    assert t.rate(now=15.1) == pytest.approx(30 / 10.0)
    assert t.rate(now=30.0) == 0.0
    assert t.total == 180


def test_an_event_exactly_window_old_still_counts():
    t = Throughput(window_s=2.0)
    t._since = 0.0
    t.add(7, now=3.0)
    assert t.rate(now=5.0) == pytest.approx(7 / 2.0)
    assert t.rate(now=5.001) == 0.0
