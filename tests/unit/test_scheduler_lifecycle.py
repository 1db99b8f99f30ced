"""The experiment lifecycle's table: every allowed transition works, every other is refused."""

from __future__ import annotations

import itertools

import pytest

from services.scheduler.lifecycle import TRANSITIONS, IllegalTransition, Lifecycle, Phase
from services.scheduler.records import ExperimentRecord, ExperimentState

P = Phase
LIVE = [P.PENDING, P.BINDING, P.STARTING, P.RUNNING, P.RESTARTING, P.FAILING, P.FINISHING]
EDGES = {
    (P.PENDING, P.BINDING),
    (P.BINDING, P.STARTING),
    (P.STARTING, P.RUNNING),
    (P.RUNNING, P.FINISHING),
    (P.FINISHING, P.ENDING),
    (P.ENDING, P.COMPLETED),
    (P.ENDING, P.FAILED),
    (P.ENDING, P.CANCELLED),
    # back to waiting: a worker lost, a start that failed, the trainer lost or replaced
    (P.BINDING, P.PENDING),
    (P.STARTING, P.PENDING),
    (P.RUNNING, P.PENDING),
    # the watchdog
    (P.RUNNING, P.RESTARTING),
    (P.RESTARTING, P.PENDING),
    (P.RUNNING, P.FAILING),
    # a commit at total_steps can land in any live phase
    *((p, P.FINISHING) for p in LIVE if p not in (P.RUNNING, P.FINISHING)),
    # cancel, a refused bind, a crash: any live phase ends
    *((p, P.ENDING) for p in LIVE if p != P.FINISHING),
}
"""Written out by hand from the lifecycle's docstring (not read from the table)."""

SHOWN = {
    P.PENDING: "PENDING",
    P.BINDING: "PENDING",
    P.STARTING: "PENDING",
    P.RUNNING: "RUNNING",
    P.RESTARTING: "RUNNING",
    P.FAILING: "RUNNING",
    P.FINISHING: "RUNNING",
    P.COMPLETED: "COMPLETED",
    P.FAILED: "FAILED",
    P.CANCELLED: "CANCELLED",
}
"""The public state each phase shows (ENDING shows the one before)."""


def lifecycle_at(phase: Phase, shown: ExperimentState = ExperimentState.RUNNING) -> Lifecycle:
    life = Lifecycle(ExperimentRecord(id="exp-1", name="exp", spec={}, state=shown))
    life.phase = phase
    return life


def test_lifecycle_table_is_the_documented_one():
    table = {(a, b) for a, targets in TRANSITIONS.items() for b in targets}
    assert table == EDGES
    assert set(TRANSITIONS) == set(Phase)
    assert [p for p in Phase if p.terminal] == [P.COMPLETED, P.FAILED, P.CANCELLED]


@pytest.mark.parametrize(("current", "target"), sorted(EDGES))
def test_lifecycle_allowed_transition_enters_target_and_shows_its_state(current, target):
    life = lifecycle_at(current, ExperimentState.PENDING)
    changed = life.to(target, reason="why", message="said")
    shown = SHOWN.get(target, "PENDING")  # ENDING keeps what was shown
    assert (life.phase, life.reason, life.record.message) == (target, "why", "said")
    assert (life.record.state.value, changed) == (shown, shown != "PENDING")


@pytest.mark.parametrize(
    ("current", "target"),
    [pair for pair in itertools.product(Phase, Phase) if pair not in EDGES],
)
def test_lifecycle_illegal_transition_is_refused_and_changes_nothing(current, target):
    life = lifecycle_at(current)
    with pytest.raises(IllegalTransition, match=f"no transition {current} -> {target}"):
        life.to(target, message="never")
    assert (life.phase, life.record.state, life.record.message) == (
        current,
        ExperimentState.RUNNING,
        "",
    )


def test_lifecycle_resumes_a_persisted_record_at_its_public_state():
    got = {
        s.value: Lifecycle(ExperimentRecord("e", "e", {}, state=s)).phase for s in ExperimentState
    }
    assert got == {
        "PENDING": P.PENDING,
        "RUNNING": P.RUNNING,
        "COMPLETED": P.COMPLETED,
        "FAILED": P.FAILED,
        "CANCELLED": P.CANCELLED,
    }


def test_lifecycle_ending_shows_the_state_before_until_terminal():
    life = lifecycle_at(P.RUNNING)
    assert life.to(P.ENDING) is False
    assert (life.record.state, life.live, life.stopping) == (ExperimentState.RUNNING, False, True)
    assert life.to(P.CANCELLED, message="cancelled by user") is True
    assert (life.record.state, life.terminal) == (ExperimentState.CANCELLED, True)
