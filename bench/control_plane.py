"""What the control plane costs per group: the whole deployment with nothing else to do.

Every service runs as its own process on a temporary var dir, as `make up` runs them: a secure
nats-server (JetStream, TLS, users), the scheduler, one reward worker, one rollout and one
trainer (TLS + tokens on every RPC), placed as the supervisor places them under
`ASYNCRL_CPU_AFFINITY=1` (the rollout on a core of its own, the rest on the others; the
benchmark's default, 0 leaves it to the kernel: ~5-8 % more CPU-µs per group here). Only the compute is taken out, by the benchmark's own
stand-ins (`bench.zero`): the rollout's engine answers each request at once with a fixed-length
sample, and the trainer's step consumes its batch and does nothing. Everything else is real:
dispatch under the staleness rule, GenerateGroup, scoring (exact_match in the reward pool),
publishing to JetStream, the trainer's consumer and triage, weight publishing, CommitWeights
and the fleet's UpdateWeights, checkpoints, the ledger, state persistence and logging.

It runs at B = 32 and at B = 128 groups per step (`BATCHES`; n = 8): each step also publishes
a version and commits it to the fleet (and checkpoints every `trainer.checkpoint_every`, 10), a
cost per step that B spreads over its groups (AReaL's executor has no such step). Measured in
rounds (three; one quick): a fresh deployment, after a warm-up, runs one steady window (at least
5 s and 10 steps, from one trainer step to a later one), then the peer runs once. Over the window:
- groups/s: groups trained ÷ wall time;
- CPU-µs per group: user + system CPU time of every process (children included, nats-server
  too) ÷ groups trained.
The peer is AReaL's in-process `WorkflowExecutor` with a zero-latency fake engine (groups of n,
the same B), measured by `../shared/tools/peer_areal/bench_areal_control_plane.py` (its child
process) when its venv exists; otherwise the benchmark is skipped with this side's figures in
the reason. A speed probe runs on every CPU throughout (`bench.speed`): this shared VM's speed
halves for seconds at a time, so each side's CPU-µs are put at the machine's reference speed
over its own window, and the reported pair is the round with the median ratio of those (every
round, raw and corrected, in the settings).
`python -m bench.control_plane --profile DIR` runs each service under cProfile and
prints what dominates per group in each process; `--sample DIR` samples each one with py-spy
instead (`bench.sampling`: no cost per call, so call-heavy code is not inflated).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import psutil

from asyncrl.client import AsyncrlClient
from asyncrl.natsutil import LocalNatsServer
from asyncrl.net import free_port
from asyncrl.supervisor.daemon import cpu_placement
from asyncrl.v1 import common_pb2
from bench import counts
from bench.report import Context, Result, Skip, cpu_affinity
from bench.sampling import Sampler, plot_samples, print_samples
from bench.speed import SpeedProbe, reference, slowdown
from bench.zero import PATCH_ENV, PROFILE_ENV

NAME = "control_plane"
ROOT = Path(__file__).resolve().parents[1]
AREAL_TOOL = ROOT.parent / "shared" / "tools" / "peer_areal" / "bench_areal_control_plane.py"
AREAL_PYTHON = Path(os.environ.get("ASYNCRL_BENCH_AREAL_PYTHON", "/tmp/peer_areal/venv/bin/python"))
SERVICES = ("scheduler", "reward", "rollout", "trainer")
DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")
STEP_TIMEOUT_S = 120.0  # start-up included: four Python services on a shared 2-core machine


@dataclass
class Sizes:
    n: int = 8
    batch: int = 32
    eta: int = 1
    max_concurrent: int = 64
    output_len: int = 16
    warmup_steps: int = 5
    min_seconds: float = 5.0
    """Of each window."""
    min_steps: int = 10
    windows: int = 3
    """Rounds with the peer (a deployment's window, then a peer run; the median ratio is
    reported), or consecutive windows of one deployment without it (the best is reported)."""

    @classmethod
    def for_context(cls, ctx: Context) -> Sizes:
        return cls(
            warmup_steps=ctx.size(5, 2),
            min_seconds=ctx.size(5.0, 2.0),
            min_steps=ctx.size(10, 2),
            windows=ctx.size(3, 1),
        )


@dataclass
class Window:
    """One steady window: groups trained, wall seconds and CPU seconds per process."""

    groups: int
    seconds: float
    cpu_s: dict[str, float]
    main_thread_s: dict[str, float] = field(default_factory=dict)
    """CPU of each Python service's main thread (its event loop); the rest is gRPC's C
    threads, the asyncio executor and child processes."""
    calls: dict[str, dict] = field(default_factory=dict)
    """What the calls between the services carried (`bench.counts.per_group`)."""
    waits: dict[str, int] = field(default_factory=dict)
    """Voluntary context switches of each process's main thread (its event loop's sleeps)."""
    span: tuple[float, float] = (0.0, 0.0)
    """Its start and end, monotonic clock (where the speed probe's samples are taken)."""

    @property
    def groups_per_s(self) -> float:
        return self.groups / self.seconds

    @property
    def cpu_us_per_group(self) -> float:
        return 1e6 * sum(self.cpu_s.values()) / self.groups

    def per_group(self, cpu: dict[str, float]) -> dict[str, float]:
        return {k: round(1e6 * v / self.groups, 1) for k, v in cpu.items()}


# ---- the deployment ------------------------------------------------------------------------


def pin_process(pid: int, cpus: set[int]) -> None:
    """Every thread of a running process onto `cpus` (threads it starts later inherit them)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.sched_setaffinity(int(tid), cpus)


def write_dataset(path: Path, prompts: int = 256) -> Path:
    rng = random.Random(0)
    rows = []
    for _ in range(prompts):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rows.append(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}))
    path.write_text("\n".join(rows) + "\n")
    return path


def experiment_spec(model: Path, dataset: Path, s: Sizes) -> dict:
    return {
        "name": "control-plane",
        "model": {"path": str(model)},
        "dataset": {"path": str(dataset), "epochs": 10_000},
        "rollout": {
            "engine": "torch",  # the zero engine in bench.zero's rollout process
            "n_samples": s.n,
            "max_head_offpolicyness": s.eta,
            "max_concurrent_rollouts": s.max_concurrent,
            "filter": "none",  # the zero engine's answers are all wrong: keep every group
            "gconfig": {"max_new_tokens": s.output_len},
        },
        "reward": {"function": "exact_match"},
        "trainer": {
            "backend": "torch",  # bench.zero's NoopBackend under the name: it cannot stream
            "weight_sync": "disk",
            "batch_size": s.batch,
            "total_steps": 1_000_000,
        },
    }


@contextlib.contextmanager
def _environ(**values: str):
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Deployment:
    """nats-server and the four services, each its own process, on `var`."""

    def __init__(self, var: Path, profile: Path | None = None):
        self.var = var
        self.profile = profile
        self.scheduler = f"127.0.0.1:{free_port()}"
        self.nats = LocalNatsServer(var / "nats", log_file=var / "nats.log")
        self.procs: dict[str, subprocess.Popen] = {}
        self.counts = var / "counts"

    def env(self, service: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
        env.update(
            NATS_URL=self.nats.url,
            ASYNCRL_SCHEDULER=self.scheduler,
            ASYNCRL_VAR=str(self.var),
            ASYNCRL_WEIGHTS=str(self.var / "weights"),
            ASYNCRL_SECRETS=str(self.var / "secrets"),
            ASYNCRL_INSECURE="0",
            ASYNCRL_SERVICE=service,
            PYTHONUNBUFFERED="1",
        )
        env[counts.COUNTS_ENV] = str(self.counts)
        env[PATCH_ENV] = ",".join(filter(None, ["bench.counts", env.get(PATCH_ENV, "")]))
        if self.profile is not None:
            env[PROFILE_ENV] = str(self.profile)
        return env

    def cpus(self, service: str) -> set[int] | None:
        """Where the service runs: as the supervisor places it under ASYNCRL_CPU_AFFINITY=1
        (the benchmark's default; 0 leaves it to the kernel): the rollout on a core of its own,
        the rest on the others."""
        if not cpu_affinity():
            return None
        return cpu_placement(service, 0, sorted(os.sched_getaffinity(0)), rollouts=1)

    def start(self) -> None:
        self.nats.start()
        if (cpus := self.cpus("nats")) is not None:
            pin_process(self.nats.proc.pid, cpus)
        (self.var / "logs").mkdir(parents=True, exist_ok=True)
        for service in SERVICES:
            cpus = self.cpus(service)
            cmd = [sys.executable, "-m", "bench.zero", service]
            if service == "scheduler":
                cmd += ["--port", self.scheduler.rpartition(":")[2]]
            if service == "rollout":
                cmd += ["--engine", "torch"]
            with open(self.log(service), "wb") as log:
                self.procs[service] = subprocess.Popen(
                    cmd,
                    cwd=ROOT,
                    env=self.env(service),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=None
                    if cpus is None
                    else functools.partial(os.sched_setaffinity, 0, cpus),
                )

    def log(self, service: str) -> Path:
        return self.var / "logs" / f"{service}.log"

    def pids(self) -> dict[str, int]:
        pids = {s: p.pid for s, p in self.procs.items()}
        if self.nats.proc is not None:
            pids["nats-server"] = self.nats.proc.pid
        return pids

    def signal_services(self, signum: int) -> None:
        """Start (SIGUSR1) or stop and write (SIGUSR2) the services' profiles; only when they
        run under the profiler (which handles these signals)."""
        if self.profile is None:
            return
        for proc in self.procs.values():
            proc.send_signal(signum)
        if signum == signal.SIGUSR2:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not all(
                (self.profile / f"{s}.prof").exists() for s in self.procs
            ):
                time.sleep(0.1)

    def check_alive(self) -> None:
        for service, proc in self.procs.items():
            if proc.poll() is not None:
                tail = self.log(service).read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{service} exited with {proc.returncode}:\n{tail}")

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the trainer first (it ends its step while the others still answer), then
        to the other services (they close cleanly: profiles are written); SIGKILL to the process
        group of one that outlives `timeout`; then nats-server."""
        trainer = self.procs.get("trainer")
        order = [[trainer] if trainer else [], [p for p in self.procs.values() if p is not trainer]]
        for procs in order:
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for proc in procs:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        self.nats.stop()


def cpu_seconds(
    pids: dict[str, int],
) -> tuple[dict[str, float], dict[str, float], dict[str, int]]:
    """Per process (children included): user + system CPU seconds; its main thread's; and the
    voluntary context switches of its main thread (and its children's): how often the event
    loop went to sleep waiting for something."""
    total, main, waits = {}, {}, {}
    for name, pid in pids.items():
        root = psutil.Process(pid)
        total[name], waits[name] = 0.0, 0
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                t = p.cpu_times()
                total[name] += t.user + t.system
                waits[name] += p.num_ctx_switches().voluntary
        main[name] = sum(t.user_time + t.system_time for t in root.threads() if t.id == pid)
    return total, main, waits


class StepWatch:
    """Trainer steps as the trainer logs them (`train_step` lines), read from its log file:
    nothing is asked of the services, so watching costs them nothing."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.step = 0

    def poll(self) -> int:
        if self.path.exists():
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
            end = data.rfind(b"\n") + 1
            self.offset += end
            for line in data[:end].splitlines():
                if b'"train_step"' in line:
                    with contextlib.suppress(ValueError):
                        self.step = max(self.step, int(json.loads(line).get("step", 0)))
        return self.step

    def wait_for(self, step: int, dep: Deployment, timeout: float = STEP_TIMEOUT_S) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() < step:
            dep.check_alive()
            if time.monotonic() > deadline:
                tail = self.path.read_text(errors="replace")[-3000:]
                raise TimeoutError(f"trainer at step {self.step}, not {step}:\n{tail}")
            time.sleep(0.01)
        return self.step


async def _submit(dep: Deployment, spec: dict, timeout: float = STEP_TIMEOUT_S) -> str:
    """Wait until a trainer, a rollout and a reward worker registered; submit `spec`."""
    kinds = {
        common_pb2.WORKER_KIND_TRAINER,
        common_pb2.WORKER_KIND_ROLLOUT,
        common_pb2.WORKER_KIND_REWARD,
    }
    deadline = time.monotonic() + timeout
    async with AsyncrlClient(dep.scheduler) as client:
        while True:
            dep.check_alive()
            with contextlib.suppress(Exception):
                if kinds <= {w.kind for w in await client.workers()}:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError("the workers did not register")
            await asyncio.sleep(0.2)
        return (await client.submit(spec)).id


def measure(
    work_dir: Path, model: Path, s: Sizes, profile: Path | None = None, sample: Path | None = None
) -> list[Window]:
    """Run the deployment on a fresh var dir under `work_dir`; `s.windows` consecutive steady
    windows (one under the profiler, which covers it alone; with `sample`, py-spy samples every
    service over the windows: `bench.sampling`)."""
    from asyncrl.security import ensure_secrets

    var = work_dir / f"control-plane-{os.getpid()}-{time.monotonic_ns()}"
    var.mkdir(parents=True)
    dataset = write_dataset(var / "train.jsonl")
    with _environ(ASYNCRL_SECRETS=str(var / "secrets"), ASYNCRL_INSECURE="0"):
        ensure_secrets(var / "secrets")
        dep = Deployment(var, profile)
        try:
            dep.start()
            asyncio.run(_submit(dep, experiment_spec(model, dataset, s)))
            watch = StepWatch(dep.log("trainer"))
            last = watch.wait_for(s.warmup_steps, dep)
            dep.signal_services(signal.SIGUSR1)  # profiling (if on) covers the window only
            windows = []
            if profile:  # one window as long as all of them: enough samples
                s = replace(s, min_seconds=s.min_seconds * s.windows, windows=1)
            pids = {name: proc.pid for name, proc in dep.procs.items()}
            with Sampler(sample, pids) if sample else contextlib.nullcontext():
                for _ in range(s.windows):
                    w, last = _window(dep, watch, last, s)
                    windows.append(w)
            dep.signal_services(signal.SIGUSR2)
        finally:
            dep.stop()
    return windows


def _window(dep: Deployment, watch: StepWatch, first: int, s: Sizes) -> tuple[Window, int]:
    """From trainer step `first` to the first one at least min_steps and min_seconds later."""
    cpu0, main0, waits0 = cpu_seconds(dep.pids())
    calls0 = counts.read(dep.counts)
    t0, m0 = time.perf_counter(), time.monotonic()
    last = first
    while last < first + s.min_steps or time.perf_counter() - t0 < s.min_seconds:
        last = watch.wait_for(last + 1, dep)
    seconds = time.perf_counter() - t0
    cpu1, main1, waits1 = cpu_seconds(dep.pids())
    groups = (last - first) * s.batch
    w = Window(
        groups=groups,
        seconds=seconds,
        cpu_s={k: cpu1[k] - cpu0[k] for k in cpu1},
        main_thread_s={k: main1[k] - main0[k] for k in SERVICES},
        calls=counts.per_group(calls0, counts.read(dep.counts), groups),
        waits={k: waits1[k] - waits0[k] for k in waits1},
        span=(m0, time.monotonic()),
    )
    return w, last


def best(windows: list[Window]) -> Window:
    """The window with the fewest CPU-µs per group."""
    return min(windows, key=lambda w: w.cpu_us_per_group)


# ---- the peer ------------------------------------------------------------------------------


def areal_available() -> bool:
    return AREAL_PYTHON.exists() and AREAL_TOOL.exists()


def areal_run(s: Sizes, quick: bool) -> dict:
    """One run of AReaL's WorkflowExecutor (the peer tool's child process): zero-latency
    engine, groups of n, batch B; its figures (`cpu_us_per_rollout`: CPU-µs per group)."""
    cmd = [
        str(AREAL_PYTHON), str(AREAL_TOOL), "--child", "throughput", "--layer", "executor",
        "--mode", "prepare_batch", "--batch-size", str(s.batch), "--eta", str(s.eta),
        "--group-size", str(s.n), "--gen-latency", "0", "--output-len", str(s.output_len),
        "--min-seconds", "1" if quick else "5", "--min-batches", "2" if quick else "5",
        "--max-seconds", "10" if quick else "60",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line.removeprefix("RESULT "))
    raise RuntimeError(f"AReaL peer failed ({proc.returncode}): {proc.stderr[-2000:]}")


PEER_EXIT_S = 0.5
"""Allowance for the peer's exit after its timed window (its span for the speed probe is the
window, not its start-up: importing AReaL takes seconds)."""


@dataclass
class Round:
    """One deployment's steady window, then one run of the peer right after it, each with how
    much slower than its reference speed the machine ran meanwhile (`bench.speed`)."""

    ours: Window
    peer: dict
    peer_span: tuple[float, float] = (0.0, 0.0)
    ours_slowdown: float = 1.0
    peer_slowdown: float = 1.0
    reference_unit_s: float = 0.0
    """The probe's unit at the run's reference speed (to compare separate invocations)."""

    @property
    def ours_cpu_us(self) -> float:
        """CPU-µs per group at the machine's reference speed."""
        return self.ours.cpu_us_per_group / self.ours_slowdown

    @property
    def peer_cpu_us(self) -> float:
        return self.peer["cpu_us_per_rollout"] / self.peer_slowdown

    @property
    def raw_ratio(self) -> float:
        return self.ours.cpu_us_per_group / self.peer["cpu_us_per_rollout"]

    @property
    def ratio(self) -> float:
        """At the reference speed: the code's ratio, the machine's state taken out."""
        return self.ours_cpu_us / self.peer_cpu_us


def paired_rounds(work_dir: Path, model: Path, s: Sizes, quick: bool) -> list[Round]:
    """`s.windows` rounds, each a fresh deployment's window and then a peer run, with a speed
    probe on every CPU throughout. This VM's speed halves for seconds at a time (the same code,
    the same call shapes: docs/benchmarks.md, session 16), so each side's CPU time is put at
    the machine's reference speed over its own window."""
    one = replace(s, windows=1)
    rounds = []
    with SpeedProbe(work_dir / f"speed-{os.getpid()}-{time.monotonic_ns()}") as speed:
        for _ in range(s.windows):
            [w] = measure(work_dir, model, one)
            peer = areal_run(s, quick)
            end = time.monotonic()  # its timed window ended just before it exited
            rounds.append(Round(w, peer, (end - peer["elapsed_s"] - PEER_EXIT_S, end)))
    ref = reference(speed.samples())
    for r in rounds:
        r.reference_unit_s = ref
        r.ours_slowdown = slowdown(speed.samples(*r.ours.span), ref)
        r.peer_slowdown = slowdown(speed.samples(*r.peer_span), ref)
    return rounds


def median_round(rounds: list[Round]) -> Round:
    """The round with the median ratio (the lower middle one of an even count)."""
    return sorted(rounds, key=lambda r: r.ratio)[(len(rounds) - 1) // 2]


# ---- the benchmark -------------------------------------------------------------------------


def _settings(s: Sizes, rounds: list[Round]) -> dict:
    r = median_round(rounds)
    w = r.ours
    return {
        **asdict(s),
        "rounds": [
            {
                "cpu_us_per_group": round(x.ours_cpu_us, 1),
                "peer_cpu_us_per_group": round(x.peer_cpu_us, 1),
                "ratio": round(x.ratio, 3),
                "raw_cpu_us_per_group": round(x.ours.cpu_us_per_group, 1),
                "raw_peer_cpu_us_per_group": round(x.peer["cpu_us_per_rollout"], 1),
                "raw_ratio": round(x.raw_ratio, 3),
                "slowdown": round(x.ours_slowdown, 3),
                "peer_slowdown": round(x.peer_slowdown, 3),
                "groups_per_s": round(x.ours.groups_per_s, 1),
                "peer_groups_per_s": round(x.peer["rollouts_per_s"], 1),
            }
            for x in rounds
        ],
        "reference_unit_ms": round(1e3 * rounds[0].reference_unit_s, 2),
        "raw_median_ratio": round(statistics.median_low(x.raw_ratio for x in rounds), 3),
        "window_s": round(w.seconds, 2),
        "groups": w.groups,
        "cpu_us_per_group_by_process": w.per_group(w.cpu_s),
        "main_thread_cpu_us_per_group": w.per_group(w.main_thread_s),
        "calls": w.calls,
        "cpu_per_wall": round(sum(w.cpu_s.values()) / w.seconds, 2),
        "security": "TLS + tokens on every RPC, NATS over TLS with users",
        "peer": {
            "mode": r.peer["mode"],
            "groups": r.peer["timed_rollouts"],
            "cpu_per_wall": round(r.peer["cpu_s_per_wall_s"], 2),
        },
    }


BATCHES = (32, 128)
"""Groups per step, each a run of its own (the fleet keeps two steps in flight): every step
publishes a version and commits it to the fleet (a checkpoint every `checkpoint_every`), so the
cost per group is a per-group part plus a per-step part over B. `--quick` runs the first only."""


def run(ctx: Context) -> list[Result]:
    out = []
    for batch in BATCHES[:1] if ctx.quick else BATCHES:
        s = replace(Sizes.for_context(ctx), batch=batch, max_concurrent=2 * batch)
        out += _run_batch(ctx, s)
    return out


def _run_batch(ctx: Context, s: Sizes) -> list[Result]:
    model = ctx.tiny_model(seed=0)
    if not areal_available():
        w = best(measure(ctx.work_dir, model, s))
        here = (
            f"measured here: {w.groups_per_s:.0f} groups/s, {w.cpu_us_per_group:.0f}"
            f" CPU-µs/group (n={s.n}, B={s.batch})"
        )
        missing = (
            f"no tool at {AREAL_TOOL} (../shared beside the repository)"
            if not AREAL_TOOL.exists()
            else f"no venv at {AREAL_PYTHON} (bash {AREAL_TOOL.parent}/setup_venv.sh)"
        )
        raise Skip(f"AReaL peer not run: {missing}; {here}")
    try:
        rounds = paired_rounds(ctx.work_dir, model, s, ctx.quick)
    except (RuntimeError, subprocess.TimeoutExpired) as e:  # an optional peer: say why
        raise Skip(f"AReaL peer failed ({str(e)[-300:]})") from None
    r = median_round(rounds)
    who = (
        f"AReaL 1.0.4 WorkflowExecutor in one process, zero-latency engine (n={s.n},"
        f" B={s.batch}); the median of {len(rounds)} rounds, each a deployment's window then"
        " a peer run"
    )
    settings = _settings(s, rounds)
    return [
        Result(
            NAME,
            "CPU-µs per group at the machine's reference speed, all processes (scheduler,"
            f" rollout, reward, trainer, nats), B={s.batch}",
            r.ours_cpu_us,
            "µs",
            who,
            r.peer_cpu_us,
            settings,
        ),
        Result(
            NAME,
            f"groups/s trained, zero-cost engine and trainer step (as measured), B={s.batch}",
            r.ours.groups_per_s,
            "1/s",
            who,
            r.peer["rollouts_per_s"],
            settings,
        ),
    ]


# ---- profile ------------------------------------------------------------------------------


IDLE = "<method 'poll' of 'select.epoll' objects>"
"""Where an event loop waits for work: excluded (next to nothing on the thread's CPU clock,
which the profiler runs on, but the calls are counted)."""


def print_profiles(directory: Path, w: Window, unprofiled: Window, top: int) -> None:
    """The functions with the most own time in each service's main thread over the window,
    the loop's idle wait excluded. µs/group are scaled to the unprofiled run (share of the
    profiled busy time × that thread's CPU-µs/group measured without the profiler, which
    inflates call-heavy code): estimates for ranking, not measurements."""
    import pstats

    base = unprofiled.per_group(unprofiled.main_thread_s)
    for service in SERVICES:
        path = directory / f"{service}.prof"
        if not path.exists():
            continue
        stats = pstats.Stats(str(path))
        busy = sum(v[2] for (_, _, fn), v in stats.stats.items() if fn != IDLE) or 1.0
        scale = base[service] / busy  # profiled seconds -> unprofiled µs/group
        print(
            f"\n## {service}: main thread {base[service]:.0f} CPU-µs/group unprofiled "
            f"({1e6 * busy / w.groups:.0f} µs/group busy under the profiler)"
        )
        gc_file = directory / f"{service}.gc.json"
        if gc_file.exists():
            g = json.loads(gc_file.read_text())
            per = [f"{1e6 * t / w.groups:.1f}" for t in g["seconds"]]
            print(
                f"garbage collector, gen 0/1/2: {'/'.join(per)} µs/group under the profiler,"
                f" {g['collections']} collections"
            )
        print("| own µs/group | cum µs/group | calls/group | function |")
        print("|---:|---:|---:|---|")
        rows = [kv for kv in stats.stats.items() if kv[0][2] != IDLE]
        rows.sort(key=lambda kv: -kv[1][2])
        for (file, line, fn), (_, calls, tt, ct, _) in rows[:top]:
            where = f"{'/'.join(Path(file).parts[-2:])}:{line}:{fn}" if line else fn
            print(f"| {tt * scale:.1f} | {ct * scale:.1f} | {calls / w.groups:.2f} | {where} |")


def _window_json(w: Window) -> dict:
    return {
        "groups_per_s": round(w.groups_per_s, 1),
        "cpu_us_per_group": round(w.cpu_us_per_group, 1),
        "window_s": round(w.seconds, 2),
        "groups": w.groups,
        "cpu_us_per_group_by_process": w.per_group(w.cpu_s),
        "main_thread_cpu_us_per_group": w.per_group(w.main_thread_s),
        "calls": w.calls,
        "sleeps_per_group": {k: round(v / w.groups, 2) for k, v in w.waits.items()},
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.control_plane", description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--profile", type=Path, help="then run again under cProfile into DIR")
    p.add_argument(
        "--sample", type=Path, help="then run again with py-spy sampling each service, into DIR"
    )
    p.add_argument("--top", type=int, default=25, help="functions shown per profile")
    p.add_argument("--seconds", type=float, help="each steady window (default 5, quick 2)")
    p.add_argument("--eta", type=int, default=1)
    p.add_argument(
        "--batch",
        type=int,
        help="groups per step (default 32): per-step costs shrink per group as it grows",
    )
    p.add_argument(
        "--windows",
        type=int,
        help="rounds (a deployment's window, then a peer run), or with --no-peer consecutive"
        " windows of one deployment (default 3, quick 1)",
    )
    p.add_argument("--no-peer", action="store_true", help="measure this side only")
    args = p.parse_args(argv)
    import tempfile

    from asyncrl.logging import configure_logging

    configure_logging("bench", json=False, level="WARNING")  # stdout is the JSON

    with tempfile.TemporaryDirectory(prefix="asyncrl-cp-") as tmp:
        ctx = Context(work_dir=Path(tmp), quick=args.quick)
        s = Sizes.for_context(ctx)
        s.eta = args.eta
        if args.batch:
            s.batch, s.max_concurrent = args.batch, 2 * args.batch  # two steps in flight
        if args.windows:
            s.windows = args.windows
        if args.seconds:
            s.min_seconds = args.seconds
        model = ctx.tiny_model(seed=0)
        if args.no_peer or not areal_available():
            with SpeedProbe(ctx.work_dir / "speed") as speed:
                windows = measure(ctx.work_dir, model, s)
            ref = reference(speed.samples())
            at_ref = [x.cpu_us_per_group / slowdown(speed.samples(*x.span), ref) for x in windows]
            w = best(windows)
            out = {
                **_window_json(w),
                "windows": [round(x.cpu_us_per_group, 1) for x in windows],
                "windows_at_reference_speed": [round(x, 1) for x in at_ref],
                "reference_unit_ms": round(1e3 * ref, 2),
                "windows_sleeps": [
                    {k: round(v / x.groups, 2) for k, v in x.waits.items()} for x in windows
                ],
                "sizes": asdict(s),
            }
        else:
            rounds = paired_rounds(ctx.work_dir, model, s, args.quick)
            r = median_round(rounds)
            w = r.ours
            out = {
                **_window_json(w),
                "ratio": round(r.ratio, 3),
                "cpu_us_per_group_at_reference_speed": round(r.ours_cpu_us, 1),
                "areal": {
                    "cpu_us_per_rollout_at_reference_speed": round(r.peer_cpu_us, 1),
                    **{k: r.peer[k] for k in ("rollouts_per_s", "cpu_us_per_rollout")},
                },
                "settings": _settings(s, rounds),
            }
        print(json.dumps(out, indent=1), flush=True)
        if args.profile:
            profile = args.profile.resolve()
            [pw] = measure(ctx.work_dir, model, s, profile)
            print(json.dumps({"profiled": _window_json(pw)}, indent=1))
            print_profiles(profile, pw, w, args.top)
        if args.sample:
            sample = args.sample.resolve()
            sampled = measure(ctx.work_dir, model, s, sample=sample)
            sw = best(sampled)
            print(json.dumps({"sampled": _window_json(sw)}, indent=1))
            cpu = sw.per_group(sw.cpu_s)
            print_samples(sample, cpu, args.top)
            print(f"\npicture: {plot_samples(sample, cpu)}")


if __name__ == "__main__":
    main()
