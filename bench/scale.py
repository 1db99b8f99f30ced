"""A thousand replicas, simulated: the real scheduler with 1,000 rollout workers, 100 reward
workers and 10 experiments at once (issue 24 point 4).

    python -m bench --only scale        # the full size (3-6 min here: docs/benchmarks.md)
    python -m bench                     # a reduced size among the others (~95 s here)

The scheduler and the nats-server are the real ones, secure (TLS and a token on every RPC,
NATS users), as `make up` runs them, with the default lease (10 s) and heartbeat interval
(1 s). The workers are stand-ins (`bench.scale_fleet`): a handful of processes, each serving
many worker identities, one port each on 127.0.0.1; their work costs nothing, the RPCs are
real: registration, heartbeats, BindExperiment, GenerateGroups (each group ACCEPTED after the
engine's time, asleep, and published to JetStream), UpdateWeights after every commit, and the
trainers' CommitWeights (one per B groups on the experiment's train subject).

Phases, in order, each measured on the scheduler's process (user + system CPU over wall time):
1. binding: the experiments are submitted, then the rollouts start (so that the scheduler
   spreads them: an experiment submitted while rollouts are idle takes them all): seconds until
   every rollout is bound, heartbeat latency and failures, registrations;
2. steady (after every experiment committed `warmup_versions`): the scheduler's **CPU share**,
   groups/s dispatched, **dispatch latency** p50/p99 (the ledger's `dispatched` event, the
   moment the scheduler admits a group, to its GenerateGroups call's arrival at the rollout:
   one wall clock on one machine; the ledger's times have 1 ms resolution), heartbeat latency;
3. vanish: the process serving `vanish` rollouts is killed at once (a host gone): seconds until
   the scheduler expired them all (its lease), the groups re-queued; then as many new rollouts
   register: seconds until all are bound and until their first group, and the experiments'
   rollout counts after (the rebalance);
4. idle: the experiments cancelled, heartbeats only: **CPU-µs per heartbeat** (the scheduler's
   CPU ÷ the heartbeats and registrations the stand-ins got answered) and its latency;
5. lease sweeps: the sweeper's pass (expire, then the idle checks) on the real `Registry` with
   the same workers, timed in this process.
Throughout: the live workers whose lease lapsed (the scheduler's `worker_expired` events). A
phase that misses its goal within `timeout_s` ends the run there (`broke`: where), and what
was measured so far is reported (the idle window still runs). Each result's peer is the budget
it spends (one core, the heartbeat interval, the engine's time per group, the lease, the
workers registered): the ratio is the share of it used.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import psutil

from asyncrl.client import AsyncrlClient
from asyncrl.ledger import read_events
from asyncrl.machine import machine_line
from asyncrl.natsutil import LocalNatsServer, connect
from asyncrl.net import free_port
from asyncrl.v1 import common_pb2
from bench.report import Context, Result
from bench.scale_figures import figures

NAME = "scale"
ROOT = Path(__file__).resolve().parents[1]


class Broke(Exception):
    """The deployment did not reach a phase's goal in time: where the run broke (reported)."""


@dataclass
class Sizes:
    rollouts: int = 1000
    rewards: int = 100
    experiments: int = 10
    rollout_procs: int = 3
    """Processes serving the rollouts that stay (the `vanish` ones have one of their own)."""
    vanish: int = 100
    group_s: float = 8.0
    """A group's engine time, mean (each x0.5-1.5)."""
    capacity: int = 4
    """Groups at once per rollout (its registered capacity)."""
    batch: int = 64
    eta: int = 1
    lease_ttl_s: float = 10.0
    heartbeat_interval_s: float = 1.0
    idle_s: float = 10.0
    steady_s: float = 20.0
    warmup_versions: int = 2
    """Versions every experiment commits before the steady window."""
    timeout_s: float = 180.0
    """How long a phase may take to reach its goal (every rollout bound, the warm-up's
    versions, the killed rollouts expired) before the run counts as broken there."""
    scheduler_cpu: int | None = None
    """The core the scheduler is pinned to (`taskset`; None: not pinned)."""

    @classmethod
    def huge(cls) -> Sizes:
        """Issue 38's size: 10,000 rollouts (1,000 of them killed at once, 1,000 joining),
        1,000 reward workers, 100 experiments."""
        return cls(
            rollouts=10_000, rewards=1_000, experiments=100, rollout_procs=9, vanish=1_000,
            timeout_s=600.0,
        )  # fmt: skip

    @classmethod
    def reduced(cls) -> Sizes:
        """For `make bench`: a tenth of the workers, two experiments, shorter
        windows and groups, a 5 s lease."""
        return cls(
            rollouts=100, rewards=10, experiments=2, rollout_procs=1, vanish=20,
            group_s=2.0, batch=16, lease_ttl_s=5.0, idle_s=3.0, steady_s=6.0,
            warmup_versions=1, timeout_s=45.0,
        )  # fmt: skip

    @property
    def max_concurrent(self) -> int:
        """Each experiment's max_concurrent_rollouts: what the staleness rule lets it keep in
        flight anyway ((eta + 1) x B)."""
        return (self.eta + 1) * self.batch

    @property
    def offered_groups_per_s(self) -> float:
        """What the experiments can dispatch: max_concurrent groups each, each the engine's
        time on average."""
        return self.experiments * self.max_concurrent / self.group_s


# ---- the deployment ------------------------------------------------------------------------


class Deployment:
    """nats-server, the scheduler and the stand-in processes on `var`, secure."""

    def __init__(self, var: Path, s: Sizes):
        self.var, self.s = var, s
        self.scheduler = f"127.0.0.1:{free_port()}"
        self.nats = LocalNatsServer(var / "nats", log_file=var / "nats.log")
        self.procs: dict[str, subprocess.Popen] = {}
        (var / "logs").mkdir(parents=True, exist_ok=True)

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "NATS_URL": self.nats.url,
            "ASYNCRL_SCHEDULER": self.scheduler,
            "ASYNCRL_VAR": str(self.var),
            "ASYNCRL_SECRETS": str(self.var / "secrets"),
            "ASYNCRL_INSECURE": "0",
            "PYTHONUNBUFFERED": "1",
        }

    def _spawn(self, name: str, cmd: list[str], cpu: int | None = None) -> None:
        pin = ["taskset", "-c", str(cpu)] if cpu is not None else []
        with open(self.var / "logs" / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen(
                [*pin, sys.executable, *cmd], cwd=ROOT, env=self.env(), stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def start(self) -> None:
        """nats-server, the scheduler, the reward workers and the trainers."""
        s = self.s
        self.nats.start()
        self._spawn("scheduler", [
            "-m", "services.scheduler", "--port", self.scheduler.rpartition(":")[2],
            "--lease-ttl", str(s.lease_ttl_s), "--heartbeat-interval", str(s.heartbeat_interval_s),
        ], cpu=s.scheduler_cpu)  # fmt: skip
        self.fleet("reward", "reward", s.rewards)
        self.fleet("trainer", "trainer", s.experiments)

    def start_rollouts(self) -> None:
        """The rollouts' processes: `rollout_procs` of those that stay, one of `vanish`."""
        s = self.s
        stay = s.rollouts - s.vanish
        for i in range(s.rollout_procs):
            count = stay // s.rollout_procs + (i < stay % s.rollout_procs)
            self.fleet(f"rollout{i}", "rollout", count)
        self.fleet("doomed", "rollout", s.vanish)

    def fleet(self, name: str, kind: str, count: int) -> None:
        s = self.s
        self._spawn(name, [
            "-m", "bench.scale_fleet", kind, "--count", str(count), "--name", name,
            "--stats", str(self.stats_file(name)), "--group-s", str(s.group_s),
            "--capacity", str(s.capacity), "--batch", str(s.batch),
            "--seed", str(len(self.procs)),
        ])  # fmt: skip

    def expired(self) -> list[float]:
        """Wall times of the scheduler's `worker_expired` events (its log: JSON lines)."""
        return [e["t"] for e in self.events("worker_expired")]

    def events(self, name: str) -> list[dict]:
        """The scheduler's log events `name` (JSON lines), each with its wall time `t`."""
        from datetime import datetime

        found = []
        with open(self.var / "logs" / "scheduler.log", "rb") as f:
            for line in f:
                if f'"{name}"'.encode() in line:
                    with contextlib.suppress(ValueError, KeyError):
                        event = json.loads(line)
                        stamp = event["timestamp"].replace("Z", "+00:00")
                        found.append({**event, "t": datetime.fromisoformat(stamp).timestamp()})
        return found

    def stats_file(self, name: str) -> Path:
        return self.var / f"stats-{name}.json"

    def check_alive(self, *, but: tuple[str, ...] = ()) -> None:
        for name, proc in self.procs.items():
            if name not in but and proc.poll() is not None:
                tail = (self.var / "logs" / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{tail}")

    def kill(self, name: str) -> None:
        """At once, as a host dies: no goodbye, no stats."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait()

    def stop(self) -> dict[str, dict]:
        """SIGTERM every stand-in (each writes its stats), then the scheduler, then NATS; the
        stand-ins' stats by process."""
        for name, proc in self.procs.items():
            if name != "scheduler" and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name in [n for n in self.procs if n != "scheduler"] + ["scheduler"]:
            proc = self.procs[name]
            if name == "scheduler" and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.nats.stop()
        stats = {}
        for name in self.procs:
            path = self.stats_file(name)
            if path.exists():
                stats[name] = json.loads(path.read_text())
        return stats


def cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


class CpuWindow:
    """The scheduler's and the nats-server's CPU seconds and the wall time between `__init__`
    and `close`."""

    def __init__(self, dep: Deployment):
        self.pids = {"scheduler": dep.procs["scheduler"].pid, "nats": dep.nats.proc.pid}
        self.t0, self.wall0 = time.perf_counter(), time.time()
        self.cpu0 = {k: cpu_s(p) for k, p in self.pids.items()}

    def close(self) -> dict:
        seconds = time.perf_counter() - self.t0
        cpu = {k: cpu_s(p) - self.cpu0[k] for k, p in self.pids.items()}
        return {
            "start": self.wall0,
            "end": self.wall0 + seconds,
            "seconds": seconds,
            "cpu_s": cpu,
            "share": {k: v / seconds for k, v in cpu.items()},
        }


# ---- the run -------------------------------------------------------------------------------


def write_inputs(var: Path, prompts: int = 4096) -> tuple[Path, Path]:
    """A dataset and a model directory the spec can name (the stand-ins load neither)."""
    rng = random.Random(0)
    rows = []
    for _ in range(prompts):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rows.append(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}))
    dataset = var / "train.jsonl"
    dataset.write_text("\n".join(rows) + "\n")
    model = var / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2"}\n')
    return model, dataset


def experiment_spec(i: int, model: Path, dataset: Path, s: Sizes) -> dict:
    return {
        "name": f"scale-{i}",
        "model": {"path": str(model)},
        "dataset": {"path": str(dataset), "epochs": 10_000},
        "rollout": {
            "engine": "torch",
            "n_samples": 8,
            "max_head_offpolicyness": s.eta,
            "max_concurrent_rollouts": s.max_concurrent,
            "filter": "none",
        },
        "reward": {"function": "exact_match"},
        "trainer": {"backend": "torch", "batch_size": s.batch, "total_steps": 1_000_000},
    }


async def wait_workers(
    client: AsyncrlClient, dep: Deployment, pred, what: str, timeout: float
) -> float:
    """Poll ListWorkers (every 0.5 s: each lists every worker) until `pred(workers)`; the wall
    time it held. Broke(`what`) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        dep.check_alive(but=("doomed",))
        with contextlib.suppress(Exception):
            if pred(await client.workers()):
                return time.time()
        if time.monotonic() > deadline:
            raise Broke(f"{what}: not within {timeout:.0f} s")
        await asyncio.sleep(0.5)


def count(workers, kind: int, bound: bool | None = None, name: str = "") -> int:
    return sum(
        1
        for w in workers
        if w.kind == kind
        and w.name.startswith(name)
        and (bound is None or bool(w.experiment_id) == bound)
    )


def progress(what: str) -> None:
    print(f"[scale] {time.strftime('%H:%M:%S')} {what}", file=sys.stderr, flush=True)


async def run_phases(dep: Deployment, var: Path, s: Sizes) -> dict:
    """The phases on a started deployment (module docstring); the raw figures, as far as the
    run got (`broke`: where it stopped)."""
    out: dict = {}
    async with AsyncrlClient(dep.scheduler) as client:
        try:
            await phases(client, dep, var, s, out)
        except Broke as e:
            out["broke"] = str(e)
            progress(f"broke: {e}")
            if "bind_window" in out:  # broke binding or warming up: that window is measured
                out["bind"] = out.pop("bind_window").close()
            if "experiments" in out:  # what heartbeats cost once the experiments are gone
                with contextlib.suppress(Broke):
                    out["idle"] = await idle_window(client, dep, s, out["experiments"])
    if "experiments" in out:
        out["ledgers"] = await read_ledgers(dep, out["experiments"])
    return out


async def phases(client: AsyncrlClient, dep: Deployment, var: Path, s: Sizes, out: dict) -> None:
    rollout, trainer = common_pb2.WORKER_KIND_ROLLOUT, common_pb2.WORKER_KIND_TRAINER
    await wait_workers(
        client, dep, lambda ws: len(ws) == s.rewards + s.experiments, "start", s.timeout_s
    )
    model, dataset = write_inputs(var)
    ids = [(await client.submit(experiment_spec(i, model, dataset, s))).id for i in range(s.experiments)]  # fmt: skip
    out["experiments"] = ids
    await bind_rollouts(client, dep, s, out)
    progress(f"{s.rollouts} rollouts bound in {out['bind_s']:.1f} s; warming up")
    await wait_versions(client, dep, ids, s)
    out["bind"] = out.pop("bind_window").close()
    steady = CpuWindow(dep)
    await asyncio.sleep(s.steady_s)
    out["steady"] = steady.close()
    out["steady"]["versions"] = await versions(client, ids)
    progress(f"versions {out['steady']['versions']}; killing {s.vanish} rollouts")
    out["vanish"] = {}
    await vanish(client, dep, s, out["vanish"])
    out["bound_after"] = await bound_counts(client, ids, rollout)
    out["trainers_bound"] = count(await client.workers(), trainer, bound=True)
    progress("rebalanced; the experiments cancelled, heartbeats only")
    out["idle"] = await idle_window(client, dep, s, ids)


async def bind_rollouts(client: AsyncrlClient, dep: Deployment, s: Sizes, out: dict) -> None:
    """Start the rollouts (the experiments wait for them): each is bound as it registers, to
    the experiment with the fewest. Seconds until all are bound, and how they spread."""
    rollout = common_pb2.WORKER_KIND_ROLLOUT
    out["bind_window"] = window = CpuWindow(dep)
    dep.start_rollouts()
    bound_at = await wait_workers(
        client, dep, lambda ws: count(ws, rollout, True) == s.rollouts, "binding", s.timeout_s
    )
    out["bind_s"] = bound_at - window.wall0
    out["bound_before"] = await bound_counts(client, out["experiments"], rollout)


async def idle_window(client: AsyncrlClient, dep: Deployment, s: Sizes, ids: list[str]) -> dict:
    """Cancel the experiments (`cancel_s`: until every worker is free); then a window of
    heartbeats only."""
    t0, cancel_s = time.time(), float("nan")
    answers = await asyncio.gather(*(client.cancel(i) for i in ids), return_exceptions=True)
    failed = [a for a in answers if isinstance(a, BaseException)]  # all at once; an overloaded
    if failed:  # scheduler may drop some calls: the window still runs and says so
        print(f"[scale] {len(failed)} cancels failed: {failed[0]}", file=sys.stderr, flush=True)
    with contextlib.suppress(Broke):
        freed = await wait_workers(
            client, dep, lambda ws: not any(w.experiment_id for w in ws), "cancel", s.timeout_s
        )
        cancel_s = freed - t0
    await asyncio.sleep(2 * s.heartbeat_interval_s)
    window = CpuWindow(dep)
    await asyncio.sleep(s.idle_s)
    return {**window.close(), "cancel_s": cancel_s, "cancels_failed": len(failed)}


async def versions(client: AsyncrlClient, ids: list[str]) -> dict[str, int]:
    return {e.id: e.progress.version for e in await client.list() if e.id in ids}


async def wait_versions(client, dep: Deployment, ids: list[str], s: Sizes) -> None:
    """Until every experiment committed `s.warmup_versions` (Broke after `s.timeout_s`)."""
    deadline = time.monotonic() + s.timeout_s
    while min((got := await versions(client, ids)).values()) < s.warmup_versions:
        dep.check_alive()
        if time.monotonic() > deadline:
            raise Broke(f"warm-up: versions {sorted(got.values())} after {s.timeout_s:.0f} s")
        await asyncio.sleep(0.5)


async def bound_counts(client: AsyncrlClient, ids: list[str], kind: int) -> dict[str, int]:
    workers = await client.workers()
    return {i: sum(1 for w in workers if w.kind == kind and w.experiment_id == i) for i in ids}


async def vanish(client: AsyncrlClient, dep: Deployment, s: Sizes, out: dict) -> None:
    """Kill the process of `s.vanish` rollouts; time their expiry; start as many new ones (a
    process of their own) and poll until all are bound."""
    rollout = common_pb2.WORKER_KIND_ROLLOUT
    window = CpuWindow(dep)
    out["killed_at"] = time.time()
    dep.kill("doomed")
    out["expired_at"] = await wait_workers(
        client, dep, lambda ws: count(ws, rollout) == s.rollouts - s.vanish,
        "expiry", s.lease_ttl_s + s.timeout_s,
    )  # fmt: skip
    out["cpu"] = window.close()
    dep.fleet("joined", "rollout", s.vanish)
    out["bound_at"] = await wait_workers(
        client, dep, lambda ws: count(ws, rollout, bound=True, name="joined") == s.vanish,
        "rejoin", s.timeout_s,
    )  # fmt: skip
    await asyncio.sleep(max(2.0, 1.5 * s.group_s))  # their first groups come and go
    out["settle_end"] = time.time()


async def read_ledgers(dep: Deployment, ids: list[str]) -> dict[str, list[dict]]:
    """Every experiment's ledger (the nats-server still up), as the admin reads it."""
    nc = await connect(dep.nats.url, identity="admin")
    try:
        js = nc.jetstream()
        return {i: await read_events(js, i) for i in ids}
    finally:
        await nc.close()


def measure(work_dir: Path, s: Sizes) -> dict:
    """Run the deployment on a fresh var dir under `work_dir`; `figures` of the run."""
    from asyncrl.security import ensure_secrets

    machine = machine_line()  # before the run: its load is what else the machine does
    var = work_dir / f"scale-{os.getpid()}-{time.monotonic_ns()}"
    var.mkdir(parents=True)
    secrets = var / "secrets"
    saved = {k: os.environ.get(k) for k in ("ASYNCRL_SECRETS", "ASYNCRL_INSECURE")}
    os.environ.update(ASYNCRL_SECRETS=str(secrets), ASYNCRL_INSECURE="0")
    try:
        ensure_secrets(secrets)
        dep = Deployment(var, s)
        try:
            dep.start()
            raw = asyncio.run(run_phases(dep, var, s))
        finally:
            stats = dep.stop()
        raw["expired"] = dep.expired()
        raw["liveness"] = dep.events("liveness")
        return {"machine": machine, **figures(raw, stats, s)}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---- the benchmark -------------------------------------------------------------------------


def run(ctx: Context) -> list[Result]:
    """The full size under `--only scale`, the reduced one among the other benchmarks."""
    s = Sizes() if NAME in ctx.only else Sizes.reduced()
    if ctx.quick:
        s = replace(Sizes.reduced(), idle_s=2.0, steady_s=4.0)
    if os.environ.get("BENCH_SCHEDULER_CPU"):  # the scheduler on a core of its own (taskset)
        s.scheduler_cpu = int(os.environ["BENCH_SCHEDULER_CPU"])
    f = measure(ctx.work_dir, s)
    return results(f, s)


def results(f: dict, s: Sizes) -> list[Result]:
    """One Result per figure the run got to (all of them unless it `broke`); the settings of
    each hold every figure."""
    who = f"{s.rollouts} rollouts, {s.rewards} reward workers, {s.experiments} experiments"
    workers = s.rollouts + s.rewards + s.experiments
    engine_ms = 1e3 * s.group_s
    rows = [
        ("live workers the scheduler expired (their lease lapsed)",
         f["lapsed_live_workers"], "workers", "the workers registered", workers),
        ("lease sweep (expire + idle checks)", f["sweep_us"], "µs",
         "the sweep interval", 1e6 * min(1.0, max(0.05, s.lease_ttl_s / 4))),
    ]  # fmt: skip
    if steady := f.get("steady"):
        rows += [
            ("scheduler CPU share, experiments running", steady["scheduler_share"], "cores",
             "one core (the scheduler is one event loop)", 1.0),
            ("heartbeat latency p99, experiments running", steady["heartbeat_ms_p99"], "ms",
             "the heartbeat interval", 1e3 * s.heartbeat_interval_s),
            ("dispatch latency p50, admission -> GenerateGroups", steady["dispatch_ms_p50"], "ms",
             "a group's engine time (mean)", engine_ms),
            ("dispatch latency p99, admission -> GenerateGroups", steady["dispatch_ms_p99"], "ms",
             "a group's engine time (mean)", engine_ms),
            ("groups/s dispatched", steady["groups_per_s"], "1/s",
             "what the experiments may keep in flight / engine time", s.offered_groups_per_s),
        ]  # fmt: skip
    if idle := f.get("idle"):
        rows.append(
            ("scheduler CPU-µs per heartbeat (or registration), no experiment",
             idle["cpu_us_per_worker_rpc"], "µs",
             f"one core's µs per heartbeat ({workers} workers, 1 per {s.heartbeat_interval_s:g} s)",
             1e6 * s.heartbeat_interval_s / workers)
        )  # fmt: skip
    if gone := f.get("vanish"):
        rows += [
            (f"{s.vanish} rollouts killed at once: s until all expired", gone["expired_s"], "s",
             "the lease", s.lease_ttl_s),
            (f"{s.vanish} new rollouts: s from registering to their first group",
             gone["joined_first_group_s"], "s", "a group's engine time (mean)", s.group_s),
        ]  # fmt: skip
    return [
        Result(NAME, f"{metric} ({who})", value, unit, peer, peer_value, f)
        for metric, value, unit, peer, peer_value in rows
    ]


def main(argv: list[str] | None = None) -> None:
    import argparse
    import tempfile

    from asyncrl.logging import configure_logging

    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__)
    p.add_argument("--reduced", action="store_true", help="the size `make bench` runs")
    p.add_argument("--huge", action="store_true", help="10,000 + 1,000 workers, 100 experiments")
    p.add_argument("--pin", type=int, help="pin the scheduler to this core (taskset)")
    p.add_argument("--steady", type=float, help="seconds of the steady window")
    p.add_argument("--lease", type=float, help="the scheduler's lease (default 10 s)")
    p.add_argument("--rollouts", type=int, help="rollout workers (default 1000; 100 vanish)")
    p.add_argument("--experiments", type=int, help="experiments (default 10)")
    p.add_argument("--work", type=Path, help="keep the run's files here (logs, stats)")
    args = p.parse_args(argv)
    configure_logging("bench", json=False, level="WARNING")
    s = Sizes.reduced() if args.reduced else Sizes.huge() if args.huge else Sizes()
    s.scheduler_cpu = args.pin
    if args.lease:
        s.lease_ttl_s = args.lease
    if args.rollouts:  # a tenth of them reward workers, a tenth vanish, as at full size
        s.rollouts, s.rewards, s.vanish = args.rollouts, args.rollouts // 10, args.rollouts // 10
    if args.experiments:
        s.experiments = args.experiments
    if args.steady:
        s.steady_s = args.steady
    if args.work:
        print(json.dumps(measure(args.work.resolve(), s), indent=1))
        return
    with tempfile.TemporaryDirectory(prefix="asyncrl-scale-") as tmp:
        print(json.dumps(measure(Path(tmp), s), indent=1))


if __name__ == "__main__":
    main()
