"""python -m services.scheduler [--port 50051] [--host 127.0.0.1] [--lease-ttl 10]
[--heartbeat-interval 1] [--metrics-port PORT]

Environment: NATS_URL (experiment state in NATS KV).
"""

from __future__ import annotations

import argparse
import asyncio
import signal

from asyncrl.logging import configure_logging, get_logger
from asyncrl.metrics import SchedulerCollector, registry_for, start_metrics_server
from asyncrl.natsutil import nats_url
from services.scheduler.server import create_scheduler


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m services.scheduler",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--port", type=int, default=50051, help="port to bind")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: all)")
    p.add_argument(
        "--lease-ttl",
        type=float,
        default=10.0,
        help="seconds without a heartbeat after which a worker is gone",
    )
    p.add_argument(
        "--heartbeat-interval", type=float, default=1.0, help="seconds between worker heartbeats"
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on this port (0: any free port; default: off)",
    )
    return p.parse_args(argv)


async def main(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    _, port, scheduler = await create_scheduler(
        nats_url(),
        port=args.port,
        host=args.host,
        lease_ttl_s=args.lease_ttl,
        heartbeat_interval_s=args.heartbeat_interval,
    )
    if args.metrics_port is not None:
        start_metrics_server(args.metrics_port, registry_for(SchedulerCollector(scheduler)))
    get_logger().info("scheduler_ready", port=port)
    await stop.wait()
    await scheduler.stop(grace=2.0)


if __name__ == "__main__":
    configure_logging("scheduler")
    asyncio.run(main(parse_args()))
