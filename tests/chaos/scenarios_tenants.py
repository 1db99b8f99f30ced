"""The chaos scenario of a shared fleet with tenants (issue 25, point 5 and acceptance 4).

- `tenants`: three LoRA experiments on one base, two of tenant `acme` (the run's own, share 1,
  and `acme-2`, share 2) and one of tenant `bcorp` (share 1), each submitted with an admin token
  of its tenant, each with its own trainer (3 trainer replicas), all sharing two rollout
  replicas (docs/lora.md, "Sharing a fleet"). In turn, each once all three have moved on from
  the fault before: `kill -9` rollout-0, `kill -9` the scheduler, and `kill -9` the trainer
  serving bcorp's experiment. After the scheduler's restart tenant isolation must still hold: a
  bcorp token gets NOT_FOUND for acme's experiment, which acme's token still sees.

Every experiment must complete with its ledger clean (`report.problems`: 0 lost, 0 trained
twice, 0 failed, steps x B trained). Each fault records, per experiment, its longest stall
(the longest gap between two versions from the fault to its recovery, `report.stall_s`), its
recovery and its median step before the fault; every experiment the fault did not hit
directly (all three for the rollout and the scheduler, the two others for bcorp's trainer) must
stall no longer than the fault's usual recovery (USUAL_RECOVERY_S) plus STEP_ALLOWANCE of its
own median steps. Everything goes to <var>/tenants.json too.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import psutil

from asyncrl.client import AsyncrlClient
from asyncrl.security import ensure_secrets
from asyncrl.settings import settings
from asyncrl.v1 import common_pb2
from tests.chaos import report
from tests.chaos.watch import POLL_S, TERMINAL, ExperimentWatch

if TYPE_CHECKING:
    from tests.chaos.run import Run
    from tests.chaos.scenarios import Scenario

STEPS = 120
"""Steps of the two experiments submitted in the scenario."""
OWN_STEPS = 180
"""Steps of the run's own experiment, which starts before the others (their submits, their
binding): 21-30 versions ahead of both at every fault on 2026-11-27, 118 of 120 at the last.
Long enough that all three still run at the third fault."""
LORA_SETS = (
    "trainer.lora.rank=4",
    "trainer.lora.alpha=8.0",
    "trainer.lora.target_modules=[q_proj, v_proj]",
    "share=1.0",
)
CAPACITY = 4
"""Group slots per rollout (2 x 4 = 8, divided 2 / 4 / 2 by shares 1:2:1): the shares bind."""
EXTRA = (("acme", "acme-2", 2.0), ("bcorp", "bcorp-1", 1.0))
"""(tenant, name, share) of the experiments besides the run's own (tenant acme, share 1)."""
VICTIM = "bcorp-1"
"""The experiment whose trainer is killed."""
USUAL_RECOVERY_S = {"rollout": 6.3, "trainer": 16.1, "scheduler": 7.2}
"""The slowest recovery of each kill with one experiment (docs/failures.md)."""
STEP_ALLOWANCE = 3
"""Steps of an experiment's own median step time allowed on top (the machine's load)."""


@dataclass
class Exp:
    name: str
    tenant: str
    watch: ExperimentWatch
    fates: dict = field(default_factory=dict)


def _token(run: Run, tenant: str) -> str:
    return str((run.cfg.var / f"{tenant}-admin.jwt").resolve())


def mint_tokens(run: Run) -> None:
    """An admin token per tenant (before `make up`, so nats-server's configuration has the
    tenants' users); the run's own experiment is submitted with acme's."""
    if not settings().insecure:
        ensure_secrets()
    for tenant in ("acme", "bcorp"):
        argv = ("secrets", "token", f"{tenant}-admin", "--role", "admin", "--tenant", tenant)
        done = run.sh(".venv/bin/asyncrl", *argv, "--out", _token(run, tenant))
        if done.returncode != 0:
            raise RuntimeError(f"minting {tenant}'s token failed: {done.stdout}{done.stderr}")
    run.submit_env["ASYNCRL_TOKEN_FILE"] = _token(run, "acme")


def as_tenant(run: Run, tenant: str, *args: str) -> subprocess.CompletedProcess:
    """The CLI with the tenant's admin token (the services and the run's own reads keep the
    operator's: a token in `make up`'s environment would be the services' too)."""
    env = {"ASYNCRL_TOKEN_FILE": _token(run, tenant)}
    return run.sh(".venv/bin/asyncrl", *args, timeout=120, env=env)


def submit(run: Run, tenant: str, name: str, share: float) -> str:
    from tests.chaos.run import ARITH  # noqa: PLC0415

    id_file = run.cfg.var / f"{name}.id"
    overrides = [*run.cfg.overrides(), *run.scenario.sets, f"trainer.total_steps={STEPS}"]
    overrides += [f"name={name}", f"share={share}"]
    sets = [a for o in overrides for a in ("--set", o)]
    done = as_tenant(run, tenant, "submit", str(ARITH), "--id-file", str(id_file), *sets)
    if done.returncode != 0:
        raise RuntimeError(f"submit of {name} failed: {done.stdout}{done.stderr}")
    return id_file.read_text().strip()


def step_s(timeline: list[tuple[float, int]], before: float) -> float | None:
    """The median time between two version changes before `before`."""
    times = [t for t, _ in timeline if t <= before]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return round(statistics.median(gaps), 2) if gaps else None


def peak(exp: Exp) -> int:
    return max((v for _, v in exp.watch.timeline), default=0)


def live(exps: list[Exp]) -> list[Exp]:
    return [e for e in exps if e.watch.state not in TERMINAL]


async def all_at(exps: list[Exp], version: int) -> bool:
    """Every experiment still running at `version` or past it (the slowest decides)."""
    return all(await asyncio.gather(*(e.watch.reach(version) for e in live(exps))))


async def all_on(exps: list[Exp], rng: random.Random) -> None:
    """The slowest running experiment 2-4 versions past its peak (the next fault's stall window
    starts in steady progress)."""
    await all_at(exps, min((peak(e) for e in live(exps)), default=0) + 2 + rng.randrange(3))


async def all_advance(exps: list[Exp]) -> None:
    """Every running experiment makes a version past every one it has shown."""
    await asyncio.gather(*(e.watch.reach(peak(e) + 1) for e in live(exps)))


async def ended(watch: ExperimentWatch) -> None:
    """Until the experiment ended, its tracker gave up on it (hung) or the run's time is up."""
    deadline = watch.t0 + watch.timeout_s
    while watch.state not in TERMINAL and time.time() < deadline:
        if any(e.startswith("hung") for e in watch.errors):
            return
        await asyncio.sleep(POLL_S)


async def replica_pid(run: Run, service: str, replica: int, old: int = 0) -> int:
    """The live pid of a replica other than `old` (waiting for its restart)."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        pid = await run.pid(service, replica, timeout=180)
        if pid != old:
            return pid
        await asyncio.sleep(POLL_S)
    raise RuntimeError(f"{service}-{replica} not restarted after 180s")


async def trainer_of(run: Run, experiment_id: str) -> tuple[int, int]:
    """(replica, pid) of the trainer replica bound to `experiment_id`: the scheduler's worker
    list names its address, the replica is the one listening on that port."""
    async with AsyncrlClient(run.scheduler, timeout_s=5.0) as client:
        workers = await client.workers()
    ports = {
        int(w.address.rsplit(":", 1)[1])
        for w in workers
        if w.kind == common_pb2.WORKER_KIND_TRAINER and w.experiment_id == experiment_id
    }
    for p in run.processes():
        if p["service"] != "trainer" or not p["pid"]:
            continue
        proc = psutil.Process(p["pid"])
        listening = {
            c.laddr.port
            for q in (proc, *proc.children(recursive=True))
            for c in q.net_connections("tcp")
        }
        if listening & ports:
            return p["replica"], p["pid"]
    raise RuntimeError(f"no trainer replica serves {experiment_id}: ports {ports}")


async def kill(run: Run, exps: list[Exp], kind: str, replica: int, pid: int, victim: str = ""):
    """kill -9, wait for the restart and for every experiment's new progress; record each
    experiment's stall and recovery around it."""
    at = {e.name: (e.watch.version, step_s(e.watch.timeline, e.watch.since())) for e in exps}
    running = len(live(exps))
    os.kill(pid, signal.SIGKILL)
    fault = run.mark(f"kill -9 {kind}-{replica} (pid {pid})", kind=kind, running=running)
    if running < len(exps):
        run.errors.append(f"{kind} kill hit {running} running experiments, not {len(exps)}")
    await replica_pid(run, kind, replica, old=pid)
    fault["back_s"] = round(run.since() - fault["at_s"], 2)
    await all_advance(exps)
    fault["experiments"] = {}
    for e in exps:
        version, step = at[e.name]
        mine = {"at_s": fault["at_s"], "at_version": version, "back_s": fault["back_s"]}
        mine["done_s"] = recovered_at(e.watch.timeline, mine)
        stall = report.stall_s(e.watch.timeline, mine)
        limit = USUAL_RECOVERY_S[kind] + STEP_ALLOWANCE * (step or 0.0)
        judged = e.name != victim and stall is not None
        fault["experiments"][e.name] = {
            "at_version": version,
            "step_s": step,
            "stall_s": stall,
            "recovery_s": report.recovery_s(e.watch.timeline, mine),
            "limit_s": round(limit, 2) if judged else None,
        }
        if judged and stall > limit:
            run.errors.append(f"{e.name} stalled {stall} s > {limit:.1f} s around {kind} kill")
    return fault


def recovered_at(timeline: list[tuple[float, int]], fault: dict) -> float | None:
    """When the experiment first passed every version it had shown until the killed service
    was back (`report.recovery_s`, unrounded: the end of the stall window)."""
    back = fault["at_s"] + fault["back_s"]
    peak = max([fault["at_version"], *(v for t, v in timeline if t <= back)])
    return next((t for t, v in timeline if t > back and v > peak), None)


def isolation(run: Run, exps: list[Exp]) -> dict:
    """After the scheduler's restart: bcorp's token gets NOT_FOUND for acme's experiment (the
    very answer of an id that does not exist), which acme's token still sees, and bcorp's own."""
    acme, bcorp = exps[0].watch.experiment_id, exps[2].watch.experiment_id
    foreign = as_tenant(run, "bcorp", "status", acme, "--json")
    own = as_tenant(run, "acme", "status", acme, "--json")
    other_own = as_tenant(run, "bcorp", "status", bcorp, "--json")
    seen = {
        "bcorp_sees_acme": foreign.returncode == 0,
        "bcorp_on_acme": (foreign.stdout + foreign.stderr).strip()[-200:],
        "acme_sees_acme": own.returncode == 0,
        "bcorp_sees_bcorp": other_own.returncode == 0,
    }
    if foreign.returncode == 0 or "NOT_FOUND" not in foreign.stdout + foreign.stderr:
        run.errors.append(f"isolation: bcorp's token on {acme}: {seen['bcorp_on_acme']}")
    if not (seen["acme_sees_acme"] and seen["bcorp_sees_bcorp"]):
        run.errors.append(f"isolation: a tenant lost its own experiment: {seen}")
    return seen


def judge(run: Run, exps: list[Exp]) -> None:
    """Each experiment's ledger judged as the run's own is (`report.problems`)."""
    for e in exps:
        args = (e.watch.experiment_id, "--json")
        ledger = run.sh(".venv/bin/asyncrl", "ledger", *args, timeout=120)
        status = run.sh(".venv/bin/asyncrl", "status", *args, timeout=120)
        try:
            led, st = json.loads(ledger.stdout), json.loads(status.stdout)
        except ValueError:
            run.errors.append(f"{e.name}: no ledger/status: {ledger.stderr}{status.stderr}")
            continue
        row = report.make_row(
            {"faults": [], "timeline": e.watch.timeline, "batch_size": run.cfg.batch_size},
            led,
            st,
        )
        keys = ("state", "steps", "trained", "lost", "trained_twice", "failed", "in_flight")
        e.fates = {k: row[k] for k in (*keys, "trained_groups", "expected_groups")}
        run.errors.extend(f"{e.name}: {p}" for p in report.problems(row))


async def faults(run: Run, exps: list[Exp], rng: random.Random) -> None:
    """rollout-0, the scheduler, bcorp's trainer, each once all three moved on from the last.

    The trainer comes last: while bcorp's trainer recovers (39 s idle, up to 127 s under load)
    acme's two go on at their rate, and a fault after it found one of them finished (`make
    chaos`, scenarios side by side, 2026-11-27). A rollout or scheduler kill stalls all three
    alike, so none runs ahead of the others before the trainer's."""
    if not await all_at(exps, 3 + rng.randrange(3)):
        raise RuntimeError("the experiments ended or stalled before the first fault")
    await kill(run, exps, "rollout", 0, await run.pid("rollout", 0))
    await all_on(exps, rng)
    fault = await kill(run, exps, "scheduler", 0, await run.pid("scheduler"))
    fault["isolation"] = await asyncio.to_thread(isolation, run, exps)
    await all_on(exps, rng)
    victim = next(e for e in exps if e.name == VICTIM)
    replica, pid = await trainer_of(run, victim.watch.experiment_id)
    await kill(run, exps, "trainer", replica, pid, victim=VICTIM)


async def tenants(run: Run, rng: random.Random) -> None:
    exps = [Exp(name="acme-1", tenant="acme", watch=run)]
    ids = await asyncio.gather(*(asyncio.to_thread(submit, run, *extra) for extra in EXTRA))
    for (tenant, name, _), experiment_id in zip(EXTRA, ids, strict=True):
        watch = ExperimentWatch(run.scheduler, run.cfg.timeout_s, run.cfg.stall_s)
        watch.experiment_id, watch.t0 = experiment_id, run.t0  # one clock for every timeline
        exps.append(Exp(name=name, tenant=tenant, watch=watch))
    trackers = [asyncio.create_task(e.watch.track()) for e in exps[1:]]
    try:
        await faults(run, exps, rng)
    finally:
        done = await asyncio.gather(
            *(asyncio.wait_for(t, run.cfg.timeout_s) for t in trackers), return_exceptions=True
        )
        run.errors.extend(
            f"{e.name}: not ended: {d!r}" for e, d in zip(exps[1:], done, strict=True) if d
        )
        for e in exps[1:]:
            run.errors.extend(f"{e.name}: {x}" for x in e.watch.errors)
        await ended(run)  # the run's own, tracked by the run: to its end
        await asyncio.to_thread(judge, run, exps)
        write_summary(run, exps)


def write_summary(run: Run, exps: list[Exp]) -> None:
    summary = {
        "experiments": {
            e.name: {"id": e.watch.experiment_id, "tenant": e.tenant, **e.fates} for e in exps
        },
        "faults": run.faults,
        "timelines": {e.name: e.watch.timeline for e in exps},
        "errors": run.errors,
    }
    if run.faults:
        run.faults[-1]["ledgers"] = summary["experiments"]
    (run.cfg.var / "tenants.json").write_text(json.dumps(summary, indent=1) + "\n")


def scenarios(scenario: type[Scenario]) -> list[Scenario]:
    shared = scenario(
        "tenants",
        "3 LoRA exps, 2 tenants, 2 shared rollouts: kill -9 rollout, scheduler, a trainer",
        tenants,
        count=3,
        rollouts=2,
        trainers=3,
        env={"ASYNCRL_ROLLOUT_ENGINE": "torch", "ASYNCRL_ROLLOUT_ARGS": f"--capacity {CAPACITY}"},
        before_up=mint_tokens,
        sets=LORA_SETS,
        steps=OWN_STEPS,
    )
    return [shared]
