"""`make fuzz`: the fuzzer for FUZZ_MINUTES (default 30) against one real server of each
service and a real nats-server, round-robin over every RPC and the trainer's train subject;
findings (each kind once per RPC, with the request's bytes) in var/fuzz/report.json. Exit 1 if
there is any.

    python -m tests.fuzz --minutes 5 --out var/fuzz/report.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

BATCH = 50
"""Cases per RPC per round (random, not derandomized: each round draws new ones)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__)
    parser.add_argument("--minutes", type=float, default=float(os.environ.get("FUZZ_MINUTES", 30)))
    parser.add_argument("--out", type=Path, default=Path("var/fuzz/report.json"))
    args = parser.parse_args(argv)
    os.environ.setdefault("ASYNCRL_SECRETS", tempfile.mkdtemp(prefix="asyncrl-fuzz-secrets-"))
    from asyncrl.security import ensure_secrets

    ensure_secrets()
    from tests.fuzz.cluster import FuzzCluster
    from tests.fuzz.nats_subjects import NatsFuzz
    from tests.fuzz.props import methods, path_of
    from tests.fuzz.run import Tally, fuzz_method

    stop_at = time.monotonic() + 60 * args.minutes
    tallies: dict[str, Tally] = {}
    root = Path(tempfile.mkdtemp(prefix="asyncrl-fuzz-"))
    cluster = FuzzCluster(root).start()
    subjects = NatsFuzz(cluster)
    try:
        while time.monotonic() < stop_at:
            for method in methods():
                tally = tallies.setdefault(path_of(method), Tally())
                fuzz_method(cluster, method, BATCH, False, tally, stop_at=stop_at)
            tally = tallies.setdefault(subjects.NAME, Tally())
            subjects.fuzz(BATCH, False, tally, stop_at=stop_at)
            tally = tallies.setdefault(subjects.LEDGER, Tally())
            subjects.fuzz_ledger(BATCH, False, tally, stop_at=stop_at)
            _write(args, tallies)
    finally:
        subjects.close()
        cluster.stop()
    report = _write(args, tallies)
    print(f"{report['cases']} cases in {args.minutes:g} min, {len(report['findings'])} findings")
    for name, t in sorted(tallies.items()):
        print(f"  {name:45} {t.cases:7d}  {t.codes}")
    for f in report["findings"]:
        print(f"  FINDING {f['method']} as {f['identity']}: {f['problem'][:200]}")
    print(f"report: {args.out}")
    return 1 if report["findings"] else 0


def _write(args, tallies) -> dict:
    report = {
        "minutes": args.minutes,
        "cases": sum(t.cases for t in tallies.values()),
        "findings": [vars(f) for t in tallies.values() for f in t.findings],
        "by_target": {name: t.as_dict() for name, t in tallies.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(args.out)
    return report


if __name__ == "__main__":
    sys.exit(main())
