"""`make multihost`: the system on three hosts (network namespaces on a bridge, each with its
own address, directory and supervisor; a three-node NATS cluster with the stream and the KV
bucket at replicas 3; weights through the NATS object store), the arith experiment run across
them, judged by its ledger. Each run gets a fresh network and mount namespace (`unshare -n -m`,
root), so nothing leaks out and every fault stays inside.

    python -m tests.multihost                      # the demo experiment, no fault
    python -m tests.multihost --faults nats,link,host --steps 40 --batch-size 4 --backend torch
    python -m tests.multihost --short              # what the test in `make test` runs

Writes var/multihost/report.json ({"runs": [...]}: tests.chaos.report rows plus where the
rollouts' weights came from) and prints the table; exits 1 when a run misses the acceptance
(not COMPLETED, a prompt lost or trained twice, a rollout host holding a file of the trainer's
weight store or loading a version other than from NATS).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rich.console import Console

from tests.chaos import report
from tests.chaos.__main__ import build_task, fresh_dir, run_isolated, to_row
from tests.multihost.run import FAULTS

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "var" / "multihost"
SHORT = ["--steps", "6", "--batch-size", "4", "--n-samples", "8", "--backend", "torch"]

console = Console(highlight=False, width=200)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tests.multihost", description=__doc__.split("\n")[0]
    )
    p.add_argument("--faults", default="none", help=f"comma-separated runs of {FAULTS}")
    p.add_argument("--steps", type=int, default=None, help="trainer.total_steps (demo: 250)")
    p.add_argument("--batch-size", type=int, default=None, help="trainer.batch_size (demo: 16)")
    p.add_argument("--n-samples", type=int, default=None, help="rollout.n_samples (demo: 16)")
    p.add_argument("--backend", default=None, help="trainer.backend (demo: megatron)")
    p.add_argument("--short", action="store_true", help="6 steps of B=4, torch trainer")
    p.add_argument("--timeout", type=float, default=1500.0, help="per run, submit to end")
    p.add_argument("--out", type=Path, default=OUT)
    return p.parse_args(argv)


def run_args(args: argparse.Namespace) -> list[str]:
    if args.short:
        return SHORT
    out = []
    for flag in ("steps", "batch_size", "n_samples", "backend"):
        value = getattr(args, flag)
        if value is not None:
            out += [f"--{flag.replace('_', '-')}", str(value)]
    return out


def run_one(args: argparse.Namespace, fault: str) -> dict:
    """One run in a fresh network + mount namespace; its result.json (or what went wrong)."""
    out = fresh_dir(args.out / fault)
    argv = [
        "unshare", "-n", "-m", sys.executable, "-m", "tests.multihost.run", "--fault", fault,
        "--out", str(out), "--task", str(args.out / "task"), "--timeout", str(args.timeout),
        *run_args(args),
    ]  # fmt: skip
    return run_isolated(argv, out, fault, fault)


def deployment_problems(row: dict) -> list[str]:
    """A stream or the KV bucket not replicated on the three nodes; a rollout host that holds
    a file of the trainer's store, or loaded a trained version from anywhere but the object
    store."""
    found = []
    for name, info in (row.get("nats") or {}).items():
        if info["replicas"] != 3 or len(info["peers"]) != 3:
            found.append(f"{name}: replicas {info['replicas']} on {info['peers']}")
    if row.get("completed") and not row.get("nats"):
        found.append("no NATS cluster evidence")
    evidence = row.get("weights") or {}
    if evidence.get("leaked"):
        found.append(f"trainer files on rollout hosts: {evidence['leaked'][:3]}")
    for host, schemes in (evidence.get("uri_schemes") or {}).items():
        if "file" in schemes:
            found.append(f"host {host} loaded a file:// version")
    if row.get("completed") and not any((evidence.get("cached") or {}).values()):
        found.append("no version fetched from NATS by any rollout")
    return found


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        raise SystemExit(f"unknown faults {unknown}; choose from {FAULTS}")
    build_task(args.out / "task")
    started = time.time()
    rows = [to_row(run_one(args, fault)) for fault in faults]
    for row in rows:
        row["deployment_problems"] = deployment_problems(row)
        if row["deployment_problems"]:
            row["error"] = "; ".join(filter(None, [row.get("error"), *row["deployment_problems"]]))
    wall = round(time.time() - started, 1)
    out = {"runs": rows, "wall_s": wall, "args": vars(args) | {"out": str(args.out)}}
    (args.out / "report.json").write_text(json.dumps(out, indent=1, default=str) + "\n")
    console.print(report.table(rows, title=f"make multihost ({len(rows)} runs, {wall:.0f}s)"))
    console.print(f"report: {args.out / 'report.json'}")
    return 1 if any(report.problems(r) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
