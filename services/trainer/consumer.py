"""The trainer's durable JetStream pull consumer on one experiment's train subject.

Messages are acked as they are taken (into a batch, or dropped as stale); the position that
matters for recovery is kept in the trainer checkpoint, not in the consumer's ack floor. So
`open(start_seq)` always deletes and re-creates the durable consumer to deliver from
`start_seq` (DeliverPolicy.BY_START_SEQUENCE): the checkpoint decides where training resumes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import nats
from google.protobuf.message import DecodeError
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from asyncrl.convert import group_from_bytes
from asyncrl.logging import get_logger
from asyncrl.natsutil import STREAM, train_subject
from asyncrl.types import TrajectoryGroup

log = get_logger()

ACK_TIMEOUT_S = 10.0


def durable_name(experiment_id: str) -> str:
    """`trainer-<exp>`, with characters JetStream forbids in consumer names replaced."""
    return "trainer-" + re.sub(r"[^A-Za-z0-9_-]", "_", experiment_id)


@dataclass
class Pulled:
    seq: int
    """Stream sequence of the message."""
    group: TrajectoryGroup | None
    """None when the payload was not a TrajectoryGroup (acked and skipped)."""


class GroupConsumer:
    def __init__(self, js, experiment_id: str):
        self.js = js
        self.experiment_id = experiment_id
        self.name = durable_name(experiment_id)
        self._sub = None

    async def open(self, start_seq: int) -> None:
        """(Re-)create the durable consumer so that it delivers from stream seq `start_seq`."""
        try:
            await self.js.delete_consumer(STREAM, self.name)
        except nats.js.errors.NotFoundError:
            pass
        cfg = ConsumerConfig(
            durable_name=self.name,
            name=self.name,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=start_seq,
            filter_subject=train_subject(self.experiment_id),
            ack_wait=60.0,
        )
        await self.js.add_consumer(STREAM, config=cfg)
        self._sub = await self.js.pull_subscribe_bind(durable=self.name, stream=STREAM)
        log.info(
            "consumer_opened",
            experiment=self.experiment_id,
            consumer=self.name,
            start_seq=start_seq,
        )

    async def pull(self, n: int, timeout: float) -> list[Pulled]:
        """Take up to n messages (waiting at most `timeout` for the first), acking each."""
        assert self._sub is not None, "open() first"
        try:
            msgs = await self._sub.fetch(n, timeout=timeout)
        except (TimeoutError, nats.errors.TimeoutError):
            return []
        out = []
        for msg in msgs:
            seq = msg.metadata.sequence.stream
            try:
                group = group_from_bytes(msg.data)
            except DecodeError as exc:  # a poison message must not stop training
                log.error(
                    "bad_trajectory_message",
                    experiment=self.experiment_id,
                    seq=seq,
                    error=f"{type(exc).__name__}: {exc}",
                )
                group = None
            await msg.ack_sync(timeout=ACK_TIMEOUT_S)
            out.append(Pulled(seq=seq, group=group))
        return out

    async def close(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
