"""The shared summary line: counts summed by name, one INFO line per `every_s` seconds."""

from __future__ import annotations

import time

from structlog.testing import capture_logs

from asyncrl.logging import Tally, get_logger

log = get_logger()


def test_tally_before_every_s_logs_nothing():
    tally = Tally("done", log, every_s=10.0, start=100.0)
    with capture_logs() as logs:
        tally.add(100.0, calls=1)
        tally.add(109.9, calls=1)
    assert logs == []


def test_tally_at_every_s_logs_the_sums_and_the_interval_once():
    tally = Tally("done", log, every_s=10.0, start=100.0)
    with capture_logs() as logs:
        tally.add(101.0, calls=1, items=8, failed=0)
        tally.add(105.0, calls=1, items=8, failed=2)
        tally.add(110.04, calls=1, items=3, failed=0)
    assert logs == [
        {
            "event": "done",
            "log_level": "info",
            "calls": 3,
            "items": 19,
            "failed": 2,
            "seconds": 10.0,
        }
    ]


def test_tally_after_a_line_counts_from_zero_and_times_from_that_line():
    tally = Tally("done", log, every_s=10.0, start=100.0)
    with capture_logs() as logs:
        tally.add(101.0, calls=1, items=8)
        tally.add(112.0, calls=1, items=8)  # line 1: 12 s
        tally.add(113.0, calls=1, items=5)
        tally.add(121.9, calls=1, items=5)  # 9.9 s since line 1: no line
        tally.add(122.4, calls=1, items=1)  # line 2: 10.4 s
    assert logs == [
        {"event": "done", "log_level": "info", "calls": 2, "items": 16, "seconds": 12.0},
        {"event": "done", "log_level": "info", "calls": 3, "items": 11, "seconds": 10.4},
    ]


def test_tally_name_added_only_in_an_earlier_interval_is_absent_zero_added_is_present():
    tally = Tally("done", log, every_s=10.0, start=0.0)
    with capture_logs() as logs:
        tally.add(1.0, tokens=40, accepted=1)
        tally.add(10.0, tokens=8, rejected=1)
        tally.add(20.0, tokens=0, rejected=1)
    assert logs == [
        {
            "event": "done",
            "log_level": "info",
            "tokens": 48,
            "accepted": 1,
            "rejected": 1,
            "seconds": 10.0,
        },
        {"event": "done", "log_level": "info", "tokens": 0, "rejected": 1, "seconds": 10.0},
    ]


def test_tally_line_carries_the_loggers_bound_context():
    tally = Tally("done", get_logger(component="rollout"), every_s=1.0, start=0.0)
    with capture_logs() as logs:
        tally.add(1.0, calls=1)
    assert logs == [
        {"component": "rollout", "event": "done", "log_level": "info", "calls": 1, "seconds": 1.0}
    ]


def test_tally_without_start_times_the_first_interval_from_its_creation():
    made = time.perf_counter()
    tally = Tally("done", log, every_s=10.0)
    with capture_logs() as logs:
        tally.add(made + 9.0, calls=1)
        assert logs == []
        tally.add(made + 20.0, calls=1)
    assert [(line["calls"], 10.0 < line["seconds"] <= 20.0) for line in logs] == [(2, True)]
