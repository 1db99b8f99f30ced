"""The reward service's summary line: Score calls are counted, one line per `every_s`."""

from __future__ import annotations

from structlog.testing import capture_logs

from services.reward.server import Tally


def test_tally_logs_totals_once_per_period_then_starts_over():
    tally = Tally(every_s=10.0)
    start = tally._since
    with capture_logs() as logs:
        tally.add(8, 0, start + 1)
        tally.add(8, 2, start + 5)
        assert logs == []
        tally.add(8, 0, start + 10)
        tally.add(8, 1, start + 11)
    assert logs == [
        {
            "event": "scored",
            "log_level": "info",
            "calls": 3,
            "items": 24,
            "failed": 2,
            "seconds": 10.0,
        }
    ]
    assert (tally.calls, tally.items, tally.failed) == (1, 8, 1)
