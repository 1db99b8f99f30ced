"""An experiment's lifecycle: its phases, the transitions allowed between them (one table), and
the one function every transition goes through (`Lifecycle.to`), which refuses any other.

    PENDING -> BINDING -> STARTING -> RUNNING -> FINISHING -> ENDING -> COMPLETED
    BINDING, STARTING, RUNNING -> PENDING                          ENDING -> FAILED
    RUNNING -> RESTARTING -> PENDING                               ENDING -> CANCELLED
    RUNNING -> FAILING -> ENDING
    every live phase -> FINISHING (but FINISHING itself) and -> ENDING

- PENDING: waiting for a trainer, a rollout and a reward worker.
- BINDING: sending the spec to the reward workers (one that refuses it fails the run).
- STARTING: StartExperiment to the trainer (it answers the version to resume from).
- RUNNING: dispatching training groups. A trainer lost or replaced goes back to PENDING; a
  scheduler restart resumes a RUNNING record the same way.
- RESTARTING: the watchdog found the trainer failed, idle or stalled: back to PENDING, and the
  trainer is started again.
- FAILING: the watchdog gave up on the trainer; the runner's loop ends the run FAILED.
- FINISHING: total_steps reached or dataset exhausted: no more training groups, the final eval
  runs once the fleet serves the last version. A commit is told to stop.
- ENDING: stopping the trainer and freeing the workers; the terminal state follows.

The public state (`ExperimentState`, persisted and served) is derived from the phase; ENDING
keeps what the experiment said before, so a client that sees the end also sees the trainer's
last events (`ExperimentRunner._end`).
"""

from __future__ import annotations

from enum import StrEnum

from services.scheduler.records import ExperimentRecord, ExperimentState


class Phase(StrEnum):
    PENDING = "pending"
    BINDING = "binding"
    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"
    FAILING = "failing"
    FINISHING = "finishing"
    ENDING = "ending"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return not TRANSITIONS[self]


_LIVE = (
    Phase.PENDING,
    Phase.BINDING,
    Phase.STARTING,
    Phase.RUNNING,
    Phase.RESTARTING,
    Phase.FAILING,
    Phase.FINISHING,
)

TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.PENDING: frozenset({Phase.BINDING, Phase.FINISHING, Phase.ENDING}),
    Phase.BINDING: frozenset({Phase.STARTING, Phase.PENDING, Phase.FINISHING, Phase.ENDING}),
    Phase.STARTING: frozenset({Phase.RUNNING, Phase.PENDING, Phase.FINISHING, Phase.ENDING}),
    Phase.RUNNING: frozenset(
        {Phase.PENDING, Phase.RESTARTING, Phase.FAILING, Phase.FINISHING, Phase.ENDING}
    ),
    Phase.RESTARTING: frozenset({Phase.PENDING, Phase.FINISHING, Phase.ENDING}),
    Phase.FAILING: frozenset({Phase.FINISHING, Phase.ENDING}),
    Phase.FINISHING: frozenset({Phase.ENDING}),
    Phase.ENDING: frozenset({Phase.COMPLETED, Phase.FAILED, Phase.CANCELLED}),
    Phase.COMPLETED: frozenset(),
    Phase.FAILED: frozenset(),
    Phase.CANCELLED: frozenset(),
}
"""Every allowed transition, by the phase it leaves (a commit can land while the trainer is
being started again, hence FINISHING from every live phase but ENDING)."""

PUBLIC: dict[Phase, ExperimentState | None] = {
    Phase.PENDING: ExperimentState.PENDING,
    Phase.BINDING: ExperimentState.PENDING,
    Phase.STARTING: ExperimentState.PENDING,
    Phase.RUNNING: ExperimentState.RUNNING,
    Phase.RESTARTING: ExperimentState.RUNNING,
    Phase.FAILING: ExperimentState.RUNNING,
    Phase.FINISHING: ExperimentState.RUNNING,
    Phase.ENDING: None,  # says what it said before until the terminal state
    Phase.COMPLETED: ExperimentState.COMPLETED,
    Phase.FAILED: ExperimentState.FAILED,
    Phase.CANCELLED: ExperimentState.CANCELLED,
}
"""The state a phase shows (None: the one shown before)."""

_RESTORED = {
    ExperimentState.PENDING: Phase.PENDING,
    ExperimentState.RUNNING: Phase.RUNNING,  # goes back to PENDING until its workers are there
    ExperimentState.COMPLETED: Phase.COMPLETED,
    ExperimentState.FAILED: Phase.FAILED,
    ExperimentState.CANCELLED: Phase.CANCELLED,
}


class IllegalTransition(Exception):
    """A transition the table does not allow (a bug in the caller, never the user's)."""

    def __init__(self, experiment_id: str, current: Phase, target: Phase):
        allowed = ", ".join(sorted(TRANSITIONS[current])) or "none, it is terminal"
        super().__init__(
            f"experiment {experiment_id}: no transition {current} -> {target} (allowed: {allowed})"
        )
        self.current, self.target = current, target


class Lifecycle:
    """The phase of one experiment, and the only writer of its record's `state`."""

    def __init__(self, record: ExperimentRecord):
        self.record = record
        self.phase = _RESTORED[record.state]
        self.reason = ""
        """Why the phase was entered (the restart or failure reason, the finish reason)."""

    def to(self, target: Phase, reason: str = "", message: str | None = None) -> bool:
        """Enter `target` (IllegalTransition if the table has no such edge), setting the
        record's message when one is given; True if the public state changed."""
        if target not in TRANSITIONS[self.phase]:
            raise IllegalTransition(self.record.id, self.phase, target)
        self.phase, self.reason = target, reason
        if message is not None:
            self.record.message = message
        shown = PUBLIC[target]
        if shown is None or shown == self.record.state:
            return False
        self.record.state = shown
        return True

    @property
    def terminal(self) -> bool:
        return self.phase.terminal

    @property
    def live(self) -> bool:
        """Not terminal and not ending: may still take workers."""
        return self.phase in _LIVE

    @property
    def stopping(self) -> bool:
        """No more training (finishing, ending or ended): a commit is told to stop."""
        return self.phase in (Phase.FINISHING, Phase.ENDING) or self.terminal
