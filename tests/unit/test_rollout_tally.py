"""The rollout's summary line: finished groups counted by status, one line per `every_s`."""

from __future__ import annotations

from structlog.testing import capture_logs

from services.rollout.filters import GroupStatus
from services.rollout.service import GroupSummary, GroupTally


def test_tally_logs_groups_by_status_once_per_period_then_starts_over():
    tally = GroupTally(every_s=10.0)
    start = tally._since
    accepted = GroupSummary("g1", GroupStatus.ACCEPTED, tokens=40)
    rejected = GroupSummary("g2", GroupStatus.REJECTED, tokens=8)
    with capture_logs() as logs:
        tally.add(accepted, start + 1)
        tally.add(rejected, start + 5)
        assert logs == []
        tally.add(accepted, start + 10)
        tally.add(rejected, start + 11)
    assert logs == [
        {
            "component": "rollout",
            "event": "groups_done",
            "log_level": "info",
            "seconds": 10.0,
            "tokens": 88,
            "accepted": 2,
            "rejected": 1,
        }
    ]
    assert (tally._counts, tally._tokens) == ({"rejected": 1}, 8)
