"""What the scheduler shares with its experiment runners: settings, the registry, gRPC channels,
the state store and a way to say "workers changed, re-bind"."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from prometheus_client import Histogram

from asyncrl.grpcutil import channel
from asyncrl.phases import FLEET_PHASES
from services.scheduler.config import SchedulerConfig
from services.scheduler.history import HistoryLog
from services.scheduler.registry import Registry, Worker
from services.scheduler.state import StateStore

CLOSE_GRACE_S = 60.0
"""How long a gone worker's channel stays open for the calls still in flight on it. Each ends by
its own deadline first (the longest the scheduler gives a worker call is the weight update's,
30 s by default); closing at once would cancel them, and a cancelled call raises CancelledError
in its caller, which cannot tell it from being cancelled itself (a cancel whose StopExperiment
was cut so never answered)."""


class ChannelPool:
    """One gRPC channel per worker address, closed when the worker is gone."""

    def __init__(self):
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._retired: dict[grpc.aio.Channel, asyncio.Task] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = channel(address, "scheduler")
        return self._channels[address]

    def retire(self, address: str) -> None:
        """The worker at `address` is gone: later calls get a new channel, and this one closes
        once the calls in flight on it ended (at most CLOSE_GRACE_S)."""
        ch = self._channels.pop(address, None)
        if ch is not None:
            task = asyncio.create_task(ch.close(CLOSE_GRACE_S), name=f"close-{address}")
            self._retired[ch] = task
            task.add_done_callback(lambda _: self._retired.pop(ch, None))

    async def close(self, address: str) -> None:
        ch = self._channels.pop(address, None)
        if ch is not None:
            await ch.close()

    async def close_all(self) -> None:
        """At once, the retired channels' calls in flight too (the scheduler is stopping)."""
        for address in list(self._channels):
            await self.close(address)
        for ch in list(self._retired):
            await ch.close()


FLEET_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def fleet_histogram() -> Histogram:
    """Seconds of the fleet's weight updates by phase: `update` (UpdateWeights to every ready
    rollout, in parallel), `lag` (a version's commit until the fleet served it), the slowest
    rollout's `read`, `pause`, `load`, `resume`, and the scheduler's `commit` bookkeeping.
    Rendered by the scheduler's collector (never prometheus' global registry)."""
    return Histogram(
        "asyncrl_scheduler_weight_update_seconds",
        "Fleet weight updates by phase: " + ", ".join(FLEET_PHASES),
        ["experiment", "phase"],
        buckets=FLEET_BUCKETS,
        registry=None,
    )


@dataclass
class RunnerContext:
    config: SchedulerConfig
    registry: Registry
    channels: ChannelPool
    store: StateStore
    history: HistoryLog
    """Where steps and evals are appended (the record keeps only the last ones)."""
    js: object
    """JetStream: each runner appends its groups' fates to the ledger there."""
    workers_changed: Callable[[], None]
    """Call after binding changes (a worker freed or fenced) so the scheduler re-binds."""
    fleet_seconds: Histogram = field(default_factory=fleet_histogram)
    """Where the runners' fleet updates spend their time (rendered by the collector)."""
    slot_freed: Callable[[Worker], None] = lambda worker: None
    """A group on a shared rollout ended: the other experiments sharing it may dispatch."""
    announcer: object = None
    """Announces committed versions on NATS (services/scheduler/announce.py)."""
    held: Callable[[], bool] = lambda: True
    """Whether this scheduler holds its lease now (services/scheduler/leadership.py): the
    ledger's writes wait until it does."""
