"""A sampling profile of each service over the control-plane benchmark's window, with py-spy.

`python -m bench.control_plane --sample DIR` runs the deployment once more with py-spy attached
to every service from the first window to the last (`--nonblocking`: the service is never
stopped; `--gil`: a sample is taken only when one of its threads holds the GIL, so a loop
waiting in epoll or a thread blocked in a socket call is not counted). DIR/<service>.txt holds
the collapsed stacks (`flamegraph.pl` draws them), and the summary gives, per service, the
share of its samples in which each function was on the stack (inclusive) or running (leaf);
DIR/samples.png draws the same, one panel a service (`plot_samples`).

Why next to `--profile`: cProfile charges its own cost per call, so call-heavy code reads
several times too dear there (a generator over 128 per-token versions read as 77 CPU-µs a
group; `timeit` gives 3). A sample costs the sampled process nothing, so the shares stand as
they are: what the service's Python spends its time on. They are not µs: time in C with the
GIL released (socket writes, TLS) is in no sample.
"""

from __future__ import annotations

import collections
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

RATE_HZ = 200
FRAME = re.compile(r"^(?P<fn>.*) \((?P<file>[^()]*?):\d+\)$")
"""A raw frame: `function (path/to/file.py:line)`; the line is dropped (one row per function)."""
WRAPPERS = (
    "(<frozen runpy>)",
    "(bench/zero.py)",
    "(asyncio/runners.py)",
    "(asyncrl/service_main.py)",
    "/__main__.py)",
    "BaseEventLoop.run_forever (",
    "BaseEventLoop.run_until_complete (",
    "BaseEventLoop._run_once (",
    "Handle._run (asyncio/events.py)",
    "Thread._bootstrap",
    "Thread.run (",
)
"""Frames on nearly every stack (the process's entry, the event loop, a thread's start): left out
of the inclusive table, where they would only head it. A frame matches if it contains one."""


def py_spy() -> str | None:
    """The py-spy executable (the venv's, else on PATH); None if it is not installed."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


class Sampler:
    """py-spy on each of `pids` (service name -> pid) while the `with` block runs."""

    def __init__(self, directory: Path, pids: dict[str, int], rate_hz: int = RATE_HZ):
        exe = py_spy()
        if exe is None:
            raise RuntimeError("--sample needs py-spy (requirements.txt pins it: make venv)")
        self.directory, self.pids, self.rate_hz, self.exe = directory, pids, rate_hz, exe
        self.procs: list[subprocess.Popen] = []
        self.logs: list = []

    def __enter__(self) -> Sampler:
        self.directory.mkdir(parents=True, exist_ok=True)
        for service, pid in self.pids.items():
            cmd = [self.exe, "record", "--pid", str(pid), "--rate", str(self.rate_hz)]
            cmd += ["--nonblocking", "--gil", "--format", "raw", "--duration", "3600"]
            cmd += ["--output", str(self.directory / f"{service}.txt")]
            log = open(self.directory / f"{service}.log", "wb")  # noqa: SIM115 - closed on exit
            self.logs.append(log)
            self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs:  # py-spy writes what it sampled on SIGINT
            proc.send_signal(signal.SIGINT)
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self.logs:
            log.close()


def read_stacks(path: Path) -> tuple[collections.Counter, collections.Counter, int]:
    """From py-spy's raw output (`frame;frame;... count` a line, outermost first): samples
    per function anywhere on the stack, per function at the top, and the total."""
    inclusive: collections.Counter = collections.Counter()
    leaf: collections.Counter = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = [_name(frame) for frame in stack.split(";")]
        total += int(count)
        for frame in set(frames):
            inclusive[frame] += int(count)
        leaf[frames[-1]] += int(count)
    return inclusive, leaf, total


def _name(frame: str) -> str:
    """`function (file)` with the file as its last two path parts."""
    m = FRAME.match(frame)
    if m is None:
        return frame
    return f"{m['fn']} ({'/'.join(Path(m['file']).parts[-2:])})"


def _wrapper(frame: str) -> bool:
    return any(w in frame for w in WRAPPERS)


def panels(directory: Path, cpu_us_per_group: dict[str, float], top: int) -> list[tuple]:
    """Per service with samples: (service, CPU-µs/group, samples, the `top` functions most
    often on the stack as (function, samples) with the `WRAPPERS` left out, samples per
    function running)."""
    out = []
    for service, us in cpu_us_per_group.items():
        path = directory / f"{service}.txt"
        if path.exists():
            inclusive, leaf, total = read_stacks(path)
            if total:
                shown = [(f, n) for f, n in inclusive.most_common() if not _wrapper(f)][:top]
                out.append((service, us, total, shown, leaf))
    return out


def print_samples(directory: Path, cpu_us_per_group: dict[str, float], top: int) -> None:
    """Per service: the functions most often on the stack and most often running, as shares of
    the samples in which the service held the GIL (the frames that head every stack, the
    entry and the event loop's own, `WRAPPERS`, are left out of the first table)."""
    for service, us, total, shown, leaf in panels(directory, cpu_us_per_group, top):
        print(f"\n## {service}: {us:.0f} CPU-µs/group in this window, {total} samples")
        print("| on the stack | running | function |")
        print("|---:|---:|---|")
        for frame, n in shown:
            print(f"| {100 * n / total:.1f} % | {100 * leaf[frame] / total:.1f} % | {frame} |")
        print("\nmost often running:")
        for frame, n in leaf.most_common(top // 2):
            print(f"- {100 * n / total:.1f} % {frame}")


def plot_samples(directory: Path, cpu_us_per_group: dict[str, float], top: int = 12) -> Path:
    """DIR/samples.png: per service, the `top` functions most often on the stack (light bar)
    and the part of it running there (dark bar), as in `print_samples`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = panels(directory, cpu_us_per_group, top)
    fig, axes = plt.subplots(len(drawn), 1, figsize=(13, 3.2 * len(drawn)), squeeze=False)
    for ax, (service, us, total, shown, leaf) in zip(axes[:, 0], drawn, strict=True):
        frames = [f for f, _ in shown][::-1]
        names = [f.replace(".<locals>.", " > ") for f in frames]  # shorter labels
        stack = [100 * n / total for _, n in shown][::-1]
        ax.barh(names, stack, color="#9ecae1", label="on the stack")
        ax.barh(names, [100 * leaf[f] / total for f in frames], color="#08519c", label="running")
        ax.set_title(f"{service}: {us:.0f} CPU-µs/group, {total} samples", loc="left")
        ax.set_xlabel("% of the samples holding the GIL")
        ax.tick_params(axis="y", labelsize=7)
        ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    out = directory / "samples.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
