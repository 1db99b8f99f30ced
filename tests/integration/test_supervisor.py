"""The local supervisor (`make up`) with a reduced service set: nats + scheduler + reward, and
metrics ports from ASYNCRL_METRICS_PORT; then its process handling on its own (psutil): killing
trees across sessions, zombies, `stop` of a daemon that ignores SIGTERM, settings from the
environment.

One supervisor per module (starting it costs seconds); the cluster tests run in file order and
the last one stops it. The module fixture stops it again and kills leftovers whatever happens.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from subprocess import PIPE

import jwt
import psutil
import pytest
from typer.testing import CliRunner

from asyncrl.cli import app as cli_app
from asyncrl.net import free_port
from asyncrl.proc import kill_tree
from asyncrl.security import Credentials
from asyncrl.supervisor import Paths, pid_alive, port_in_use
from asyncrl.supervisor.commands import app as sup_app
from asyncrl.supervisor.commands import use_secrets
from tests.cluster import Cluster, wait_for

SERVICES = "scheduler,reward"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("var"))
    c.metrics_port = free_port()  # the scheduler's; reward has none
    c.env["ASYNCRL_METRICS_PORT"] = str(c.metrics_port)
    c.started = c.sup("start", "--services", SERVICES, "--timeout", "120")
    yield c
    c.sup("stop")
    for pid in c.seen_pids:  # never leave processes behind, even when a test failed
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_start_reduced_services_returns_healthy(cluster):
    assert cluster.started.returncode == 0, cluster.started.stdout + cluster.started.stderr
    assert "asyncrl is up" in cluster.started.stdout
    assert len(cluster.reward_workers()) == 1


def test_start_again_while_running_says_so_exit_0(cluster):
    again = cluster.sup("start", "--services", SERVICES)
    assert again.returncode == 0
    assert "already running" in again.stdout


def test_ps_lists_nats_scheduler_reward_running(cluster):
    result = cluster.sup("ps")
    assert result.returncode == 0
    for name in ("nats", "scheduler", "reward"):
        assert name in result.stdout
    state = cluster.state()
    assert [(p["service"], p["status"]) for p in state["processes"]] == [
        ("nats", "running"),
        ("scheduler", "running"),
        ("reward", "running"),
    ]
    assert all(pid_alive(p["pid"]) for p in state["processes"])
    assert Path(cluster.procs("reward")[0]["log"]).name == "reward-0.log"


def test_ps_metrics_base_scheduler_gets_base_port_and_serves_it(cluster):
    state = cluster.state()
    ports = {p["service"]: p["metrics_port"] for p in state["processes"]}
    assert ports == {"nats": None, "scheduler": cluster.metrics_port, "reward": None}
    table = cluster.sup("ps").stdout
    assert "metrics" in table and str(cluster.metrics_port) in table
    url = f"https://127.0.0.1:{cluster.metrics_port}/metrics"  # TLS, with the cluster's CA
    tls = Credentials.load("viewer").client_ssl_context()
    text = wait_for(lambda: urllib.request.urlopen(url, timeout=5, context=tls).read().decode())
    assert 'asyncrl_scheduler_workers{kind="reward"}' in text


def test_cli_workers_and_bad_spec_against_real_scheduler(cluster, tmp_path):
    runner = CliRunner()
    result = runner.invoke(cli_app, ["--scheduler", cluster.scheduler, "workers"])
    assert result.exit_code == 0, result.output
    assert "reward" in result.output
    spec = tmp_path / "spec.yaml"
    spec.write_text("model: {path: /nope}\ndataset: {path: /nope.jsonl}\n")
    # valid to the CLI's own check; the scheduler finds the files missing
    result = runner.invoke(cli_app, ["--scheduler", cluster.scheduler, "submit", str(spec)])
    assert result.exit_code == 2
    assert "INVALID_ARGUMENT" in result.output and "dataset.path" in result.output
    # caught by the CLI before anything is sent
    result = runner.invoke(
        cli_app, ["--scheduler", cluster.scheduler, "submit", str(spec), "--set", "trainer.lr=-1"]
    )
    assert result.exit_code == 2 and "bad spec: trainer.lr" in result.output


def test_killed_reward_process_is_restarted(cluster):
    old = cluster.procs("reward")[0]
    os.kill(old["pid"], signal.SIGKILL)
    new = wait_for(
        lambda: next(
            (p for p in cluster.procs("reward") if p["restarts"] == 1 and p["status"] == "running"),
            None,
        )
    )
    assert new["pid"] != old["pid"] and pid_alive(new["pid"])
    assert new["last_exit"] == -signal.SIGKILL

    # the new process registers itself (its scoring processes started first); the dead one
    # stops heartbeating: one list, read once per poll
    def only_the_new_one() -> bool:
        listed = cluster.reward_workers()
        return len(listed) == 1 and listed[0].last_seen_unix > new["started_at"]

    wait_for(only_the_new_one)


def test_scale_reward_2_then_1_workers_follow(cluster):
    result = cluster.sup("scale", "reward", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert [p["replica"] for p in cluster.procs("reward")] == [0, 1]
    wait_for(lambda: len(cluster.reward_workers()) == 2)

    survivor = cluster.procs("reward")[0]
    newest = cluster.procs("reward")[1]
    result = cluster.sup("scale", "reward", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert [p["pid"] for p in cluster.procs("reward")] == [survivor["pid"]]
    wait_for(lambda: not pid_alive(newest["pid"]), timeout=20)
    wait_for(lambda: len(cluster.reward_workers()) == 1)


def _scoring_processes(pid: int) -> int:
    """The reward process's pool: its forkserver and the workers forked from it."""
    tree = psutil.Process(pid).children(recursive=True)
    return sum("multiprocessing.forkserver" in " ".join(p.cmdline()) for p in tree)


def test_sigterm_reward_successor_registered_before_the_old_one_leaves(cluster):
    """A SIGTERM the supervisor did not send: the scheduler lists a reward worker at every poll
    (the successor registers while the old one serves), then only the successor's. Once the
    successor is listed its scoring processes run (forkserver + one per core, at most 4, and
    the spares): its first pooled items wait for no pool to start (2-8 s on the loaded
    machine)."""
    old = next(p for p in cluster.procs("reward") if p["status"] == "running")
    before = {w.address for w in cluster.reward_workers()}
    os.kill(old["pid"], signal.SIGTERM)
    counts, pool = [], None
    deadline = time.monotonic() + 60  # a poll takes 20-100 ms: a count of polls is no clock
    while pid_alive(old["pid"]):
        counts.append(len(cluster.reward_workers()))
        if counts[-1] == 2 and pool is None:
            [succ] = [p for p in cluster.procs("reward") if p["pid"] != old["pid"]]
            pool = _scoring_processes(succ["pid"])
        assert time.monotonic() < deadline, "the old reward process did not exit in 60 s"
    assert min(counts) >= 1 and max(counts) == 2, counts
    assert pool >= 1 + min(4, os.cpu_count() or 1)  # the share's processes (spares may be up too)
    wait_for(lambda: len(cluster.reward_workers()) == 1)
    [after] = cluster.reward_workers()
    assert after.address not in before
    [new] = [p for p in cluster.procs("reward") if p["status"] == "running"]
    assert new["pid"] != old["pid"] and new["handovers"] == old["handovers"] + 1


def test_restart_reward_lists_a_reward_worker_at_every_poll_and_replaces_it(cluster):
    """`restart reward` (make restart): the replica is replaced successor first, as on a
    SIGTERM not from the supervisor; the command returns once the old process exited."""
    [old] = [p for p in cluster.procs("reward") if p["status"] == "running"]
    counts: list[int] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            counts.append(len(cluster.reward_workers()))

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        result = cluster.sup("restart", "reward")
    finally:
        done.set()
        poller.join()
    assert result.returncode == 0, result.stdout + result.stderr
    [new] = [p for p in cluster.procs("reward") if p["status"] == "running"]
    assert f"reward-0: pid {old['pid']} -> {new['pid']}" in result.stdout
    assert not pid_alive(old["pid"]) and new["handovers"] == old["handovers"] + 1
    # never none listed (the two overlap ~0.1-0.3 s: a poll under load may not see both)
    assert counts and min(counts) >= 1, counts
    assert cluster.sup("restart", "nats").returncode != 0  # not a service it replaces


def _secret_values(secrets: Path) -> list[str]:
    """Every secret in the directory: NATS passwords, tokens, and the private keys' PEM bodies."""
    values = [f.read_text().strip() for f in (secrets / "nats").glob("*.password")]
    values += [f.read_text().strip() for f in (secrets / "tokens").glob("*.jwt")]
    for key in secrets.glob("*.key"):
        values += [line for line in key.read_text().splitlines() if "-----" not in line]
    return values


def test_ps_logs_state_and_process_args_show_no_secret_replica_has_own_token(cluster):
    secrets = Path(os.environ["ASYNCRL_SECRETS"])
    # the supervisor's state can still list a process that just exited (the predecessor of a
    # hand-over, on a loaded machine): read it once every listed process is alive
    wait_for(lambda: all(pid_alive(p["pid"]) for p in cluster.state()["processes"]))
    state = cluster.state()
    shown = {
        "ps": cluster.sup("ps").stdout,
        "ps --json": cluster.sup("ps", "--json").stdout,
        "logs": cluster.sup("logs", "--lines", "1000").stdout,
        "state.json": (cluster.var / "run" / "state.json").read_text(),
    }
    for p in state["processes"]:
        proc = psutil.Process(p["pid"])
        shown[f"{p['service']} argv"] = " ".join(proc.cmdline())
        shown[f"{p['service']} environment"] = json.dumps(proc.environ())
    values = _secret_values(secrets)
    assert len(values) >= 10
    leaks = [(where, v[:6]) for where, text in shown.items() for v in values if v in text]
    assert leaks == []
    reward = psutil.Process(cluster.procs("reward")[0]["pid"]).environ()
    token_file = Path(reward["ASYNCRL_TOKEN_FILE"])
    assert token_file == secrets / "tokens" / "reward-0.jwt"
    claims = jwt.decode(token_file.read_text(), options={"verify_signature": False})
    assert (claims["sub"], claims["role"]) == ("reward-0", "reward")


def test_scale_scheduler_refused(cluster):
    result = cluster.sup("scale", "scheduler", "2")
    assert result.returncode != 0
    assert "exactly one" in result.stdout + result.stderr


def test_stop_leaves_no_process_behind(cluster):
    state = cluster.state()
    result = cluster.sup("stop")
    assert result.returncode == 0 and "stopped" in result.stdout
    pids = {p["pid"] for p in state["processes"]} | cluster.seen_pids
    assert not [pid for pid in pids if pid_alive(pid)]
    for pid in {p["pid"] for p in state["processes"]}:  # no stragglers in their groups either
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)
    assert not port_in_use(cluster.nats_port) and not port_in_use(cluster.scheduler_port)
    assert "not running" in cluster.sup("ps").stdout


# ---------------------------------------------------------------- process trees (psutil)

CHAIN = """
import os, signal, subprocess, sys, time
leaf_file, depth, ignore_term = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
if ignore_term:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if depth:
    subprocess.Popen([sys.executable, __file__, leaf_file, str(depth - 1), "0"],
                     start_new_session=True)
else:
    open(leaf_file + ".tmp", "w").write(str(os.getpid()))
    os.replace(leaf_file + ".tmp", leaf_file)
time.sleep(300)
"""


@pytest.fixture
def chain(tmp_path):
    """Start a chain of processes, each in a session of its own (as torchrun starts its ranks):
    returns (root Popen, leaf pid). Whatever is left of it is SIGKILLed afterwards."""
    script = tmp_path / "chain.py"
    script.write_text(CHAIN)
    started: list[psutil.Process] = []

    def start(depth: int, ignore_term: bool = False) -> tuple[subprocess.Popen, int]:
        leaf_file = tmp_path / f"leaf-{len(started)}.pid"
        args = [sys.executable, str(script), str(leaf_file), str(depth), str(int(ignore_term))]
        root = subprocess.Popen(args, start_new_session=True)
        started.append(psutil.Process(root.pid))
        leaf = int(wait_for(lambda: leaf_file.exists() and leaf_file.read_text()))
        started.extend(psutil.Process(root.pid).children(recursive=True))
        return root, leaf

    yield start
    for p in started:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def test_kill_tree_reaches_a_grandchild_in_another_session(chain):
    """What the supervisor does to a replica past its grace period: torchrun starts each rank
    in a new session, out of reach of a signal to torchrun's process group; found by parent pid,
    every level below is killed."""
    root, leaf = chain(depth=2)
    assert len({os.getsid(root.pid), os.getsid(psutil.Process(leaf).ppid()), os.getsid(leaf)}) == 3
    kill_tree(root.pid)
    assert root.wait(10) == -signal.SIGKILL
    wait_for(lambda: not pid_alive(leaf), timeout=10)


def test_pid_alive_exited_unreaped_child_false_until_reaped():
    """A zombie (exited, its parent has not waited for it yet) counts as dead."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=PIPE)
    assert pid_alive(proc.pid)
    proc.stdin.close()
    wait_for(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE, timeout=10)
    assert not pid_alive(proc.pid)
    assert proc.wait(10) == 0
    assert not pid_alive(proc.pid)


def test_stop_supervisor_ignoring_sigterm_killed_with_its_whole_tree(chain, tmp_path):
    """`stop` past its timeout kills the daemon and everything below it, a grandchild in
    another session included (a rank of a torchrun trainer)."""
    daemon, leaf = chain(depth=2, ignore_term=True)
    paths = Paths(tmp_path / "var")
    paths.run.mkdir(parents=True)
    paths.pidfile.write_text(str(daemon.pid))
    result = CliRunner().invoke(sup_app, ["stop", "--var", str(paths.var), "--timeout", "1"])
    assert result.exit_code == 0, result.output
    assert "killing it" in result.output and "asyncrl stopped" in result.output
    assert daemon.wait(10) == -signal.SIGKILL
    wait_for(lambda: not pid_alive(leaf), timeout=10)
    assert not paths.pidfile.exists()


def test_start_env_sets_port_defaults_flag_wins(tmp_path, monkeypatch):
    """ASYNCRL_NATS_PORT / ASYNCRL_SCHEDULER_PORT set the defaults; --nats-port overrides
    its variable, so the busy port `start` refuses is the scheduler's."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        monkeypatch.setenv("ASYNCRL_NATS_PORT", str(port))
        monkeypatch.setenv("ASYNCRL_SCHEDULER_PORT", str(port))
        args = ["start", "--var", str(tmp_path), "--nats-port", str(free_port())]
        result = CliRunner().invoke(sup_app, args)
    assert result.exit_code == 1, result.output
    assert f"port {port} (scheduler) is already in use" in result.output
    assert not (tmp_path / "run").exists()  # refused before anything was started


def test_start_without_asyncrl_secrets_uses_var_secrets_for_itself_and_daemon(
    tmp_path, monkeypatch
):
    """`start --var X` makes X/secrets and points ASYNCRL_SECRETS there, so its own readiness
    checks and the daemon's services present the credentials of this cluster."""
    monkeypatch.delenv("ASYNCRL_SECRETS")
    use_secrets(tmp_path / "var")
    secrets = tmp_path / "var" / "secrets"
    assert os.environ["ASYNCRL_SECRETS"] == str(secrets.resolve())
    assert (secrets / "ca.pem").exists() and (secrets / "tokens" / "admin.jwt").exists()
    assert oct(secrets.stat().st_mode & 0o777) == "0o700"
