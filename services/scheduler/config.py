"""The scheduler's settings and their defaults, written here only (the registry, the
`create_scheduler` factory and the command line take theirs from `SchedulerConfig`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerConfig:
    lease_ttl_s: float = 10.0
    """A worker that has not heartbeated for this long is gone; its work is reassigned."""
    heartbeat_interval_s: float = 1.0
    """How often workers are told to heartbeat."""
    bind_timeout_s: float = 300.0
    """Deadline for a newly bound rollout to load the current weights (may load a model)."""
    trainer_start_timeout_s: float = 600.0
    """Deadline for the trainer's StartExperiment (it loads the model and checkpoint)."""
    trainer_stop_timeout_s: float = 10.0
    max_start_failures: int = 5
    """Failed StartExperiment calls (any trainer) before the experiment is FAILED."""
    snapshot_interval_s: float = 2.0
    """WatchExperiment sends a snapshot at least this often."""
    save_interval_s: float = 0.2
    """Minimum time between two KV writes of one experiment."""
    trainer_poll_interval_s: float = 5.0
    """How often a running experiment asks its trainer for its status (GetStatus)."""
    trainer_poll_timeout_s: float = 5.0
    """Deadline of that GetStatus."""
    leader_lease_s: float = 3.0
    """The lease that makes one scheduler the active one (services/scheduler/leadership.py):
    a standby takes over this long after the active one's last renewal."""
    progress_timeout_s: float = 300.0
    """No step committed, no group settled and no rollout joined for this long: the trainer is
    started again; the second time in a row the experiment is FAILED."""

    @property
    def fence_cooldown_s(self) -> float:
        """A fenced worker is not bound again for this long (it may be dead)."""
        return self.lease_ttl_s
