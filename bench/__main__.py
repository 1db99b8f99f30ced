"""`python -m bench [--quick] [--only NAME ...] [--out PATH]`: run, print a table, write JSON."""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from asyncrl.logging import configure_logging
from bench import BENCHMARKS
from bench.report import (
    Context,
    Result,
    Skip,
    build_report,
    machine_info,
    render_table,
    write_report,
)


def run_benchmarks(
    names: list[str], quick: bool, work_dir: Path, progress=None, only: list[str] | None = None
) -> tuple[list[Result], list[dict]]:
    """Run the named benchmarks in order in one context (`only`: those named with --only);
    (results, skipped)."""
    ctx = Context(work_dir=work_dir, quick=quick, only=list(only or []))
    results, skipped = [], []
    for name in names:
        module = importlib.import_module(BENCHMARKS[name])
        t0 = time.perf_counter()
        try:
            results.extend(module.run(ctx))
            status = f"done in {time.perf_counter() - t0:.1f}s"
        except Skip as exc:
            skipped.append({"name": name, "reason": str(exc)})
            status = f"skipped: {exc}"
        if progress:
            progress(f"[bench] {name}: {status}")
    return results, skipped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smallest sizes, one repeat")
    parser.add_argument(
        "--only",
        action="append",
        choices=sorted(BENCHMARKS),
        metavar="NAME",
        help=f"run only this benchmark (repeatable): {', '.join(BENCHMARKS)}",
    )
    parser.add_argument("--out", type=Path, default=Path("var/bench/report.json"))
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # fairness: every side gets one core on a shared machine
    warnings.filterwarnings("ignore")
    configure_logging("bench", json=False, level="WARNING")
    from rich.console import Console
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    console = Console()
    if not console.is_terminal:  # piped or teed (make bench | tee): do not squeeze the table
        console = Console(width=150)
    err = Console(stderr=True, markup=False, highlight=False)
    names = args.only or list(BENCHMARKS)
    machine = machine_info()  # before the run: its load is what else the machine is doing
    err.print(f"[bench] machine: {machine['line']}", style="dim")
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-") as tmp:
        results, skipped = run_benchmarks(
            names,
            args.quick,
            Path(tmp),
            progress=lambda m: err.print(m, style="dim"),
            only=args.only,
        )
    command = ["python", "-m", "bench", *sys.argv[1:]]
    report = build_report(results, skipped, args.quick, command, machine)
    write_report(report, args.out)
    console.print(render_table(report))
    console.print(f"report: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
