"""Async against sync on the whole system, against a zero-overhead model of the same run, and
against the engine's own limit.

The workload is long-tailed and generation-dominated: the workflow `bench.longtail:LongTail`
gives every sample a target length from a lognormal (capped) and generates exactly that many
tokens (EOS ignored), on the tiny model with the torch engine and the torch trainer. All
services run as their own processes, as `make up` starts them (a temporary var dir, TLS and
tokens, one replica each, one torch thread each), and the same cluster runs the experiment at
eta = 0 (synchronous), 1, 2 and 4 on the same prompts in the same order, `repeats` times; each
eta reports its fastest run. The supervisor gives the rollout a core to itself and the other
processes the other (`ASYNCRL_CPU_AFFINITY=1`, the benchmark's default).

Measured in each experiment: its wall time (first `dispatched` to the N-th `trained` ledger
event), the groups each step trained, the trainer's StepMetrics, the rollout's weight updates
(its `weights_updated` log), and the engine's counters over exactly the wall (/metrics polled
with the experiment, interpolated at both ends: `counters_between`).

Measured in the same run on the rollout's core (`bench.decode`, the cluster idle, before and
after the experiments): the decode cost t(a) replaying the workload's lengths, and the engine's
saturated rate (tokens/s at its best concurrency).

`bench.system_model` turns them into the model's parameters and the results, one pair per eta:
- `system_efficiency`: trained samples/s measured ÷ the model's at that eta (`bench.overlap`
  under the scheduler's rules, with the very lengths the workflow generated for every attempt,
  and the weight update pipelined as the trainer runs it), with both speedups against eta = 0;
  the run's noise is the largest spread between repeats of one eta (`bench.yardstick.noise`);
- `fleet_utilisation`: tokens trained per second ÷ the engine's saturated rate, with the gap
  split into what it was lost to (`bench.yardstick.Losses`).
A PNG plots throughput against eta (var/bench/system_throughput.png; the work dir when --quick).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np
import psutil

from asyncrl.client import AsyncrlClient, is_terminal, state_name
from asyncrl.ledger import read_events, summarize
from asyncrl.natsutil import connect
from asyncrl.net import free_port
from asyncrl.proc import kill_tree, pid_alive
from asyncrl.security import Credentials
from asyncrl.settings import settings
from asyncrl.tiny import build_tiny_model
from asyncrl.types import GroupId
from bench import overlap, system_model
from bench.decode import (
    PROBE_CONCURRENCY,
    PROBE_TOKENS,
    fit_decode,
    replay_log,
    saturation,
)
from bench.longtail import target_lengths
from bench.report import Context, Result, cpu_affinity
from services.scheduler.policy import too_stale

NAME = "system"
ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = "bench.longtail:LongTail"
DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")
ROLLOUT_METRICS_OFFSET = 10
"""The rollout's /metrics port is ASYNCRL_METRICS_PORT + 10 (scheduler + 0, trainer + 1)."""
ENGINE_PREFIX = "asyncrl_rollout_engine_"
ABORT_LAG = next(lag for lag in range(4) if too_stale(0, committed_version=2 + lag, eta=1))
"""Versions past the model's abort point (v - start > eta) at which the scheduler aborts a
running group: the first lag at which `too_stale` is true (0: the rollout aborts it at once
unless it is already being published; `must_abort`, one version later, cancels the rest)."""


@dataclass(frozen=True)
class Plan:
    """The workload and run sizes."""

    n: int
    batch: int
    steps: int
    max_groups: int
    """max_concurrent_rollouts; the fleet has C = max_groups * n slots."""
    median: float
    sigma: float
    max_len: int
    etas: tuple[int, ...] = (0, 1, 2, 4)
    repeats: int = 1
    keep_kv: bool = False
    """The rollout's engine keeps in-flight requests' KV caches across weight updates
    (`--engine-opt keep_kv_on_update=true`, ASYNCRL_BENCH_KEEP_KV=1) instead of recomputing
    them: the re-prefill after each update is the cost the model leaves out."""
    """Runs of every eta; each eta reports its fastest (the least disturbed)."""
    seed: int = 0
    timeout_s: float = 600.0
    probe: tuple[int, ...] = PROBE_CONCURRENCY
    """Concurrencies the saturation probe tries (`bench.decode.saturation`)."""
    probe_tokens: int = PROBE_TOKENS

    @property
    def slots(self) -> int:
        return self.max_groups * self.n

    @property
    def prompts(self) -> int:
        """Enough prompts that no run wraps around (dropped groups come back as new attempts)."""
        return self.steps * self.batch * 3 + self.max_groups


def plan_for(ctx: Context) -> Plan:
    keep_kv = os.environ.get("ASYNCRL_BENCH_KEEP_KV", "") not in ("", "0")
    if ctx.quick:
        return Plan(n=2, batch=2, steps=3, max_groups=8, median=8, sigma=1.5, max_len=64,
                    timeout_s=60, keep_kv=keep_kv, probe=(4, 16), probe_tokens=16)  # fmt: skip
    # a loaded machine (8 agents on 2 cores) may need fewer steps and longer than 600 s each
    timeout = float(os.environ.get("ASYNCRL_BENCH_SYSTEM_TIMEOUT_S", "600"))
    steps = int(os.environ.get("ASYNCRL_BENCH_SYSTEM_STEPS", "60"))
    return Plan(n=4, batch=2, steps=steps, max_groups=12, median=32, sigma=1.5, max_len=1024,
                repeats=2, keep_kv=keep_kv, timeout_s=timeout)  # fmt: skip


# ---------------------------------------------------------------------------- the task

Lengths = Callable[[int, int], Sequence[int]]
"""(dataset index, attempt) -> the n target lengths the workflow generates for that dispatch."""


@dataclass(frozen=True)
class Task:
    model: Path
    tokenizer: Path
    """The model's tokenizer without an EOS token: the engine then never stops early."""
    dataset: Path
    prompts: list[str]
    prompt_len: int

    def lengths(self, plan: Plan) -> list[list[int]]:
        """Each prompt's n target lengths (first attempt), in dataset order (= dispatch order)."""
        return [self.attempt_lengths(plan, i, 0) for i in range(len(self.prompts))]

    def attempt_lengths(self, plan: Plan, index: int, attempt: int) -> list[int]:
        """The n target lengths of attempt `attempt` of prompt `index` (the workflow's)."""
        return target_lengths(
            plan.seed, self.prompts[index], plan.n, plan.median, plan.sigma, plan.max_len, attempt
        )


def build_task(root: Path, plan: Plan) -> Task:
    from transformers import AutoTokenizer

    prompts = [f"p{i:05d}:" for i in range(plan.prompts)]
    model = root / "model"
    build_tiny_model(model, max_position_embeddings=plan.max_len + 64)
    tok = AutoTokenizer.from_pretrained(str(model))
    prompt_len = len(tok(prompts[0], add_special_tokens=False).input_ids)
    tok.eos_token = None
    tok.save_pretrained(str(root / "tokenizer"))
    dataset = root / "train.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p, "answer": "0"}) + "\n" for p in prompts))
    return Task(model, root / "tokenizer", dataset, prompts, prompt_len)


def experiment_spec(task: Task, plan: Plan, eta: int) -> dict:
    args = {"median": plan.median, "sigma": plan.sigma, "max_len": plan.max_len, "seed": plan.seed}
    return {
        "name": f"system-eta{eta}",
        "model": {"path": str(task.model), "tokenizer_path": str(task.tokenizer)},
        "dataset": {"path": str(task.dataset), "shuffle": False, "epochs": 1},
        "rollout": {
            "engine": "torch",
            "n_samples": plan.n,
            "max_head_offpolicyness": eta,
            "max_concurrent_rollouts": plan.max_groups,
            "filter": "none",  # exact_match never pays on these prompts: keep every group
            "gconfig": {"temperature": 1.0, "max_new_tokens": plan.max_len},
            "workflow": {"name": WORKFLOW, "args": args},
        },
        "reward": {"function": "exact_match"},
        "trainer": {
            "backend": "torch",
            "batch_size": plan.batch,
            "total_steps": plan.steps,
            "lr": 1e-4,
            "checkpoint_every": 1_000_000,  # only the final one, after the measured window
        },
    }


# ---------------------------------------------------------------------------- the cluster


class LocalCluster:
    """nats + the four services under the supervisor on a temporary var dir (`make up`)."""

    def __init__(self, var: Path, keep_kv: bool = False):
        self.var = var
        self.scheduler_port, nats_port = free_port(), free_port()
        self.nats_url = f"nats://127.0.0.1:{nats_port}"
        self.metrics_port = _free_metrics_base()
        inherited = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
        self.env = {
            **inherited,
            "ASYNCRL_NATS_PORT": str(nats_port),
            "ASYNCRL_SCHEDULER_PORT": str(self.scheduler_port),
            "ASYNCRL_METRICS_PORT": str(self.metrics_port),
            "OMP_NUM_THREADS": "1",  # one core each: rollout and trainer overlap on two cores
            "ASYNCRL_TRAINER_ARGS": "--threads 1",
            # the rollout's core to itself, the rest for everything else (Supervisor.cpus)
            "ASYNCRL_CPU_AFFINITY": "1" if cpu_affinity() else "0",
            "ASYNCRL_ROLLOUT_ARGS": f"--engine-opt keep_kv_on_update={str(keep_kv).lower()}",
        }
        if not settings().insecure:
            from asyncrl.security import ensure_secrets

            self.env["ASYNCRL_SECRETS"] = str(ensure_secrets().resolve())

    @property
    def scheduler(self) -> str:
        return f"127.0.0.1:{self.scheduler_port}"

    def _sup(self, *args: str, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "asyncrl.supervisor", *args, "--var", str(self.var)],
            env=self.env,
            cwd=ROOT,  # the rollout imports the workflow plugin (bench.longtail) from here
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def __enter__(self) -> LocalCluster:
        done = self._sup("start", "--timeout", "120", timeout=180)
        if done.returncode != 0:
            self.__exit__()
            raise RuntimeError(f"cluster did not start: {done.stdout[-2000:]}{done.stderr[-2000:]}")
        return self

    def __exit__(self, *exc) -> None:
        pids = self._pids()
        try:
            self._sup("stop", "--timeout", "60", timeout=90)
        except subprocess.TimeoutExpired:
            pass
        for pid in pids:  # whatever the supervisor could not stop
            if pid_alive(pid):
                kill_tree(pid)

    def _state(self) -> dict:
        try:
            return json.loads((self.var / "run" / "state.json").read_text())
        except (OSError, ValueError):
            return {}

    def _pids(self) -> list[int]:
        state = self._state()
        if not state:
            return []
        return [state["supervisor_pid"], *(p["pid"] for p in state["processes"] if p["pid"])]

    def cpu_seconds(self) -> dict[str, float]:
        """User + system CPU seconds each service's process has used so far."""
        used = {}
        for p in self._state().get("processes", []):
            try:
                times = psutil.Process(p["pid"]).cpu_times()
            except (psutil.Error, TypeError):
                continue
            used[p["service"]] = times.user + times.system
        return used

    def engine_counters(self) -> dict[str, float]:
        """The rollout engine's cumulative counters (steps, stream_steps, step_seconds, ...)
        from its /metrics; empty when it cannot be read."""
        from prometheus_client.parser import text_string_to_metric_families

        port = self.metrics_port + ROLLOUT_METRICS_OFFSET
        if settings().insecure:
            url, tls = f"http://127.0.0.1:{port}/metrics", None
        else:
            url, tls = f"https://127.0.0.1:{port}/metrics", Credentials.load("viewer")
        try:
            context = tls.client_ssl_context() if tls else None
            with urllib.request.urlopen(url, timeout=5, context=context) as resp:
                text = resp.read().decode()
        except OSError:
            return {}
        return {
            sample.name.removeprefix(ENGINE_PREFIX).removesuffix("_total"): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name.startswith(ENGINE_PREFIX) and sample.name.endswith("_total")
        }

    def log_events(self, service: str, event: str, experiment: str) -> list[dict]:
        """The JSON log records of `event` for `experiment` in the service's first replica."""
        found = []
        for line in (self.var / "log" / f"{service}-0.log").read_text().splitlines():
            if f'"{event}"' not in line:
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("event") == event and record.get("experiment") == experiment:
                found.append(record)
        return found


def _free_metrics_base(tries: int = 20) -> int:
    """A base port whose scheduler, trainer and rollout metrics ports are all free now."""
    for _ in range(tries):
        base = free_port()
        if base + ROLLOUT_METRICS_OFFSET < 65536 and all(
            _bindable(base + offset) for offset in (1, ROLLOUT_METRICS_OFFSET)
        ):
            return base
    raise RuntimeError(f"no free metrics port range in {tries} tries")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# ---------------------------------------------------------------------------- one experiment


@dataclass
class RunRecord:
    """What one experiment measured (times are Unix seconds)."""

    eta: int
    experiment: str
    start_t: float
    """First group dispatched."""
    trained_t: dict[int, float]
    """Version -> when its `trained` ledger event was written (after CommitWeights)."""
    train_end_t: dict[int, float]
    """Version -> end of its train_step (trainer log)."""
    step_time_s: dict[int, float]
    serialize_s: list[float]
    """Each step's version gathered as bytes (the trainer's critical path after the step)."""
    step_prompts: dict[int, list[tuple[int, int]]]
    """Version -> (dataset index, attempt) of the groups it trained."""
    staleness_max: int
    dropped: int
    cpu_share: dict[str, float] = field(default_factory=dict)
    """CPU seconds of each service over the experiment's duration (1.0 = one core busy)."""
    finished_prompts: list[tuple[int, int]] = field(default_factory=list)
    """(dataset index, attempt) of the groups that finished generating before the N-th commit."""
    rejected_prompts: list[tuple[int, int]] = field(default_factory=list)
    """Those the filter rejected."""
    engine: dict[str, float] = field(default_factory=dict)
    """The rollout engine's counters over the wall (see LocalCluster.engine_counters)."""
    pause_s: list[float] = field(default_factory=list)
    """Seconds each weight update within the wall stopped generation (the engine's load and
    resume phases, the rollout's `weights_updated` log)."""
    duration_s: float = 0.0
    """Submit to end, the window of `cpu_share`."""
    load_avg: float = 0.0
    """The machine's 1-minute load average at the end."""
    fates: dict[str, int] = field(default_factory=dict)
    """The ledger's count of prompts by fate (asyncrl.ledger.summarize): the aborts and drops
    lost nothing and trained nothing twice."""

    @property
    def steps(self) -> int:
        return max(self.trained_t)

    @property
    def wall_s(self) -> float:
        return self.trained_t[self.steps] - self.start_t

    def update_s(self) -> list[float]:
        return [self.trained_t[v] - self.train_end_t[v] for v in sorted(self.trained_t)]


def _iso(ts: str) -> float:
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


async def run_to_end(
    scheduler: str,
    spec: dict,
    timeout_s: float,
    poll_s: float = 0.25,
    on_poll: Callable[[], None] = lambda: None,
):
    """Submit `spec`, wait for its end and return the experiment with its history (COMPLETED,
    else a RuntimeError with the message; cancelled and a TimeoutError after `timeout_s`);
    `on_poll` runs at every poll."""
    async with AsyncrlClient(scheduler) as client:
        exp = await client.submit(spec)
        deadline = time.monotonic() + timeout_s
        while not is_terminal(exp):
            on_poll()
            if time.monotonic() > deadline:
                await client.cancel(exp.id)
                raise TimeoutError(f"{spec['name']} did not finish in {timeout_s:.0f}s")
            await asyncio.sleep(poll_s)
            exp = await client.get(exp.id)
        if state_name(exp.state) != "COMPLETED":
            raise RuntimeError(f"{spec['name']} ended {state_name(exp.state)}: {exp.message}")
        return await client.get(exp.id, with_history=True)


async def _ledger(nats_url: str, experiment: str) -> list[dict]:
    nc = await connect(nats_url, identity="admin", max_reconnect_attempts=2)
    try:
        return await read_events(nc.jetstream(timeout=10), experiment)
    finally:
        await nc.close()


def run_experiment(cluster: LocalCluster, spec: dict, eta: int, timeout_s: float) -> RunRecord:
    polls: list[tuple[float, dict[str, float]]] = []

    def poll() -> None:
        polls.append((time.time(), cluster.engine_counters()))

    cpu0, t0 = cluster.cpu_seconds(), time.monotonic()
    poll()
    exp = asyncio.run(run_to_end(cluster.scheduler, spec, timeout_s, on_poll=poll))
    poll()
    duration, cpu1 = time.monotonic() - t0, cluster.cpu_seconds()
    cpu_share = {k: round((cpu1[k] - cpu0[k]) / duration, 3) for k in cpu1 if k in cpu0}
    events = asyncio.run(_ledger(cluster.nats_url, exp.id))
    trained = [e for e in events if e["event"] == "trained"]
    start_t, end_t = min(e["t"] for e in events if e["event"] == "dispatched"), trained[-1]["t"]
    steps = cluster.log_events("trainer", "train_step", exp.id)
    updates = cluster.log_events("rollout", "weights_updated", exp.id)
    return RunRecord(
        eta=eta,
        experiment=exp.id,
        start_t=start_t,
        trained_t={e["version"]: e["t"] for e in trained},
        train_end_t={r["version"]: _iso(r["timestamp"]) for r in steps},
        step_time_s={h.version: h.step_time_s for h in exp.history},
        serialize_s=[h.serialize_s for h in exp.history],
        step_prompts={e["version"]: [dispatch_of(g) for g in e["groups"]] for e in trained},
        staleness_max=max(h.staleness_max for h in exp.history),
        dropped=exp.progress.stale_dropped,
        cpu_share=cpu_share,
        finished_prompts=_settled(events, "accepted", end_t),
        rejected_prompts=_settled(events, "rejected", end_t),
        engine=counters_between(polls, start_t, end_t),
        pause_s=[
            u.get("load_s", 0.0) + u.get("resume_s", 0.0)
            for u in updates
            if u.get("version", 0) > 0 and start_t <= _iso(u["timestamp"]) <= end_t
        ],
        duration_s=duration,
        load_avg=os.getloadavg()[0],
        fates={k: v for k, v in summarize(events).totals.items() if v},
    )


def counters_between(
    polls: Sequence[tuple[float, dict[str, float]]], start: float, end: float
) -> dict[str, float]:
    """The engine's counters' increase from `start` to `end`, each end interpolated linearly
    between the polls around it (the polls' times in order)."""
    polls = [(t, c) for t, c in polls if c]
    if len(polls) < 2:
        return {}
    times = [t for t, _ in polls]
    keys = set.intersection(*(set(c) for _, c in polls))
    return {
        k: float(np.interp(end, times, [c[k] for _, c in polls]))
        - float(np.interp(start, times, [c[k] for _, c in polls]))
        for k in sorted(keys)
    }


def dispatch_of(group_id: str) -> tuple[int, int]:
    """(dataset index, attempt) of a training group id (`asyncrl.types.GroupId`)."""
    gid = GroupId.parse(group_id)
    return gid.index, gid.attempt


def _settled(events: list[dict], status: str, until: float) -> list[tuple[int, int]]:
    """(dataset index, attempt) of the groups settled with `status` (accepted: fully generated
    and kept; rejected: by the filter) up to `until`."""
    return [
        dispatch_of(e["group"])
        for e in events
        if e["event"] == "settled" and e["status"] == status and e["t"] <= until
    ]


# ---------------------------------------------------------------------------- the run


def rollout_cores(cluster: LocalCluster) -> set[int] | None:
    """The cores the supervisor gave the rollout service (None: unknown)."""
    for proc in cluster._state().get("processes", []):
        if proc.get("service") == "rollout" and proc.get("pid"):
            try:
                return set(psutil.Process(proc["pid"]).cpu_affinity())
            except psutil.Error:
                return None
    return None


def engine_costs(task: Task, plan: Plan, table, cores, updates: int):
    """One replay of the workload's lengths and one saturation probe, on `cores`."""
    from transformers import AutoTokenizer

    prompt_ids = AutoTokenizer.from_pretrained(str(task.tokenizer))(
        task.prompts[0], add_special_tokens=False
    ).input_ids
    lengths = [L for row in table for L in row][: 4 * plan.slots]
    log = replay_log(task.model, prompt_ids, lengths, plan.slots, updates, plan.keep_kv, cores)
    return log, saturation(task.model, prompt_ids, cores, plan.probe, plan.probe_tokens)


def run(ctx: Context) -> list[Result]:
    plan = plan_for(ctx)
    task = build_task(ctx.work_dir / "system", plan)
    table = task.lengths(plan)

    @functools.cache
    def lengths(index: int, attempt: int) -> tuple[int, ...]:
        return tuple(task.attempt_lengths(plan, index, attempt))

    records: dict[int, list[RunRecord]] = {eta: [] for eta in plan.etas}
    with LocalCluster(ctx.work_dir / "system" / "var", plan.keep_kv) as cluster:
        cores = rollout_cores(cluster)
        updates = ctx.size(6, 1)
        before = engine_costs(task, plan, table, cores, updates)
        for _ in range(plan.repeats):
            for eta in plan.etas:
                spec = experiment_spec(task, plan, eta)
                records[eta].append(run_experiment(cluster, spec, eta, plan.timeout_s))
        after = engine_costs(task, plan, table, cores, updates)
    runs = {eta: min(rs, key=lambda r: r.wall_s) for eta, rs in records.items()}  # best of
    decode = fit_decode([before[0], after[0]], plan.slots)
    saturated = {a: max(before[1][a], after[1][a]) for a in before[1]}
    m = system_model.measure(records, lengths, plan, task, decode, saturated)
    w = system_model.workload(plan, task.prompt_len, m, ABORT_LAG)
    model = overlap.ideal(w, plan.etas, table, lengths)
    variants = system_model.variants(w, plan.etas, table, lengths)
    common = {
        "workload": {"n": plan.n, "batch": plan.batch, "steps": plan.steps,
                     "max_groups": plan.max_groups, "slots": plan.slots,
                     "keep_kv_on_update": plan.keep_kv, "cpu_affinity": cpu_affinity(),
                     "rollout_cores": sorted(cores) if cores else None,
                     "lengths": f"lognormal median {plan.median:g} sigma {plan.sigma:g} "
                                f"cap {plan.max_len}", "prompt_len": task.prompt_len},
        "measured_parameters": system_model._r(asdict(m), 7),
        "replays": {  # each replay's own fit: how far the two moved apart
            when: {"t0": round(d.t0, 7), "c1": round(d.c1, 9)}
            for when, d in (("before", fit_decode([before[0]], plan.slots)),
                            ("after", fit_decode([after[0]], plan.slots)))
        },
        "model": {"alpha": round(w.alpha, 4), "resume_stall_s": round(decode.resume_stall_s, 4),
                  "full_fleet_step_s": round(decode.full_fleet_step_s, 5)},
    }  # fmt: skip
    out = system_model.results(plan, records, runs, model, variants, lengths, m, common)
    effs = [r for r in out if r.metric == "system_efficiency"]
    out_dir = ctx.work_dir if ctx.quick else Path("var/bench")
    tool_tp = [variants["tool"].runs[r.settings["eta"]].throughput for r in effs]
    png = system_model.plot(effs, tool_tp, out_dir / "system_throughput.png")
    for r in effs:
        r.settings["plot"] = str(png)
    return out


if __name__ == "__main__":  # python -m bench.system [--quick]: this benchmark alone, as JSON
    import tempfile

    with tempfile.TemporaryDirectory(prefix="asyncrl-system-") as tmp:
        results = run(Context(work_dir=Path(tmp), quick="--quick" in sys.argv))
    print(json.dumps([r.to_json() for r in results], indent=1))
