"""The phases of a weight update: the one list of their names. They label the `phase` of the
weight-update histograms (scheduler, rollout, trainer), name the fields of the rollout's
UpdateWeights answer (`<phase>_s`) and the step metrics' timings."""

from __future__ import annotations

from enum import StrEnum


class WeightPhase(StrEnum):
    # the trainer's side of a version: serialize, write (or upload), commit to the scheduler
    SERIALIZE = "serialize"
    WRITE = "write"
    UPLOAD = "upload"
    COMMIT = "commit"
    """The trainer's CommitWeights call; on the scheduler, its bookkeeping of the commit."""
    # the scheduler's fleet update
    UPDATE = "update"
    """UpdateWeights to every ready rollout, in parallel."""
    LAG = "lag"
    """A version's commit until the fleet served it."""
    # one rollout's UpdateWeights
    READ = "read"
    PAUSE = "pause"
    LOAD = "load"
    RESUME = "resume"
    TOTAL = "total"
    """The whole UpdateWeights call."""


ROLLOUT_PHASES = (WeightPhase.READ, WeightPhase.PAUSE, WeightPhase.LOAD, WeightPhase.RESUME)
"""A rollout's UpdateWeights phases, in order (its answer has a `<phase>_s` field for each)."""
FLEET_PHASES = (WeightPhase.COMMIT, WeightPhase.UPDATE, WeightPhase.LAG, *ROLLOUT_PHASES)
"""What the scheduler's fleet histogram observes (the slowest rollout's phases included)."""
