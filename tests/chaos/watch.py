"""What a fault run sees of its experiment, shared by `make chaos` (tests.chaos.run) and
`make multihost` (tests.multihost.run): the version timeline polled from the scheduler, the
faults injected (each at the version and second it hit), and what went wrong with the run
itself. A run subclasses it and injects its faults while `watch` tracks the experiment."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable

from asyncrl.client import AsyncrlClient, is_terminal, state_name

POLL_S = 0.25
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED")


class ExperimentWatch:
    def __init__(self, scheduler: str, timeout_s: float, stall_s: float):
        self.scheduler = scheduler
        self.timeout_s = timeout_s
        """Submit to the end of the experiment, at most."""
        self.stall_s = stall_s
        """A run whose version has not moved for this long is hung: stop waiting."""
        self.experiment_id = ""
        self.t0 = 0.0
        self.version = 0
        self.state = ""
        self.timeline: list[tuple[float, int]] = []
        self.faults: list[dict] = []
        self.errors: list[str] = []

    def since(self) -> float:
        return round(time.time() - self.t0, 3)

    async def track(self) -> None:
        """Poll the experiment until it ends, recording (seconds since submit, version) at each
        change; a scheduler that cannot be reached just means no poll this time."""
        async with AsyncrlClient(self.scheduler, timeout_s=2.0) as client:
            while self.state not in TERMINAL:
                try:
                    exp = await client.get(self.experiment_id)
                except Exception:  # the scheduler or nats is down: the point of the exercise
                    await asyncio.sleep(POLL_S)
                    continue
                self.state = state_name(exp.state)
                if not self.timeline or exp.progress.version != self.version:
                    self.version = exp.progress.version
                    self.timeline.append((self.since(), self.version))
                if is_terminal(exp):
                    return
                if self.since() - self.timeline[-1][0] > self.stall_s:
                    self.errors.append(
                        f"hung: {self.state} at v{self.version} for {self.stall_s:.0f}s"
                    )
                    return
                await asyncio.sleep(POLL_S)

    async def reach(self, version: int, timeout: float = 240) -> bool:
        """Wait until the experiment is at `version` or past it; False if it ended or stalled."""
        deadline = time.monotonic() + timeout
        while self.version < version:
            if self.state in TERMINAL or time.monotonic() > deadline:
                return False
            await asyncio.sleep(POLL_S / 2)
        return True

    def mark(self, what: str, **extra) -> dict:
        """Record a fault happening now, at the current version."""
        fault = {"what": what, "at_version": self.version, "at_s": self.since(), **extra}
        self.faults.append(fault)
        return fault

    async def watch(self, inject: Awaitable[None]) -> None:
        """Track the experiment while `inject` injects the faults; wait for the end."""
        tracker = asyncio.create_task(self.track())
        try:
            await inject
        except Exception as e:  # recorded; the experiment is still watched to its end
            self.errors.append(f"inject: {type(e).__name__}: {e}")
        try:
            await asyncio.wait_for(tracker, max(1.0, self.timeout_s - self.since()))
        except TimeoutError:
            self.errors.append(f"experiment not ended after {self.timeout_s:.0f}s")
