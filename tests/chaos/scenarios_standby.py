"""The chaos scenario of a standby scheduler (services/scheduler/leadership.py):

- `standby-scheduler`: `make up` with a standby scheduler (ASYNCRL_SCHEDULER_STANDBY=1; every
  client, the CLI and this run's watcher included, dials both addresses). KILLS times, at
  drawn versions, kill -9 the active one (the one that serves its port). The standby takes the
  lease over and resumes the experiment from NATS KV; the supervisor starts the killed one
  again, as the new standby. Each fault records `progress_s` (the first new version after the
  kill, seconds after it), `active_s` (the other scheduler serves) and `standby_s` (the killed
  one is back, waiting); the run fails when it stalled more than MAX_STALL_S (the issue's goal:
  experiments progress again within 10 s of the kill -9), and, as every run, on any group the
  ledger finds lost or trained twice.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from typing import TYPE_CHECKING

from tests.chaos.scenarios import KILLS, Scenario, targets
from tests.chaos.scenarios_df import step_s

if TYPE_CHECKING:
    from tests.chaos.run import Run

MAX_STALL_S = 10.0
STEPS = 120
"""A takeover costs the lease (3 s) and a resume, at ~0.26 s a step: three need more than the
suite's 30 steps."""
BOTH = "127.0.0.1:50051,127.0.0.1:50052"
ROLE_TIMEOUT_S = 120.0


def roles(run: Run) -> dict[str, int]:
    """The live schedulers' pids by role (`active`, `standby`), from the supervisor's state."""
    return {
        p["role"]: p["pid"]
        for p in run.processes()
        if p["service"] == "scheduler" and p["status"] == "running" and p.get("role")
    }


async def _roles_settled(run: Run, killed: int, fault: dict, started: float) -> bool:
    """Wait until another scheduler is active (`active_s`) and one other than `killed` waits
    as standby (`standby_s`)."""
    while time.monotonic() - started < ROLE_TIMEOUT_S:
        now = roles(run)
        at = round(time.monotonic() - started, 2)
        if "active_s" not in fault and now.get("active") not in (None, killed):
            fault["active_s"] = at
        if "active_s" in fault and now.get("standby") not in (None, killed):
            fault["standby_s"] = at
            return True
        await asyncio.sleep(0.1)
    run.errors.append(f"schedulers not active + standby {ROLE_TIMEOUT_S:.0f}s after kill -9")
    return False


async def kill_active(run: Run, rng: random.Random) -> None:
    for version in targets(rng, run.scenario.count, run.cfg.total_steps):
        if not await run.reach_in_time(version):
            return
        before = roles(run)
        if set(before) != {"active", "standby"}:
            run.errors.append(f"no active + standby scheduler before the kill: {before}")
            return
        pid = before["active"]
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        fault = run.mark(f"kill -9 active scheduler (pid {pid})", step_s=step_s(run))
        settled = asyncio.create_task(_roles_settled(run, pid, fault, started))
        went_on = await run.advance()
        if went_on:
            fault["done_s"] = run.timeline[-1][0]
            fault["progress_s"] = round(fault["done_s"] - fault["at_s"], 2)
        if not await settled or not went_on:
            return


def scenarios() -> list[Scenario]:
    return [
        Scenario(
            "standby-scheduler",
            f"kill -9 the active of 2 schedulers x{KILLS}",
            kill_active,
            count=KILLS,
            env={"ASYNCRL_SCHEDULER_STANDBY": "1", "ASYNCRL_SCHEDULER": BOTH},
            steps=STEPS,
            max_stall_s=MAX_STALL_S,
        )
    ]
