"""The chaos scenarios: which fault, when, and how it is injected into a running `Run`.

Every fault hits at a version drawn from the run's seeded generator (`targets`) and is recorded
with `run.mark` (what, at_version, at_s); a run with several faults of one kind waits for the
next committed step after each before it injects the next one.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

from asyncrl.security import ensure_secrets
from asyncrl.settings import settings
from tests.chaos import poison

if TYPE_CHECKING:
    from tests.chaos.run import Run

KILLS = 3
"""kill -9 scenarios kill their service this many times in one run."""
ROLLOUT_STOP_S = 15.0
TRAINER_STOP_S = 13.0
PROXY_PORT = 50061
"""The lost-reply rollout binds 127.0.0.2:PORT and registers 127.0.0.1:PORT, the proxy."""

Inject = Callable[["Run", random.Random], Awaitable[None]]


def run_rng(seed: int, scenario: str) -> random.Random:
    """The generator of one run: the same seed and scenario draw the same fault points."""
    return random.Random(f"{seed}-{scenario}")


def targets(rng: random.Random, k: int, total_steps: int) -> list[int]:
    """k versions to inject at, one drawn in each of k equal slices of [2, total_steps - 4]
    (past the start, leaving steps to recover in), increasing."""
    lo, hi = 2, max(2, total_steps - 4)
    width = (hi - lo + 1) / k
    return [lo + int(i * width) + rng.randrange(max(1, int(width))) for i in range(k)]


async def kill(service: str, run: Run, rng: random.Random) -> None:
    for version in targets(rng, run.scenario.count, run.cfg.total_steps):
        if not await run.reach_in_time(version):
            return
        pid = await run.pid(service)
        os.kill(pid, signal.SIGKILL)
        fault = run.mark(f"kill -9 {service} (pid {pid})")
        if not await run.recovered(fault, service, pid):
            return


async def stop_rollout(run: Run, rng: random.Random) -> None:
    """SIGSTOP one of two rollouts for ROLLOUT_STOP_S (long enough for weight updates to be
    committed while it is frozen), then SIGCONT."""
    (version,) = targets(rng, 1, run.cfg.total_steps)
    if not await run.reach_in_time(version):
        return
    pid = await run.pid("rollout", 0)
    os.kill(pid, signal.SIGSTOP)
    fault = run.mark(f"SIGSTOP rollout-0 (pid {pid}) {ROLLOUT_STOP_S:.0f}s, SIGCONT")
    await asyncio.sleep(ROLLOUT_STOP_S)
    os.kill(pid, signal.SIGCONT)
    fault["versions_while_stopped"] = run.version - fault["at_version"]


async def stop_trainer(run: Run, rng: random.Random) -> None:
    """SIGSTOP the trainer for TRAINER_STOP_S, then kill -9 it (the supervisor restarts it)."""
    (version,) = targets(rng, 1, run.cfg.total_steps)
    if not await run.reach_in_time(version):
        return
    pid = await run.pid("trainer")
    os.kill(pid, signal.SIGSTOP)
    fault = run.mark(f"SIGSTOP trainer (pid {pid}) {TRAINER_STOP_S:.0f}s, then kill -9")
    await asyncio.sleep(TRAINER_STOP_S)
    os.kill(pid, signal.SIGKILL)
    await run.recovered(fault, "trainer", pid)


def start_proxy(run: Run) -> None:
    """The proxy serves TLS with the run's certificate: the secrets are made now (before `make
    up`, which keeps them)."""
    if not settings().insecure:
        ensure_secrets()
    run.proxy = run.spawn_helper(
        "-m",
        "tests.chaos.proxy",
        "--listen",
        f"127.0.0.1:{PROXY_PORT}",
        "--upstream",
        f"127.0.0.2:{PROXY_PORT}",
        log="proxy.log",
    )


def drops(run: Run) -> list[float]:
    """When the proxy lost a reply (unix seconds), from its log."""
    lines = (run.cfg.var / "proxy.log").read_text().splitlines()
    events = [json.loads(line) for line in lines if line.startswith("{")]
    return [e["t"] for e in events if e["event"] == "reply_dropped"]


async def lose_reply(run: Run, rng: random.Random) -> None:
    """KILLS times: arm the proxy (SIGUSR1); the next GenerateGroup reply, or the next
    GenerateGroups message that reports a published group (and the rest of its stream), is lost
    after the publish. The fault is marked when the proxy reports the loss."""
    for version in targets(rng, run.scenario.count, run.cfg.total_steps):
        if not await run.reach_in_time(version):
            return
        before = len(drops(run))
        run.proxy.send_signal(signal.SIGUSR1)
        for _ in range(600):  # a minute for the next group to come back
            if len(drops(run)) > before:
                break
            await asyncio.sleep(0.1)
        else:
            raise RuntimeError("the armed proxy lost no reply in 60s")
        run.mark("GenerateGroup(s) reply lost after publish")
        if not await run.advance():
            return


async def publish_poison(run: Run, rng: random.Random) -> None:
    """Each kind of poison once, at its own version."""
    versions = targets(rng, run.scenario.count, run.cfg.total_steps)
    for kind, version in zip(poison.KINDS, versions, strict=True):
        if not await run.reach_in_time(version):
            return
        what = await poison.publish(run.nats_url, run.experiment_id, kind, rng)
        run.mark(f"poison {kind}: {what}")


def _no_setup(run: Run) -> None:
    pass


@dataclass(frozen=True)
class Scenario:
    name: str
    fault: str
    inject: Inject
    count: int = 1
    """Faults per run (each at its own drawn version)."""
    rollouts: int = 1
    trainers: int = 1
    """Trainer replicas (`make scale SERVICE=trainer`), one per concurrent experiment."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of `make up` (e.g. the rollout's bind address)."""
    before_up: Callable[[Run], None] = _no_setup
    after_down: Callable[[Run], None] = _no_setup
    infrastructure: bool = True
    """An infrastructure fault: no prompt may end `failed` because of it."""
    expect_quarantined: int = 0
    """Bad messages the ledger must count as quarantined."""
    expect_replayed: int = 0
    """Replays of trained groups the trainer must report skipping (StepMetrics.replayed)."""
    sets: tuple[str, ...] = ()
    """Extra `--set` overrides of the submitted spec, after the run's own, so they win (e.g.
    its reward function)."""
    expect_failed_reasons: tuple[str, ...] = ()
    """The task fails some prompts: there must be some, each with one of these in its reason."""
    steps: int | None = None
    """trainer.total_steps of its runs, when not the suite's (`--steps`)."""
    max_stall_s: float | None = None
    """The longest the run may stall around a fault (`report.stall_s`); None: not judged."""


def _scenarios() -> dict[str, Scenario]:
    kills = [
        Scenario(s, f"kill -9 {s} x{KILLS}", partial(kill, s), count=KILLS)
        for s in ("rollout", "reward", "trainer", "scheduler", "nats")
    ]
    others = [
        Scenario("stop-rollout", "SIGSTOP 1 of 2 rollouts 15s", stop_rollout, rollouts=2),
        Scenario("stop-trainer", "SIGSTOP trainer 13s, kill -9", stop_trainer),
        Scenario(
            "lost-reply",
            f"GenerateGroup(s) reply lost x{KILLS}",
            lose_reply,
            count=KILLS,
            env={"ASYNCRL_ROLLOUT_ARGS": f"--host 127.0.0.2 --port {PROXY_PORT}"},
            before_up=start_proxy,
        ),
        Scenario(
            "poison",
            "poison: " + ", ".join(poison.KINDS),
            publish_poison,
            count=len(poison.KINDS),
            infrastructure=False,
            expect_quarantined=len(poison.KINDS) - 1,  # garbage, foreign, misaligned
            expect_replayed=1,
        ),
    ]
    from tests.chaos import scenarios_ck, scenarios_df, scenarios_rw  # noqa: PLC0415

    extra = (
        *scenarios_rw.scenarios(),
        *scenarios_ck.scenarios(),
        *scenarios_df.scenarios(Scenario),
    )
    from tests.chaos import scenarios_stop  # noqa: PLC0415

    extra = (*extra, *scenarios_stop.scenarios())
    from tests.chaos import scenarios_standby, scenarios_tenants  # noqa: PLC0415

    extra = (*extra, *scenarios_tenants.scenarios(Scenario), *scenarios_standby.scenarios())
    from tests.chaos import scenarios_bcast  # noqa: PLC0415

    extra = (*extra, *scenarios_bcast.scenarios())
    return {s.name: s for s in (*kills, *others, *extra)}


SCENARIOS = _scenarios()
