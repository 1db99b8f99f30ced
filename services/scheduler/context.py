"""What the scheduler shares with its experiment runners: settings, the registry, gRPC channels,
the state store and a way to say "workers changed, re-bind"."""

from __future__ import annotations

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


class ChannelPool:
    """One gRPC channel per worker address, closed when the worker is gone."""

    def __init__(self):
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = channel(address, "scheduler")
        return self._channels[address]

    async def close(self, address: str) -> None:
        ch = self._channels.pop(address, None)
        if ch is not None:
            await ch.close()

    async def close_all(self) -> None:
        for address in list(self._channels):
            await self.close(address)


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
