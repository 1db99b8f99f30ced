"""JetStream transport: TrajectoryGroups through a real nats-server, as the services move them.

The rollout side publishes each group with `asyncrl.natsutil.publish_group` (awaiting the
JetStream ack, Nats-Msg-Id dedup, file storage); the trainer side pulls them with its durable
pull consumer (`services.trainer.consumer.GroupConsumer`: fetch B, decode, ack each). The peer
is the raw serialisation rate of the same groups (`group_to_bytes` + `group_from_bytes`), so
the ratio is what the broker costs on top of encoding.
"""

from __future__ import annotations

import asyncio
import random
import time

from asyncrl.convert import group_from_bytes, group_to_bytes
from asyncrl.natsutil import LocalNatsServer, connect, ensure_stream, publish_group
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
        times = []
        for rep in range(ctx.repeats + 1):  # round 0 warms up (stream creation, file store)
            exp = f"bench{rep}"
            t = asyncio.run(
                _round_trip(server.url, exp, make_groups(exp, count, n, out_len), batch)
            )
            if rep:
                times.append(t)
    nats_s = min(times)

    settings = {
        "groups": count,
        "samples_per_group": n,
        "output_tokens": out_len,
        "mean_message_bytes": round(mb * 1e6 / count),
        "pull_batch": batch,
        "repeats": ctx.repeats,
        "storage": "file",
    }
    peer = "serialise+parse only (no broker)"
    return [
        Result(
            NAME,
            "publish+consume groups/s",
            count / nats_s,
            "groups/s",
            peer,
            count / ser_s,
            settings,
        ),
        Result(NAME, "publish+consume MB/s", mb / nats_s, "MB/s", peer, mb / ser_s, settings),
    ]
