"""The off-policy ablation: `python -m bench.offpolicy [--quick] [--out DIR]`.

The arith task of `make demo` (little-endian three-digit addition, the same warm-started tiny
model, exact-match reward) trained through all four services at eta = 0, 4, 8 and 16 with the
default loss and each off-policy correction of `trainer.offpolicy_correction`
(services/trainer/losses.py), several seeds each. Every run of the matrix goes through one
deployment (`make up`: nats and the four services under the supervisor in <out>/offpolicy-var,
one torch thread each) scaled to `parallel` trainers and rollouts (`make scale`), so that many
experiments run at once, each with a trainer and a rollout of its own.

Recorded per run, from the experiment's step history and evals: the final greedy eval accuracy,
the first version whose eval reaches `threshold` (the steps to accuracy), the mean staleness of
the trained groups, and the fraction of tokens masked or truncated by the correction. Written:
`<out>/offpolicy.json` (every run and the mean and sample standard deviation over seeds of each
(eta, correction) cell) and `<out>/offpolicy.png` (final accuracy and steps to accuracy against
eta, one line per correction).

The runs are the demo's: its batch (16 groups of 16), its 250 steps, its learning rate (3e-4,
decaying linearly to a tenth) and its 4 optimizer updates per version, so a sample a few
versions old is off-policy.

How staleness is made to bite. `max_concurrent_rollouts` is at least (eta + 1) x batch, so
admission, not the slot count, bounds how far generation runs ahead; and each trainer step
takes at least `min_step_s` (the bench knob ASYNCRL_BENCH_MIN_STEP_S: the trainer waits out the
rest of the step, as a bigger model's step would; nothing in the engines), so generation
outpaces training and the trainer takes groups as old as eta allows. Without it, on two cores
shared by several runs, generation bounded staleness at ~3 whatever eta was. The report carries
each run's measured mean staleness, and `staleness_bites` says per eta whether it reached
0.6 x eta.

`rollout.filter` is the demo's `nonconstant_reward`: every trained group carries signal, so
the eta = 0 runs learn enough in 250 steps for the corrections to differ (under `none` the
on-policy runs gained only 0.29 over v0). A run whose policy collapses to constant groups has
most of them rejected and may run out of prompts before its last step ("dataset exhausted"):
it completes early, and its final accuracy is its last eval, at the version it reached (the
evals say which); one that fills no batch at all ends at the bench's timeout, reported failed.

At eta = 0 the behaviour and proximal policies are the same weights (w = pi_prox / pi_behav = 1
up to the engines' numerics), where token_tis, token_mis, seq_mis, icepop and m2po compute
exactly token_cap's loss: those cells are not run, they are token_cap's runs (marked `same_as`
in the report). gspo and cispo are different objectives even on-policy and run at eta = 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import typing
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from asyncrl.cli import load_spec_dict
from asyncrl.client import AsyncrlClient, is_terminal, state_name
from asyncrl.net import free_port
from asyncrl.proc import kill_tree, pid_alive
from asyncrl.settings import settings
from asyncrl.spec import TrainerSpec
from bench.report import Result

NAME = "offpolicy"
ROOT = Path(__file__).resolve().parents[1]
ARITH = ROOT / "examples" / "arith" / "experiment.yaml"
TASK_DIR = ROOT / "var" / "bench" / "offpolicy-task"
"""The warm-started model and data (`python -m examples.arith.build`), built once and reused."""
CORRECTIONS: tuple[str, ...] = typing.get_args(
    TrainerSpec.model_fields["offpolicy_correction"].annotation
)
DEFAULT = TrainerSpec.model_fields["offpolicy_correction"].default
SAME_ON_POLICY = ("token_tis", "token_mis", "seq_mis", "icepop", "m2po")
"""Corrections whose loss is token_cap's when w = 1 (eta = 0): not run there."""
DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")


@dataclass(frozen=True)
class Plan:
    etas: tuple[int, ...] = (0, 4, 8, 16)
    corrections: tuple[str, ...] = CORRECTIONS
    seeds: tuple[int, ...] = (1, 2, 3)
    steps: int = 250
    batch: int = 16
    n_samples: int = 16
    minibatches: int = 4
    lr: float = 3e-4
    eval_every: int = 25
    eval_prompts: int = 100
    threshold: float = 0.5
    """The accuracy whose first crossing is each run's steps to accuracy."""
    parallel: int = 5
    """Experiments at once (trainer and rollout replicas of the one deployment)."""
    min_step_s: float = 2.0
    """Each trainer step takes at least this long (ASYNCRL_BENCH_MIN_STEP_S)."""
    timeout_s: float = 1800.0

    def runs(self) -> list[tuple[int, int, str]]:
        """(seed, eta, correction) of every run: eta = 0 first, then the highest, then the
        rest from the top down (a matrix cut short keeps its ends), seeds in turn within each.
        At eta = 0 the corrections in SAME_ON_POLICY are left out (token_cap's runs stand in)."""
        etas = sorted(self.etas, key=lambda e: (e != 0, -e))
        return [
            (seed, eta, corr)
            for eta in etas
            for seed in self.seeds
            for corr in self.corrections
            if not (eta == 0 and corr in SAME_ON_POLICY and DEFAULT in self.corrections)
        ]


QUICK = Plan(
    etas=(0, 4),
    corrections=(DEFAULT, "icepop"),
    seeds=(1,),
    steps=10,
    batch=8,
    eval_every=5,
    eval_prompts=50,
    threshold=0.2,
    parallel=3,
    min_step_s=0.0,
)


# ---------------------------------------------------------------------------- pure aggregation


@dataclass
class RunRecord:
    seed: int
    eta: int
    correction: str
    evals: list[tuple[int, float]]
    """(version, greedy eval accuracy), version order."""
    staleness_mean: float
    """Mean over steps of the step's mean staleness of its trained groups."""
    masked_fraction: float
    """Mean over steps of the fraction of tokens masked by the correction."""
    truncated_fraction: float
    wall_s: float
    experiment: str = ""

    @property
    def final_accuracy(self) -> float:
        return self.evals[-1][1]


def steps_to_accuracy(evals: Iterable[tuple[int, float]], threshold: float) -> int | None:
    """The first version (in version order) whose eval accuracy is at least `threshold`; None
    when no eval reaches it."""
    for version, accuracy in sorted(evals):
        if accuracy >= threshold:
            return version
    return None


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1; 0 for a single value)."""
    mean = statistics.fmean(values)
    return mean, statistics.stdev(values) if len(values) > 1 else 0.0


@dataclass
class Cell:
    """One (eta, correction) over its seeds."""

    eta: int
    correction: str
    seeds: list[int]
    final: list[float]
    final_mean: float
    final_std: float
    reached: int
    """Runs whose eval reached the threshold."""
    steps_mean: float | None
    """Mean steps to accuracy over the runs that reached it (None: none did)."""
    staleness_mean: float
    masked_fraction: float
    same_as: str | None = None


def aggregate(records: Sequence[RunRecord], threshold: float) -> list[Cell]:
    """One Cell per (eta, correction) present in `records`, in (eta, first appearance) order."""
    keys = sorted({(r.eta, r.correction) for r in records}, key=lambda k: k[0])
    order = list(dict.fromkeys(r.correction for r in records))
    cells = []
    for eta, corr in sorted(keys, key=lambda k: (k[0], order.index(k[1]))):
        runs = sorted((r for r in records if (r.eta, r.correction) == (eta, corr)), key=_seed)
        final = [r.final_accuracy for r in runs]
        steps = [s for r in runs if (s := steps_to_accuracy(r.evals, threshold)) is not None]
        fmean, fstd = mean_std(final)
        cells.append(
            Cell(
                eta=eta,
                correction=corr,
                seeds=[r.seed for r in runs],
                final=final,
                final_mean=fmean,
                final_std=fstd,
                reached=len(steps),
                steps_mean=statistics.fmean(steps) if steps else None,
                staleness_mean=statistics.fmean(r.staleness_mean for r in runs),
                masked_fraction=statistics.fmean(r.masked_fraction for r in runs),
            )
        )
    return cells


def _seed(r: RunRecord) -> int:
    return r.seed


def with_on_policy_twins(cells: list[Cell], plan: Plan) -> list[Cell]:
    """The eta = 0 cells of SAME_ON_POLICY, copied from the default's (marked `same_as`)."""
    base = next((c for c in cells if c.eta == 0 and c.correction == DEFAULT), None)
    if base is None:
        return cells
    twins = [
        Cell(**{**asdict(base), "correction": corr, "same_as": DEFAULT})
        for corr in plan.corrections
        if corr in SAME_ON_POLICY
    ]
    return cells + twins


def clear_winner(cells: Sequence[Cell], eta: int, default: str = DEFAULT) -> str | None:
    """The correction that clearly beats `default` at `eta`: the best mean final accuracy,
    above the default's in every seed (paired by seed), its mean gain larger than both cells'
    standard deviations. None when the default is best or no one wins clearly."""
    at = {c.correction: c for c in cells if c.eta == eta}
    if default not in at:
        return None
    best = max(at.values(), key=lambda c: c.final_mean)
    base = at[default]
    if best.correction == default or best.seeds != base.seeds:
        return None
    every_seed = all(b > d for b, d in zip(best.final, base.final, strict=True))
    gain = best.final_mean - base.final_mean
    return best.correction if every_seed and gain > max(best.final_std, base.final_std) else None


# ---------------------------------------------------------------------------- running the runs


class Deployment:
    """nats + the four services under the supervisor on `var` (what `make up` starts), one
    torch thread each, then `replicas` trainers and rollouts (`make scale`): that many
    experiments run at once. With one replica the rollout has a core of its own
    (ASYNCRL_CPU_AFFINITY=1, as `make demo`) unless ASYNCRL_CPU_AFFINITY=0."""

    def __init__(self, var: Path, replicas: int = 1, min_step_s: float = 0.0):
        self.var = var
        self.replicas = replicas
        affinity = os.environ.get("ASYNCRL_CPU_AFFINITY", "1") if replicas == 1 else "0"
        self.scheduler = f"127.0.0.1:{free_port()}"
        inherited = {
            k: v for k, v in os.environ.items() if k not in (*DIST_ENV, "ASYNCRL_METRICS_PORT")
        }
        self.env = {
            **inherited,
            "ASYNCRL_NATS_PORT": str(free_port()),
            "ASYNCRL_SCHEDULER_PORT": self.scheduler.rpartition(":")[2],
            "OMP_NUM_THREADS": "1",
            "ASYNCRL_TRAINER_ARGS": "--threads 1",
            "ASYNCRL_CPU_AFFINITY": affinity,
            "ASYNCRL_BENCH_MIN_STEP_S": str(min_step_s),
        }
        if not settings().insecure:
            from asyncrl.security import ensure_secrets

            self.env["ASYNCRL_SECRETS"] = str(ensure_secrets().resolve())

    def _sup(self, *args: str, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "asyncrl.supervisor", *args, "--var", str(self.var)],
            env=self.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def __enter__(self) -> Deployment:
        done = self._sup("start", "--timeout", "180", timeout=240)
        if done.returncode != 0:
            self.__exit__()
            raise RuntimeError(f"deployment did not start: {done.stdout[-2000:]}{done.stderr}")
        for service in ("trainer", "rollout") if self.replicas > 1 else ():
            done = self._sup("scale", service, str(self.replicas), "--timeout", "180", timeout=240)
            if done.returncode != 0:
                self.__exit__()
                raise RuntimeError(f"{service} did not scale: {done.stdout[-2000:]}{done.stderr}")
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

    def _pids(self) -> list[int]:
        try:
            state = json.loads((self.var / "run" / "state.json").read_text())
        except (OSError, ValueError):
            return []
        return [state["supervisor_pid"], *(p["pid"] for p in state["processes"] if p["pid"])]


def ensure_task(task_dir: Path = TASK_DIR) -> Path:
    """The demo's warm-started model and data under `task_dir` (built by the command `make
    demo` runs, once)."""
    if not (task_dir / "model" / "warmstart.json").is_file():
        subprocess.run(
            [sys.executable, "-m", "examples.arith.build", "--out", str(task_dir / "model")],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
    return task_dir


def experiment_spec(task_dir: Path, plan: Plan, seed: int, eta: int, correction: str) -> dict:
    """The demo's experiment file with the bench's sizes, as `asyncrl submit --set` takes them."""
    return load_spec_dict(
        ARITH,
        [
            f"name=offpolicy-eta{eta}-{correction}-s{seed}",
            f"seed={seed}",
            f"model.path={task_dir / 'model'}",
            f"dataset.path={task_dir / 'train.jsonl'}",
            f"eval.dataset_path={task_dir / 'eval.jsonl'}",
            f"eval.every_versions={plan.eval_every}",
            f"eval.max_prompts={plan.eval_prompts}",
            f"rollout.max_head_offpolicyness={eta}",
            f"rollout.n_samples={plan.n_samples}",
            f"rollout.max_concurrent_rollouts={max(64, (eta + 1) * plan.batch)}",
            "rollout.filter=nonconstant_reward",
            "trainer.backend=torch",
            f"trainer.offpolicy_correction={correction}",
            f"trainer.total_steps={plan.steps}",
            f"trainer.batch_size={plan.batch}",
            f"trainer.minibatches={plan.minibatches}",
            f"trainer.lr={plan.lr}",
            f"trainer.checkpoint_every={plan.steps}",
            "trainer.loggers=[]",
        ],
    )


async def _run_to_end(scheduler: str, spec: dict, timeout_s: float):
    async with AsyncrlClient(scheduler) as client:
        exp = await client.submit(spec)
        deadline = time.monotonic() + timeout_s
        while not is_terminal(exp):
            if time.monotonic() > deadline:
                await client.cancel(exp.id)
                raise TimeoutError(f"{spec['name']} did not finish in {timeout_s:.0f}s")
            await asyncio.sleep(0.5)
            exp = await client.get(exp.id)
        if state_name(exp.state) != "COMPLETED":
            raise RuntimeError(f"{spec['name']} ended {state_name(exp.state)}: {exp.message}")
        return await client.get(exp.id, with_history=True)


def run_one(dep: Deployment, task_dir: Path, plan: Plan, seed: int, eta: int, corr: str):
    spec = experiment_spec(task_dir, plan, seed, eta, corr)
    t0 = time.monotonic()
    exp = asyncio.run(_run_to_end(dep.scheduler, spec, plan.timeout_s))
    wall = time.monotonic() - t0
    hist = list(exp.history)
    return RunRecord(
        seed=seed,
        eta=eta,
        correction=corr,
        evals=sorted((e.version, round(e.accuracy, 6)) for e in exp.progress.evals),
        staleness_mean=statistics.fmean(h.staleness_mean for h in hist),
        masked_fraction=statistics.fmean(h.is_masked_fraction for h in hist),
        truncated_fraction=statistics.fmean(h.is_truncated_fraction for h in hist),
        wall_s=round(wall, 2),
        experiment=exp.id,
    )


def run_matrix(plan: Plan, var: Path, log: Path, progress=print) -> list[RunRecord]:
    """Every run of `plan` through one deployment, `plan.parallel` experiments at a time (one
    trainer and one rollout replica each), in `plan.runs()` order, each appended to `log`
    (JSON lines) as it ends. A run that fails or times out is reported and left out (its cell
    then has fewer seeds)."""
    task_dir = ensure_task()
    todo = plan.runs()
    records: list[RunRecord] = []
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")

    def one(i: int, seed: int, eta: int, corr: str) -> None:
        what = f"[offpolicy] {i}/{len(todo)} eta={eta} {corr} seed={seed}"
        try:
            r = run_one(dep, task_dir, plan, seed, eta, corr)
        except (RuntimeError, TimeoutError) as exc:
            progress(f"{what}: {exc}")
            return
        records.append(r)
        with log.open("a") as f:
            f.write(json.dumps(asdict(r)) + "\n")
        progress(
            f"{what}: final {r.final_accuracy:.3f}, staleness {r.staleness_mean:.2f}, "
            f"masked {r.masked_fraction:.3f}, {r.wall_s:.0f}s"
        )

    with Deployment(var, replicas=plan.parallel, min_step_s=plan.min_step_s) as dep:
        pool = ThreadPoolExecutor(plan.parallel)
        try:
            for f in [pool.submit(one, i, *run) for i, run in enumerate(todo, 1)]:
                f.result()
        finally:  # on an interrupt: nothing new starts; the deployment's end fails the rest
            pool.shutdown(wait=False, cancel_futures=True)
    return records


# ---------------------------------------------------------------------------- report


def report(plan: Plan, records: list[RunRecord], argv: list[str]) -> dict:
    cells = with_on_policy_twins(aggregate(records, plan.threshold), plan)
    order = {corr: i for i, corr in enumerate(plan.corrections)}
    cells.sort(key=lambda c: (c.eta, order.get(c.correction, len(order))))
    top = max(plan.etas)
    return {
        "command": ["python", "-m", "bench.offpolicy", *argv],
        "plan": asdict(plan),
        "machine": machine(),
        "default": DEFAULT,
        "clear_winner_at_top_eta": clear_winner(cells, top),
        "staleness_by_eta": staleness_by_eta(records),
        "cells": [asdict(c) for c in cells],
        "runs": [asdict(r) for r in records],
    }


def staleness_by_eta(records: Sequence[RunRecord]) -> dict[str, dict]:
    """Per eta: the mean staleness of the trained groups over its runs, and whether it bit
    (at least 0.6 x eta)."""
    out = {}
    for eta in sorted({r.eta for r in records}):
        mean = statistics.fmean(r.staleness_mean for r in records if r.eta == eta)
        out[str(eta)] = {"mean": round(mean, 3), "bites": eta == 0 or mean >= 0.6 * eta}
    return out


def machine() -> dict:
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "unknown",
    )
    return {"cpu": model, "cores": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2)}


def plot(cells: Sequence[dict], plan: Plan, path: Path) -> Path:
    """Final accuracy (mean +- sample std over seeds) and mean steps to accuracy against eta."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, steps) = plt.subplots(1, 2, figsize=(11, 4.2))
    for k, corr in enumerate(plan.corrections):
        mine = sorted((c for c in cells if c["correction"] == corr), key=lambda c: c["eta"])
        if not mine:
            continue
        etas = [c["eta"] + (k - len(plan.corrections) / 2) * 0.08 for c in mine]  # dodge
        style = dict(marker="o", label=corr, linewidth=2.5 if corr == DEFAULT else 1.2)
        acc.errorbar(etas, [c["final_mean"] for c in mine], [c["final_std"] for c in mine],
                     capsize=3, **style)  # fmt: skip
        reached = [(e, c["steps_mean"]) for e, c in zip(etas, mine, strict=True) if c["reached"]]
        if reached:
            steps.plot(*zip(*reached, strict=True), **style)
    if not steps.lines:
        steps.text(0.5, 0.5, f"no run reached {plan.threshold}", transform=steps.transAxes,
                   ha="center")  # fmt: skip
    acc.set_ylabel("final greedy eval accuracy (mean ± std over seeds)")
    steps.set_ylabel(f"steps to eval accuracy {plan.threshold} (mean of runs reaching it)")
    for ax in (acc, steps):
        ax.set_xlabel("eta (max staleness in versions)")
        ax.set_xticks(list(plan.etas))
        ax.grid(alpha=0.3)
    acc.legend(fontsize=8)
    fig.suptitle(f"arith, {plan.steps} steps, {len(plan.seeds)} seed(s): off-policy corrections")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def table(rep: dict) -> str:
    """The markdown table of docs/benchmarks.md."""
    lines = [
        "| η | correction | final accuracy (mean ± std) | per seed | reached "
        f"{rep['plan']['threshold']} | mean steps to it | mean staleness | masked tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in rep["cells"]:
        steps = "—" if c["steps_mean"] is None else f"{c['steps_mean']:.1f}"
        note = f" (= {c['same_as']})" if c["same_as"] else ""
        lines.append(
            f"| {c['eta']} | {c['correction']}{note} | {c['final_mean']:.3f} ± "
            f"{c['final_std']:.3f} | {' '.join(f'{v:.3f}' for v in c['final'])} | "
            f"{c['reached']}/{len(c['final'])} | {steps} | {c['staleness_mean']:.2f} | "
            f"{c['masked_fraction']:.3f} |"
        )
    return "\n".join(lines)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.offpolicy", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="1 seed, eta 0 and 4, two corrections")
    ap.add_argument("--etas", type=int, nargs="+", help="override the plan's etas")
    ap.add_argument("--seeds", type=int, nargs="+", help="override the plan's seeds")
    ap.add_argument("--corrections", nargs="+", choices=CORRECTIONS, help="override the plan's")
    ap.add_argument("--steps", type=int, help="override the plan's steps")
    ap.add_argument("--lr", type=float, help="override the plan's learning rate")
    ap.add_argument("--n-samples", type=int, help="override the plan's group size")
    ap.add_argument("--parallel", type=int, help="experiments at once (trainer/rollout replicas)")
    ap.add_argument("--min-step-s", type=float, help="each trainer step takes at least this long")
    ap.add_argument("--out", type=Path, default=ROOT / "var" / "bench")
    ap.add_argument("--from-runs", type=Path, help="report the runs of this offpolicy-runs.jsonl")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    plan = QUICK if args.quick else Plan()
    overrides = {"etas": args.etas, "seeds": args.seeds, "corrections": args.corrections}
    plan = Plan(**{**asdict(plan), **{k: tuple(v) for k, v in overrides.items() if v}})
    sizes = {"steps": args.steps, "lr": args.lr, "n_samples": args.n_samples,
             "parallel": args.parallel, "min_step_s": args.min_step_s}  # fmt: skip
    plan = Plan(**{**asdict(plan), **{k: v for k, v in sizes.items() if v is not None}})
    argv = list(argv if argv is not None else sys.argv[1:])
    if args.from_runs:  # the report of runs already made (a matrix cut short)
        lines = args.from_runs.read_text().splitlines()
        records = [RunRecord(**json.loads(line)) for line in lines if line.strip()]
        records = [r for r in records if r.eta in plan.etas and r.correction in plan.corrections]
        rep = write_report(plan, records, args.out, argv)
    else:
        rep = run_and_write(plan, args.out, argv, progress=lambda m: print(m, flush=True))
    print(table(rep))
    print(f"clear winner at eta={max(plan.etas)}: {rep['clear_winner_at_top_eta'] or 'none'}")
    print(f"mean staleness by eta: {rep['staleness_by_eta']}")
    print(f"report: {args.out / 'offpolicy.json'}, plot: {args.out / 'offpolicy.png'}")
    return 0


def run_and_write(plan: Plan, out: Path, argv: list[str], progress=print) -> dict:
    """Run the matrix (the deployment's var dir, logs included, stays in <out>/offpolicy-var)
    and write <out>/offpolicy.json and <out>/offpolicy.png; the report."""
    var = out / "offpolicy-var"
    shutil.rmtree(var, ignore_errors=True)
    records = run_matrix(plan, var, out / "offpolicy-runs.jsonl", progress=progress)
    return write_report(plan, records, out, argv)


def write_report(plan: Plan, records: list[RunRecord], out: Path, argv: list[str]) -> dict:
    rep = report(plan, records, argv)
    out.mkdir(parents=True, exist_ok=True)
    (out / "offpolicy.json").write_text(json.dumps(rep, indent=2) + "\n")
    plot(rep["cells"], plan, out / "offpolicy.png")
    return rep


def run(ctx) -> list[Result]:
    """`python -m bench --only offpolicy`: the quick plan (`--quick`) or the full one; one Result
    per correction at the top eta: its mean final accuracy against the same runs' mean v0 eval
    (the warm start's accuracy, never 0; the default's final at eta = 0 is in the settings)."""
    plan = QUICK if ctx.quick else Plan()
    out = ctx.work_dir if ctx.quick else ROOT / "var" / "bench"
    rep = run_and_write(plan, out, ["--quick"] if ctx.quick else [])
    cells = {(c["eta"], c["correction"]): c for c in rep["cells"]}
    top, base = max(plan.etas), cells.get((0, DEFAULT))
    results = []
    for corr in plan.corrections:
        c = cells.get((top, corr))
        if c is None:
            continue
        runs = [r for r in rep["runs"] if (r["eta"], r["correction"]) == (top, corr)]
        start = statistics.fmean(r["evals"][0][1] for r in runs)
        settings = {"eta": top, "seeds": c["seeds"], "steps": plan.steps,
                    "final_std": round(c["final_std"], 4), "reached": c["reached"],
                    "threshold": plan.threshold, "steps_mean": c["steps_mean"],
                    "staleness_mean": round(c["staleness_mean"], 3),
                    "masked_fraction": round(c["masked_fraction"], 4),
                    f"{DEFAULT}_eta0_final": base and round(base["final_mean"], 4),
                    "report": str(out / "offpolicy.json")}  # fmt: skip
        results.append(
            Result(NAME, f"final eval accuracy, eta={top}, {corr}", c["final_mean"], "accuracy",
                   "the same runs' v0 eval (warm start)", start, settings)
        )  # fmt: skip
    return results


if __name__ == "__main__":
    sys.exit(main())
