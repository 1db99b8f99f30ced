"""Hosts in network namespaces: a bridge and one namespace per host, each with its own address,
its own directory (no shared var/) and its own supervisor (`asyncrl.supervisor start`, what
`make up` runs) running its share of the services and one node of a three-node NATS cluster.

Must run as root inside a private network and mount namespace (`unshare -n -m`, as
`python -m tests.multihost` arranges): the namespaces, the bridge and every process vanish with
it, and nothing is reachable from outside. The runner itself sits on the bridge at OPERATOR,
like an operator's laptop: it reaches every host through the addresses the services are given,
never through loopback.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUBNET = "10.77.0"
OPERATOR = f"{SUBNET}.254"
BRIDGE = "asyncrl-br"
NATS_PORT = 4222
ROUTE_PORT = 6222
SCHEDULER_PORT = 50051


@dataclass
class Host:
    """One machine: a network namespace `ns` with address `ip`, a directory `root` (its var/),
    the services its supervisor runs and how many rollouts."""

    name: str
    ip: str
    services: list[str]
    rollouts: int = 1
    root: Path = field(default=Path())

    @property
    def ns(self) -> str:
        return f"host-{self.name}"

    @property
    def var(self) -> Path:
        return self.root / "var"

    @property
    def secrets(self) -> Path:
        return self.var / "secrets"

    @property
    def nats_name(self) -> str:
        return f"nats-{self.name}"


def layout(out: Path) -> list[Host]:
    """Host a: scheduler + trainer; b: two rollouts; c: reward + a rollout; a NATS node on
    each. The trainer's weight store is on a, the rollouts on b and c."""
    hosts = [
        Host("a", f"{SUBNET}.1", ["scheduler", "trainer"], rollouts=0),
        Host("b", f"{SUBNET}.2", ["rollout"], rollouts=2),
        Host("c", f"{SUBNET}.3", ["reward", "rollout"], rollouts=1),
    ]
    for host in hosts:
        host.root = out / host.name
    return hosts


def sh(*argv: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, capture_output=True, text=True, **kw)


def make_network(hosts: list[Host]) -> None:
    """The bridge (the operator's address on it), one namespace per host joined by a veth
    pair. Named namespaces live under /run/netns: a tmpfs private to this mount namespace."""
    sh("mount", "--make-rprivate", "/")
    Path("/run/netns").mkdir(parents=True, exist_ok=True)
    sh("mount", "-t", "tmpfs", "tmpfs", "/run/netns")
    sh("ip", "link", "set", "lo", "up")
    sh("ip", "link", "add", BRIDGE, "type", "bridge")
    sh("ip", "addr", "add", f"{OPERATOR}/24", "dev", BRIDGE)
    sh("ip", "link", "set", BRIDGE, "up")
    for host in hosts:
        sh("ip", "netns", "add", host.ns)
        veth = f"veth-{host.name}"
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", host.ns)
        sh("ip", "link", "set", veth, "master", BRIDGE, "up")
        inside = ("ip", "netns", "exec", host.ns)
        sh(*inside, "ip", "addr", "add", f"{host.ip}/24", "dev", "eth0")
        sh(*inside, "ip", "link", "set", "eth0", "up")
        sh(*inside, "ip", "link", "set", "lo", "up")


def link(host: Host, up: bool) -> None:
    """Cut the host off the network (or restore it): its end of the veth pair."""
    sh("ip", "netns", "exec", host.ns, "ip", "link", "set", "eth0", "up" if up else "down")


def nats_urls(hosts: list[Host]) -> str:
    return ",".join(f"nats://{h.ip}:{NATS_PORT}" for h in hosts)


def base_env() -> dict[str, str]:
    """This environment without any asyncrl setting of the caller's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCRL_")}
    env.pop("NATS_URL", None)
    return env | {"COLUMNS": "10000", "PYTHONUNBUFFERED": "1", "_TYPER_STANDARD_TRACEBACK": "1"}


def host_env(host: Host, hosts: list[Host], scheduler: Host) -> dict[str, str]:
    """What a host's supervisor (and so its services) is told: where it keeps its files and
    credentials, which address it listens on and advertises, where the scheduler and the NATS
    nodes are, its route peers; replicas 3 and weights over NATS (no shared filesystem)."""
    others = [h for h in hosts if h is not host]
    return base_env() | {
        "ASYNCRL_VAR": str(host.var),
        "ASYNCRL_WEIGHTS": str(host.var / "weights"),
        "ASYNCRL_SECRETS": str(host.secrets),
        "ASYNCRL_BIND_HOST": "0.0.0.0",
        "ASYNCRL_ADVERTISE_HOST": host.ip,
        "ASYNCRL_SCHEDULER": f"{scheduler.ip}:{SCHEDULER_PORT}",
        "NATS_URL": nats_urls(hosts),
        "ASYNCRL_NATS_ROUTES": ",".join(f"{h.ip}:{ROUTE_PORT}" for h in others),
        "ASYNCRL_NATS_NAME": host.nats_name,
        "ASYNCRL_NATS_REPLICAS": "3",
        "ASYNCRL_WEIGHTS_TRANSPORT": "nats",
    }


def operator_env(hosts: list[Host], scheduler: Host) -> dict[str, str]:
    """The operator's CLI: the admin credentials of the scheduler's host, over the network."""
    return base_env() | {
        "ASYNCRL_SECRETS": str(scheduler.secrets),
        "ASYNCRL_SCHEDULER": f"{scheduler.ip}:{SCHEDULER_PORT}",
        "NATS_URL": nats_urls(hosts),
    }


def asyncrl(*args: str, env: dict[str, str], ns: str | None = None, timeout: float = 300):
    """Run the asyncrl CLI (in host namespace `ns`, or as the operator)."""
    argv = [sys.executable, "-m", "asyncrl.cli", *args]
    if ns:
        argv = ["ip", "netns", "exec", ns, *argv]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def secrets_commands(hosts: list[Host], scheduler: Host) -> list[tuple[Host, list[str]]]:
    """What makes every host's credentials, all run on the scheduler's host: `secrets init`
    (CA, its certificate for its address, token keys), then a bundle per other host: its own
    certificate, the tokens and NATS passwords of the services it runs, and what a NATS node
    needs (`--nats-node`). No CA key and no token signing key leaves the scheduler's host."""
    commands = [(scheduler, ["secrets", "init", "--host", scheduler.ip])]
    for host in hosts:
        if host is not scheduler:
            bundle = ["secrets", "bundle", host.ip, "--services", ",".join(host.services)]
            commands.append((host, [*bundle, "--nats-node", "--out", str(host.secrets)]))
    return commands


def make_secrets(hosts: list[Host], scheduler: Host) -> None:
    env = base_env() | {"ASYNCRL_SECRETS": str(scheduler.secrets)}
    for host, args in secrets_commands(hosts, scheduler):
        done = asyncrl(*args, env=env)
        if done.returncode:
            raise RuntimeError(f"{' '.join(args[:2])} {host.name}: {done.stdout}{done.stderr}")


def start_args(host: Host) -> list[str]:
    """The host's `asyncrl.supervisor start` arguments (what `make up SERVICES=...` runs)."""
    return ["start", "--services", ",".join(host.services)]


def supervisor(host: Host, env: dict[str, str], *args: str) -> subprocess.Popen:
    """`python -m asyncrl.supervisor ARGS --var <host var>` inside the host's namespace."""
    argv = ["ip", "netns", "exec", host.ns, sys.executable, "-m", "asyncrl.supervisor", *args]
    argv += ["--var", str(host.var)]
    log = open(host.root / "supervisor-cli.log", "ab")  # noqa: SIM115 (the child keeps it)
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def start_hosts(hosts: list[Host], scheduler: Host, timeout: float = 300) -> None:
    """Every host's `supervisor start` at once (the scheduler needs the NATS cluster to form,
    the cluster needs every node), then the extra rollout replicas."""
    procs = []
    for host in hosts:
        host.var.mkdir(parents=True, exist_ok=True)
        env = host_env(host, hosts, scheduler)
        procs.append((host, supervisor(host, env, *start_args(host))))
    deadline = time.monotonic() + timeout
    for host, proc in procs:
        code = proc.wait(max(1.0, deadline - time.monotonic()))
        if code:
            raise RuntimeError(f"host {host.name} did not start; see {host.root}")
    for host in hosts:
        if host.rollouts > 1:
            env = host_env(host, hosts, scheduler)
            if supervisor(host, env, "scale", "rollout", str(host.rollouts)).wait(120):
                raise RuntimeError(f"host {host.name}: scale rollout failed")


def restart_host(host: Host, hosts: list[Host], scheduler: Host) -> None:
    """The host boots again: its supervisor starts its services from the same directory."""
    env = host_env(host, hosts, scheduler)
    if supervisor(host, env, *start_args(host)).wait(300):
        raise RuntimeError(f"host {host.name} did not start again")
    if host.rollouts > 1:
        supervisor(host, env, "scale", "rollout", str(host.rollouts)).wait(120)


def processes(host: Host) -> list[dict]:
    """The host's supervised processes (its supervisor's state file)."""
    try:
        return json.loads((host.var / "run" / "state.json").read_text())["processes"]
    except (OSError, ValueError, KeyError):
        return []


def supervisor_pid(host: Host) -> int | None:
    try:
        return json.loads((host.var / "run" / "state.json").read_text())["supervisor_pid"]
    except (OSError, ValueError, KeyError):
        return None


def pid_of(host: Host, service: str, replica: int = 0) -> int | None:
    for p in processes(host):
        if (p["service"], p["replica"]) == (service, replica) and p["status"] == "running":
            return p["pid"]
    return None


def namespace_pids(host: Host) -> list[int]:
    done = sh("ip", "netns", "pids", host.ns, check=False)
    return [int(p) for p in done.stdout.split()]


def kill_host(host: Host) -> int:
    """Power off: SIGKILL every process in the host's namespace. Returns how many."""
    pids = namespace_pids(host)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(pids)


def stop_hosts(hosts: list[Host]) -> None:
    """`supervisor stop` on every host, then SIGKILL whatever is left in the namespaces."""
    procs = [supervisor(h, base_env(), "stop") for h in hosts]
    for proc in procs:
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
    for host in hosts:
        kill_host(host)
