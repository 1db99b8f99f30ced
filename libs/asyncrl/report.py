"""Run summaries and curves from an Experiment (its step history and evals).

`summarize` is pure arithmetic over the proto; `plot_experiment` draws the curves with
matplotlib's Agg backend; `write_summary` writes both to a directory and prints a table, with
the machine it ran on (`asyncrl.machine`).
"""

from __future__ import annotations

import json
from pathlib import Path

from google.protobuf import json_format
from rich.console import Console
from rich.table import Table

from asyncrl.client import experiment_spec
from asyncrl.machine import machine_line
from asyncrl.v1 import scheduler_pb2

COUNTERS = ("accepted", "rejected", "failed", "stale_dropped", "trained_groups")


def as_experiment(experiment: scheduler_pb2.Experiment | dict) -> scheduler_pb2.Experiment:
    """Accept the proto or its dict form (proto field names or JSON camelCase names)."""
    if isinstance(experiment, scheduler_pb2.Experiment):
        return experiment
    return json_format.ParseDict(experiment, scheduler_pb2.Experiment(), ignore_unknown_fields=True)


def sorted_evals(exp: scheduler_pb2.Experiment) -> list[scheduler_pb2.EvalResult]:
    return sorted(exp.progress.evals, key=lambda e: e.version)


def token_versions(e: scheduler_pb2.EvalResult) -> str:
    """The versions that generated an eval round's tokens: "v10" when the round measured its
    version alone, "v10-v13" when the fleet moved on while it ran, "-" for a round recorded
    before EvalResult carried them."""
    if e.max_version < e.version:
        return "-"
    if e.min_version == e.max_version:
        return f"v{e.min_version}"
    return f"v{e.min_version}-v{e.max_version}"


def wall_seconds(experiment: scheduler_pb2.Experiment | dict) -> float:
    """Submit to the last update (for a finished run, to its end), in seconds."""
    exp = as_experiment(experiment)
    return max(0.0, (exp.updated_unix_ms - exp.created_unix_ms) / 1000)


def summarize(experiment: scheduler_pb2.Experiment | dict, wall_seconds: float) -> dict:
    """The numbers a run is judged by.

    stale_fraction = sum(stale_groups) / sum(groups) over the step history: the share of
    trained groups that were generated (at least partly) by an older policy version.
    """
    exp = as_experiment(experiment)
    history = list(exp.history)
    evals = sorted_evals(exp)
    groups = sum(h.groups for h in history)
    stale = sum(h.stale_groups for h in history)
    max_staleness = max([h.staleness_max for h in history] + [exp.progress.staleness_max])
    summary = {
        "experiment_id": exp.id,
        "name": exp.name,
        "state": scheduler_pb2.ExperimentState.Name(exp.state).removeprefix("EXPERIMENT_STATE_"),
        "initial_eval_accuracy": evals[0].accuracy if evals else None,
        "initial_eval_version": evals[0].version if evals else None,
        "final_eval_accuracy": evals[-1].accuracy if evals else None,
        "final_eval_version": evals[-1].version if evals else None,
        "steps": len(history),
        "wall_seconds": wall_seconds,
        "max_staleness": max_staleness,
        "stale_fraction": stale / groups if groups else 0.0,
        "max_head_offpolicyness": experiment_spec(exp).rollout.max_head_offpolicyness,
        "final_reward_mean": history[-1].reward_mean if history else None,
    }
    for name in COUNTERS:
        summary[name] = getattr(exp.progress, name)
    return summary


def plot_experiment(experiment: scheduler_pb2.Experiment | dict, out: str | Path) -> Path:
    """Reward mean and eval accuracy against version (top), staleness (bottom) -> PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    exp = as_experiment(experiment)
    history = sorted(exp.history, key=lambda h: h.version)
    evals = sorted_evals(exp)
    versions = [h.version for h in history]

    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]}
    )
    top.plot(versions, [h.reward_mean for h in history], marker=".", label="train reward mean")
    if evals:
        top.plot(
            [e.version for e in evals],
            [e.accuracy for e in evals],
            marker="o",
            label="eval accuracy",
        )
    top.set_ylabel("reward / accuracy")
    top.set_title(f"{exp.name or 'experiment'} ({exp.id})")
    top.grid(alpha=0.3)
    top.legend(loc="best")

    bottom.plot(versions, [h.staleness_max for h in history], marker="^", label="staleness max")
    bottom.plot(versions, [h.staleness_mean for h in history], marker=".", label="staleness mean")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    eta = experiment_spec(exp).rollout.max_head_offpolicyness
    bottom.axhline(eta, color="grey", linestyle="--", linewidth=1, label=f"η = {eta}")
    bottom.set_xlabel("version (optimizer step)")
    bottom.set_ylabel("staleness")
    bottom.grid(alpha=0.3)
    bottom.legend(loc="best")

    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def summary_table(summary: dict) -> Table:
    table = Table(title=f"asyncrl run {summary['experiment_id']}", show_header=False)
    table.add_column("metric", style="cyan")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        if isinstance(value, float):
            value = f"{value:.4g}"
        table.add_row(key, "-" if value is None else str(value))
    return table


def write_summary(
    experiment: scheduler_pb2.Experiment | dict,
    wall_seconds: float,
    out_dir: str | Path,
    console: Console | None = None,
) -> dict:
    """Write summary.json and reward.png under `out_dir`, print a table; return the summary."""
    exp = as_experiment(experiment)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(exp, wall_seconds)
    # wall_seconds means little without the machine (issue 24): the host writing the report
    # (where `make demo` ran it), its load average at the end of the run
    summary["machine"] = machine_line()
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_experiment(exp, out_dir / "reward.png")
    (console or Console()).print(summary_table(summary))
    return summary
