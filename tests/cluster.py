"""A local asyncrl cluster driven through the supervisor (the `make up` entry point), for
integration and end-to-end tests. Free ports, a temporary var dir, and no process left behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from asyncrl.client import AsyncrlClient
from asyncrl.net import free_port
from asyncrl.supervisor import pid_alive
from asyncrl.v1 import common_pb2

ROOT = Path(__file__).resolve().parents[1]
FRESH_S = 5.0  # a worker heartbeating within this many seconds counts as alive


DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")


class Cluster:
    def __init__(self, var: Path):
        self.var = var
        self.nats_port = free_port()
        self.scheduler_port = free_port()
        # an in-process megatron test leaves MASTER_PORT (its gloo group's) in this process's
        # environment: a trainer started here must pick its own
        inherited = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
        self.env = {
            **inherited,
            "ASYNCRL_NATS_PORT": str(self.nats_port),
            "ASYNCRL_SCHEDULER_PORT": str(self.scheduler_port),
        }
        self.seen_pids: set[int] = set()
        self.log_marks: dict[str, int] = {}

    def mark_logs(self) -> None:
        """`events` reads only what the service logs get from now on (a shared cluster: what
        the tests before wrote is theirs)."""
        self.log_marks = {p.name: p.stat().st_size for p in (self.var / "log").glob("*.log")}

    def events(self, service: str, event: str, replica: int | None = None) -> list[dict]:
        """The JSON log lines of `event` that `service`'s replicas (or `replica` alone) wrote
        since `mark_logs`, replica by replica."""
        pattern = f"{service}-{'*' if replica is None else replica}.log"
        found = []
        for path in sorted((self.var / "log").glob(pattern)):
            with path.open("rb") as f:
                f.seek(self.log_marks.get(path.name, 0))
                found += parse_events(f.read().decode(errors="replace"), event)
        return found

    @property
    def scheduler(self) -> str:
        return f"127.0.0.1:{self.scheduler_port}"

    def sup(self, *args: str, timeout: float = 150) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "asyncrl.supervisor", *args, "--var", str(self.var)],
            env=self.env,
            cwd=ROOT,  # the services (and a launched SGLang fake: tests.fakes) import from here
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def state(self) -> dict:
        state = json.loads((self.var / "run" / "state.json").read_text())
        self.seen_pids |= {p["pid"] for p in state["processes"] if p["pid"]}
        self.seen_pids.add(state["supervisor_pid"])
        return state

    def procs(self, service: str) -> list[dict]:
        return [p for p in self.state()["processes"] if p["service"] == service]

    def reward_workers(self) -> list:
        return self.workers(common_pb2.WORKER_KIND_REWARD)

    def workers(self, kind: int | None = None) -> list:
        async def go():
            async with AsyncrlClient(self.scheduler) as client:
                return await client.workers()

        now = time.time()
        return [
            w
            for w in asyncio.run(go())
            if (kind is None or w.kind == kind) and now - w.last_seen_unix < FRESH_S
        ]

    def kill_all(self) -> None:
        """Stop the supervisor and SIGKILL anything it started that is still alive."""
        try:
            self.sup("stop", timeout=60)
        except subprocess.TimeoutExpired:
            pass
        for pid in self.seen_pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def parse_events(text: str, event: str) -> list[dict]:
    """The JSON log lines of `event` in a service log's `text` (other lines are skipped)."""
    found = []
    for line in text.splitlines():
        if f'"{event}"' not in line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == event:
            found.append(record)
    return found


def wait_for(pred, timeout: float = 60.0, interval: float = 0.25):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met in {timeout}s")
