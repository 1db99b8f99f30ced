"""The supervisor daemon: runs nats-server and the services as restarted processes.

State lives under the var directory: var/run/supervisor.pid, var/run/state.json (what runs,
for `ps`), var/run/replicas.json (desired replica counts, written by `scale` and polled here),
var/log/<service>-<replica>.log (each process's stdout+stderr).

Metrics ports: with a base B (`ASYNCRL_METRICS_PORT=B make up`) the services that serve
Prometheus metrics get a fixed `--metrics-port`, so a scrape config written once keeps working
across restarts and scaling: scheduler B, trainer replica i B+1+i (i < 9), rollout replica i
B+10+i. reward and nats have none. `ps` shows each replica's port.

Hand-over: a scheduler, reward or rollout process that gets a SIGTERM this daemon did not send
(an operator, a drained node) asks for a successor (var/run/handover/, `handover`): the daemon
starts one in its replica's place and keeps the old process as `handing over` until it exits
(killed past handover.READY_S + the grace period). The daemon's own stops (`make down`,
`scale`) say first that no successor comes.

Multi-GPU trainer: with `ASYNCRL_TRAINER_NPROC=N` (N > 1) each trainer replica is
`python -m torch.distributed.run --nproc_per_node N --master_addr 127.0.0.1 --master_port P
-m services.trainer ...` (P a free port picked at every spawn), for the megatron backend with
trainer.tp_size * trainer.dp_size == N. Stopping it is the usual SIGTERM to its process group:
torchrun forwards it to the ranks (each in its own session), rank 0 shuts down at a step
boundary and releases the followers, which ignore the signal; past the grace period the whole
process tree is killed, ranks included.

GPUs: each process gets CUDA_VISIBLE_DEVICES from the placement (`gpus`: ASYNCRL_GPUS, or the
visible GPUs split between rollout and trainer; none on a CPU machine, where the environment is
left as it is). `ps` shows each replica's GPUs.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from asyncrl.logging import get_logger
from asyncrl.natsutil import ClusterNode, LocalNatsServer
from asyncrl.net import free_port
from asyncrl.proc import die_with_parent, kill_tree, signal_group
from asyncrl.security import WORKER_ROLES, is_bundle, write_token
from asyncrl.settings import Settings, settings
from asyncrl.supervisor import gpus, handover
from asyncrl.supervisor.broker import BrokerWatch, NatsLogWatch
from asyncrl.supervisor.files import Paths, read_json, write_json

SERVICES = ("scheduler", "reward", "rollout", "trainer")  # start order; stop is the reverse
SINGLETONS = ("nats", "scheduler")
METRICS_OFFSETS = {"scheduler": 0, "trainer": 1, "rollout": 10}  # port = base + offset + replica
MAX_TRAINER_METRICS = METRICS_OFFSETS["rollout"] - METRICS_OFFSETS["trainer"]
POLL_S = 0.2
GRACE_S = 15.0
TRAINER_GRACE_S = 45.0  # the trainer's final checkpoint (all ranks under torchrun) must fit

log = get_logger()


# ---------------------------------------------------------------- pure policy


def backoff_s(consecutive_failures: int) -> float:
    """Delay before restarting a process that failed `consecutive_failures` times in a row."""
    return min(30.0, 0.5 * 2 ** max(0, consecutive_failures - 1))


HEALTHY_UPTIME_S = 30.0
"""A process that ran this long before exiting starts a fresh backoff sequence."""


def free_index(used: set[int]) -> int:
    """The lowest replica index not in use (so rollout-1 comes back as rollout-1)."""
    i = 0
    while i in used:
        i += 1
    return i


def metrics_port_for(service: str, index: int, base: int | None) -> int | None:
    """The --metrics-port of replica `index` of `service` given the base port (see the module
    docstring); None without a base, for services without metrics, and for trainer replicas
    past the ones the scheme has room for."""
    if base is None or service not in METRICS_OFFSETS:
        return None
    if service == "scheduler" and index > 0:  # a standby's would be the trainer's port
        return None
    if service == "trainer" and index >= MAX_TRAINER_METRICS:
        return None
    return base + METRICS_OFFSETS[service] + index


def scheduler_addresses(port: int, standby: bool) -> str:
    """What the services dial: this host's scheduler, and with a standby the standby's too
    (port + 1); whichever serves answers (`asyncrl.grpcutil.grpc_target`)."""
    ports = [port, port + 1] if standby else [port]
    return ",".join(f"127.0.0.1:{p}" for p in ports)


def torchrun_command(nproc: int, master_port: int) -> list[str]:
    """The launcher in front of `-m services.trainer` for an `nproc`-rank trainer on this host."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(master_port),
    ]


def port_in_use(port: int) -> bool:
    """Whether something listens on `port` of this host's bind address (ASYNCRL_BIND_HOST;
    loopback when that is every address)."""
    host = settings().bind_host
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1" if host in ("0.0.0.0", "") else host, port)) == 0


def cpu_placement(service: str, index: int, cores: list[int], rollouts: int) -> set[int] | None:
    """The cores of replica `index` of `service` among `cores` when `rollouts` torch rollouts
    share them: rollout i the i-th core from the end to itself, everything else the cores no
    rollout holds; None (the kernel's choice) when that would leave the others none."""
    if rollouts == 0 or rollouts >= len(cores):
        return None
    if service == "rollout":
        return {cores[-1 - index]} if index < rollouts else None
    return set(cores[: len(cores) - rollouts])


# ---------------------------------------------------------------- the daemon


@dataclass
class Replica:
    service: str
    index: int
    log: Path
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    failures: int = 0  # consecutive quick failures, for backoff
    restart_at: float | None = None
    stop_deadline: float | None = None
    last_exit: int | None = None
    metrics_port: int | None = None
    gpus: str | None = None
    """Its CUDA_VISIBLE_DEVICES (None: not set by the placement)."""
    handovers: int = 0
    """Successors started beside it on a stop it did not send (`handover`)."""
    retiring: bool = False
    """A process that handed its replica over to a successor, serving until that is ready."""

    @property
    def status(self) -> str:
        if self.retiring:
            return "handing over"
        if self.stop_deadline is not None:
            return "stopping"
        if self.proc is not None and self.proc.poll() is None:
            return "running"
        return "restarting" if self.restart_at is not None else "exited"

    def as_dict(self) -> dict:
        return {
            "service": self.service,
            "replica": self.index,
            "pid": self.proc.pid if self.proc else None,
            "status": self.status,
            "handovers": self.handovers,
            "restarts": self.restarts,
            "started_at": self.started_at,
            "last_exit": self.last_exit,
            "metrics_port": self.metrics_port,
            "gpus": self.gpus,
            "log": str(self.log),
        }


@dataclass
class Supervisor:
    paths: Paths
    services: list[str]
    nats_port: int
    scheduler_port: int
    metrics_base: int | None = None  # the services' metrics ports start here; None: none
    trainer_nproc: int = 1  # ranks per trainer replica; > 1 runs it under torchrun
    grace_s: float = GRACE_S
    placement: dict[str, gpus.Slot] = field(default_factory=dict)
    """Each service's GPUs (`gpus.resolve`); empty: no placement (a CPU machine)."""
    replicas: dict[str, list[Replica]] = field(default_factory=dict)
    stopping: bool = False
    started_at: float = field(default_factory=time.time)
    _last_state: str = ""
    broker: BrokerWatch | None = None
    nats_log: NatsLogWatch | None = None

    @cached_property
    def started_with(self) -> Settings:
        """The settings as the environment held them at the first read: `write_state` runs at
        every poll, and a settings read costs 3 ms (twice per poll was 3 % of a core idle)."""
        return settings()

    @property
    def nats_url(self) -> str:
        """What the services connect to: this host's nats-server, or, when it is a cluster node
        (ASYNCRL_NATS_ROUTES), every node NATS_URL lists (a client fails over between them)."""
        if self.cluster_node is not None:
            return self.started_with.nats_url
        return f"nats://127.0.0.1:{self.nats_port}"

    @cached_property
    def cluster_node(self) -> ClusterNode | None:
        """This host's NATS cluster node (ASYNCRL_NATS_ROUTES), read once."""
        return ClusterNode.from_settings()

    @property
    def scheduler_address(self) -> str:
        """This host's scheduler, or ASYNCRL_SCHEDULER where another host runs it."""
        if "scheduler" not in self.services:
            return self.started_with.scheduler
        return scheduler_addresses(self.scheduler_port, self.started_with.scheduler_standby)

    def command(self, service: str, index: int = 0) -> list[str]:
        """The argv of replica `index` of `service` (a multi-rank trainer gets a fresh
        master port each call, i.e. each spawn)."""
        if service == "nats":
            return LocalNatsServer(
                self.paths.var / "nats",
                port=self.nats_port,
                host=settings().bind_host,
                cluster=self.cluster_node,
            ).command()
        config = settings()
        if service == "trainer" and self.trainer_nproc > 1:
            cmd = [*torchrun_command(self.trainer_nproc, free_port()), "-m", "services.trainer"]
        else:
            cmd = [sys.executable, "-m", f"services.{service}"]
        if service == "scheduler":
            cmd += ["--port", str(self.scheduler_port + index)]  # 1: the standby
        if service == "rollout":
            cmd += ["--engine", config.rollout_engine]
        port = metrics_port_for(service, index, self.metrics_base)
        if port is not None:
            cmd += ["--metrics-port", str(port)]
        # extra flags per service, e.g. ASYNCRL_ROLLOUT_ARGS="--sglang-url http://h:30000"
        extra = shlex.split(config.service_args(service))
        if service == "trainer" and "--threads" not in extra:
            cmd += ["--threads", str(self.trainer_threads())]
        return cmd + extra

    def trainer_threads(self) -> int:
        """Torch CPU threads per trainer rank: this host's cores less one per rollout replica
        here (a rollout runs one torch thread by default), shared by the ranks, at least one.
        On 2 cores with a rollout beside it, a second trainer thread cost both demo modes
        (make demo: eta=2 53.9 -> 49.7 s, eta=0 76.5 -> 74.7 s with one)."""
        rollouts = self.desired().get("rollout", 0)
        return max(1, ((os.cpu_count() or 1) - rollouts) // self.trainer_nproc)

    def cpus(self, service: str, index: int = 0) -> set[int] | None:
        """The cores replica `index` of `service` may run on (`cpu_placement`, over this
        process's cores and the desired rollouts), or None (the kernel's choice) unless
        ASYNCRL_CPU_AFFINITY with the torch engine. On 2 cores, bench `system` at eta = 4: the
        rollout's CPU share 0.76 -> 0.95-0.99 and its decode step 1.21 -> 1.10-1.13 ms; the run
        5.54 -> 5.01-5.23 s (docs/benchmarks.md)."""
        config = settings()
        if not config.cpu_affinity or config.rollout_engine != "torch":
            return None
        cores = sorted(os.sched_getaffinity(0))
        return cpu_placement(service, index, cores, self.desired().get("rollout", 0))

    def devices(self, service: str, index: int) -> str | None:
        """CUDA_VISIBLE_DEVICES of replica `index` of `service` (`gpus.devices_for`); None
        for nats and without a placement."""
        if service == "nats":
            return None
        return gpus.devices_for(self.placement, service, index, settings().rollout_engine)

    def env(self, service: str, index: int) -> dict[str, str]:
        var = self.paths.var.resolve()
        env = dict(os.environ)
        env.update(
            NATS_URL=self.nats_url,
            ASYNCRL_SCHEDULER=self.scheduler_address,
            ASYNCRL_VAR=str(var),
            PYTHONUNBUFFERED="1",
            ASYNCRL_SERVICE=service,
            ASYNCRL_REPLICA=str(index),
        )
        env.setdefault("ASYNCRL_WEIGHTS", str(var / "weights"))
        devices = self.devices(service, index)
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = devices
        env.pop(handover.ENV_PREDECESSOR, None)
        if service in handover.SERVICES:
            env[handover.ENV_DIR] = str(self.paths.handover.resolve())
            env[handover.ENV_SUPERVISOR] = str(os.getpid())
        secrets = settings().secrets_dir
        if service in WORKER_ROLES and not settings().insecure and not is_bundle(secrets):
            name = f"{service}-{index}"
            env["ASYNCRL_TOKEN_FILE"] = str(write_token(secrets, name, service))  # own identity
        return env

    def spawn(self, r: Replica, predecessor: int | None = None) -> None:
        """Start replica `r`'s process (the successor of pid `predecessor`: `handover`)."""
        r.metrics_port = metrics_port_for(r.service, r.index, self.metrics_base)
        r.gpus = self.devices(r.service, r.index)
        cpus = self.cpus(r.service, r.index)
        env = self.env(r.service, r.index)
        if predecessor is not None:
            env[handover.ENV_PREDECESSOR] = str(predecessor)

        def setup() -> None:  # in the child, before exec: its threads inherit the cores
            die_with_parent()
            if cpus is not None:
                os.sched_setaffinity(0, cpus)

        with open(r.log, "ab") as logf:
            r.proc = subprocess.Popen(
                self.command(r.service, r.index),
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=setup,
            )
        r.started_at = time.time()
        r.restart_at = None
        log.info(
            "process_started",
            process=f"{r.service}-{r.index}",
            pid=r.proc.pid,
            metrics_port=r.metrics_port,
            cpus=sorted(cpus) if cpus is not None else None,
            gpus=r.gpus,
            predecessor=predecessor,
        )

    def add_replica(self, service: str) -> Replica:
        group = self.replicas.setdefault(service, [])
        index = free_index({r.index for r in group})
        r = Replica(service, index, self.paths.log(service, index))
        group.append(r)
        self.spawn(r)
        return r

    def start_nats(self, timeout: float = 30.0) -> None:
        r = self.add_replica("nats")
        deadline = time.monotonic() + timeout
        while not port_in_use(self.nats_port):
            if r.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nats-server did not start; see {r.log}")
            time.sleep(0.05)

    def desired(self) -> dict[str, int]:
        want = read_json(self.paths.replicas, {}) or {}
        counts = {}
        for s in self.services:
            n = want.get(s, 1)
            counts[s] = 1 if s in SINGLETONS else max(0, int(n))
        if "scheduler" in counts and self.started_with.scheduler_standby:
            counts["scheduler"] = 2
        return counts

    def stop_replica(self, r: Replica, sig: int = signal.SIGTERM) -> None:
        """Stop `r` (SIGTERM to it, or to its group for a trainer or nats; killed past the grace
        period, its group after it exits), telling it first that no successor will come
        (`handover`): also one that is handing over stops now."""
        if r.proc is not None and r.service in handover.SERVICES:
            self.mark(r.proc.pid, "stop")
        if r.stop_deadline is None:
            grace = max(self.grace_s, TRAINER_GRACE_S) if r.service == "trainer" else self.grace_s
            r.stop_deadline = time.monotonic() + grace
            r.restart_at = None
            if r.proc is not None and r.proc.poll() is None and r.service in handover.SERVICES:
                os.kill(r.proc.pid, sig)  # it closes its own (a reward's pool, reaped in order)
            elif r.proc is not None and r.proc.poll() is None:
                signal_group(r.proc.pid, sig)
            log.info(
                "process_stopping",
                process=f"{r.service}-{r.index}",
                pid=r.proc.pid if r.proc else None,
            )

    def reconcile(self) -> None:
        """Match the running replicas to replicas.json: add new ones, stop the newest extras."""
        for service, n in self.desired().items():
            live = [r for r in self.replicas.get(service, []) if r.stop_deadline is None]
            for _ in range(n - len(live)):
                self.add_replica(service)
            for r in sorted(live, key=lambda r: r.index)[n:]:
                self.stop_replica(r)

    def check(self) -> None:
        """Reap exits: drop stopped replicas, schedule and perform restarts, kill overdue ones."""
        now = time.monotonic()
        for service, group in self.replicas.items():
            for r in list(group):
                code = r.proc.poll() if r.proc else None
                if r.stop_deadline is not None:
                    if r.proc is None or code is not None:
                        if r.proc is not None:
                            signal_group(r.proc.pid, signal.SIGKILL)  # stragglers in its group
                            handover.clear_markers(self.paths.handover, r.proc.pid)
                        group.remove(r)
                    elif now > r.stop_deadline:
                        kill_tree(r.proc.pid)  # torchrun's ranks are outside its group
                    continue
                if r.restart_at is None and code is not None:
                    signal_group(r.proc.pid, signal.SIGKILL)  # stragglers in its group
                    handover.clear_markers(self.paths.handover, r.proc.pid)
                    r.last_exit = code
                    uptime = time.time() - r.started_at
                    r.failures = 1 if uptime > HEALTHY_UPTIME_S else r.failures + 1
                    r.restart_at = now + backoff_s(r.failures)
                    log.warning(
                        "process_exited",
                        process=f"{service}-{r.index}",
                        code=code,
                        uptime_s=round(uptime, 1),
                        restart_in_s=backoff_s(r.failures),
                    )
                if r.restart_at is not None and now >= r.restart_at and not self.stopping:
                    r.restarts += 1
                    self.spawn(r)

    def mark(self, pid: int, step: str, text: str = "") -> None:
        try:
            handover.write_marker(self.paths.handover, pid, step, text)
        except OSError as exc:  # a full disk: the service stops plainly after ANSWER_S
            log.warning("handover_marker_failed", pid=pid, step=step, error=repr(exc))

    def check_handovers(self) -> None:
        """Start a successor beside each process that asked for one (a stop it did not get from
        this supervisor), or tell it that none will come (stopping, or not a live replica)."""
        for pid in handover.requests(self.paths.handover):
            handover.marker(self.paths.handover, pid, "request").unlink(missing_ok=True)
            live = [
                r
                for group in self.replicas.values()
                for r in group
                if r.proc is not None and r.proc.pid == pid and r.proc.poll() is None
            ]
            if self.stopping or not live or live[0].stop_deadline is not None:
                self.mark(pid, "stop")
            else:
                self.hand_over(live[0])

    def hand_over(self, r: Replica) -> None:
        """`r`'s process serves on as a retiring replica (killed past READY_S + grace) while a
        successor starts in its place; the successor tells it when to go."""
        old = r.proc
        deadline = time.monotonic() + handover.READY_S + self.grace_s
        retiring = Replica(r.service, r.index, r.log, proc=old, started_at=r.started_at)
        retiring.stop_deadline, retiring.retiring = deadline, True
        self.replicas[r.service].append(retiring)
        r.handovers += 1
        self.spawn(r, predecessor=old.pid)
        self.mark(old.pid, "successor", str(r.proc.pid))
        log.info("process_handing_over", process=f"{r.service}-{r.index}", pid=old.pid)

    def scheduler_role(self, r: Replica) -> str | None:
        """With a standby: `active` for the scheduler that serves (only the lease holder binds
        its port), `standby` for the other; None without one."""
        if r.service != "scheduler" or not self.started_with.scheduler_standby:
            return None
        serving = r.status == "running" and port_in_use(self.scheduler_port + r.index)
        return "active" if serving else "standby"

    def write_state(self, status: str = "running") -> None:
        procs = [
            {**r.as_dict(), "role": self.scheduler_role(r)}
            for s in ("nats", *self.services)
            for r in self.replicas.get(s, [])
        ]
        state = {
            "supervisor_pid": os.getpid(),
            "status": status,
            "started_at": self.started_at,
            "var": str(self.paths.var.resolve()),
            "nats_url": self.nats_url,
            "scheduler": self.scheduler_address,
            "services": self.services,
            "processes": procs,
        }
        text = json.dumps(state, sort_keys=True)
        if text != self._last_state:
            try:
                write_json(self.paths.state, state)
            except OSError as exc:  # a full disk: `ps` shows older news, the processes run on
                log.warning("state_write_failed", error=repr(exc))
                return
            self._last_state = text

    def check_broker(self) -> None:
        """Restart nats-server when it kept a write error after space returned (BrokerWatch)."""
        if self.broker is None or self.nats_log is None:
            return
        why = self.nats_log.stuck() or self.broker.stuck()
        if not why:
            return
        for r in self.replicas.get("nats", []):
            if r.proc is not None and r.proc.poll() is None and r.stop_deadline is None:
                log.warning("nats_restart_storage", pid=r.proc.pid, reason=why)
                signal_group(r.proc.pid, signal.SIGTERM)  # `check` restarts it
        self.broker.reset()
        self.nats_log.reset()

    def shutdown(self) -> None:
        """Stop the services in reverse start order, then nats; each gets `grace_s`."""
        self.stopping = True
        self.write_state("stopping")
        for service in [*reversed(self.services), "nats"]:
            group = self.replicas.get(service, [])
            for r in group:
                self.stop_replica(r)
            while group:
                self.check()
                time.sleep(0.05)
            log.info("service_stopped", process_group=service)
        self.write_state("stopped")

    def run(self) -> None:
        def request_stop(signum, frame):
            self.stopping = True

        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)
        self.paths.handover.mkdir(parents=True, exist_ok=True)
        for stale in self.paths.handover.iterdir():
            stale.unlink(missing_ok=True)
        try:
            self.start_nats()
            if self.cluster_node is None:  # a broker of this host's own
                self.broker = BrokerWatch(self.nats_url, self.paths.var / "nats")
                self.broker.start()
                self.nats_log = NatsLogWatch(self.paths.log("nats", 0), self.paths.var / "nats")
            while not self.stopping:
                self.reconcile()
                self.check()
                self.check_handovers()
                self.check_broker()
                self.write_state()
                time.sleep(POLL_S)
        finally:
            if self.broker is not None:
                self.broker.stop()
            self.shutdown()
