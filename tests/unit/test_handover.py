"""The hand-over on a stop (asyncrl.supervisor.handover) between a Supervisor driven by the test
and real processes that run `serve` (a ServiceRuntime with nothing opened): a SIGTERM
the supervisor did not send starts a successor beside the process, which exits only once the
successor said ready; a stop from the supervisor, or while it stops, starts none."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import pytest

from asyncrl.proc import pid_alive
from asyncrl.supervisor import handover
from asyncrl.supervisor.daemon import SERVICES, Paths, Supervisor

PROBE = """
import pathlib, sys
from asyncrl.runtime import ServiceRuntime
from asyncrl.service_main import serve

async def start():
    runtime = ServiceRuntime("probe")
    pathlib.Path(sys.argv[1], f"started.{__import__('os').getpid()}").touch()
    return runtime

serve(start())
"""


@pytest.fixture
def sup(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCRL_INSECURE", "1")
    monkeypatch.delenv("ASYNCRL_CPU_AFFINITY", raising=False)
    s = Supervisor(Paths(tmp_path), list(SERVICES), 4222, 50051)
    s.paths.handover.mkdir(parents=True)
    s.paths.logs.mkdir()
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    monkeypatch.setattr(
        s, "command", lambda service, index=0: [sys.executable, str(script), str(tmp_path)]
    )
    yield s
    for group in s.replicas.values():
        for r in group:
            if r.proc is not None and r.proc.poll() is None:
                r.proc.kill()


def drive(sup: Supervisor, until, timeout: float = 60.0):
    """Run the supervisor's loop (without reconcile) until `until()` holds."""
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "timed out"
        sup.check()
        sup.check_handovers()
        time.sleep(0.02)


def started(sup: Supervisor, pid: int) -> bool:
    return (sup.paths.var / f"started.{pid}").exists()


def test_sigterm_not_from_the_supervisor_successor_first_then_the_old_process_exits(sup):
    r = sup.add_replica("reward")
    old = r.proc.pid
    drive(sup, lambda: started(sup, old))
    os.kill(old, signal.SIGTERM)
    drive(sup, lambda: r.proc.pid != old)
    assert pid_alive(old)  # serving on while the successor starts
    states = {(p["pid"], p["status"]) for p in (x.as_dict() for x in sup.replicas["reward"])}
    assert states == {(old, "handing over"), (r.proc.pid, "running")}
    drive(sup, lambda: len(sup.replicas["reward"]) == 1)  # the old one exited and was reaped
    assert started(sup, r.proc.pid) and pid_alive(r.proc.pid)
    assert (r.handovers, r.restarts) == (1, 0)
    assert not list(sup.paths.handover.glob(f"{old}.*"))


def test_stop_from_the_supervisor_no_successor(sup):
    r = sup.add_replica("reward")
    pid = r.proc.pid
    drive(sup, lambda: started(sup, pid))
    sup.stop_replica(r)
    drive(sup, lambda: not sup.replicas["reward"], timeout=10)
    assert not list(sup.paths.handover.glob("*.request"))
    assert not [p for p in sup.paths.var.glob("started.*") if p.name != f"started.{pid}"]


def test_sigterm_while_the_supervisor_stops_answered_no_successor(sup):
    r = sup.add_replica("rollout")
    pid = r.proc.pid
    drive(sup, lambda: started(sup, pid))
    sup.stopping = True
    os.kill(pid, signal.SIGTERM)
    started_at = time.monotonic()
    drive(sup, lambda: r.proc.poll() is not None, timeout=10)
    assert r.proc.pid == pid and r.proc.returncode == 0
    assert time.monotonic() - started_at < handover.ANSWER_S  # answered, not timed out


def test_announce_a_busy_predecessor_waits_until_serving(tmp_path):
    """The predecessor (this test's own pid: alive) marked busy: ready only once `serving()`."""
    me = handover.Handover(directory=tmp_path, pid=0, supervisor=0, predecessor=os.getpid())
    handover.write_marker(tmp_path, os.getpid(), "busy")
    serving = []

    async def go():
        task = asyncio.create_task(me.announce(lambda: bool(serving)))
        await asyncio.sleep(0.2)
        assert not (tmp_path / f"{os.getpid()}.ready").exists()
        serving.append(True)
        await asyncio.wait_for(task, 2)

    asyncio.run(go())
    assert (tmp_path / f"{os.getpid()}.ready").read_text() == "0"


def test_recent_work_busy_within_the_window_of_the_last_work():
    count = [2]
    work = handover.RecentWork(lambda: count[0], window_s=0.2)
    assert work() == 2 and work.busy()
    count[0] = 0
    assert work.busy()  # 2 groups a moment ago
    time.sleep(0.25)
    assert not work.busy()
    assert not handover.RecentWork(lambda: 0).busy()  # never had work
