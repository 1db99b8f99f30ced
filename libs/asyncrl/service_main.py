"""What the service entry points (`python -m services.<name>`) share: the bind, register and
metrics flags, and the loop that runs a service until SIGINT/SIGTERM.

    def parse_args(argv):
        p = argparse.ArgumentParser(prog="python -m services.x", description=__doc__)
        add_service_args(p, port=0, register=True)
        ...

    if __name__ == "__main__":
        serve(start(parse_args()))   # start() -> ServiceRuntime, closed on a signal

Each `services/<name>/__main__.py` keeps only its own flags and the wiring of its service.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Awaitable

from asyncrl.logging import get_logger
from asyncrl.runtime import ServiceRuntime, freeze_heap
from asyncrl.settings import settings
from asyncrl.supervisor.handover import Handover

log = get_logger()
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_stop_signals: list[int] = []
"""The stop signals this process got (`run_until_signal`)."""


class StartAbandoned(Exception):
    """A service gave up starting because a stop came (a standby scheduler that never took
    over): it exits without having served."""


def stop_requested() -> bool:
    """Whether a stop signal came (a service still starting may give up: StartAbandoned)."""
    return bool(_stop_signals)


PORT_HELP = "port to bind (0: any free port)"
HOST_HELP = "address to bind (0.0.0.0: all)"
REGISTER_HELP = "do not register with the scheduler (ASYNCRL_SCHEDULER)"
METRICS_HELP = "serve Prometheus metrics on this port (0: any free port; default: off)"


def add_service_args(
    p: argparse.ArgumentParser,
    *,
    port: int,
    register: bool,
    metrics: bool = True,
    port_help: str = PORT_HELP,
    host_help: str = HOST_HELP,
    register_help: str = REGISTER_HELP,
) -> None:
    """--port (default `port`) and --host; --no-register for a service that registers with the
    scheduler; --metrics-port (default: off) to serve Prometheus metrics."""
    p.add_argument("--port", type=int, default=port, help=port_help)
    p.add_argument("--host", default=settings().bind_host, help=f"{host_help}; ASYNCRL_BIND_HOST")
    if register:
        p.add_argument("--no-register", action="store_true", help=register_help)
    if metrics:
        p.add_argument("--metrics-port", type=int, default=None, help=METRICS_HELP)


def serve(startup: Awaitable[ServiceRuntime]) -> None:
    """Run a service until SIGINT or SIGTERM (`run_until_signal`) on asyncio's event loop.

    uvloop was measured here twice (docs/benchmarks.md, 2026-11-24 and session 17) and not
    kept: -3 % CPU per group on `bench control_plane`, inside the spread between runs, and no
    change in the ratio to AReaL measured beside it."""
    asyncio.run(run_until_signal(startup))


async def run_until_signal(startup: Awaitable[ServiceRuntime]) -> None:
    """Await `startup`, wait for SIGINT or SIGTERM, then close the runtime it returned.

    The handlers go in before startup, so a stop signal that arrives while the service is still
    starting is not lost (nor fatal): the service finishes starting and then shuts down cleanly.

    Under the supervisor a stop it did not send hands over (`asyncrl.supervisor.handover`): the
    service serves on until a successor started beside it is ready (`runtime.busy`, `.serving`),
    then closes (a reward worker lingers a heartbeat after leaving, so rollouts learn the
    successor's address before it stops answering). A singleton on a fixed port (the scheduler)
    takes over itself in `startup` (`Handover.take_over`).
    """
    signals = _stop_signals
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(sig: int) -> None:
        signals.append(sig)
        stop.set()

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
    hand = Handover.from_env()
    try:
        runtime = await startup
    except StartAbandoned as e:
        log.info("start_abandoned", reason=str(e) or type(e).__name__)
        if hand is not None:
            hand.gone()
        return
    announcing = None
    if hand is not None:
        announcing = asyncio.create_task(hand.announce(runtime.serving))
    freeze_heap()
    await stop.wait()
    if announcing is not None:
        announcing.cancel()
    if hand is not None and await hand.hand_over(lambda: len(signals) > 1, runtime.busy):
        runtime.linger_s = 1.0  # a heartbeat: rollouts take the reward addresses from each one
    await runtime.close()
    if hand is not None:
        hand.gone()
