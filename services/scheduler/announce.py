"""One announcement per commit (asyncrl.liveness): a committed version goes to an
experiment's ready rollouts as one NATS message, and their answers come back on NATS.

`Announcer.announce` publishes a `WeightsAnnouncement` naming the rollouts that are to load
the version and waits, up to the deadline, for each one's `WeightsAck`: the UpdateWeights
answer it would have given (its fingerprint: the weights it now serves) or the error. An
answer counts only with the lease key of that rollout's registration (every rollout shares one
NATS user; only the scheduler reads the answers). Whoever has not answered by the deadline is
missing from the result: the fleet fences it, as it fenced a failed UpdateWeights call.

An announcement is a NATS message, not a stored one: one published while a rollout's
connection was reconnecting (nats-server restarted) never reaches it. So it goes out again
every REPUBLISH_S to those that have not answered (a rollout answers a repeat with the answer
it gave), and a rollout that leaves or whose lease lapses is answered for at once
(`worker_gone`): the round waits for no one who cannot answer.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field

from google.protobuf.message import DecodeError
from nats.aio.msg import Msg

from asyncrl.liveness import ACK_ROOT, weights_subject
from asyncrl.logging import get_logger
from asyncrl.v1 import rollout_pb2, scheduler_pb2
from services.scheduler.registry import Registry, Worker

log = get_logger()

REPUBLISH_S = 2.0
"""How often an announcement goes out again to the rollouts that have not answered it."""

Answer = rollout_pb2.UpdateWeightsResponse | str
"""A rollout's answer: what it loaded, or why it could not."""


@dataclass
class _Round:
    expected: set[str]
    answers: dict[str, Answer] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)


class Announcer:
    """Publishes the announcements; collects the answers (`start` subscribes to them)."""

    def __init__(self, nc, registry: Registry):
        self.nc = nc
        self.registry = registry
        self._rounds: dict[tuple[str, int], _Round] = {}
        self._sub = None
        self.refused = 0
        """Answers dropped: undecodable, or without the rollout's lease key."""

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(f"{ACK_ROOT}.>", cb=self._answered)

    async def close(self) -> None:
        if self._sub is not None and not self.nc.is_closed:
            await self._sub.unsubscribe()

    async def announce(
        self,
        experiment_id: str,
        version: int,
        uri: str,
        fingerprint: str,
        workers: list[Worker],
        timeout: float,
    ) -> dict[str, Answer]:
        """Announce `version` to `workers`; their answers by worker id once all answered or
        `timeout` passed (the ones that did not answer are absent)."""
        if not workers:
            return {}
        key = (experiment_id, version)
        rnd = self._rounds[key] = _Round({w.worker_id for w in workers})
        message = scheduler_pb2.WeightsAnnouncement(
            experiment_id=experiment_id,
            version=version,
            uri=uri,
            fingerprint=fingerprint,
            workers=sorted(rnd.expected),
            deadline_s=timeout,
        )
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            while True:
                await self.nc.publish(weights_subject(experiment_id), message.SerializeToString())
                left = deadline - asyncio.get_running_loop().time()
                try:
                    await asyncio.wait_for(rnd.done.wait(), min(REPUBLISH_S, max(0.0, left)))
                    break
                except TimeoutError:
                    if left <= REPUBLISH_S:
                        break
                del message.workers[:]  # again, to the silent ones only
                message.workers.extend(sorted(rnd.expected - rnd.answers.keys()))
                message.deadline_s = deadline - asyncio.get_running_loop().time()
        finally:
            if self._rounds.get(key) is rnd:
                del self._rounds[key]
        return rnd.answers

    def worker_gone(self, worker_id: str, why: str, experiment_id: str | None = None) -> None:
        """`worker_id` left, its lease lapsed or it cannot be reached (of `experiment_id`'s
        rounds only, when given: fenced there): every round still waiting for it has its answer
        (the failure `why`), so none waits out its deadline for it."""
        for (exp, _), rnd in self._rounds.items():
            if experiment_id is not None and exp != experiment_id:
                continue
            if worker_id in rnd.expected and worker_id not in rnd.answers:
                rnd.answers[worker_id] = f"UNAVAILABLE: the rollout {why}"
                if len(rnd.answers) == len(rnd.expected):
                    rnd.done.set()

    async def _answered(self, msg: Msg) -> None:
        try:
            ack = scheduler_pb2.WeightsAck.FromString(msg.data)
        except DecodeError:
            self.refused += 1
            return
        rnd = self._rounds.get((ack.experiment_id, ack.version))
        if rnd is None or ack.worker_id not in rnd.expected:
            return  # late (its round ended), or not asked
        worker = self.registry.get(ack.worker_id)
        if worker is None or not secrets.compare_digest(ack.lease_key, worker.lease_key):
            self.refused += 1
            log.warning("weights_ack_refused", worker=ack.worker_id, version=ack.version)
            return
        rnd.answers.setdefault(ack.worker_id, ack.error or ack.answer)
        if len(rnd.answers) == len(rnd.expected):
            rnd.done.set()
