"""`python -m asyncrl.supervisor start|stop|ps|logs|scale` (behind make up/down/ps/logs/scale).

`start` launches the daemon (`run`) in its own session and returns once nats answers, the
scheduler is healthy and ListWorkers shows a worker of every started kind. The daemon starts
nats-server (`-js -sd var/nats`), then the scheduler, reward, rollout and trainer, each with
stdout+stderr in var/log/<service>-<replica>.log; restarts what crashes (with backoff); follows
var/run/replicas.json (written by `scale`); records var/run/state.json (for `ps`); and on
SIGTERM stops the services in reverse order, nats last.

`ASYNCRL_METRICS_PORT=B` (or `start --metrics-port B`) gives the services with metrics fixed
ports from B (scheduler B, trainer B+1, rollout replica i B+10+i; see `daemon`), shown by `ps`;
`ASYNCRL_TRAINER_NPROC=N` (or `--trainer-nproc N`) runs each trainer under torchrun with N ranks.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from asyncrl.logging import configure_logging
from asyncrl.supervisor.daemon import (
    GRACE_S,
    SERVICES,
    SINGLETONS,
    Paths,
    Supervisor,
    metrics_port_for,
    pid_alive,
    port_in_use,
    read_json,
    signal_group,
    supervisor_pid,
    write_json,
)
from asyncrl.v1 import common_pb2

WORKER_KINDS = {
    "reward": common_pb2.WORKER_KIND_REWARD,
    "rollout": common_pb2.WORKER_KIND_ROLLOUT,
    "trainer": common_pb2.WORKER_KIND_TRAINER,
}
READY_TIMEOUT_S = 180.0

app = typer.Typer(
    help="Local supervisor for nats-server and the asyncrl services.",
    no_args_is_help=True,
    add_completion=False,
)
out = Console(highlight=False)


# ---------------------------------------------------------------- readiness


async def _missing(scheduler: str, nats_port: int, services: list[str]) -> list[str]:
    """What is not up yet: 'nats', 'scheduler', or worker kinds absent from ListWorkers."""
    from asyncrl.client import AsyncrlClient, AsyncrlError
    from asyncrl.grpcutil import check_health

    if not port_in_use(nats_port):
        return ["nats", *services]
    if "scheduler" not in services:
        return []
    if not await check_health(scheduler, timeout=2.0):
        return list(services)
    async with AsyncrlClient(scheduler, timeout_s=2.0) as client:
        try:
            kinds = {w.kind for w in await client.workers()}
        except AsyncrlError:
            return [s for s in services if s in WORKER_KINDS]
    return [s for s in services if s in WORKER_KINDS and WORKER_KINDS[s] not in kinds]


def _print_tail(path: Path, n: int = 15) -> None:
    """The last lines of a log, verbatim (no markup, no wrapping)."""
    try:
        lines = path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        lines = ["(no log)"]
    out.print(f"--- {path} (last {n} lines)", markup=False)
    for line in lines:
        out.print(line, markup=False, highlight=False, soft_wrap=True)


def _short(path: str) -> str:
    """A path relative to the working directory when it is under it."""
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return path


def _wait_stopped(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


# ---------------------------------------------------------------- commands

VarOpt = Annotated[Path, typer.Option("--var", envvar="ASYNCRL_VAR", help="State directory.")]


@app.command()
def start(
    var: VarOpt = Path("var"),
    services: Annotated[str, typer.Option(help="Comma-separated services to run.")] = ",".join(
        SERVICES
    ),
    nats_port: Annotated[int, typer.Option(envvar="ASYNCRL_NATS_PORT")] = 4222,
    scheduler_port: Annotated[int, typer.Option(envvar="ASYNCRL_SCHEDULER_PORT")] = 50051,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            envvar="ASYNCRL_METRICS_PORT",
            min=1,
            help="Base port for the services' Prometheus metrics (default: no metrics).",
        ),
    ] = None,
    trainer_nproc: Annotated[
        int,
        typer.Option(
            envvar="ASYNCRL_TRAINER_NPROC", min=1, help="Ranks per trainer (> 1: torchrun)."
        ),
    ] = 1,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for healthy.")] = READY_TIMEOUT_S,
) -> None:
    """Start nats and the services in the background; return once all are healthy."""
    paths = Paths(var)
    chosen = [s.strip() for s in services.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SERVICES))
    if unknown:
        raise typer.BadParameter(f"unknown services {unknown}; choose from {SERVICES}")
    chosen = [s for s in SERVICES if s in chosen]
    pid = supervisor_pid(paths)
    if pid:
        out.print(
            f"asyncrl is already running (supervisor pid {pid}, var {var}); "
            "`make ps` to see it, `make down` to stop it"
        )
        return
    for name, port in (("nats", nats_port), ("scheduler", scheduler_port)):
        if port_in_use(port):
            out.print(
                f"[red]port {port} ({name}) is already in use[/red]; stop what uses it or "
                f"set ASYNCRL_{name.upper()}_PORT"
            )
            raise typer.Exit(1)
    for name in chosen:
        port = metrics_port_for(name, 0, metrics_port)
        if port is not None and port_in_use(port):
            out.print(
                f"[red]port {port} ({name} metrics) is already in use[/red]; stop what uses it "
                "or set ASYNCRL_METRICS_PORT"
            )
            raise typer.Exit(1)
    for d in (paths.run, paths.logs, var / "nats", var / "weights"):
        d.mkdir(parents=True, exist_ok=True)
    paths.state.unlink(missing_ok=True)
    write_json(paths.replicas, {s: 1 for s in chosen})
    cmd = [
        sys.executable,
        "-m",
        "asyncrl.supervisor",
        "run",
        "--var",
        str(var),
        "--services",
        ",".join(chosen),
        "--nats-port",
        str(nats_port),
        "--scheduler-port",
        str(scheduler_port),
        "--trainer-nproc",
        str(trainer_nproc),
        *(["--metrics-port", str(metrics_port)] if metrics_port is not None else []),
    ]
    with open(paths.supervisor_log, "ab") as logf:
        daemon = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    scheduler = f"127.0.0.1:{scheduler_port}"
    deadline = time.monotonic() + timeout
    missing = ["nats", *chosen]
    with out.status("starting") as status:
        while missing:
            if daemon.poll() is not None:
                out.print(f"[red]the supervisor exited ({daemon.returncode})[/red]; see below")
                _print_tail(paths.supervisor_log)
                raise typer.Exit(1)
            if time.monotonic() > deadline:
                break
            missing = asyncio.run(_missing(scheduler, nats_port, chosen))
            status.update(f"waiting for: {', '.join(missing)}")
            if missing:
                time.sleep(0.5)
    if missing:
        out.print(f"[red]not healthy after {timeout:.0f}s: {', '.join(missing)}[/red]")
        for s in missing:
            for logfile in sorted(paths.logs.glob(f"{s}-*.log")):
                _print_tail(logfile)
        out.print(f"logs: {paths.logs}/; stopping")
        daemon.terminate()
        daemon.wait(GRACE_S * (len(chosen) + 2))
        raise typer.Exit(1)
    out.print(
        f"asyncrl is up: scheduler {scheduler}, nats nats://127.0.0.1:{nats_port}, "
        f"services {', '.join(chosen)} (logs in {paths.logs}/)"
    )


@app.command(hidden=True)
def run(
    var: VarOpt = Path("var"),
    services: Annotated[str, typer.Option()] = ",".join(SERVICES),
    nats_port: Annotated[int, typer.Option()] = 4222,
    scheduler_port: Annotated[int, typer.Option()] = 50051,
    metrics_port: Annotated[int | None, typer.Option()] = None,
    trainer_nproc: Annotated[int, typer.Option(min=1)] = 1,
) -> None:
    """The daemon itself (started by `start`)."""
    configure_logging("supervisor")
    paths = Paths(var)
    paths.pidfile.write_text(str(os.getpid()))
    sup = Supervisor(
        paths,
        [s for s in services.split(",") if s],
        nats_port,
        scheduler_port,
        metrics_base=metrics_port,
        trainer_nproc=trainer_nproc,
    )
    try:
        sup.run()
    finally:
        paths.pidfile.unlink(missing_ok=True)


@app.command()
def stop(
    var: VarOpt = Path("var"),
    timeout: Annotated[float, typer.Option(help="Seconds to wait.")] = 120.0,
) -> None:
    """Stop the services (reverse order) and nats."""
    paths = Paths(var)
    pid = supervisor_pid(paths)
    if not pid:
        out.print("asyncrl is not running")
        return
    os.kill(pid, signal.SIGTERM)
    if not _wait_stopped(pid, timeout):
        out.print(f"[red]supervisor {pid} did not stop in {timeout:.0f}s; killing it[/red]")
        os.kill(pid, signal.SIGKILL)
        for p in (read_json(paths.state, {}) or {}).get("processes", []):
            if p.get("pid"):
                signal_group(p["pid"], signal.SIGKILL)
        paths.pidfile.unlink(missing_ok=True)
    out.print("asyncrl stopped")


@app.command()
def ps(var: VarOpt = Path("var"), as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Supervised processes: service, replica, pid, status, restarts, uptime, metrics port
    (when the services have one), log."""
    paths = Paths(var)
    state = read_json(paths.state, {}) or {}
    if not supervisor_pid(paths):
        out.print("asyncrl is not running")
        return
    if as_json:
        out.print_json(json.dumps(state))
        return
    table = Table(
        title=f"asyncrl (supervisor pid {state.get('supervisor_pid')}, "
        f"scheduler {state.get('scheduler')}, {state.get('nats_url')})"
    )
    processes = state.get("processes", [])
    with_metrics = any(p.get("metrics_port") for p in processes)
    for col in ("service", "replica", "pid", "status", "restarts", "uptime"):
        table.add_column(col)
    if with_metrics:
        table.add_column("metrics")
    table.add_column("log", overflow="fold")
    for p in processes:
        alive = p["status"] == "running" and pid_alive(p["pid"])
        status = p["status"] if alive or p["status"] != "running" else "dead"
        uptime = f"{time.time() - p['started_at']:.0f}s" if alive else "-"
        metrics = [str(p.get("metrics_port") or "-")] if with_metrics else []
        table.add_row(
            p["service"],
            str(p["replica"]),
            str(p["pid"]),
            status,
            str(p["restarts"]),
            uptime,
            *metrics,
            _short(p["log"]),
        )
    out.print(table)


@app.command()
def logs(
    service: Annotated[
        str | None,
        typer.Argument(
            help="nats, scheduler, reward, rollout, trainer, supervisor, or e.g. rollout-1"
        ),
    ] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f")] = False,
    lines: Annotated[int, typer.Option("--lines", "-n")] = 50,
    var: VarOpt = Path("var"),
) -> None:
    """Show (or follow) the logs of one service or all."""
    logdir = Paths(var).logs
    if service is None:
        files = sorted(logdir.glob("*.log"))
    else:
        files = sorted(logdir.glob(f"{service}.log")) or sorted(logdir.glob(f"{service}-*.log"))
    if not files:
        out.print(f"no logs for {service or 'any service'} in {logdir}")
        raise typer.Exit(1)
    os.execvp("tail", ["tail", "-n", str(lines), *(["-F"] if follow else []), *map(str, files)])


@app.command()
def scale(
    service: str,
    n: int,
    var: VarOpt = Path("var"),
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the change.")] = 30.0,
) -> None:
    """Set the replica count of a service; the supervisor applies it within a second."""
    paths = Paths(var)
    state = read_json(paths.state, {}) or {}
    running = state.get("services", list(SERVICES))
    if service not in running:
        raise typer.BadParameter(f"{service} is not supervised here (services: {running})")
    if service in SINGLETONS and n != 1:
        raise typer.BadParameter(f"{service} runs exactly one replica")
    if n < 0:
        raise typer.BadParameter("N must be >= 0")
    paths.run.mkdir(parents=True, exist_ok=True)
    want = read_json(paths.replicas, {}) or {}
    want[service] = n
    write_json(paths.replicas, want)
    if not supervisor_pid(paths):
        out.print(f"{service}: {n} replicas (applied at the next `make up`)")
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        procs = (read_json(paths.state, {}) or {}).get("processes", [])
        mine = [p for p in procs if p["service"] == service]
        if len(mine) == n and all(p["status"] == "running" for p in mine):
            out.print(f"{service}: {n} replicas running")
            return
        time.sleep(0.2)
    out.print(f"[red]{service} did not reach {n} running replicas in {timeout:.0f}s[/red]")
    raise typer.Exit(1)


if __name__ == "__main__":
    app()
