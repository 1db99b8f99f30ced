"""What every benchmark shares: the result record, the run context, timing, and the report.

`ratio` is always `value / peer_value`; the metric's name says which way is better (a
throughput ratio above 1 means faster than the peer, a time ratio above 1 means slower).
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import torch

from asyncrl.machine import machine_info as host_info
from asyncrl.machine import machine_line
from asyncrl.tiny import build_tiny_model


class Skip(Exception):
    """A benchmark that cannot run here (a missing optional module); the reason is reported."""


@dataclass
class Result:
    name: str  # the benchmark (rollout, interrupt, ...)
    metric: str  # what `value` measures, e.g. "engine tokens/s (KV cache)"
    value: float
    unit: str
    peer: str  # what it is compared with, measured in the same run
    peer_value: float
    settings: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.value / self.peer_value if self.peer_value else float("inf")

    def to_json(self) -> dict:
        return {**asdict(self), "ratio": self.ratio}


@dataclass
class Context:
    """Sizes for this run plus what benchmarks share (tiny models, measured group time)."""

    work_dir: Path
    quick: bool = False
    shared: dict = field(default_factory=dict)
    only: list[str] = field(default_factory=list)
    """The benchmarks named with `--only` (empty: all of them): one named may run its full
    size, which would make the whole `make bench` too long (bench.scale)."""

    def size(self, full, quick):
        return quick if self.quick else full

    @property
    def repeats(self) -> int:
        return self.size(3, 1)

    def model_config(self) -> dict:
        """The tiny model every benchmark uses: the library default when quick, a little larger
        otherwise so that model work, not Python overhead, dominates."""
        if self.quick:
            return {}
        return dict(hidden_size=128, num_layers=4, intermediate_size=256, num_heads=4)

    def tiny_model(self, seed: int = 0) -> Path:
        """A tiny Qwen2 saved under work_dir, built once per seed and run."""
        out = self.work_dir / f"tiny-qwen2-{seed}"
        if not (out / "config.json").exists():
            build_tiny_model(out, family="qwen2", seed=seed, **self.model_config())
        return out


def cpu_affinity() -> bool:
    """Whether the benchmarks that start services place them as `ASYNCRL_CPU_AFFINITY=1` does
    (the rollout on a core of its own, the rest on the others): yes unless it is set to 0. A
    benchmark owns the machine, as a deployment on its own would."""
    return os.environ.get("ASYNCRL_CPU_AFFINITY", "1") not in ("", "0")


def best_of(fn: Callable[[], object], repeats: int) -> float:
    """Fastest wall time of `repeats` calls (timeit's advice: the minimum is the run least
    disturbed by other load on the machine)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def machine_info() -> dict:
    """The host (`asyncrl.machine`: CPU model, cores, load, GPU; `line` is it in one line, as
    the table's caption prints it) and the versions that matter."""
    import transformers

    host = host_info()
    return {
        **host,
        "line": machine_line(host),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
    }


def build_report(
    results: list[Result],
    skipped: list[dict],
    quick: bool,
    command: list[str],
    machine: dict | None = None,
) -> dict:
    """`machine`: `machine_info()` taken before the run (its load average is then what else the
    machine was doing); now when None."""
    return {
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": command,
        "quick": quick,
        "machine": machine or machine_info(),
        "results": [r.to_json() for r in results],
        "skipped": skipped,
    }


def write_report(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def _fmt(x: float) -> str:
    if x == 0:
        return "0"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) >= 1:
        return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"
    return f"{x:.3g}"


def render_table(report: dict):
    """A rich Table of the results (skips listed as rows with their reason)."""
    from rich.table import Table

    m = report["machine"]
    table = Table(
        title=f"asyncrl benchmarks ({m['cpu_count']} CPUs, torch {m['torch']}, "
        f"{m['torch_threads']} thread{'s' if m['torch_threads'] != 1 else ''}"
        f"{', quick' if report['quick'] else ''})",
        caption=f"machine (load before the run): {m.get('line', 'unknown')} · command: {' '.join(report['command'])}",
    )
    for col, justify in (
        ("bench", "left"),
        ("metric", "left"),
        ("value", "right"),
        ("peer", "left"),
        ("peer value", "right"),
        ("ratio", "right"),
    ):
        table.add_column(col, justify=justify)
    for r in report["results"]:
        table.add_row(
            r["name"],
            r["metric"],
            f"{_fmt(r['value'])} {r['unit']}",
            r["peer"],
            f"{_fmt(r['peer_value'])} {r['unit']}",
            f"{r['ratio']:.3g}x",
        )
    for s in report["skipped"]:
        table.add_row(s["name"], f"skipped: {s['reason']}", "", "", "", "")
    lines = [r["settings"]["summary"] for r in report["results"] if "summary" in r["settings"]]
    if lines:  # the system rows' verdicts (efficiency, goal, noise; fleet losses)
        table.caption, table.caption_justify = "\n".join(lines), "left"
    return table
