"""What the fleet's background update changes in the scheduler's pure rules: how far the fleet may
lag the trainer (out of eta), and which evals are due when the fleet skips versions."""

from __future__ import annotations

import pytest

from asyncrl.spec import RolloutSpec
from services.scheduler.evaluation import Evaluator, eval_due
from services.scheduler.fleet import FLEET_LAG_MAX, fleet_lag


@pytest.mark.parametrize(("eta", "lag"), [(0, 0), (1, 0), (2, 1), (4, 1)])
def test_fleet_lag_comes_out_of_eta_at_most_one(eta, lag):
    assert FLEET_LAG_MAX == 1
    assert fleet_lag(RolloutSpec(max_head_offpolicyness=eta)) == lag


@pytest.mark.parametrize(
    ("since", "version", "expected"),
    [(23, 24, False), (24, 25, True), (24, 26, True), (25, 27, False), (23, 51, True)],
)
def test_eval_due_when_the_fleet_skips_versions_past_a_multiple(since, version, expected):
    assert eval_due(version, 25, since=since) is expected


def test_evaluator_schedules_the_version_the_fleet_reached_past_a_due_one_once():
    ev = Evaluator(n_prompts=3, every_versions=25, n_samples=1, done_versions=set())
    assert ev.schedule(26, since=24)  # 25 was coalesced: evaluated at 26, what the fleet serves
    assert not ev.schedule(26, since=24)
    assert not ev.schedule(27, since=26)
    assert [r.version for r in ev.rounds] == [26]
