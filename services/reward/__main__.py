"""python -m services.reward [--port 0] [--workers N] [--host 127.0.0.1]"""

from __future__ import annotations

import argparse
import asyncio
import signal

from asyncrl.logging import configure_logging, get_logger
from services.reward.server import create_reward


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.reward", description=__doc__)
    p.add_argument("--port", type=int, default=0, help="port to bind (0: any free port)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: all)")
    p.add_argument(
        "--workers", type=int, default=None, help="scoring processes (default: min(4, cpu count))"
    )
    p.add_argument(
        "--no-register",
        action="store_true",
        help="do not register with the scheduler (ASYNCRL_SCHEDULER)",
    )
    return p.parse_args(argv)


async def main(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    _, port, service = await create_reward(
        port=args.port, workers=args.workers, register=not args.no_register, host=args.host
    )
    get_logger().info("reward_ready", port=port)
    await stop.wait()
    await service.stop()


if __name__ == "__main__":
    configure_logging("reward")
    asyncio.run(main(parse_args()))
