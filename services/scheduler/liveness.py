"""The scheduler's side of heartbeats on NATS (asyncrl.liveness): collected as they come,
applied in batches.

A heartbeat costs the scheduler's event loop one append when it arrives and one registry
look-up when its batch is applied (every `BATCH_S`), instead of a gRPC call each (HTTP/2,
TLS, a token check, a task: hundreds of µs). A beat with the wrong incarnation or lease key
renews nothing (`Registry.beat`: STALE); a beat of a worker the registry does not know is
answered `unknown` on its reply subject, so the worker registers again. Every `REPORT_S` a
`liveness` log line says how many beats came, how late (sent -> applied), and how many were
stale or unknown. The reward workers' addresses go out on `asyncrl.fleet.rewards` when they
change (a rollout's Score retries go there; each group's request names its experiment's too).
"""

from __future__ import annotations

import asyncio
import json
import time

from nats.aio.msg import Msg

from asyncrl.liveness import LIVE_ROOT, REWARDS_SUBJECT, SCHEDULER_SUBJECT, UNKNOWN, Beat
from asyncrl.logging import get_logger, keep_running
from services.scheduler.registry import BeatResult, Registry

log = get_logger()

BATCH_S = 0.1
REPORT_S = 5.0
STALL_FACTOR = 3.0
PENDING_LIMIT = 1_000_000
"""Messages nats-py holds for the subscription before it drops (a slow consumer)."""


def percentile(values: list[float], q: float) -> float:
    """The `q` quantile (0..1) of `values` by the nearest rank; 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q * len(ordered))) - 1))]


class StallGuard:
    """Whether the scheduler's own event loop just stalled (the sweeper woke more than
    `STALL_FACTOR` intervals after its last pass): the beats sent meanwhile may still be
    unread in the socket, so that pass expires no one (the next one, an interval later, does
    if they did not come)."""

    def __init__(self, interval: float, clock=time.monotonic):
        self.interval, self.clock = interval, clock
        self.last = clock()

    def stalled(self) -> bool:
        now = self.clock()
        gap, self.last = now - self.last, now
        if gap > STALL_FACTOR * self.interval:
            log.warning("scheduler_stalled", seconds=round(gap, 3), expiry="postponed")
            return True
        return False


class Liveness:
    """Consumes the heartbeats (`start`), applies them in batches to `registry`."""

    def __init__(self, nc, registry: Registry, batch_s: float = BATCH_S):
        self.nc = nc
        self.registry = registry
        self.batch_s = batch_s
        self._inbox: list[Msg] = []
        self._sub = None
        self._tasks: list[asyncio.Task] = []
        self.counts = dict.fromkeys(BeatResult, 0)
        """Beats by outcome since the start (tests and the bench read them)."""
        self._lags: list[float] = []
        self._rewards: list[str] | None = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(
            f"{LIVE_ROOT}.>", cb=self._arrived, pending_msgs_limit=PENDING_LIMIT
        )
        self._tasks = [
            asyncio.create_task(keep_running("liveness", self._apply_soon, log, self.batch_s)),
            asyncio.create_task(keep_running("liveness_report", self._report, log, REPORT_S)),
        ]

    async def announce_start(self) -> None:
        """Serving: tell every worker to register (`SCHEDULER_SUBJECT`). Best effort: a worker
        that misses it registers when its next heartbeat is answered `unknown`."""
        try:
            await self.nc.publish(SCHEDULER_SUBJECT, b"serving")
        except Exception as e:  # noqa: BLE001 - NATS away: the heartbeats' answers do it
            log.warning("scheduler_start_not_announced", error=repr(e))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._sub is not None and not self.nc.is_closed:
            await self._sub.unsubscribe()

    async def _arrived(self, msg: Msg) -> None:
        self._inbox.append(msg)

    async def _apply_soon(self) -> None:
        await asyncio.sleep(self.batch_s)
        await self.apply()

    async def apply(self) -> None:
        """Apply the beats that came since the last batch; answer the unknown ones."""
        batch, self._inbox = self._inbox, []
        now = time.time()
        for msg in batch:
            beat = Beat.decode(msg.data)
            if beat is None:
                self.counts[BeatResult.STALE] += 1
                continue
            result = self.registry.beat(beat.worker_id, beat.incarnation, beat.lease_key, beat.load)
            self.counts[result] += 1
            if result is BeatResult.RENEWED:
                self._lags.append(now - beat.sent_unix)
            elif result is BeatResult.UNKNOWN and msg.reply:
                await self.nc.publish(msg.reply, UNKNOWN)
        await self._publish_rewards()

    async def _publish_rewards(self) -> None:
        addresses = self.registry.reward_addresses()
        if addresses != self._rewards:  # on a change only: 1,000 addresses to 10,000 rollouts
            self._rewards = addresses  # are 220 MB; a group's own request names them too
            await self.nc.publish(REWARDS_SUBJECT, json.dumps(addresses).encode())

    async def _report(self) -> None:
        await asyncio.sleep(REPORT_S)
        lags, self._lags = self._lags, []
        log.info(
            "liveness",
            beats=len(lags),
            seconds=REPORT_S,
            lag_ms_p50=round(1e3 * percentile(lags, 0.5), 2),
            lag_ms_p99=round(1e3 * percentile(lags, 0.99), 2),
            lag_ms_max=round(1e3 * max(lags, default=0.0), 2),
            **{f"total_{k.value}": v for k, v in self.counts.items()},
        )
