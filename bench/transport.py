"""JetStream transport: TrajectoryGroups through a real nats-server, as the services move them,
against raw JetStream moving the same bytes.

asyncrl's side: the rollout's `asyncrl.natsutil.publish_group` (serialise, publish with
Nats-Msg-Id dedup, await the JetStream ack) for every group, then the trainer's durable pull
consumer (`services.trainer.consumer.GroupConsumer`: fetch B, check the delivery chain, decode,
ack the newest of each fetch).

The peer is JetStream alone with the same broker work: plain nats-py `js.publish` of the very
bytes asyncrl sends (serialised before the clock starts) with the same Nats-Msg-Id header, to a
file-backed stream with the same dedup window, then a pull consumer with the same ack policy
(AckPolicy.ALL, one ack for the newest message of each fetch) fetching them in batches of B;
no asyncrl code in the loop. Both run on one nats-server, alternating, best of the repeats, so
the ratio is asyncrl's own cost on top of JetStream (serialisation and parsing included). The
serialisation rate alone is in the settings.
"""

from __future__ import annotations

import asyncio
import random
import time

from nats.js.api import AckPolicy, ConsumerConfig, StorageType, StreamConfig

from asyncrl.convert import group_from_bytes, group_to_bytes
from asyncrl.natsutil import (
    DUPLICATE_WINDOW_S,
    LocalNatsServer,
    connect,
    ensure_stream,
    publish_group,
)
from asyncrl.types import Sample, TrajectoryGroup
from bench.report import Context, Result, best_of
from services.trainer.consumer import GroupConsumer

NAME = "transport"


def make_groups(experiment_id: str, count: int, n: int, out_len: int) -> list[TrajectoryGroup]:
    rng = random.Random(0)
    groups = []
    for gi in range(count):
        samples = [
            Sample(
                output_ids=[rng.randrange(4, 99) for _ in range(out_len)],
                logprobs=[-rng.random() * 4 for _ in range(out_len)],
                versions=[3] * out_len,
                reward=float(si % 2),
                text="x" * out_len,
            )
            for si in range(n)
        ]
        groups.append(
            TrajectoryGroup(
                experiment_id,
                f"{experiment_id}-g{gi}",
                f"p{gi}",
                "12+34=",
                "46",
                [rng.randrange(4, 99) for _ in range(24)],
                samples,
                start_version=3,
            )
        )
    return groups


async def _round_trip(url: str, experiment_id: str, groups, batch: int) -> float:
    """Publish every group, then pull them all back; the wall time of both."""
    nc = await connect(url, identity="scheduler")  # creates the stream, publishes, consumes
    try:
        js = nc.jetstream()
        await ensure_stream(js)
        consumer = GroupConsumer(js, experiment_id)
        await consumer.open(start_seq=1)
        t0 = time.perf_counter()
        for g in groups:
            await publish_group(js, g)
        got = 0
        while got < len(groups):
            pulled = await consumer.pull(min(batch, len(groups) - got), timeout=10.0)
            if not pulled:
                raise TimeoutError(f"pulled {got} of {len(groups)} groups")
            got += len(pulled)
        elapsed = time.perf_counter() - t0
        await consumer.close()
        return elapsed
    finally:
        await nc.drain()


async def _raw_round_trip(url: str, name: str, messages: list[tuple[str, bytes]], batch: int):
    """The same bytes through JetStream with plain nats-py: publish each (msg id, payload) to a
    stream of its own and await the ack, then pull them all back in fetches of `batch`,
    acking the newest of each fetch (AckPolicy.ALL). The wall time of both."""
    nc = await connect(url, identity="scheduler")  # set-up only: TLS and the user
    try:
        js = nc.jetstream()
        subject = f"benchraw.{name}"
        await js.add_stream(
            StreamConfig(
                name=f"BENCHRAW_{name}",
                subjects=[subject],
                storage=StorageType.FILE,
                duplicate_window=DUPLICATE_WINDOW_S,
            )
        )
        durable = f"raw-{name}"
        config = ConsumerConfig(durable_name=durable, ack_policy=AckPolicy.ALL, ack_wait=60.0)
        await js.add_consumer(f"BENCHRAW_{name}", config=config)
        sub = await js.pull_subscribe_bind(durable=durable, stream=f"BENCHRAW_{name}")
        t0 = time.perf_counter()
        for msg_id, data in messages:
            await js.publish(subject, data, headers={"Nats-Msg-Id": msg_id})
        got = 0
        while got < len(messages):
            msgs = await sub.fetch(min(batch, len(messages) - got), timeout=10.0)
            got += len(msgs)
            await msgs[-1].ack()
        elapsed = time.perf_counter() - t0
        await sub.unsubscribe()
        return elapsed
    finally:
        await nc.drain()


def run(ctx: Context) -> list[Result]:
    count, n, out_len = ctx.size(1000, 10), ctx.size(8, 2), ctx.size(256, 16)
    batch = ctx.size(8, 2)
    sample_groups = make_groups("bench0", count, n, out_len)  # same sizes as sent
    payload = [group_to_bytes(g) for g in sample_groups]
    mb = sum(len(p) for p in payload) / 1e6

    def serialise():
        for g in sample_groups:
            group_from_bytes(group_to_bytes(g))

    serialise()  # warm-up
    ser_s = best_of(serialise, ctx.repeats)

    with LocalNatsServer(ctx.work_dir / "jetstream") as server:
        asyncrl_times, raw_times = [], []
        for rep in range(ctx.repeats + 1):  # round 0 warms up (stream creation, file store)
            exp = f"bench{rep}"
            groups = make_groups(exp, count, n, out_len)
            messages = [(g.group_id, group_to_bytes(g)) for g in groups]  # the bytes asyncrl sends
            t = asyncio.run(_round_trip(server.url, exp, groups, batch))
            raw = asyncio.run(_raw_round_trip(server.url, str(rep), messages, batch))
            if rep:
                asyncrl_times.append(t)
                raw_times.append(raw)
    nats_s, raw_s = min(asyncrl_times), min(raw_times)

    settings = {
        "groups": count,
        "samples_per_group": n,
        "output_tokens": out_len,
        "mean_message_bytes": round(mb * 1e6 / count),
        "pull_batch": batch,
        "repeats": ctx.repeats,
        "storage": "file",
        "serialise_parse_groups_per_s": round(count / ser_s, 1),
    }
    peer = "raw JetStream (nats-py publish + pull of the same bytes)"
    return [
        Result(
            NAME,
            "publish+consume groups/s",
            count / nats_s,
            "groups/s",
            peer,
            count / raw_s,
            settings,
        ),
        Result(NAME, "publish+consume MB/s", mb / nats_s, "MB/s", peer, mb / raw_s, settings),
    ]
