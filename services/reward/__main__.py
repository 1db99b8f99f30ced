"""python -m services.reward [--port 0] [--workers N] [--host 127.0.0.1] [--metrics-port PORT]"""

from __future__ import annotations

import argparse

from asyncrl.logging import configure_logging
from asyncrl.runtime import ServiceRuntime
from asyncrl.service_main import add_service_args, serve
from services.reward.server import create_reward


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.reward", description=__doc__)
    add_service_args(p, port=0, register=True)
    p.add_argument(
        "--workers", type=int, default=None, help="scoring processes (default: min(4, cpu count))"
    )
    return p.parse_args(argv)


async def start(args: argparse.Namespace) -> ServiceRuntime:
    runtime, _ = await create_reward(
        port=args.port,
        workers=args.workers,
        register=not args.no_register,
        host=args.host,
        metrics_port=args.metrics_port,
    )
    return runtime


if __name__ == "__main__":
    configure_logging("reward")
    serve(start(parse_args()))
