"""The trainer's durable JetStream pull consumer on one experiment's train subject.

The position that matters for recovery is kept in the trainer checkpoint, not in the consumer's
ack floor. So `open(start_seq)` always deletes and re-creates the durable consumer to deliver
from `start_seq` (DeliverPolicy.BY_START_SEQUENCE): the checkpoint decides where training
resumes.

Acks only stop the server from delivering a message again while this consumer lives, so they
are cheap: AckPolicy.ALL, and one ack without waiting for the newest message of each request.
That is sound only if every delivery before it reached us, so each pull is checked: the
consumer's delivery sequence must go on by one from message to message, and nothing may come a
second time. A delivery lost on the way (a reconnect, a slow-consumer drop, a nats-server that
restarted and redelivers) breaks that chain; the messages from the break on are discarded and
the consumer is re-created right after the last message taken in order, so the stream is read
in order again, nothing skipped (an ack of a later message would have covered the lost one).

Messages come by pull requests this consumer makes itself (the JetStream protocol: a request on
`$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>` asks for a batch, delivered to an inbox of
ours as it is published, until the batch is full or the request expires). One request asks for
what the trainer still needs for its step and stays open across `pull`s, which take what it
brought so far: about one request per step, where nats-py's `fetch` made one or two per `pull`,
each bringing the few groups published since the last and a status reply (bench/control_plane.py:
trainer ~55 and nats-server ~30 CPU-µs per group more). A re-created consumer gets a new inbox,
so nothing a request of the old one brings reaches it. The requests go out on the connection
under the JetStream context, which nats-py keeps private (`jetstream_connection`, the one place
that reaches for it, with its contract test in tests/integration/test_group_consumer_nats.py).

`pull(n)` hands out at most n messages, in stream order. A request can bring more than a
`pull` asked for (one made for an earlier, larger `pull`); the surplus waits here for the next
`pull`. It is acked but not consumed: the trainer's position (the last sequence it handed to a
step) stays below it, so after a crash the re-created consumer delivers it again.

A message the trainer will not train is dead-lettered on `dead_subject(experiment)`, with the
reason and its stream sequence in headers (deduplicated by that sequence).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections import deque
from dataclasses import dataclass

import nats
from google.protobuf.message import DecodeError
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, Header

from asyncrl.convert import group_from_bytes
from asyncrl.logging import get_logger
from asyncrl.natsutil import STREAM, dead_subject, train_subject
from asyncrl.retry import jetstream_call
from asyncrl.types import TrajectoryGroup

log = get_logger()

PUBLISH_TIMEOUT_S = 10.0
EXPIRY_SHARE = 0.9
"""A request expires on the server after this share of the `pull` timeout it was made for: its
408 reply then comes while the `pull` still waits, so the next `pull` knows to ask again."""
REASON_HEADER = "Asyncrl-Reason"
SEQ_HEADER = "Asyncrl-Stream-Seq"
MAX_REASON_CHARS = 1000


def durable_name(experiment_id: str) -> str:
    """`trainer-<exp>`, with characters JetStream forbids in consumer names replaced."""
    return "trainer-" + re.sub(r"[^A-Za-z0-9_-]", "_", experiment_id)


def header_safe(text: str) -> str:
    """`text` as one printable ASCII line a NATS header can carry."""
    flat = " ".join(text.split())[:MAX_REASON_CHARS]
    return flat.encode("ascii", "backslashreplace").decode("ascii")


@dataclass
class Pulled:
    seq: int
    """Stream sequence of the message."""
    group: TrajectoryGroup | None
    """None when the payload did not decode as a TrajectoryGroup (see `error`)."""
    data: bytes = b""
    """The payload as published (what a dead letter carries)."""
    error: str = ""
    """Why the payload did not decode."""


def jetstream_connection(js: JetStreamContext) -> NATS:
    """The NATS connection a JetStream context works on: the pull requests are plain publishes
    on it, their messages come to an inbox subscribed on it. nats-py has no public accessor;
    it keeps the connection in `_nc` (the contract test checks that it is the client)."""
    return js._nc


def _decode(seq: int, data: bytes) -> Pulled:
    try:
        return Pulled(seq=seq, group=group_from_bytes(data), data=data)
    except (DecodeError, ValueError) as exc:  # garbage on the stream must not stop training
        return Pulled(seq=seq, group=None, data=data, error=f"{type(exc).__name__}: {exc}")


class GroupConsumer:
    def __init__(self, js, experiment_id: str):
        self.js = js
        self.experiment_id = experiment_id
        self.name = durable_name(experiment_id)
        self._next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.{self.name}"
        self._sub = None
        """The subscription on this consumer's inbox (None before `open`)."""
        self._inbox = ""
        self._arrivals: deque = deque()
        """What the inbox received and no `pull` took yet: messages and status replies."""
        self._arrived = asyncio.Event()
        self._owed = 0
        """Messages the open request may still bring (0: none is open)."""
        self._open_until = 0.0
        """Monotonic time the open request has expired by."""
        self._surplus: deque[Pulled] = deque()
        self._unacked = None
        """The newest message taken and not acked yet (see `_ack`)."""
        self._last_seq = 0
        """Stream sequence of the last message taken in order (0: before the first)."""
        self._next_delivery = 1
        """The consumer's delivery sequence the next message must carry."""
        self._broken = False
        """A delivery went missing: re-create the consumer before the next pull."""
        self.reopened = 0
        """Times the consumer was re-created after a broken delivery chain."""

    async def open(self, start_seq: int) -> None:
        """(Re-)create the durable consumer so that it delivers from stream seq `start_seq`."""
        self._surplus.clear()
        await self._create(start_seq)

    async def _create(self, start_seq: int) -> None:
        await self._unsubscribe()
        try:
            await self.js.delete_consumer(STREAM, self.name)
        except nats.js.errors.NotFoundError:
            pass
        cfg = ConsumerConfig(
            durable_name=self.name,
            name=self.name,
            ack_policy=AckPolicy.ALL,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=start_seq,
            filter_subject=train_subject(self.experiment_id),
            ack_wait=60.0,
        )
        await self.js.add_consumer(STREAM, config=cfg)
        nc = jetstream_connection(self.js)
        self._inbox = nc.new_inbox()
        self._sub = await nc.subscribe(self._inbox, cb=self._receive)
        self._arrivals.clear()
        self._owed, self._unacked = 0, None
        self._last_seq, self._next_delivery, self._broken = start_seq - 1, 1, False
        log.info(
            "consumer_opened",
            experiment=self.experiment_id,
            consumer=self.name,
            start_seq=start_seq,
        )

    async def _receive(self, msg) -> None:
        self._arrivals.append(msg)
        self._arrived.set()

    async def pull(self, n: int, timeout: float) -> list[Pulled]:
        """Take up to n messages in stream order (waiting at most `timeout` for the first when
        none is held back from an earlier one), acking what arrived as it is taken."""
        if not self._surplus:
            if self._broken and not await self._reopen():
                return []
            assert self._sub is not None, "open() first"
            msgs = await self._messages(n, timeout)
            if msgs:
                await self._take(msgs)
        return [self._surplus.popleft() for _ in range(min(n, len(self._surplus)))]

    async def _messages(self, n: int, timeout: float) -> list:
        """The messages that arrived, waiting up to `timeout` for the first; asks for n when no
        request is open (once: when the request made here expires, the wait is over)."""
        deadline = time.monotonic() + timeout
        asked = False
        while True:
            msgs = self._drain()
            now = time.monotonic()
            if msgs or self._broken or now >= deadline:
                return msgs
            if self._owed <= 0 or now >= self._open_until:
                if asked:
                    return []
                await self._ask(n, deadline - now)
                asked = True
            if not self._arrivals:
                try:
                    await asyncio.wait_for(self._arrived.wait(), deadline - now)
                except TimeoutError:
                    return []

    async def _ask(self, n: int, timeout: float) -> None:
        """Open a request for n messages that expires within `timeout`."""
        await self._ack()
        expires_ns = max(1_000_000, int(timeout * EXPIRY_SHARE * 1e9))
        body = json.dumps({"batch": n, "expires": expires_ns}).encode()
        await jetstream_connection(self.js).publish(self._next_subject, body, reply=self._inbox)
        self._owed, self._open_until = n, time.monotonic() + timeout

    def _drain(self) -> list:
        """The messages among what arrived. A status reply ends the open request (404/408:
        expired) or, for any other (409: the consumer was deleted, its leader changed), has the
        consumer re-created."""
        self._arrived.clear()
        msgs = []
        while self._arrivals:
            msg = self._arrivals.popleft()
            status = msg.headers.get(Header.STATUS) if msg.headers else None
            if status is None:
                msgs.append(msg)
                self._owed -= 1
            elif status in ("404", "408"):
                self._owed = 0
            elif status != "100":  # 100: an idle heartbeat
                self._owed, self._broken = 0, True
                log.warning(
                    "consumer_request_failed",
                    experiment=self.experiment_id,
                    status=status,
                    description=msg.headers.get(Header.DESCRIPTION, ""),
                )
        return msgs

    async def _take(self, msgs: list) -> None:
        """Keep the unbroken run of deliveries at the head of `msgs` and ack its newest (which
        acks every delivery before it); from a break on, drop the rest and mark the consumer
        for re-creation."""
        taken = None
        for msg in msgs:
            meta = msg.metadata
            if meta.sequence.consumer != self._next_delivery or meta.num_delivered > 1:
                self._broken = True
                log.warning(
                    "consumer_delivery_gap",
                    experiment=self.experiment_id,
                    expected=self._next_delivery,
                    got=meta.sequence.consumer,
                    delivered=meta.num_delivered,
                    seq=meta.sequence.stream,
                    last_seq=self._last_seq,
                )
                break
            self._next_delivery += 1
            self._last_seq = meta.sequence.stream
            self._surplus.append(_decode(self._last_seq, msg.data))
            taken = msg
        if taken is not None:
            self._unacked = taken
        if self._owed <= 0 or self._broken:
            await self._ack()

    async def _ack(self) -> None:
        """Ack the newest message taken (acking every delivery before it): once a request is
        over (filled: the step's batch is complete; expired; before the next one), not at each
        `pull`. Unacked messages are delivered again only after `ack_wait` (60 s)."""
        msg, self._unacked = self._unacked, None
        if msg is None:
            return
        try:
            await msg.ack()
        except nats.errors.Error as exc:  # lost: the server delivers again, a broken chain
            log.warning("consumer_ack_failed", experiment=self.experiment_id, error=str(exc))

    async def _reopen(self) -> bool:
        """Re-create the consumer right after the last message taken in order; False (and
        another try at the next pull) while NATS does not answer."""
        try:
            await self._create(self._last_seq + 1)
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("consumer_reopen_failed", experiment=self.experiment_id, error=str(exc))
            return False
        self.reopened += 1
        return True

    @property
    def held(self) -> int:
        """Messages received but not yet handed out."""
        return len(self._surplus)

    async def dead_letter(self, pulled: Pulled, reason: str) -> None:
        """Publish the message to the experiment's dead-letter subject with `reason`."""
        headers = {
            "Nats-Msg-Id": f"dead-{pulled.seq}",
            REASON_HEADER: header_safe(reason),
            SEQ_HEADER: str(pulled.seq),
        }
        await jetstream_call(  # deduplicated by its id
            lambda: self.js.publish(
                dead_subject(self.experiment_id),
                pulled.data,
                headers=headers,
                timeout=PUBLISH_TIMEOUT_S,
            )
        )

    async def close(self) -> None:
        self._surplus.clear()
        await self._unsubscribe()

    async def _unsubscribe(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()


async def unconsumed_group_ids(js, experiment_id: str, after_seq: int) -> list[str]:
    """Ids of the training groups stored after stream sequence `after_seq` (what no step took
    when the run ended), read with an ephemeral ordered consumer; undecodable messages skipped."""
    subject = train_subject(experiment_id)
    info = await js.stream_info(STREAM, subjects_filter=subject)
    if info.state.last_seq <= after_seq:
        return []
    config = ConsumerConfig(
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=after_seq + 1
    )
    sub = await js.subscribe(subject, stream=STREAM, ordered_consumer=True, config=config)
    ids = []
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=1.0)
            except TimeoutError:
                return ids
            try:
                ids.append(group_from_bytes(msg.data).group_id)
            except DecodeError:
                pass
            if msg.metadata.num_pending == 0:
                return ids
    finally:
        await sub.unsubscribe()
