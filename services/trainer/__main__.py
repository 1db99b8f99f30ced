"""`python -m services.trainer [--port 0]`: run one trainer worker until SIGINT/SIGTERM.

Multi-GPU megatron: `torchrun --nproc_per_node N -m services.trainer`; rank 0 is the service,
the other ranks follow its backend calls."""

from __future__ import annotations

import argparse
import os
import signal

import torch

from asyncrl.logging import configure_logging
from asyncrl.runtime import ServiceRuntime
from asyncrl.service_main import add_service_args, serve
from asyncrl.settings import settings
from services.trainer.server import create_trainer


async def start(args: argparse.Namespace) -> ServiceRuntime:
    runtime, _ = await create_trainer(
        args.nats_url,
        port=args.port,
        scheduler=args.scheduler,
        register=not args.no_register,
        host=args.host,
        metrics_port=args.metrics_port,
    )
    return runtime


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.trainer", description=__doc__)
    add_service_args(
        p,
        port=0,
        register=True,
        port_help="gRPC port (0: any free port)",
        host_help="address to bind (0.0.0.0 for other hosts)",
        register_help="do not register with a scheduler",
    )
    p.add_argument("--nats-url", default=settings().nats_url, help="NATS server (env NATS_URL)")
    p.add_argument(
        "--scheduler",
        default=None,
        help="scheduler host:port (env ASYNCRL_SCHEDULER, default 127.0.0.1:50051)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    configure_logging("trainer")
    if args.threads:
        torch.set_num_threads(args.threads)
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        serve(start(args))
    else:
        # under torchrun (megatron backend, TP/DP > 1) only rank 0 serves; the others follow it
        from services.trainer.backends.megatron_backend import follow, release_followers
        from services.trainer.megatron.parallel import (
            die_with_launcher,
            init_default_group,
            shutdown_distributed,
        )

        die_with_launcher()
        init_default_group()
        if int(os.environ["RANK"]) > 0:
            # a stop signal reaches every rank (torchrun forwards it); rank 0 shuts down at a
            # step boundary (final checkpoint, which needs every rank), then releases the others
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)
            follow()
        else:
            serve(start(args))
            release_followers()
        shutdown_distributed()
