"""python -m services.scheduler [--port 50051] [--host 127.0.0.1] [--lease-ttl S]
[--heartbeat-interval S] [--progress-timeout S] [--trainer-poll-interval S]
[--leader-lease S] [--metrics-port PORT]  (defaults: services.scheduler.config.SchedulerConfig)

Environment: NATS_URL (experiment state in NATS KV).

A scheduler started beside an active one waits as its standby (no port bound) and takes over
once the active one's lease lapses (services/scheduler/leadership.py).
"""

from __future__ import annotations

import argparse
import asyncio
import signal

from asyncrl.logging import configure_logging
from asyncrl.runtime import ServiceRuntime
from asyncrl.service_main import add_service_args, serve, stop_requested
from asyncrl.settings import settings
from asyncrl.supervisor.handover import Handover
from services.scheduler.config import SchedulerConfig
from services.scheduler.server import create_scheduler

DEFAULTS = SchedulerConfig()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m services.scheduler",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_service_args(p, port=50051, register=False, port_help="port to bind")
    p.add_argument(
        "--lease-ttl",
        type=float,
        default=DEFAULTS.lease_ttl_s,
        help="seconds without a heartbeat after which a worker is gone (%(default)s)",
    )
    p.add_argument(
        "--heartbeat-interval",
        type=float,
        default=DEFAULTS.heartbeat_interval_s,
        help="seconds between worker heartbeats (%(default)s)",
    )
    p.add_argument(
        "--progress-timeout",
        type=float,
        default=DEFAULTS.progress_timeout_s,
        help="seconds without a commit, a settled group or a joining rollout before the trainer"
        " is started again (the second time: the experiment is FAILED) (%(default)s)",
    )
    p.add_argument(
        "--leader-lease",
        type=float,
        default=DEFAULTS.leader_lease_s,
        help="seconds after the active scheduler's last lease renewal before a standby takes"
        " over (%(default)s)",
    )
    p.add_argument(
        "--trainer-poll-interval",
        type=float,
        default=DEFAULTS.trainer_poll_interval_s,
        help="seconds between two GetStatus calls to a running experiment's trainer (%(default)s)",
    )
    return p.parse_args(argv)


async def start(args: argparse.Namespace) -> ServiceRuntime:
    hand = Handover.from_env()  # a successor connects, then waits for its predecessor to close
    runtime, scheduler = await create_scheduler(
        settings().nats_url,
        port=args.port,
        host=args.host,
        lease_ttl_s=args.lease_ttl,
        heartbeat_interval_s=args.heartbeat_interval,
        metrics_port=args.metrics_port,
        progress_timeout_s=args.progress_timeout,
        trainer_poll_interval_s=args.trainer_poll_interval,
        take_over=hand.take_over if hand is not None else None,
        stopping=stop_requested,
        leader_lease_s=args.leader_lease,
    )
    # paused (SIGSTOP) and resumed: renew now; a lease taken over meanwhile stops it at once
    asyncio.get_running_loop().add_signal_handler(signal.SIGCONT, scheduler.leadership.renew_soon)
    return runtime


if __name__ == "__main__":
    configure_logging("scheduler")
    serve(start(parse_args()))
