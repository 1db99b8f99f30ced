"""One chaos run, inside its own network namespace (started by `python -m tests.chaos`):

    python -m tests.chaos.run --scenario trainer --var var/chaos/trainer --task var/chaos/task

`make up` with the run's var dir on the namespace's own loopback (default ports: nothing else
is there), the arith experiment submitted with `asyncrl submit --id-file`, the scenario's
faults injected at seeded random versions while a poller records the version timeline, the
wait for COMPLETED/FAILED (or the timeout), `asyncrl ledger ID --json` and `asyncrl status ID
--json`, and `make down`. Everything it learned goes to <var>/result.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from asyncrl.proc import pid_alive
from tests.chaos.scenarios import SCENARIOS, Scenario, run_rng
from tests.chaos.watch import POLL_S, ExperimentWatch

ROOT = Path(__file__).resolve().parents[2]
NATS_URL = "nats://127.0.0.1:4222"
SCHEDULER = "127.0.0.1:50051"
ARITH = ROOT / "examples" / "arith" / "experiment.yaml"


@dataclass(frozen=True)
class RunConfig:
    scenario: str
    var: Path
    task: Path
    """Built by `python -m examples.arith.build --out <task>/model`."""
    seed: int = 0
    total_steps: int = 30
    batch_size: int = 4
    n_samples: int = 8
    timeout_s: float = 600.0
    """Submit to the end of the experiment, at most."""
    stall_s: float = 150.0
    """A run whose version has not moved for this long is hung: stop waiting."""

    def overrides(self) -> list[str]:
        t = self.task.resolve()
        return [
            f"name=chaos-{self.scenario}",
            f"seed={self.seed}",
            f"model.path={t / 'model'}",
            f"dataset.path={t / 'train.jsonl'}",
            f"eval.dataset_path={t / 'eval.jsonl'}",
            "eval.max_prompts=16",
            "eval.every_versions=0",
            "trainer.backend=torch",
            f"trainer.total_steps={self.total_steps}",
            f"trainer.batch_size={self.batch_size}",
            "trainer.checkpoint_every=4",
            f"rollout.n_samples={self.n_samples}",
            "rollout.max_head_offpolicyness=2",
            "rollout.filter=none",
        ]


class Run(ExperimentWatch):
    """The cluster of one run and what the run saw of it."""

    def __init__(self, cfg: RunConfig, scenario: Scenario):
        # a scenario with a standby scheduler dials both (its ASYNCRL_SCHEDULER)
        super().__init__(
            scenario.env.get("ASYNCRL_SCHEDULER", SCHEDULER), cfg.timeout_s, cfg.stall_s
        )
        self.cfg = cfg
        self.scenario = scenario
        self.env = {
            k: v for k, v in os.environ.items() if not k.startswith("ASYNCRL_") and k != "NATS_URL"
        } | {"COLUMNS": "10000", "NATS_URL": NATS_URL, "ASYNCRL_SCHEDULER": self.scheduler}
        self.env |= scenario.env
        # the run's `make up` makes <var>/secrets; the CLI it runs and this process's own
        # clients (the tracker, the poison) present the credentials found there
        secrets = str((cfg.var / "secrets").resolve())
        self.env["ASYNCRL_SECRETS"] = os.environ["ASYNCRL_SECRETS"] = secrets
        self.seen_pids: set[int] = set()
        self.helpers: list[subprocess.Popen] = []
        self.nats_url = NATS_URL
        self.proxy: subprocess.Popen | None = None
        self.skipped: list[str] = []
        self.submit_env: dict[str, str] = {}
        """Extra environment of the run's `asyncrl submit` only (a tenant's token), not of the
        services `make up` starts."""

    # ------------------------------------------------------------ processes

    def sh(
        self, *argv: str, timeout: float = 300, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        env = self.env | (env or {})
        return subprocess.run(
            argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )

    def make(self, *args: str) -> subprocess.CompletedProcess:
        return self.sh("make", "--no-print-directory", *args, f"VAR={self.cfg.var}")

    def supervisor_pid(self) -> int:
        return json.loads((self.cfg.var / "run" / "state.json").read_text())["supervisor_pid"]

    def processes(self) -> list[dict]:
        state = json.loads((self.cfg.var / "run" / "state.json").read_text())
        self.seen_pids |= {p["pid"] for p in state["processes"] if p["pid"]}
        self.seen_pids.add(state["supervisor_pid"])
        return state["processes"]

    async def pid(self, service: str, replica: int = 0, timeout: float = 60) -> int:
        """The live pid of a replica (waiting for it to be running again after a restart)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self.processes():
                if (p["service"], p["replica"]) == (service, replica) and p["status"] == "running":
                    if p["pid"] and pid_alive(p["pid"]):
                        return p["pid"]
            await asyncio.sleep(POLL_S)
        raise RuntimeError(f"{service}-{replica} not running after {timeout}s")

    def spawn_helper(self, *args: str, log: str) -> subprocess.Popen:
        """A process of the run's own (the lost-reply proxy), stopped at `down`."""
        with open(self.cfg.var / log, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, *args], cwd=ROOT, env=self.env, stdout=out, stderr=out
            )
        self.helpers.append(proc)
        return proc

    # ------------------------------------------------------------ the run's steps

    def up(self) -> None:
        self.cfg.var.mkdir(parents=True, exist_ok=True)
        self.scenario.before_up(self)
        started = self.make("-o", "venv", "-o", "protos", "up")  # built once, before the runs
        if started.returncode != 0:
            raise RuntimeError(f"make up failed: {started.stdout[-2000:]}{started.stderr[-2000:]}")
        if self.scenario.rollouts > 1:
            self.make("scale", "SERVICE=rollout", f"N={self.scenario.rollouts}")
        if self.scenario.trainers > 1:
            self.make("scale", "SERVICE=trainer", f"N={self.scenario.trainers}")
        self.processes()

    def submit(self) -> None:
        id_file = self.cfg.var / "experiment_id"
        overrides = [*self.cfg.overrides(), *self.scenario.sets]
        sets = [a for o in overrides for a in ("--set", o)]
        done = self.sh(
            ".venv/bin/asyncrl", "submit", str(ARITH), "--id-file", str(id_file), *sets,
            env=self.submit_env,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"submit failed: {done.stdout}{done.stderr}")
        self.t0 = time.time()
        self.experiment_id = id_file.read_text().strip()

    def cli_json(self, *args: str) -> dict:
        done = self.sh(".venv/bin/asyncrl", *args, self.experiment_id, "--json", timeout=120)
        if done.returncode != 0:
            return {"error": (done.stdout + done.stderr)[-1000:]}
        return json.loads(done.stdout)

    def down(self) -> None:
        for proc in self.helpers:
            proc.terminate()
        try:
            self.make("down")
        except subprocess.TimeoutExpired:
            pass
        for pid in self.seen_pids | {p.pid for p in self.helpers}:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)

    # ------------------------------------------------------------ watching the experiment

    async def reach_in_time(self, version: int) -> bool:
        """`reach`, and False (noted in `skipped`) when the run got so close to its end on the
        way that a fault there would leave nothing to recover in."""
        if not await self.reach(version):
            return False
        if self.version >= self.cfg.total_steps - 2:
            self.skipped.append(f"fault at v{version} skipped: already at v{self.version}")
            return False
        return True

    async def advance(self) -> bool:
        """Wait for new progress: a version past every one seen so far; False if none came."""
        return await self.reach(max(v for _, v in self.timeline) + 1)

    async def recovered(self, fault: dict, service: str, old_pid: int) -> bool:
        """Wait until `service` runs again (a new pid; back_s records when) and the run makes
        new progress after that, so the next fault hits a system that recovered. False if it
        never did."""
        if not await self.restarted(service, old_pid):
            return False
        fault["back_s"] = round(self.since() - fault["at_s"], 2)
        return await self.advance()

    async def restarted(self, service: str, old_pid: int, timeout: float = 120) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await self.pid(service, timeout=timeout) != old_pid:
                return True
            await asyncio.sleep(POLL_S)
        return False


def execute(cfg: RunConfig) -> dict:
    scenario = SCENARIOS[cfg.scenario]
    if scenario.steps is not None:
        cfg = replace(cfg, total_steps=scenario.steps)
    run = Run(cfg, scenario)
    rng = run_rng(cfg.seed, cfg.scenario)
    result = {"run": cfg.var.name, "fault": scenario.fault, "seed": cfg.seed}
    result |= {"batch_size": cfg.batch_size, "infrastructure": scenario.infrastructure}
    result |= {"expect_quarantined": scenario.expect_quarantined, "faults": [], "timeline": []}
    result["expect_replayed"] = scenario.expect_replayed
    result["expect_failed_reasons"] = list(scenario.expect_failed_reasons)
    result["max_stall_s"] = scenario.max_stall_s
    started = time.time()
    try:
        run.up()
        run.submit()
        result["experiment"] = run.experiment_id
        asyncio.run(run.watch(run.scenario.inject(run, rng)))
        result["wall_s"] = round(run.since(), 1)
        result["ledger"] = run.cli_json("ledger")
        result["status"] = run.cli_json("status")
    except Exception as e:  # the report says what broke the run itself
        run.errors.append(f"{type(e).__name__}: {e}")
    finally:
        result |= {"faults": run.faults, "timeline": run.timeline, "skipped": run.skipped}
        run.down()
        scenario.after_down(run)
    if run.errors:
        result["error"] = "; ".join(run.errors)
    result["total_s"] = round(time.time() - started, 1)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenario", required=True, choices=sorted(SCENARIOS))
    p.add_argument("--var", type=Path, required=True)
    p.add_argument("--task", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--n-samples", type=int, default=8)
    p.add_argument("--timeout", type=float, default=600.0)
    a = p.parse_args()
    cfg = RunConfig(
        a.scenario, a.var, a.task, a.seed, a.steps, a.batch_size, a.n_samples, a.timeout
    )
    result = execute(cfg)
    (cfg.var / "result.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
