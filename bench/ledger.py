"""The ledger's cost: what recording every group's fate adds to moving the group.

Each training group costs the scheduler two ledger events (`dispatched`, `settled`) and the
trainer a share of one `trained` event per step. Measured on a real nats-server: publishing
trajectory groups as a rollout does (`publish_group`, awaited JetStream acks) with and without
those events (`Ledger.emit`, flushed before the clock stops). The ratio is the group rate with
the ledger over the rate without it (1.0 = free).
"""

from __future__ import annotations

import asyncio
import time

from asyncrl.ledger import Ledger, ensure_ledger
from asyncrl.natsutil import LocalNatsServer, connect, ensure_stream, publish_group
from bench.report import Context, Result
from bench.transport import make_groups

NAME = "ledger"


async def _publish(url: str, experiment_id: str, count: int, batch: int, ledger: bool) -> float:
    groups = make_groups(experiment_id, count, 8, 16)
    nc = await connect(url, identity="scheduler")  # a trusted harness: creates the streams
    try:
        js = nc.jetstream()
        await ensure_stream(js)
        await ensure_ledger(js)
        book = Ledger(js, experiment_id)
        t0 = time.perf_counter()
        for i, g in enumerate(groups):
            if ledger:
                book.emit("dispatched", group=g.group_id, prompt=g.prompt_id, epoch=0, index=i)
            await publish_group(js, g)
            if ledger:
                book.emit("settled", group=g.group_id, status="accepted", reason="")
                if (i + 1) % batch == 0:
                    ids = [x.group_id for x in groups[i + 1 - batch : i + 1]]
                    book.emit("trained", step=i // batch, version=i // batch, groups=ids, run="b")
        await book.flush()
        return time.perf_counter() - t0
    finally:
        await nc.drain()


def run(ctx: Context) -> list[Result]:
    count, batch = ctx.size(2000, 40), 8
    with LocalNatsServer(ctx.work_dir / "ledger-js") as server:
        asyncio.run(_publish(server.url, "warm", count // 4 or 1, batch, ledger=True))
        plain, booked = [], []
        for rep in range(ctx.repeats):
            plain.append(asyncio.run(_publish(server.url, f"p{rep}", count, batch, False)))
            booked.append(asyncio.run(_publish(server.url, f"l{rep}", count, batch, True)))
    settings = {"groups": count, "samples_per_group": 8, "batch": batch, "events_per_group": 2.125}
    return [
        Result(
            NAME,
            "groups/s published with their ledger events",
            count / min(booked),
            "groups/s",
            "the same groups without a ledger",
            count / min(plain),
            settings,
        ),
        Result(
            NAME,
            "ledger µs per group (extra wall time)",
            (min(booked) - min(plain)) / count * 1e6,
            "µs",
            "publishing the group itself",
            min(plain) / count * 1e6,
            settings,
        ),
    ]
