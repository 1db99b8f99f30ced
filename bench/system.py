"""Async against sync on the whole system, and against the ideal for the same workload.

The workload is long-tailed and generation-dominated: the workflow `bench.longtail:LongTail`
gives every sample a target length from a lognormal (capped) and generates exactly that many
tokens (EOS ignored), on the tiny model with the torch engine and the torch trainer. All
services run as their own processes, as `make up` starts them (a temporary var dir, TLS and
tokens, one replica each, one torch thread each), and the same cluster runs the experiment at
eta = 0 (synchronous), 1, 2 and 4 on the same prompts in the same order. The supervisor gives
the rollout a core to itself and the other processes the other (`ASYNCRL_CPU_AFFINITY=1`, the
benchmark's default; `ASYNCRL_CPU_AFFINITY=0` leaves placement to the kernel).

Measured in the run:
- wall time of each experiment: first dispatch to the N-th committed step (the ledger's
  `dispatched` and `trained` events); speedup(eta) = wall(0) / wall(eta);
- decode time per step against active streams: the same engine class on the same model and
  thread count replays the workload's lengths at the fleet's concurrency; a least-squares line
  t(a) = t0 + c1 a gives t0 and alpha = c1 C / t0;
- train time per step against tokens, from the eta=0 run's StepMetrics (`step_time_s`) and
  the groups each step trained (the ledger): the torch backend pads every sample to the
  batch's longest, so tokens are B n (max L + prompt);
- weight-update time: from the end of `train_step` (trainer log) to the step's `trained`
  ledger event, which the trainer writes once CommitWeights has returned (the fleet loaded it).

Those parameters go into `bench.overlap` (the zero-overhead model: analytic bound and a
discrete-event simulation of sync and async with AReaL's admission, the trainer dropping
groups staler than eta) with the very lengths the workflow generated, in dispatch order, under
the scheduler's own rules where they differ from the tool's model: a too-stale running group
is aborted when the model aborts it unless the rollout is publishing it (`ABORT_LAG` 0, from
`too_stale`: AbortGroups), and a dropped group's prompt is generated again before new ones
(`requeue`: no prompt is lost), as its next attempt, with the new lengths the workflow draws
for that attempt (`resample`): in distribution, the tool's "a dropped group is gone, the next
admission draws new lengths". One Result per eta: measured speedup against the ideal speedup
of the tool's zero-overhead model (ratio = measured ÷ ideal: what the workload allows);
`ideal_speedup_scheduler_rules` and `ratio_scheduler_rules` are the same model under the rules
above, fed with the very lengths the system generated for each attempt. A PNG plots throughput
against eta beside the ideal (var/bench/system_throughput.png; the work dir when --quick).
Each eta runs `repeats` times and reports its fastest run.

Settings carry what explains the gap: each service's CPU share (a rollout near 1.0 is
engine-bound), the fleet's tokens/s (finished groups only) against the model's, the train step
measured against the fitted cost of the same batches (CPU contention), the replayed full-fleet
step against t(C) (the engine's cost grows with the batch's longest context, which the model's
t(a) cannot see) and the re-prefill stall after each weight update (interrupted requests
recompute their KV cache; the model keeps their progress for free) times the steps.

`engine` compares the rollout's own engine counters over the run (its /metrics:
asyncrl_rollout_engine_*_total) with the model: active streams per decode step against the
model's (`mean_active`: what the admission rule lets run; the model applies the same rule), the
decode steps taken against the model's token clock (tokens wasted on groups dropped as too
stale, the tail), and the seconds per step in the run against t(a) from the replay on an
otherwise idle engine (the difference is CPU the engine did not get: with `busy` near 1 and
the rollout's CPU share near 0.5, each step waited for a core half of its time); `prefill_s`
and `prefill_tokens` are the engine's prefills (new prompts, and interrupted requests
recomputed after each weight update: the model keeps their progress for free) and
`decode_step_ms` a step without them. `contention` re-runs the model with the decode cost
replayed beside a training load on the other core, for the share of the run the trainer
computes (see `contention`): what this machine's shared caches and memory bandwidth allow,
beside the headline ratio. `load_avg` is
the machine's 1-minute load average when the run ended (2 cores here).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path

import numpy as np
import psutil
import torch

from asyncrl.client import AsyncrlClient, is_terminal, state_name
from asyncrl.ledger import read_events, summarize
from asyncrl.natsutil import connect
from asyncrl.net import free_port
from asyncrl.proc import kill_tree, pid_alive
from asyncrl.security import Credentials
from asyncrl.settings import settings
from asyncrl.spec import SamplingParams
from asyncrl.tiny import build_tiny_model
from asyncrl.types import GroupId
from bench import overlap
from bench.longtail import target_lengths
from bench.report import Context, Result, cpu_affinity
from services.rollout.engine import GenRequest
from services.rollout.torch_engine import TorchEngine
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
                    timeout_s=60, keep_kv=keep_kv)  # fmt: skip
    return Plan(n=4, batch=2, steps=60, max_groups=12, median=32, sigma=1.5, max_len=1024,
                repeats=2, keep_kv=keep_kv)  # fmt: skip


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
    step_prompts: dict[int, list[tuple[int, int]]]
    """Version -> (dataset index, attempt) of the groups it trained."""
    staleness_max: int
    dropped: int
    cpu_share: dict[str, float] = field(default_factory=dict)
    """CPU seconds of each service over the experiment's duration (1.0 = one core busy)."""
    finished_prompts: list[tuple[int, int]] = field(default_factory=list)
    """(dataset index, attempt) of the groups that finished generating before the N-th commit."""
    engine: dict[str, float] = field(default_factory=dict)
    """The rollout engine's counters over the experiment (see LocalCluster.engine_counters)."""
    duration_s: float = 0.0
    """Submit to end, the window of `cpu_share` and `engine`."""
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


async def run_to_end(scheduler: str, spec: dict, timeout_s: float, poll_s: float = 0.25):
    """Submit `spec`, wait for its end and return the experiment with its history (COMPLETED,
    else a RuntimeError with the message; cancelled and a TimeoutError after `timeout_s`)."""
    async with AsyncrlClient(scheduler) as client:
        exp = await client.submit(spec)
        deadline = time.monotonic() + timeout_s
        while not is_terminal(exp):
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
    cpu0, engine0, t0 = cluster.cpu_seconds(), cluster.engine_counters(), time.monotonic()
    exp = asyncio.run(run_to_end(cluster.scheduler, spec, timeout_s))
    duration, cpu1 = time.monotonic() - t0, cluster.cpu_seconds()
    engine1 = cluster.engine_counters()
    cpu_share = {k: round((cpu1[k] - cpu0[k]) / duration, 3) for k in cpu1 if k in cpu0}
    events = asyncio.run(_ledger(cluster.nats_url, exp.id))
    trained = [e for e in events if e["event"] == "trained"]
    steps = cluster.log_events("trainer", "train_step", exp.id)
    return RunRecord(
        eta=eta,
        experiment=exp.id,
        start_t=min(e["t"] for e in events if e["event"] == "dispatched"),
        trained_t={e["version"]: e["t"] for e in trained},
        train_end_t={r["version"]: _iso(r["timestamp"]) for r in steps},
        step_time_s={h.version: h.step_time_s for h in exp.history},
        step_prompts={e["version"]: [dispatch_of(g) for g in e["groups"]] for e in trained},
        staleness_max=max(h.staleness_max for h in exp.history),
        dropped=exp.progress.stale_dropped,
        cpu_share=cpu_share,
        finished_prompts=_finished(events, max(e["t"] for e in trained)),
        engine={k: engine1[k] - engine0[k] for k in engine1 if k in engine0},
        duration_s=duration,
        load_avg=os.getloadavg()[0],
        fates={k: v for k, v in summarize(events).totals.items() if v},
    )


def dispatch_of(group_id: str) -> tuple[int, int]:
    """(dataset index, attempt) of a training group id (`asyncrl.types.GroupId`)."""
    gid = GroupId.parse(group_id)
    return gid.index, gid.attempt


def _finished(events: list[dict], until: float) -> list[tuple[int, int]]:
    """(dataset index, attempt) of the groups accepted (fully generated) up to `until`."""
    return [
        dispatch_of(e["group"])
        for e in events
        if e["event"] == "settled" and e["status"] == "accepted" and e["t"] <= until
    ]


# ---------------------------------------------------------------------------- the parameters


class _TimedEngine(TorchEngine):
    """The torch engine, recording every step: (active streams, seconds, whether it is the
    first step after a weight update, i.e. re-prefills every interrupted request)."""

    def __init__(self, keep_kv: bool = False):
        super().__init__(seed=0, keep_kv_on_update=keep_kv)
        self.step_log: list[tuple[int, float, bool]] = []
        self._resumed = False

    async def _apply(self, op) -> None:
        await super()._apply(op)
        self._resumed = op.kind == "update"

    def _step(self, batch):
        resumed, self._resumed = self._resumed, False
        t0 = time.perf_counter()
        finished = super()._step(batch)
        self.step_log.append((len(batch), time.perf_counter() - t0, resumed))
        return finished


async def _replay(
    model: Path,
    prompt_ids: list[int],
    lengths: list[int],
    slots: int,
    updates: int,
    keep_kv: bool = False,
):
    """Generate `lengths` with at most `slots` in flight; `updates` weight updates (the same
    weights, a new version) at even shares of the tokens, as the fleet gets them mid-run."""
    engine = _TimedEngine(keep_kv)
    await engine.start()
    try:
        await engine.load(str(model), 0)
        gate = asyncio.Semaphore(slots)

        async def one(i: int, length: int):
            async with gate:
                params = SamplingParams(max_new_tokens=length)
                await engine.generate(GenRequest(f"cal-{i}", prompt_ids, params))

        job = asyncio.gather(*(one(i, L) for i, L in enumerate(lengths)))
        for v in range(1, updates + 1):
            share = sum(lengths) * v // (updates + 1)
            while engine.tokens_generated < share and not job.done():
                await asyncio.sleep(0.005)
            if not job.done():
                await engine.update_weights(str(model), v)
        await job
    finally:
        await engine.stop()
    return engine.step_log


@dataclass(frozen=True)
class Decode:
    """The engine's decode cost, t(a) = t0 + c1 a seconds per step at a active streams, and
    what re-prefilling interrupted requests after a weight update adds (not in the model)."""

    t0: float
    c1: float
    steps: int
    resume_stall_s: float
    """Mean extra seconds of the first step after an update, over t(a)."""
    resume_streams: float
    """Mean requests in flight at those updates."""
    full_fleet_step_s: float
    """Mean step with at least 90 % of the slots active, as replayed (model: t(C))."""


TRAINING_LOAD = """
import sys, torch
from transformers import AutoModelForCausalLM
torch.set_num_threads(1)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
ids = torch.randint(0, model.config.vocab_size, (8, 256))
def step():
    opt.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
step()
print("ready", flush=True)
while True:
    step()
"""
"""What the trainer does beside the engine in an asynchronous run: the workload's model trained
on one thread (forward, backward, AdamW), without end."""


@contextlib.contextmanager
def training_load(model: Path):
    """TRAINING_LOAD running in its own process (the other core) while the block runs."""
    proc = subprocess.Popen(
        [sys.executable, "-c", TRAINING_LOAD, str(model)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the training load did not start ({proc.poll()})")
        yield
    finally:
        proc.kill()
        proc.wait()


def measure_decode(
    task: Task, plan: Plan, table: list[list[int]], updates: int, loaded: bool = False
) -> Decode:
    """Fit t(a) on the engine replaying 4 C of the workload's lengths at the fleet's
    concurrency C (full fleet, then the drain down to one stream); `loaded`: with a training
    load on the other core (`training_load`), as in an asynchronous run while the trainer
    computes."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(task.tokenizer))
    prompt_ids = tok(task.prompts[0], add_special_tokens=False).input_ids
    lengths = [L for row in table for L in row][: 4 * plan.slots]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the rollout service runs here (OMP_NUM_THREADS=1)
    try:
        with training_load(task.model) if loaded else contextlib.nullcontext():
            log = asyncio.run(
                _replay(task.model, prompt_ids, lengths, plan.slots, updates, plan.keep_kv)
            )
    finally:
        torch.set_num_threads(threads)
    plain = [(a, dt) for a, dt, resumed in log if not resumed]
    t0, c1 = fit_line(*per_level_medians(plain))
    t0 = max(t0, 1e-6)  # the model needs t0 > 0 (alpha = c1 C / t0)
    resumed = [(a, dt) for a, dt, r in log if r]
    stall = float(np.mean([dt - (t0 + c1 * a) for a, dt in resumed])) if resumed else 0.0
    streams = float(np.mean([a for a, _ in resumed])) if resumed else 0.0
    full = [dt for a, dt in plain if a >= 0.9 * plan.slots] or [t0 + c1 * plan.slots]
    return Decode(t0, c1, len(plain), stall, streams, float(np.mean(full)))


def fit_line(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """Theil-Sen (intercept, slope): the median of the pairwise slopes, robust to the outliers
    a shared machine adds (a preempted step). Both kept >= 0: a negative intercept gives the
    median of y/x through the origin instead."""
    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    i, j = np.triu_indices(len(xs), 1)
    dx = xs[j] - xs[i]
    if not np.any(dx != 0):
        return float(np.median(ys)), 0.0
    slope = max(0.0, float(np.median((ys[j] - ys[i])[dx != 0] / dx[dx != 0])))
    intercept = float(np.median(ys - slope * xs))
    if intercept < 0:
        return 0.0, float(np.median(ys[xs > 0] / xs[xs > 0]))
    return intercept, slope


def per_level_medians(points: Sequence[tuple[int, float]]) -> tuple[list[int], list[float]]:
    """The median y at each distinct x (each occupancy level counts once in the fit)."""
    levels: dict[int, list[float]] = {}
    for a, dt in points:
        levels.setdefault(a, []).append(dt)
    xs = sorted(levels)
    return xs, [float(np.median(levels[a])) for a in xs]


@dataclass(frozen=True)
class Measured:
    decode: Decode
    train_a: float
    train_b: float
    t_sync: float


def measure_train(syncs: list[RunRecord], lengths: Lengths, task: Task, plan: Plan):
    """(train_a, train_b) over padded tokens, from the synchronous runs' steps."""
    padded, seconds = [], []
    for sync in syncs:
        for v, prompts in sorted(sync.step_prompts.items()):
            longest = max(L for i, a in prompts for L in lengths(i, a))
            padded.append(len(prompts) * plan.n * (longest + task.prompt_len))
            seconds.append(sync.step_time_s[v])
    return fit_line(padded, seconds)


def workload(plan: Plan, task: Task, m: Measured) -> overlap.Workload:
    return overlap.Workload(
        slots=plan.slots,
        n=plan.n,
        batch=plan.batch,
        max_groups=plan.max_groups,
        len_median=plan.median,
        len_sigma=plan.sigma,
        max_len=plan.max_len,
        prompt_len=task.prompt_len,
        t0=m.decode.t0,
        alpha=m.decode.c1 * plan.slots / m.decode.t0 if m.decode.t0 > 0 else 0.0,
        train_a=m.train_a,
        train_b=m.train_b,
        padded=True,
        t_sync=m.t_sync,
        steps=plan.steps,
        seed=plan.seed,
        abort_lag=ABORT_LAG,
        requeue=True,
        resample=True,
    )


# ---------------------------------------------------------------------------- report


@dataclass
class EtaFigures:
    eta: int
    measured_speedup: float
    ideal_speedup: float
    measured_throughput: float
    ideal_throughput: float
    settings: dict = field(default_factory=dict)


def predicted_train_s(w: overlap.Workload, r: RunRecord, lengths: Lengths) -> float:
    """Mean train step the fitted cost predicts for the batches this run actually trained."""
    return float(
        np.mean(
            [
                w.train_time([L for i, a in ps for L in lengths(i, a)])
                for ps in r.step_prompts.values()
            ]
        )
    )


def engine_figures(r: RunRecord, sim: overlap.SimResult, decode: Decode) -> dict:
    """The engine's counters over the run beside the model's (see the module docstring)."""
    e = r.engine
    if not e.get("steps"):
        return {}
    active = e["stream_steps"] / e["steps"]
    return {
        "mean_active": round(active, 2),
        "ideal_mean_active": round(sim.mean_active, 2),
        "steps": int(e["steps"]),
        "ideal_steps": round(sim.token_steps),
        "tokens": int(e["stream_steps"]),
        "ideal_tokens": round(sim.gen_tokens),
        "step_ms": round(1000 * e["step_seconds"] / e["steps"], 3),
        "model_step_ms": round(1000 * (decode.t0 + decode.c1 * active), 3),
        "busy": round(e["step_seconds"] / r.duration_s, 3),
        "prefill_s": round(e.get("prefill_seconds", 0.0), 3),
        "prefill_tokens": int(e.get("prefill_tokens", 0)),
        "decode_step_ms": round(
            1000 * (e["step_seconds"] - e.get("prefill_seconds", 0.0)) / e["steps"], 3
        ),
    }


def figures(
    plan: Plan,
    runs: dict[int, RunRecord],
    ideal: overlap.Ideal,
    lengths: Lengths,
    decode: Decode,
) -> list[EtaFigures]:
    m = plan.steps * plan.batch * plan.n
    w = ideal.sync_workload
    out = []
    for eta, r in runs.items():
        sim = ideal.runs[eta]
        out.append(
            EtaFigures(
                eta=eta,
                measured_speedup=runs[0].wall_s / r.wall_s,
                ideal_speedup=ideal.speedup(eta),
                measured_throughput=m / r.wall_s,
                ideal_throughput=sim.throughput,
                settings={
                    "wall_s": round(r.wall_s, 3),
                    "ideal_wall_s": round(sim.wall_s, 3),
                    "sync_wall_s": round(runs[0].wall_s, 3),
                    "ideal_sync_wall_s": round(ideal.sync.wall_s, 3),
                    "staleness_max": r.staleness_max,
                    "ideal_staleness_max": sim.max_staleness,
                    "dropped": r.dropped,
                    "ideal_dropped": sim.dropped,
                    "train_step_s_mean": round(float(np.mean(list(r.step_time_s.values()))), 4),
                    "train_step_s_predicted": round(predicted_train_s(w, r, lengths), 4),
                    "ideal_train_step_s_mean": round(sim.train_busy_s / plan.steps, 4),
                    "update_s_median": round(float(np.median(r.update_s())), 4),
                    "cpu_share": r.cpu_share,
                    "fleet_tokens_per_s_finished": round(
                        sum(L for i, a in r.finished_prompts for L in lengths(i, a)) / r.wall_s,
                        1,
                    ),
                    "ideal_fleet_tokens_per_s": round(sim.gen_tokens / sim.wall_s, 1),
                    "engine": engine_figures(r, sim, decode),
                    "load_avg": round(r.load_avg, 2),
                    "ledger": r.fates,
                },
            )
        )
    return out


def contention(
    w: overlap.Workload,
    tool: overlap.Ideal,
    idle: Decode,
    loaded: Decode,
    f: EtaFigures,
    table: list[list[int]],
) -> dict:
    """What sharing the machine's memory system with the trainer costs the engine, in the
    model: the decode cost replayed beside a training load (`measure_decode(loaded=True)`),
    applied for the share of the asynchronous run the model's trainer computes (t0 and c1
    interpolated by that share; none in sync, where they never overlap). The model's premise is
    separate hardware for generation and training; here they share two cores' caches and
    memory bandwidth. An explanation of the gap beside the ratio, not a replacement for it."""
    if f.eta == 0:
        return {}
    sim = tool.runs[f.eta]
    share = min(1.0, sim.train_busy_s / sim.wall_s)
    t0 = max(1e-6, idle.t0 + share * (loaded.t0 - idle.t0))
    c1 = max(0.0, idle.c1 + share * (loaded.c1 - idle.c1))
    wc = replace(w, t0=t0, alpha=c1 * w.slots / t0, eta=f.eta)
    speedup = tool.sync.wall_s / overlap.simulate_async(wc, overlap.GroupLengths(wc, table)).wall_s
    return {
        "loaded_decode": {"t0": round(loaded.t0, 7), "c1": round(loaded.c1, 8)},
        "full_fleet_step_s": {"idle": round(idle.full_fleet_step_s, 5),
                              "loaded": round(loaded.full_fleet_step_s, 5)},
        "trainer_share": round(share, 3),
        "ideal_speedup": round(speedup, 3),
        "ratio": round(f.measured_speedup / speedup, 3),
    }  # fmt: skip


def plot(figs: list[EtaFigures], tool: list[float], bound_throughput: float, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    etas = [f.eta for f in figs]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(etas, [f.measured_throughput for f in figs], "o-", label="measured (asyncrl)")
    ax.plot(etas, [f.ideal_throughput for f in figs], "s--", label="ideal, the scheduler's rules")
    ax.plot(etas, tool, "^:", label="ideal, overlap_bound's model")
    ax.axhline(bound_throughput, color="grey", linestyle=":", label="analytic ceiling")
    ax.set_xlabel("eta (max staleness; 0 = synchronous)")
    ax.set_ylabel("trained samples / s")
    ax.set_xticks(etas)
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title("long-tail workload: throughput against eta")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _rounded(d: dict) -> dict:
    return {k: _rounded(v) if isinstance(v, dict) else round(v, 6) if isinstance(v, float) else v
            for k, v in d.items()}  # fmt: skip


def run(ctx: Context) -> list[Result]:
    plan = plan_for(ctx)
    task = build_task(ctx.work_dir / "system", plan)
    table = task.lengths(plan)

    @functools.cache
    def lengths(index: int, attempt: int) -> tuple[int, ...]:
        return tuple(task.attempt_lengths(plan, index, attempt))

    decode = measure_decode(task, plan, table, updates=ctx.size(6, 1))
    loaded = measure_decode(task, plan, table, updates=0, loaded=True)
    records: dict[int, list[RunRecord]] = {eta: [] for eta in plan.etas}
    with LocalCluster(ctx.work_dir / "system" / "var", plan.keep_kv) as cluster:
        for _ in range(plan.repeats):
            for eta in plan.etas:
                spec = experiment_spec(task, plan, eta)
                records[eta].append(run_experiment(cluster, spec, eta, plan.timeout_s))
    runs = {eta: min(rs, key=lambda r: r.wall_s) for eta, rs in records.items()}  # best of
    train_a, train_b = measure_train(records[0], lengths, task, plan)
    t_sync = float(np.median([u for r in records[0] for u in r.update_s()]))
    measured = Measured(decode, train_a, train_b, t_sync)
    w = workload(plan, task, measured)
    ideal = overlap.ideal(w, plan.etas, table, lengths)
    tool_w = replace(w, abort_lag=0, requeue=False)
    tool = overlap.ideal(tool_w, plan.etas, table)
    figs = figures(plan, runs, ideal, lengths, decode)
    bound = ideal.bound
    ceiling = w.m / (bound.t_sync + max(bound.t_gen_throughput, bound.t_train))
    out_dir = ctx.work_dir if ctx.quick else Path("var/bench")
    tool_throughput = [tool.runs[f.eta].throughput for f in figs]
    png = plot(figs, tool_throughput, ceiling, out_dir / "system_throughput.png")
    common = {
        "workload": {"n": plan.n, "batch": plan.batch, "steps": plan.steps,
                     "max_groups": plan.max_groups, "slots": plan.slots,
                     "keep_kv_on_update": plan.keep_kv,
                     "cpu_affinity": cpu_affinity(),
                     "lengths": f"lognormal median {plan.median:g} sigma {plan.sigma:g} "
                                f"cap {plan.max_len}", "prompt_len": task.prompt_len},
        "measured_parameters": _rounded(asdict(measured)),
        "model": {"alpha": round(w.alpha, 4), "E_len": round(bound.e_len, 2),
                  "E_max_len": round(bound.e_max, 2), "T_gen_sync": round(bound.t_gen_sync, 4),
                  "T_gen_throughput": round(bound.t_gen_throughput, 4),
                  "T_train": round(bound.t_train, 4), "T_sync": round(bound.t_sync, 4),
                  "speedup_bound": round(bound.speedup, 3)},
        "plot": str(png),
    }  # fmt: skip
    peer = "ideal speedup (overlap_bound's zero-overhead model, measured parameters)"
    return [
        Result(NAME, "system_speedup", f.measured_speedup, "x", peer, tool.speedup(f.eta),
               {"eta": f.eta, "measured_throughput": round(f.measured_throughput, 3),
                "ideal_throughput": round(tool.runs[f.eta].throughput, 3),
                "walls_s": [round(r.wall_s, 3) for r in records[f.eta]],
                "ideal_speedup_scheduler_rules": round(f.ideal_speedup, 3),
                "ideal_throughput_scheduler_rules": round(f.ideal_throughput, 3),
                "ratio_scheduler_rules": round(f.measured_speedup / f.ideal_speedup, 3),
                # every update interrupts the requests in flight (none in sync): re-prefill
                "resume_stall_s_est": round(plan.steps * decode.resume_stall_s, 3) if f.eta else 0,
                "contention": contention(tool_w, tool, decode, loaded, f, table),
                **f.settings, **common})
        for f in figs
    ]  # fmt: skip


if __name__ == "__main__":  # python -m bench.system [--quick]: this benchmark alone, as JSON
    import tempfile

    with tempfile.TemporaryDirectory(prefix="asyncrl-system-") as tmp:
        results = run(Context(work_dir=Path(tmp), quick="--quick" in sys.argv))
    print(json.dumps([r.to_json() for r in results], indent=1))
