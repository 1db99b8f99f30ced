"""`python -m asyncrl.supervisor start|stop|ps|logs|scale|restart` (behind make
up/down/ps/logs/scale/restart).

`start` makes the secrets once (`<var>/secrets`, or ASYNCRL_SECRETS: the CA, certificates,
tokens, NATS users; see asyncrl.security), launches the daemon (`run`) in its own session and
returns once nats answers, the scheduler is healthy and ListWorkers shows a worker of every
started kind. The daemon starts
nats-server (`-js -sd var/nats`), then the scheduler, reward, rollout and trainer, each with
stdout+stderr in var/log/<service>-<replica>.log; restarts what crashes (with backoff); follows
var/run/replicas.json (written by `scale`); records var/run/state.json (for `ps`); and on
SIGTERM stops the services in reverse order, nats last. `restart SERVICE` replaces its replicas
one at a time, each successor started before its predecessor leaves (`handover`).

`ASYNCRL_METRICS_PORT=B` (or `start --metrics-port B`) gives the services with metrics fixed
ports from B (scheduler B, trainer B+1, rollout replica i B+10+i; see `daemon`), shown by `ps`;
`ASYNCRL_TRAINER_NPROC=N` (or `--trainer-nproc N`) runs each trainer under torchrun with N ranks.
`ASYNCRL_GPUS="rollout=0-3 trainer=4-7"` places the services on GPUs (`gpus`; by default the
visible GPUs are split between rollout and trainer); a placement it refuses fails `start`.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.table import Table

from asyncrl.logging import configure_logging
from asyncrl.proc import kill_tree, pid_alive, signal_group
from asyncrl.security import ensure_secrets
from asyncrl.settings import Settings, settings
from asyncrl.supervisor import gpus, handover
from asyncrl.supervisor.daemon import (
    GRACE_S,
    SERVICES,
    SINGLETONS,
    Supervisor,
    metrics_port_for,
    port_in_use,
    scheduler_addresses,
)
from asyncrl.supervisor.files import Paths, read_json, supervisor_pid, write_json
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


def _kill_all(paths: Paths, supervisor: int) -> None:
    """SIGKILL the daemon and every process below it (torchrun's ranks too), then the trees
    and groups of the processes it recorded (stragglers that outlived their parent)."""
    kill_tree(supervisor)
    for p in (read_json(paths.state, {}) or {}).get("processes", []):
        if p.get("pid"):
            kill_tree(p["pid"])
    paths.pidfile.unlink(missing_ok=True)


# ---------------------------------------------------------------- start, step by step


@dataclass(frozen=True)
class Launch:
    """What `start` runs: the daemon's settings."""

    var: Path
    services: list[str]
    """The chosen services, in start order."""
    nats_port: int
    scheduler_port: int
    metrics_port: int | None
    """Base of the services' metrics ports; None: no metrics."""
    trainer_nproc: int

    @property
    def paths(self) -> Paths:
        return Paths(self.var)

    @property
    def scheduler(self) -> str:
        if "scheduler" not in self.services:
            return settings().scheduler  # another host's
        return scheduler_addresses(self.scheduler_port, settings().scheduler_standby)

    def daemon_command(self) -> list[str]:
        """The argv of the daemon (`run`) that supervises these services."""
        metrics = [] if self.metrics_port is None else ["--metrics-port", str(self.metrics_port)]
        return [
            sys.executable, "-m", "asyncrl.supervisor", "run",
            "--var", str(self.var),
            "--services", ",".join(self.services),
            "--nats-port", str(self.nats_port),
            "--scheduler-port", str(self.scheduler_port),
            "--trainer-nproc", str(self.trainer_nproc),
            *metrics,
        ]  # fmt: skip


def _parse_services(services: str) -> list[str]:
    """'rollout, scheduler' -> ['scheduler', 'rollout'] (start order); unknown names refused."""
    chosen = [s.strip() for s in services.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SERVICES))
    if unknown:
        raise typer.BadParameter(f"unknown services {unknown}; choose from {SERVICES}")
    return [s for s in SERVICES if s in chosen]


def _check_ports_free(launch: Launch) -> None:
    """Exit 1 naming the first port the cluster needs that something else holds."""
    wanted = [
        (launch.nats_port, "nats", "ASYNCRL_NATS_PORT"),
        (launch.scheduler_port, "scheduler", "ASYNCRL_SCHEDULER_PORT"),
    ]
    if settings().scheduler_standby:
        wanted.append((launch.scheduler_port + 1, "scheduler standby", "ASYNCRL_SCHEDULER_PORT"))
    for name in launch.services:
        port = metrics_port_for(name, 0, launch.metrics_port)
        if port is not None:
            wanted.append((port, f"{name} metrics", "ASYNCRL_METRICS_PORT"))
    for port, what, envvar in wanted:
        if port_in_use(port):
            out.print(
                f"[red]port {port} ({what}) is already in use[/red]; stop what uses it or set "
                f"{envvar}"
            )
            raise typer.Exit(1)


def placement(trainer_nproc: int) -> dict[str, gpus.Slot]:
    """The GPU placement of this host's services (ASYNCRL_GPUS, or the default split of the
    visible GPUs); PlacementError names what is wrong with one stated."""
    config = settings()
    return gpus.resolve(config.gpus, gpus.visible_gpus(), config.rollout_engine, trainer_nproc)


def _check_placement(launch: Launch) -> str:
    """The placement as one line; exit 1 naming the problem of one it refuses."""
    try:
        return gpus.describe(placement(launch.trainer_nproc))
    except gpus.PlacementError as e:
        out.print(f"[red]bad GPU placement (ASYNCRL_GPUS={settings().gpus!r})[/red]: {e}")
        raise typer.Exit(1) from None


def _launch_daemon(launch: Launch) -> subprocess.Popen:
    """Prepare var/ (one replica of each service, no stale state) and start the daemon in its
    own session, its output in var/log/supervisor.log."""
    paths = launch.paths
    for d in (paths.run, paths.logs, launch.var / "nats", launch.var / "weights"):
        d.mkdir(parents=True, exist_ok=True)
    paths.state.unlink(missing_ok=True)
    write_json(paths.replicas, {s: 1 for s in launch.services})
    with open(paths.supervisor_log, "ab") as logf:
        return subprocess.Popen(
            launch.daemon_command(),
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def use_secrets(var: Path) -> None:
    """Make whatever is missing of the secrets (the CA, certificates, tokens and NATS users:
    made once, reused) and point this process and the daemon it starts at them through
    ASYNCRL_SECRETS: `<var>/secrets` unless ASYNCRL_SECRETS names another directory."""
    if not settings().insecure:
        secrets = ensure_secrets(settings().secrets or var / "secrets")
        os.environ["ASYNCRL_SECRETS"] = str(secrets.resolve())


def _wait_healthy(daemon: subprocess.Popen, launch: Launch, timeout: float) -> list[str]:
    """Poll until everything is up or `timeout` passes; what is still missing. Exit 1 (with
    the daemon's log) if the daemon itself exits."""
    deadline = time.monotonic() + timeout
    missing = ["nats", *launch.services]
    with out.status("starting") as status:
        while missing and time.monotonic() <= deadline:
            if daemon.poll() is not None:
                out.print(f"[red]the supervisor exited ({daemon.returncode})[/red]; see below")
                _print_tail(launch.paths.supervisor_log)
                raise typer.Exit(1)
            missing = asyncio.run(_missing(launch.scheduler, launch.nats_port, launch.services))
            status.update(f"waiting for: {', '.join(missing)}")
            if missing:
                time.sleep(0.5)
    return missing


def _give_up(
    daemon: subprocess.Popen, launch: Launch, missing: list[str], timeout: float
) -> NoReturn:
    """Show the logs of what did not come up, stop the daemon (and so everything) and exit 1."""
    out.print(f"[red]not healthy after {timeout:.0f}s: {', '.join(missing)}[/red]")
    logs = launch.paths.logs
    for s in missing:
        for logfile in sorted(logs.glob(f"{s}-*.log")):
            _print_tail(logfile)
    out.print(f"logs: {logs}/; stopping")
    daemon.terminate()
    daemon.wait(GRACE_S * (len(launch.services) + 2))
    raise typer.Exit(1)


# ---------------------------------------------------------------- commands


def _from_env(name: str, text: str | None = None, **kw) -> typer.models.OptionInfo:
    """A typer option whose default is setting `name` as the environment holds it when the
    command line is parsed: ASYNCRL_<NAME> sets the default, the flag wins."""
    default = Settings.model_fields[name].default
    return typer.Option(
        default_factory=lambda: getattr(settings(), name),
        show_default=f"$ASYNCRL_{name.upper()} or {default}",
        help=text,
        **kw,
    )


VarOpt = Annotated[Path, _from_env("var", "State directory.")]
NatsPortOpt = Annotated[int, _from_env("nats_port")]
SchedulerPortOpt = Annotated[int, _from_env("scheduler_port")]
MetricsPortOpt = Annotated[
    int | None,
    _from_env("metrics_port", "Base port for the services' Prometheus metrics.", min=1),
]
TrainerNprocOpt = Annotated[
    int, _from_env("trainer_nproc", "Ranks per trainer (> 1: torchrun).", min=1)
]


@app.command()
def start(
    var: VarOpt,
    nats_port: NatsPortOpt,
    scheduler_port: SchedulerPortOpt,
    metrics_port: MetricsPortOpt,
    trainer_nproc: TrainerNprocOpt,
    services: Annotated[str, typer.Option(help="Comma-separated services to run.")] = ",".join(
        SERVICES
    ),
    timeout: Annotated[float, typer.Option(help="Seconds to wait for healthy.")] = READY_TIMEOUT_S,
) -> None:
    """Start nats and the services in the background; return once all are healthy."""
    launch = Launch(
        var, _parse_services(services), nats_port, scheduler_port, metrics_port, trainer_nproc
    )
    pid = supervisor_pid(launch.paths)
    if pid:
        out.print(
            f"asyncrl is already running (supervisor pid {pid}, var {var}); "
            "`make ps` to see it, `make down` to stop it"
        )
        return
    placed = _check_placement(launch)
    _check_ports_free(launch)
    use_secrets(var)  # the readiness checks below present the admin's credentials too
    daemon = _launch_daemon(launch)
    missing = _wait_healthy(daemon, launch, timeout)
    if missing:
        _give_up(daemon, launch, missing, timeout)
    out.print(
        f"asyncrl is up: scheduler {launch.scheduler}, nats nats://127.0.0.1:{nats_port}, "
        f"services {', '.join(launch.services)} (logs in {launch.paths.logs}/)"
        + ("" if placed == "none" else f", GPUs {placed}")
    )


@app.command(hidden=True)
def run(
    var: VarOpt,
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
        placement=placement(trainer_nproc),
    )
    try:
        sup.run()
    finally:
        paths.pidfile.unlink(missing_ok=True)


@app.command()
def stop(
    var: VarOpt,
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
        _kill_all(paths, pid)
    out.print("asyncrl stopped")


@app.command()
def ps(var: VarOpt, as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
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
    with_gpus = any(p.get("gpus") is not None for p in processes)
    for col in ("service", "replica", "pid", "status", "restarts", "uptime"):
        table.add_column(col)
    if with_metrics:
        table.add_column("metrics")
    if with_gpus:
        table.add_column("gpus")
    table.add_column("log", overflow="fold")
    for p in processes:
        alive = p["status"] == "running" and pid_alive(p["pid"])
        status = p["status"] if alive or p["status"] != "running" else "dead"
        if alive and p.get("role"):
            status = f"{status} ({p['role']})"  # a scheduler with a standby
        uptime = f"{time.time() - p['started_at']:.0f}s" if alive else "-"
        metrics = [str(p.get("metrics_port") or "-")] if with_metrics else []
        placed = [p.get("gpus") or "-"] if with_gpus else []
        table.add_row(
            p["service"],
            str(p["replica"]),
            str(p["pid"]),
            status,
            str(p["restarts"]),
            uptime,
            *metrics,
            *placed,
            _short(p["log"]),
        )
    out.print(table)


@app.command()
def logs(
    var: VarOpt,
    service: Annotated[
        str | None,
        typer.Argument(
            help="nats, scheduler, reward, rollout, trainer, supervisor, or e.g. rollout-1"
        ),
    ] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f")] = False,
    lines: Annotated[int, typer.Option("--lines", "-n")] = 50,
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
    var: VarOpt,
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


@app.command()
def restart(
    service: str,
    var: VarOpt,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for each replica.")] = 240.0,
) -> None:
    """Rolling restart: replace each replica of a service in turn, the next once the previous
    one's successor runs and the old process exited. A scheduler, reward or rollout replica
    hands over (its SIGTERM is not the supervisor's: its successor starts beside it and it
    serves until that is ready, `handover`); a trainer stops at a step boundary and is started
    again."""
    paths = Paths(var)
    if not supervisor_pid(paths):
        out.print("asyncrl is not running")
        raise typer.Exit(1)
    state = read_json(paths.state, {}) or {}
    if service not in state.get("services", []):
        raise typer.BadParameter(f"{service} is not supervised here ({state.get('services')})")
    replicas = [p for p in state["processes"] if p["service"] == service and p["pid"]]
    for old in sorted(replicas, key=lambda p: p["replica"]):
        if service in handover.SERVICES:
            os.kill(old["pid"], signal.SIGTERM)  # its own: its pool or engine stays until then
        else:
            signal_group(old["pid"], signal.SIGTERM)  # torchrun forwards it to the ranks
        new = _replaced(paths, old, timeout)
        name = f"{service}-{old['replica']}"
        if new is None:
            out.print(f"[red]{name}: pid {old['pid']} not replaced in {timeout:.0f}s[/red]")
            raise typer.Exit(1)
        out.print(f"{name}: pid {old['pid']} -> {new}")


def _replaced(paths: Paths, old: dict, timeout: float) -> int | None:
    """The pid running in `old`'s replica slot once `old` exited, or None past `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        procs = (read_json(paths.state, {}) or {}).get("processes", [])
        slot = [
            p for p in procs if (p["service"], p["replica"]) == (old["service"], old["replica"])
        ]
        new = [p["pid"] for p in slot if p["status"] == "running" and p["pid"] != old["pid"]]
        if new and not pid_alive(old["pid"]) and pid_alive(new[0]):
            return new[0]
        time.sleep(0.2)
    return None


if __name__ == "__main__":
    app()
