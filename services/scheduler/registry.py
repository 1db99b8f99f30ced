"""The worker registry: who is alive (leases renewed by heartbeats) and who is bound where.

Pure bookkeeping with an injected clock; the scheduler runs the sweeper that calls `expire()`
and decides what an expiry means for the experiments.
"""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from services.scheduler.config import SchedulerConfig


class WorkerKind(StrEnum):
    ROLLOUT = "rollout"
    REWARD = "reward"
    TRAINER = "trainer"


class Joined(StrEnum):
    """What a registration was (`Registry.register`)."""

    NEW = "new"
    """No live worker at that address: a new id."""
    AGAIN = "again"
    """The same process registering again (same incarnation): its id, binding, loaded weights
    and lease key stand; nothing is to be done again."""
    RESTARTED = "restarted"
    """Another process at a live worker's address (another incarnation, or an older worker
    that sends none): its id and binding stand, it must load its experiment again."""


class BeatResult(StrEnum):
    """What a heartbeat on NATS did (`Registry.beat`)."""

    RENEWED = "renewed"
    UNKNOWN = "unknown"
    """No such worker (its lease lapsed, or the scheduler restarted): it registers again."""
    STALE = "stale"
    """Another incarnation's, or the lease key is wrong: a late beat of a process that was
    replaced, or a forgery; ignored (never taken for a restart)."""


@dataclass
class Worker:
    worker_id: str
    kind: WorkerKind
    address: str
    name: str
    capacity: int
    last_seen: float
    """Clock time of the last registration or heartbeat."""
    last_seen_unix: float
    experiment_id: str | None = None
    """Bound experiment (rollouts and trainers; reward workers are shared)."""
    shared: list[str] = field(default_factory=list)
    """The LoRA experiments sharing this rollout (on the same base), in the order they joined.
    A rollout is idle, bound to one experiment (`experiment_id`), or shared: never both."""
    fenced_for: dict[str, float] = field(default_factory=dict)
    """Experiment -> clock time before which a rollout it fenced is not shared with it again."""
    running: int = 0
    groups_done: int = 0
    version: int = 0
    """Last weights version the worker confirmed (rollouts)."""
    load: int = 0
    """Load the worker reported in its last heartbeat."""
    cooldown_until: float = 0.0
    """A fenced worker is not bound again before this clock time."""
    probed: bool = True
    """False until the scheduler asked a new trainer what it is running."""
    affinity: str | None = None
    """The experiment a trainer said it is already running (bound back to it first)."""
    device: str = ""
    """Where it computes, as it registered it (shown by `asyncrl workers`)."""
    principal: str = ""
    """The identity (token subject) that registered it: only it may heartbeat for it, register
    it again, or (a trainer) commit for its experiment. "" when security is off."""
    incarnation: str = ""
    """The worker process's random id (RegisterWorkerRequest.incarnation; "" an older one)."""
    lease_key: str = ""
    """The secret its heartbeats on NATS carry (asyncrl.liveness), made per incarnation."""
    on_nats: bool = False
    """Its heartbeats come on NATS (this incarnation's): it hears weight announcements too."""


class Registry:
    def __init__(
        self,
        lease_ttl_s: float = SchedulerConfig.lease_ttl_s,
        heartbeat_interval_s: float = SchedulerConfig.heartbeat_interval_s,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.lease_ttl_s = lease_ttl_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.clock = clock
        self._workers: dict[str, Worker] = {}
        self._by_address: dict[tuple[WorkerKind, str], Worker] = {}
        self._sorted: dict[WorkerKind | None, list[Worker]] = {}
        """`workers(kind)` by id, kept until a worker joins or leaves (asked several times per
        group dispatched)."""
        self._bound: dict[WorkerKind, dict[str, list[Worker]]] = {}
        """`bound(...)` by kind and experiment, kept until a worker joins, leaves, or is bound,
        shared or let go (asked by every experiment's dispatch pass: one scan of ten thousand
        rollouts per experiment per pass cost the scheduler most of its core)."""

    def register(
        self,
        kind: WorkerKind,
        address: str,
        name: str,
        capacity: int,
        principal: str = "",
        incarnation: str = "",
    ) -> tuple[Worker, Joined]:
        """Add a worker registered by `principal`; returns (worker, what it was: `Joined`).

        A live worker registering again from the same address keeps its id and binding, so its
        in-flight work is not reassigned twice: AGAIN when it is the same process (its
        `incarnation`, not ""), RESTARTED otherwise (a new lease key then). The caller checks
        first (`at`) that it is the same principal."""
        w = self.at(kind, address)
        if w is not None:
            w.name, w.capacity = name or w.name, capacity
            self._touch(w)
            if incarnation and incarnation == w.incarnation:
                return w, Joined.AGAIN
            w.incarnation, w.lease_key = incarnation, secrets.token_hex(16)
            w.on_nats = False
            return w, Joined.RESTARTED
        worker_id = f"{kind.value}-{uuid.uuid4().hex[:8]}"
        w = Worker(
            worker_id, kind, address, name or worker_id, capacity, 0.0, 0.0, principal=principal
        )
        w.incarnation, w.lease_key = incarnation, secrets.token_hex(16)
        self._touch(w)
        self._workers[worker_id] = w
        self._by_address[(kind, address)] = w
        self._changed()
        return w, Joined.NEW

    def at(self, kind: WorkerKind, address: str) -> Worker | None:
        """The live worker of `kind` registered at `address`, if any."""
        return self._by_address.get((kind, address))

    def get(self, worker_id: str) -> Worker | None:
        return self._workers.get(worker_id)

    def heartbeat(self, worker_id: str, load: int = 0) -> bool:
        """Renew the lease; False for an unknown id (the worker must register again)."""
        w = self._workers.get(worker_id)
        if w is None:
            return False
        w.load = load
        self._touch(w)
        return True

    def beat(self, worker_id: str, incarnation: str, lease_key: str, load: int) -> BeatResult:
        """A heartbeat that came on NATS: renews the lease only with the worker's incarnation
        and lease key (`BeatResult`)."""
        w = self._workers.get(worker_id)
        if w is None:
            return BeatResult.UNKNOWN
        if incarnation != w.incarnation or not secrets.compare_digest(lease_key, w.lease_key):
            return BeatResult.STALE
        w.load, w.on_nats = load, True
        self._touch(w)
        return BeatResult.RENEWED

    def remove(self, worker_id: str) -> Worker | None:
        """Forget a worker that said it is leaving; the worker, None for an unknown id."""
        w = self._workers.pop(worker_id, None)
        if w is not None:
            self._forget(w)
        return w

    def expire(self) -> list[Worker]:
        """Remove and return the workers whose lease lapsed."""
        deadline = self.clock() - self.lease_ttl_s
        gone = [w for w in self._workers.values() if w.last_seen < deadline]
        for w in gone:
            del self._workers[w.worker_id]
            self._forget(w)
        return gone

    def _forget(self, w: Worker) -> None:
        if self._by_address.get((w.kind, w.address)) is w:
            del self._by_address[(w.kind, w.address)]
        self._changed()

    def _changed(self) -> None:
        """A worker joined or left, or a binding changed: the cached lists go."""
        self._sorted.clear()
        self._bound.clear()

    def workers(self, kind: WorkerKind | None = None) -> list[Worker]:
        """The live workers (of `kind`) by id; a new list each call."""
        return list(self._of(kind))

    def _of(self, kind: WorkerKind | None) -> list[Worker]:
        """`workers(kind)`, the cached list itself (not to be changed)."""
        ws = self._sorted.get(kind)
        if ws is None:
            ws = [w for w in self._workers.values() if kind is None or w.kind == kind]
            ws = self._sorted[kind] = sorted(ws, key=lambda w: w.worker_id)
        return ws

    def bound(self, experiment_id: str, kind: WorkerKind) -> list[Worker]:
        """The workers of `kind` bound to or shared with `experiment_id` (by id; a new list)."""
        by_experiment = self._bound.get(kind)
        if by_experiment is None:
            by_experiment = self._bound[kind] = {}
            for w in self._of(kind):
                for e in [w.experiment_id] if w.experiment_id else w.shared:
                    by_experiment.setdefault(e, []).append(w)
        return list(by_experiment.get(experiment_id, ()))

    @staticmethod
    def serves(worker: Worker, experiment_id: str) -> bool:
        return worker.experiment_id == experiment_id or experiment_id in worker.shared

    def missing(self, experiment_id: str) -> list[str]:
        """The workers an experiment waits for: its trainer, a rollout, a reward worker."""
        needs = {
            "a trainer": self.bound(experiment_id, WorkerKind.TRAINER),
            "a rollout worker": self.bound(experiment_id, WorkerKind.ROLLOUT),
            "a reward worker": self._of(WorkerKind.REWARD),
        }
        return [what for what, workers in needs.items() if not workers]

    def idle(self, kind: WorkerKind) -> list[Worker]:
        """Unbound workers of `kind` that are not cooling down after being fenced."""
        now = self.clock()
        return [
            w
            for w in self._of(kind)
            if w.experiment_id is None and not w.shared and w.cooldown_until <= now
        ]

    def bind(self, worker: Worker, experiment_id: str) -> None:
        assert worker.experiment_id is None, f"{worker.worker_id} is already bound"
        assert not worker.shared, f"{worker.worker_id} is shared"
        worker.experiment_id = experiment_id
        self._bound.clear()

    def unbind(self, worker: Worker, cooldown_s: float = 0.0) -> None:
        worker.experiment_id = None
        worker.cooldown_until = self.clock() + cooldown_s
        self._bound.clear()

    def share(self, worker: Worker, experiment_id: str) -> bool:
        """Share rollout `worker` with LoRA experiment `experiment_id`; False (nothing done)
        while it cools down after that experiment fenced it."""
        assert worker.experiment_id is None, f"{worker.worker_id} is bound"
        if self.fenced_for(worker, experiment_id) or experiment_id in worker.shared:
            return False
        worker.shared.append(experiment_id)
        self._bound.clear()
        return True

    def fenced_for(self, worker: Worker, experiment_id: str) -> bool:
        return worker.fenced_for.get(experiment_id, 0.0) > self.clock()

    def release(self, worker: Worker, experiment_id: str, cooldown_s: float = 0.0) -> None:
        """`experiment_id` lets go of `worker`: unbound if it held it alone; if shared, only
        that experiment leaves it (and may not share it again for `cooldown_s`)."""
        if experiment_id in worker.shared:
            worker.shared.remove(experiment_id)
            self._bound.clear()
            if cooldown_s:
                worker.fenced_for[experiment_id] = self.clock() + cooldown_s
            if not worker.shared:  # idle again: cools down as an unbound one does
                worker.cooldown_until = self.clock() + cooldown_s
        elif worker.experiment_id == experiment_id:
            self.unbind(worker, cooldown_s)

    def probing(self, worker: Worker) -> None:
        """A new trainer: not bound before it said what it runs (`probed`)."""
        worker.probed = False

    def probed(self, worker: Worker, affinity: str | None) -> None:
        """The trainer said it runs experiment `affinity` (None: nothing, or no answer)."""
        worker.probed = True
        if affinity:
            worker.affinity = affinity

    def group_started(self, worker: Worker) -> None:
        worker.running += 1

    def group_ended(self, worker: Worker) -> None:
        """One of its groups settled (answered, or ended by the scheduler)."""
        worker.running -= 1

    def group_done(self, worker: Worker) -> None:
        """It answered one of its groups."""
        worker.groups_done += 1

    def weights_loaded(self, worker: Worker, version: int) -> None:
        """`worker` (a rollout) confirmed it serves `version`."""
        worker.version = version

    def reward_addresses(self) -> list[str]:
        return [w.address for w in self._of(WorkerKind.REWARD)]

    def _touch(self, w: Worker) -> None:
        w.last_seen = self.clock()
        w.last_seen_unix = time.time()
