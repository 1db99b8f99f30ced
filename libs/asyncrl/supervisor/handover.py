"""Surge on a stop: a supervised service that gets a SIGTERM it did not get from the supervisor
(a node drained, an operator, Kubernetes rescheduling a pod) keeps serving until a successor
the supervisor starts beside it is ready, and only then leaves and drains. With one replica the
run then waits for nothing but the hand-over itself, not for a new process to start.

The protocol is a file per step in the supervisor's `var/run/handover/` (ASYNCRL_HANDOVER_DIR in
every supervised service that supports it), named by the pid it is about:

    <pid>.stop       supervisor: it stops <pid> itself (shutdown, scale down): no successor
    <pid>.busy       service <pid>: I serve work (a rollout with groups lately; removed when
                     that ends while it waits, e.g. the experiment completed)
    <pid>.request    service <pid>: I was told to stop; start my successor
    <pid>.successor  supervisor: the successor's pid (or `<pid>.stop`: none will come)
    <pid>.ready      the successor: ready (registered and, when <pid> was busy, serving too;
                     a singleton's: its imports done, about to take over)
    <pid>.gone       service <pid>: closed (its port is free; a singleton's successor binds now)

A successor learns its predecessor from ASYNCRL_PREDECESSOR_PID. A singleton (the scheduler:
one port, one owner of the experiments) hands over exclusively (`take_over`): its successor
says ready once it is connected to NATS, waits for `<pid>.gone`, and only then reads the
experiments and binds the port. Without a supervisor
(ASYNCRL_HANDOVER_DIR unset, or the parent gone) a stop is the plain graceful stop.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from asyncrl.logging import get_logger
from asyncrl.proc import pid_alive

ENV_DIR = "ASYNCRL_HANDOVER_DIR"
ENV_PREDECESSOR = "ASYNCRL_PREDECESSOR_PID"
ENV_SUPERVISOR = "ASYNCRL_SUPERVISOR_PID"
SERVICES = ("scheduler", "reward", "rollout")
"""The services that hand over (the trainer stops at a step boundary with its checkpoint)."""
ANSWER_S = 2.0
"""How long a stopping service waits for the supervisor to answer its request."""
READY_S = 180.0
"""How long it keeps serving while its successor starts (a rollout loading its model under
load took 60 s); the supervisor kills it past READY_S + its grace."""
POLL_S = 0.05

log = get_logger()


def marker(directory: Path, pid: int, step: str) -> Path:
    return directory / f"{pid}.{step}"


def write_marker(directory: Path, pid: int, step: str, text: str = "") -> None:
    """Atomic: a reader sees the whole file or none."""
    path = marker(directory, pid, step)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def clear_markers(directory: Path, pid: int) -> None:
    for path in directory.glob(f"{pid}.*"):
        path.unlink(missing_ok=True)


def requests(directory: Path) -> list[int]:
    """The pids that asked for a successor, oldest first."""
    found = sorted(directory.glob("*.request"), key=lambda p: p.stat().st_mtime)
    return [int(p.stem) for p in found if p.stem.isdigit()]


@dataclass(frozen=True)
class Handover:
    """This process's side of the protocol."""

    directory: Path
    pid: int
    supervisor: int
    predecessor: int | None

    @classmethod
    def from_env(cls) -> Handover | None:
        directory = os.environ.get(ENV_DIR)
        if not directory:
            return None
        predecessor = os.environ.get(ENV_PREDECESSOR)
        return cls(
            directory=Path(directory),
            pid=os.getpid(),
            supervisor=int(os.environ.get(ENV_SUPERVISOR) or os.getppid()),
            predecessor=int(predecessor) if predecessor else None,
        )

    def _has(self, pid: int, step: str) -> bool:
        return marker(self.directory, pid, step).exists()

    def ready(self) -> None:
        """Tell the predecessor (if any, and still there) that it may stop now."""
        if self.predecessor is None or not pid_alive(self.predecessor):
            return
        if not self._has(self.predecessor, "ready"):
            write_marker(self.directory, self.predecessor, "ready", str(self.pid))
            log.info("handover_ready", predecessor=self.predecessor)

    def gone(self) -> None:
        write_marker(self.directory, self.pid, "gone")

    async def take_over(self) -> None:
        """A singleton's successor (the scheduler, once connected): the predecessor may go;
        return once it closed."""
        self.ready()
        await self.predecessor_gone()

    async def predecessor_gone(self, timeout_s: float = READY_S) -> None:
        """Wait until the predecessor closed (or died); a singleton's successor starts then."""
        if self.predecessor is None:
            return
        started = time.monotonic()
        while not self._has(self.predecessor, "gone") and pid_alive(self.predecessor):
            if time.monotonic() - started > timeout_s:
                log.warning("handover_predecessor_stuck", predecessor=self.predecessor)
                return
            await asyncio.sleep(POLL_S / 2)
        log.info("handover_took_over", predecessor=self.predecessor, waited_s=_since(started))

    async def announce(self, serving: Callable[[], bool], timeout_s: float = READY_S) -> None:
        """Tell the predecessor it may go: at once, or when it was busy, once this process
        serves too (`serving()`: a rollout loaded the experiment's weights), within timeout_s."""
        if self.predecessor is None:
            return
        started = time.monotonic()
        while self._has(self.predecessor, "busy") and not serving():
            if not pid_alive(self.predecessor):
                return
            if time.monotonic() - started > timeout_s:
                break
            await asyncio.sleep(POLL_S)
        self.ready()

    async def hand_over(
        self, interrupted: Callable[[], bool], busy: Callable[[], bool] = lambda: False
    ) -> bool:
        """Called on a stop signal: unless the supervisor sent it (or is gone), ask it for a
        successor and keep serving until the successor is ready. True when one is; False for a
        plain stop (no supervisor, its own stop, no answer, the successor died, a second signal,
        or READY_S passed)."""
        if self._has(self.pid, "stop") or os.getppid() != self.supervisor:
            return False
        started = time.monotonic()
        self._mark_busy(busy())
        write_marker(self.directory, self.pid, "request")
        successor = await self._answer(interrupted)
        if successor is None:
            return False
        log.info("handover_waiting", successor=successor)
        while not self._has(self.pid, "ready"):
            late = time.monotonic() - started > READY_S
            if late or interrupted() or self._has(self.pid, "stop") or not pid_alive(successor):
                log.warning("handover_abandoned", successor=successor, waited_s=_since(started))
                return False
            self._mark_busy(busy())
            await asyncio.sleep(POLL_S)
        log.info("handover_done", successor=successor, waited_s=_since(started))
        return True

    def _mark_busy(self, busy: bool) -> None:
        if busy and not self._has(self.pid, "busy"):
            write_marker(self.directory, self.pid, "busy")
        elif not busy:
            marker(self.directory, self.pid, "busy").unlink(missing_ok=True)

    async def _answer(self, interrupted: Callable[[], bool]) -> int | None:
        """The successor's pid, or None when the supervisor says no or does not answer."""
        deadline = time.monotonic() + ANSWER_S
        while time.monotonic() < deadline and not interrupted():
            if self._has(self.pid, "stop"):
                return None
            path = marker(self.directory, self.pid, "successor")
            if path.exists():
                return int(path.read_text())
            await asyncio.sleep(POLL_S)
        log.warning("handover_unanswered", waited_s=ANSWER_S)
        return None


class RecentWork:
    """Whether a process served work lately (`busy`): a count of work in hand (a rollout's
    running groups), read on every call (each heartbeat's load), that was above 0 within
    `window_s`. A rollout between two dispatches is busy; one whose experiment ended is not."""

    def __init__(self, count: Callable[[], int], window_s: float = 10.0):
        self.count = count
        self.window_s = window_s
        self.last: float | None = None

    def __call__(self) -> int:
        n = self.count()
        if n:
            self.last = time.monotonic()
        return n

    def busy(self) -> bool:
        self()
        return self.last is not None and time.monotonic() - self.last < self.window_s


def _since(started: float) -> float:
    return round(time.monotonic() - started, 3)
