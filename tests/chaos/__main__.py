"""`make chaos`: the fault suite. Each run is one scenario in its own network namespace
(`unshare -n`, loopback only: its own `make up` on the default ports, faults stay inside),
with its own var dir var/chaos/<run>/; `--jobs` runs side by side. Writes
var/chaos/report.json ({"runs": [...]}, see tests.chaos.report) and prints the table; exits 1
when a run misses the acceptance (not COMPLETED, lost, trained twice, failed by an
infrastructure fault, poison not quarantined).

    python -m tests.chaos [--only trainer,poison] [--repeat N] [--jobs 2] [--seed 0] [--dry]

Each kill -9 scenario kills its service 3 times in one run, at seeded random versions, waiting
for the restart and new progress between kills; `--repeat N` makes N runs of every scenario
with seeds seed..seed+N-1. On the 2-core dev machine, 2 runs side by side: the 9 runs of one
pass take ~4 min, `--repeat 3` (27 runs) ~9 min.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console

from tests.chaos import report
from tests.chaos.scenarios import SCENARIOS, run_rng, targets

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "var" / "chaos"
IN_NAMESPACE = 'ip link set lo up && exec "$0" -m tests.chaos.run "$@"'

console = Console(highlight=False, width=200)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__.split("\n")[0])
    p.add_argument("--only", default="", help=f"comma-separated scenarios of {sorted(SCENARIOS)}")
    p.add_argument("--repeat", type=int, default=1, help="runs per scenario")
    p.add_argument("--jobs", type=int, default=2, help="runs side by side")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=30, help="trainer.total_steps")
    p.add_argument("--batch-size", type=int, default=4, help="trainer.batch_size (B)")
    p.add_argument("--n-samples", type=int, default=8, help="rollout.n_samples")
    p.add_argument("--timeout", type=float, default=600.0, help="per run, submit to end")
    p.add_argument("--dry", action="store_true", help="print the plan; run nothing")
    return p.parse_args(argv)


def plan(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    """(run name, scenario, seed) for every run."""
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(SCENARIOS)
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        raise SystemExit(f"unknown scenarios {unknown}; choose from {sorted(SCENARIOS)}")
    runs = []
    for name in names:
        for i in range(args.repeat):
            run = name if args.repeat == 1 else f"{name}-{i + 1}"
            runs.append((run, name, args.seed + i))
    return runs


def build_task(task: Path) -> None:
    """The arith model and data, built once, outside the namespaces."""
    if (task / "model" / "config.json").exists():
        return
    console.print(f"building the arith task in {task}")
    subprocess.run(
        [sys.executable, "-m", "examples.arith.build", "--out", str(task / "model")],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )


def run_one(args: argparse.Namespace, run: str, scenario: str, seed: int) -> dict:
    """One run in a fresh network namespace; its result.json (or what went wrong)."""
    var = fresh_dir(OUT / run)
    argv = [
        "unshare", "-n", "bash", "-c", IN_NAMESPACE, sys.executable,
        "--scenario", scenario, "--var", str(var.relative_to(ROOT)),
        "--task", str((OUT / "task").relative_to(ROOT)), "--seed", str(seed),
        "--steps", str(args.steps), "--batch-size", str(args.batch_size),
        "--n-samples", str(args.n_samples), "--timeout", str(args.timeout),
    ]  # fmt: skip
    return run_isolated(argv, var, run, SCENARIOS[scenario].fault)


def fresh_dir(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def run_isolated(argv: list[str], out: Path, run: str, fault: str) -> dict:
    """Run a runner (`argv`: in namespaces of its own) that writes <out>/result.json, its
    output in <out>/runner.log; the result, or a row saying the runner itself broke."""
    console.print(f"[bold]{run}[/bold] started ({out})")
    with open(out / "runner.log", "wb") as log:
        done = subprocess.run(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        result = json.loads((out / "result.json").read_text())
    except (OSError, ValueError):
        result = {"run": run, "fault": fault, "faults": [], "timeline": []}
        result["error"] = f"runner exited {done.returncode}; see {out / 'runner.log'}"
    console.print(f"[bold]{run}[/bold] ended in {result.get('total_s', '?')}s")
    return result


def to_row(result: dict) -> dict:
    ledger, status = result.pop("ledger", {}), result.pop("status", {})
    return report.make_row(result, ledger, status)


def print_plan(args: argparse.Namespace, runs: list[tuple[str, str, int]]) -> None:
    """Each run's scenario and the versions its faults are drawn at (the run's first draw)."""
    for run, name, seed in runs:
        s = SCENARIOS[name]
        at = targets(run_rng(seed, name), s.count, s.steps or args.steps)
        console.print(f"{run}: {s.fault}, {s.rollouts} rollout(s), seed {seed}, at versions {at}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = plan(args)
    if args.dry:
        print_plan(args, runs)
        return 0
    build_task(OUT / "task")
    started = time.time()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(lambda r: run_one(args, *r), runs))
    rows = [to_row(r) for r in results]
    wall = round(time.time() - started, 1)
    out = {"runs": rows, "seed": args.seed, "wall_s": wall, "steps": args.steps}
    (OUT / "report.json").write_text(json.dumps(out, indent=1) + "\n")
    console.print(report.table(rows, title=f"make chaos ({len(rows)} runs, {wall:.0f}s)"))
    console.print(f"report: {OUT / 'report.json'}")
    return 1 if any(report.problems(r) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
