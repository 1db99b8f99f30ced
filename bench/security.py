"""What TLS and authentication cost on the control-plane path, against the same path without.

Both halves run in this process on the same machine, one after the other, each with its own
real nats-server and real scheduler: secure (as `make up` runs: TLS on every port, a verified
bearer token on every RPC, NATS users over TLS) and plain (`ASYNCRL_INSECURE=1`). Measured:

- worker heartbeats/s: a registered worker's `Heartbeat` RPC, the call every worker makes
  every second (a long-lived channel: the TLS handshake is paid once, the token is checked on
  every call);
- connections/s: a new channel, its handshake and one `ListWorkers` (what each CLI call pays);
- trajectory groups/s: `publish_group` on JetStream with awaited acks, as a rollout publishes.

Ratio = secure rate ÷ plain rate (1.0 = free).
"""

from __future__ import annotations

import asyncio
import os
import time
from contextlib import contextmanager

from asyncrl.grpcutil import channel
from asyncrl.natsutil import LocalNatsServer, connect, ensure_stream, publish_group
from asyncrl.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from bench.report import Context, Result
from bench.transport import make_groups
from services.scheduler.server import create_scheduler

NAME = "security"


@contextmanager
def _mode(secure: bool):
    """Run the enclosed code secure (the default) or with ASYNCRL_INSECURE=1."""
    before = os.environ.get("ASYNCRL_INSECURE")
    os.environ["ASYNCRL_INSECURE"] = "0" if secure else "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("ASYNCRL_INSECURE", None)
        else:
            os.environ["ASYNCRL_INSECURE"] = before


async def _heartbeats(address: str, count: int) -> float:
    async with channel(address, "rollout") as ch:
        stub = scheduler_pb2_grpc.SchedulerStub(ch)
        worker = await stub.RegisterWorker(
            scheduler_pb2.RegisterWorkerRequest(
                kind=common_pb2.WORKER_KIND_ROLLOUT, address="127.0.0.1:1", name="b", capacity=1
            ),
            timeout=10,
        )
        request = scheduler_pb2.HeartbeatRequest(worker_id=worker.worker_id)
        t0 = time.perf_counter()
        for _ in range(count):
            await stub.Heartbeat(request, timeout=10)
        return time.perf_counter() - t0


async def _connections(address: str, count: int) -> float:
    t0 = time.perf_counter()
    for _ in range(count):
        async with channel(address, "viewer") as ch:
            await scheduler_pb2_grpc.SchedulerStub(ch).ListWorkers(
                scheduler_pb2.ListWorkersRequest(), timeout=10
            )
    return time.perf_counter() - t0


async def _publish(url: str, count: int) -> float:
    groups = make_groups("sec", count, 8, 16)
    nc = await connect(url, identity="rollout")
    try:
        js = nc.jetstream()
        t0 = time.perf_counter()
        for g in groups:
            await publish_group(js, g)
        return time.perf_counter() - t0
    finally:
        await nc.drain()


async def _half(ctx: Context, store: str, sizes: dict[str, int]) -> dict[str, float]:
    """Best-of-repeats seconds of each part, in the mode set around this call."""
    with LocalNatsServer(ctx.work_dir / store) as server:
        admin = await connect(server.url, identity="scheduler")
        await ensure_stream(admin.jetstream())
        runtime, _ = await create_scheduler(server.url)
        address = f"127.0.0.1:{runtime.port}"
        try:
            await _heartbeats(address, 20)  # warm-up
            best = {"heartbeats": [], "connections": [], "groups": []}
            for _ in range(ctx.repeats):
                best["heartbeats"].append(await _heartbeats(address, sizes["heartbeats"]))
                best["connections"].append(await _connections(address, sizes["connections"]))
                best["groups"].append(await _publish(server.url, sizes["groups"]))
            return {k: min(v) for k, v in best.items()}
        finally:
            await runtime.close()
            await admin.drain()


def run(ctx: Context) -> list[Result]:
    sizes = {
        "heartbeats": ctx.size(2000, 50),
        "connections": ctx.size(100, 5),
        "groups": ctx.size(1000, 20),
    }
    with _mode(secure=False):
        plain = asyncio.run(_half(ctx, "plain-js", sizes))
    with _mode(secure=True):
        secure = asyncio.run(_half(ctx, "secure-js", sizes))
    settings = {**sizes, "tls": "ECDSA P-256", "token": "EdDSA JWT, verified once per token"}
    metrics = {
        "heartbeats": "worker heartbeats/s, TLS + token",
        "connections": "new connections/s (handshake + one ListWorkers), TLS + token",
        "groups": "trajectory groups/s published, NATS over TLS with a user",
    }
    return [
        Result(
            NAME,
            metrics[key],
            sizes[key] / secure[key],
            "1/s",
            "the same path without TLS or authentication (ASYNCRL_INSECURE=1)",
            sizes[key] / plain[key],
            settings,
        )
        for key in metrics
    ]
