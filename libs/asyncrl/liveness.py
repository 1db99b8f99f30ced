"""The control plane's NATS subjects: heartbeats, weight announcements and their answers.

Heartbeats: a worker publishes `asyncrl.live.<kind>.<worker_id>` every heartbeat interval,
the body `<worker_id> <incarnation> <lease_key> <load> <unix time sent>`; the scheduler alone
subscribes (`asyncrl.live.>`) and applies what came in batches. `lease_key` is a secret of the
registration (answered over the authenticated RegisterWorker RPC), so a worker of the same NATS
user (every rollout shares the `rollout` user) cannot keep another's lease: NATS permissions
let each kind publish only its own kind's subjects and let no one but the scheduler read them.
A heartbeat for a worker the scheduler does not know (its lease lapsed, the scheduler
restarted) is answered `unknown` on its reply subject: the worker registers again.

Weights: the scheduler announces a committed version to an experiment's rollouts with one
message on `asyncrl.weights.<experiment_id>` (`WeightsAnnouncement`); each rollout named in it
answers on `asyncrl.weights_ack.<experiment_id>` (`WeightsAck`, with its lease key and the
fingerprint it now serves). The reward workers' addresses are published on
`asyncrl.fleet.rewards` (JSON list) when they change and every few seconds, and a scheduler
that starts serving publishes on `asyncrl.fleet.scheduler`: every worker registers again.
"""

from __future__ import annotations

from dataclasses import dataclass

LIVE_ROOT = "asyncrl.live"
WEIGHTS_ROOT = "asyncrl.weights"
ACK_ROOT = "asyncrl.weights_ack"
REWARDS_SUBJECT = "asyncrl.fleet.rewards"
SCHEDULER_SUBJECT = "asyncrl.fleet.scheduler"
"""A scheduler that starts serving says so here: every worker registers at once (a hand-over's
successor or a restarted scheduler knows none of them), not at its next heartbeat's answer."""
UNKNOWN = b"unknown"
"""The scheduler's answer to a heartbeat of a worker it does not know: register again."""


def live_subject(kind: str, worker_id: str) -> str:
    return f"{LIVE_ROOT}.{kind}.{worker_id}"


def live_subjects(kind: str) -> str:
    """What a worker of `kind` may publish heartbeats on (NATS permissions)."""
    return f"{LIVE_ROOT}.{kind}.*"


def weights_subject(experiment_id: str) -> str:
    return f"{WEIGHTS_ROOT}.{experiment_id}"


def ack_subject(experiment_id: str) -> str:
    return f"{ACK_ROOT}.{experiment_id}"


@dataclass(frozen=True)
class Beat:
    worker_id: str
    incarnation: str
    lease_key: str
    load: int = 0
    sent_unix: float = 0.0

    def encode(self) -> bytes:
        fields = (self.worker_id, self.incarnation, self.lease_key, self.load, self.sent_unix)
        return " ".join(map(str, fields)).encode()

    @classmethod
    def decode(cls, data: bytes) -> Beat | None:
        """The beat in `data`, None if it is not one (nothing a worker of ours sent)."""
        parts = data.split()
        if len(parts) != 5:
            return None
        try:
            worker_id, incarnation, key = (p.decode() for p in parts[:3])
            return cls(worker_id, incarnation, key, int(parts[3]), float(parts[4]))
        except (UnicodeDecodeError, ValueError):
            return None
