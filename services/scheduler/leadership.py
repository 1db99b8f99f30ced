"""Which scheduler acts: a lease in the scheduler's KV bucket (`scheduler.lease`), so that a
standby scheduler takes over within seconds of the active one's death and two never both act.

The lease's value is {holder, epoch, renewed_unix_ms, released} (JSON); every write of it is a
compare-and-set on the revision the writer last saw:
- a scheduler starting (`acquire`) reads it every `poll_s` and takes it, epoch + 1, when it is
  absent, released, its holder was a process of this host that exists no more (killed: a
  supervisor's restart, a standby beside it, take over at once), or its revision has not
  changed for `ttl_s` since this process first saw that revision (by this process's monotonic
  clock: no clocks are compared across hosts); until then it binds no port and reads no
  experiment (a standby);
- the holder renews it every ttl_s / RENEWALS and acts (`held`) only until ACT_FRACTION of
  ttl_s after the start of its last renewal that succeeded: it stops before any standby may
  take over, since a standby waits a whole ttl_s from a revision it saw after that renewal;
- a compare-and-set that fails (on the lease, or on an experiment record: `StateStore`) means
  another scheduler took over: `on_lost` (the process exits at once, writing nothing more; the
  supervisor starts it again, as a standby). A renewal that fails on NATS only (a timeout) is
  tried again; meanwhile the writes wait (`held` is False) and a renewal that succeeds later
  (nobody took over) lets them go on;
- closing releases it (`released`, by compare-and-set): a standby takes over at its next poll.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import nats.errors
import nats.js.errors

from asyncrl.logging import get_logger, raise_if_cancelled
from asyncrl.proc import pid_alive
from asyncrl.service_main import StartAbandoned

log = get_logger(component="leadership")

LEASE_KEY = "scheduler.lease"
RENEWALS = 3
"""Renewals per lease time: one renewal may fail (NATS slow) and the holder still acts."""
ACT_FRACTION = 5 / 6
"""The holder acts until this fraction of the lease time after its last renewal began."""
STEPPED_DOWN = 75
"""Exit status of a scheduler that lost its lease (the supervisor starts it again)."""


class NotHeld(Exception):
    """This scheduler does not hold the lease now (a write waits, or it stepped down)."""


class StandbyStopped(StartAbandoned):
    """A stop came while this scheduler waited as a standby: it never acted."""


@dataclass(frozen=True)
class LeaseValue:
    holder: str
    epoch: int
    renewed_unix_ms: int
    released: bool = False

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> LeaseValue:
        d = json.loads(data)
        return cls(d["holder"], int(d["epoch"]), int(d["renewed_unix_ms"]), bool(d["released"]))


@dataclass
class Sighting:
    """A standby's view of the lease: the revision it saw last and since when (monotonic)."""

    revision: int | None = None
    since: float = 0.0

    def see(self, revision: int | None, now: float) -> None:
        if revision != self.revision:
            self.revision, self.since = revision, now


def may_take(
    value: LeaseValue | None, sighting: Sighting, now: float, ttl_s: float, gone: bool = False
) -> bool:
    """Whether a standby may take the lease: none yet, released, its holder `gone` (a process
    of this host that no longer exists), or unchanged for ttl_s."""
    return value is None or value.released or gone or now - sighting.since >= ttl_s


def holder_gone(holder: str, hostname: str, alive: Callable[[int], bool]) -> bool:
    """Whether `holder` (`holder_id`: host:pid:port-token) was a process of `hostname` that is
    not `alive` now: a scheduler killed on this host, whose lease nobody need wait out."""
    host, pid, _ = ([*holder.split(":", 2), "", ""])[:3]
    return host == hostname and pid.isdigit() and not alive(int(pid))


def act_until(renewal_started: float, ttl_s: float) -> float:
    """Until when (monotonic) the holder acts after a renewal that began at `renewal_started`."""
    return renewal_started + ACT_FRACTION * ttl_s


HOSTNAME = socket.gethostname()


def holder_id(port: int) -> str:
    return f"{HOSTNAME}:{os.getpid()}:{port}-{secrets.token_hex(3)}"


class Leadership:
    """This process's side of the lease in `kv`."""

    def __init__(
        self,
        kv,
        holder: str,
        ttl_s: float,
        on_lost: Callable[[str], None],
        poll_s: float | None = None,
    ):
        self.kv = kv
        self.holder = holder
        self.ttl_s = ttl_s
        self.on_lost = on_lost
        """Called once the lease is lost (another scheduler holds it): must stop all acting."""
        self.poll_s = poll_s if poll_s is not None else ttl_s / 6
        self.epoch = 0
        self.revision: int | None = None
        self.lost = False
        self._until = 0.0
        self._renewer: asyncio.Task | None = None
        self._wake = asyncio.Event()

    def held(self) -> bool:
        """Whether this scheduler may write to NATS now (its lease renewed in time)."""
        return not self.lost and time.monotonic() < self._until

    async def acquire(self, stopping: Callable[[], bool] = lambda: False) -> None:
        """Wait as a standby until this process holds the lease, then renew it in the
        background. StandbyStopped when `stopping()` turns True meanwhile."""
        sighting = Sighting()
        waited = time.monotonic()
        announced = False
        while True:
            if stopping():  # first: a stop beside a graceful release takes nothing over
                raise StandbyStopped()
            try:
                value, revision = await self._read()
            except (TimeoutError, nats.errors.Error) as e:
                log.warning("lease_read_failed", error=repr(e))
            else:
                sighting.see(revision, time.monotonic())
                mine = value is not None and value.holder == self.holder and not value.released
                gone = value is not None and holder_gone(value.holder, HOSTNAME, pid_alive)
                if mine:  # a take whose answer a timeout lost
                    self.epoch, self.revision = value.epoch, revision
                    await self.renew()
                    if self.held():
                        break
                elif may_take(value, sighting, time.monotonic(), self.ttl_s, gone):
                    if await self._take(value, revision):
                        break
                    continue  # another standby was first: read what it wrote
                elif not announced:
                    log.info("scheduler_standby", active=value.holder, epoch=value.epoch)
                    announced = True
            await asyncio.sleep(self.poll_s)
        log.info(
            "scheduler_active",
            holder=self.holder,
            epoch=self.epoch,
            waited_s=round(time.monotonic() - waited, 3),
        )
        self._renewer = asyncio.create_task(self._renew_forever(), name="lease-renewer")

    async def _read(self) -> tuple[LeaseValue | None, int | None]:
        try:
            entry = await self.kv.get(LEASE_KEY)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None, None
        return LeaseValue.from_json(entry.value), entry.revision

    async def _take(self, value: LeaseValue | None, revision: int | None) -> bool:
        epoch = (value.epoch if value is not None else 0) + 1
        started = time.monotonic()
        mine = LeaseValue(self.holder, epoch, int(time.time() * 1000)).to_json()
        try:
            if revision is None:
                self.revision = await self.kv.create(LEASE_KEY, mine)
            else:
                self.revision = await self.kv.update(LEASE_KEY, mine, last=revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            return False  # another standby was first
        except (TimeoutError, nats.errors.Error) as e:  # it may have landed: read it again
            log.warning("lease_take_failed", error=repr(e))
            return False
        self.epoch = epoch
        self._until = act_until(started, self.ttl_s)
        if value is not None:
            log.warning(
                "lease_taken_over",
                previous=value.holder,
                released=value.released,
                renewed_s_ago=round(time.time() - value.renewed_unix_ms / 1000, 3),
            )
        return True

    def renew_soon(self) -> None:
        """Renew now rather than at the next tick (the process was paused: SIGCONT)."""
        self._wake.set()

    async def _renew_forever(self) -> None:
        while not self.lost:
            raise_if_cancelled("lease-renewer")
            try:
                await asyncio.wait_for(self._wake.wait(), self.ttl_s / RENEWALS)
            except TimeoutError:
                pass
            self._wake.clear()
            await self.renew()

    async def renew(self, released: bool = False) -> None:
        started = time.monotonic()
        value = LeaseValue(self.holder, self.epoch, int(time.time() * 1000), released)
        try:
            self.revision = await self.kv.update(LEASE_KEY, value.to_json(), last=self.revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            if await self.confirm():  # our own write, whose answer a timeout lost
                await self.renew(released)
            return
        except (TimeoutError, nats.errors.Error) as e:
            log.warning("lease_renew_failed", error=repr(e), held=self.held())
            return
        self._until = 0.0 if released else act_until(started, self.ttl_s)

    async def confirm(self) -> bool:
        """After a compare-and-set failed: whether the lease is still this process's (then
        the failed write's revision is taken as the one seen). When it is not: `step_down`."""
        try:
            value, revision = await self._read()
        except (TimeoutError, nats.errors.Error) as e:
            log.warning("lease_read_failed", error=repr(e))
            return False
        if value is not None and value.holder == self.holder and value.epoch == self.epoch:
            self.revision = revision
            return True
        self.step_down(f"the lease is {value.holder if value else 'gone'}'s now")
        return False

    def step_down(self, why: str) -> None:
        if self.lost:
            return
        self.lost = True
        self._until = 0.0
        log.error("scheduler_stepped_down", holder=self.holder, epoch=self.epoch, reason=why)
        self.on_lost(why)

    async def release(self) -> None:
        """Stop renewing and let a standby take over at once (after the last flush)."""
        if self._renewer is not None:
            self._renewer.cancel()
            await asyncio.gather(self._renewer, return_exceptions=True)
        if self.revision is not None and not self.lost:
            await self.renew(released=True)
            log.info("lease_released", holder=self.holder, epoch=self.epoch)
