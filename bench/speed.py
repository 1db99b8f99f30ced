"""How fast this machine runs Python at each moment: a probe on each CPU.

On the shared 2-core VM this project is built on, a fixed piece of Python work takes ~28 ms of
CPU time for seconds at a time, then ~54 ms (the same bytes, one core or the other; another
tenant's load on the host, most likely): every CPU-time figure measured here moves with it, by up
to 2x within a minute. The probe measures it while a benchmark runs, so a figure can be put at
the machine's reference speed. One process per CPU, pinned to it, runs `unit()` every
`INTERVAL_S` (~3 % of a core at full speed) and appends "<monotonic time> <CPU seconds>" to its
file.

    python -m bench.speed --cpu 0 --out FILE     # one probe (SpeedProbe starts them)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

INTERVAL_S = 0.1
REFERENCE_QUANTILE = 0.1
"""The reference speed: this quantile of every probe's CPU time in the run (its fast state;
the minimum would be one lucky sample)."""


def unit() -> int:
    """The fixed work: dict stores and str formatting, what a service's Python mostly does."""
    d: dict[int, str] = {}
    for i in range(20_000):
        d[i % 1000] = str(i)
    return len(d)


def probe(cpu: int, out: Path) -> None:
    os.sched_setaffinity(0, {cpu})
    with open(out, "a", buffering=1) as f:
        while True:
            c0 = time.process_time()
            unit()
            f.write(f"{time.monotonic()} {time.process_time() - c0}\n")
            time.sleep(INTERVAL_S)


class SpeedProbe:
    """A probe on each CPU this process may use, from `start` to `stop`."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.procs: list[subprocess.Popen] = []

    def start(self) -> SpeedProbe:
        self.directory.mkdir(parents=True, exist_ok=True)
        for cpu in sorted(os.sched_getaffinity(0)):
            out = self.directory / f"cpu{cpu}.txt"
            cmd = [sys.executable, "-m", "bench.speed", "--cpu", str(cpu), "--out", str(out)]
            self.procs.append(subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1]))
        return self

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait()

    def __enter__(self) -> SpeedProbe:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def samples(self, t0: float = float("-inf"), t1: float = float("inf")) -> list[float]:
        """CPU seconds of the probes' units that ended between monotonic times t0 and t1."""
        out = []
        for path in self.directory.glob("cpu*.txt"):
            for line in path.read_text().splitlines():
                parts = line.split()
                if len(parts) == 2 and t0 <= float(parts[0]) <= t1:
                    out.append(float(parts[1]))
        return out


def reference(samples: list[float]) -> float:
    """The machine's reference CPU time for a unit: the REFERENCE_QUANTILE of `samples`."""
    ordered = sorted(samples)
    return ordered[int(REFERENCE_QUANTILE * (len(ordered) - 1))]


def slowdown(samples: list[float], ref: float) -> float:
    """How much slower than the reference the machine ran over `samples`: their mean ÷ ref
    (1.0 with no samples: nothing to correct by)."""
    return statistics.fmean(samples) / ref if samples else 1.0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.speed", description=__doc__)
    p.add_argument("--cpu", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    probe(args.cpu, args.out)


if __name__ == "__main__":
    main()
