"""python -m services.rollout --engine torch|sglang [--sglang-url URL | --sglang-launch]
[--engine-opt key=value ...] [--port 0] [--host 127.0.0.1] [--capacity 64] [--no-register]
[--metrics-port PORT]

Environment: NATS_URL (trajectory stream), ASYNCRL_SCHEDULER (registration).
"""

from __future__ import annotations

import argparse

from asyncrl.logging import configure_logging
from asyncrl.overrides import parse_assignments
from asyncrl.registry import ENGINES
from asyncrl.runtime import ServiceRuntime
from asyncrl.service_main import add_service_args, serve
from asyncrl.settings import settings
from asyncrl.spec import SpecError
from services.rollout.engines import make_engine
from services.rollout.server import DEFAULT_CAPACITY, create_rollout


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m services.rollout",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--engine", choices=ENGINES.names, default="torch", help="inference backend")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--sglang-url", help="drive an SGLang server already running at URL")
    g.add_argument(
        "--sglang-launch",
        action="store_true",
        help="launch (and supervise) an SGLang server as a child process",
    )
    p.add_argument(
        "--engine-opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra engine constructor option (value parsed as YAML); repeatable",
    )
    add_service_args(p, port=0, register=True)
    p.add_argument(
        "--capacity",
        type=int,
        default=DEFAULT_CAPACITY,
        help="concurrent groups this worker accepts",
    )
    p.add_argument(
        "--openai-port",
        type=int,
        default=0,
        help="port of the OpenAI-compatible endpoint agent workflows use (127.0.0.1; 0: free)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (0: torch's default, one per core). One by default: a"
        " continuous-batching decode step is a small batch, and a second thread costs more than"
        " it gives while the trainer needs the cores (make demo on 2 cores: eta=2 108 -> 98 s,"
        " eta=0 151 -> 133 s)",
    )
    return p.parse_args(argv)


def engine_opts(args: argparse.Namespace) -> dict:
    try:
        pairs = parse_assignments(args.engine_opt, "--engine-opt", "key=value")
    except SpecError as e:
        raise SystemExit(str(e)) from None
    opts = {key.replace("-", "_"): value for key, value in pairs}
    if args.sglang_url:
        opts["url"] = args.sglang_url
    if args.sglang_launch:
        opts["launch"] = True
    return opts


async def start(args: argparse.Namespace) -> ServiceRuntime:
    engine = make_engine(args.engine, **engine_opts(args))
    runtime, _ = await create_rollout(
        settings().nats_url,
        engine,
        port=args.port,
        register=not args.no_register,
        capacity=args.capacity,
        host=args.host,
        engine_kind=args.engine,
        openai_port=args.openai_port,
        metrics_port=args.metrics_port,
    )
    return runtime


if __name__ == "__main__":
    configure_logging("rollout")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # weight loading logs through structlog, not tqdm
    args = parse_args()
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    serve(start(args))
