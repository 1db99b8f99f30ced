"""What `asyncrl watch` and `asyncrl status` show: one experiment's latest state, folded from
its ProgressEvents (`ProgressView`), as

- a live view that stays in place (`ProgressView.live`): a progress bar to total_steps with the
  elapsed time and an estimate of the rest, the latest step's figures, the evals as they land;
- one line per event (`ProgressView.line`), for logs and CI;
- a status table (`ProgressView.render`).

`follow` drives either from a stream of events.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from asyncrl.client import experiment_spec, state_name
from asyncrl.report import token_versions
from asyncrl.v1 import common_pb2, scheduler_pb2

LIVE_EVALS = 8
"""Evals the live view lists: the first (the start) and the newest."""


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def duration(seconds: float) -> str:
    """`1:02:03`, `2:03` (h:mm:ss, m:ss)."""
    s = max(0, round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


def failure_summary(p: scheduler_pb2.Progress, top: int = 5) -> str:
    """The most frequent reasons groups failed, e.g. `3x reward raised: ZeroDivisionError`."""
    reasons = sorted(p.failure_reasons.items(), key=lambda kv: -kv[1])
    text = "; ".join(f"{n}x {why}" for why, n in reasons[:top])
    if len(reasons) > top:
        text += f"; and {len(reasons) - top} more"
    return text


class ProgressView:
    """The latest known state of one experiment, folded from ProgressEvents."""

    def __init__(self, experiment_id: str):
        self.experiment_id = experiment_id
        self.experiment = scheduler_pb2.Experiment(id=experiment_id)
        self.last_step: common_pb2.StepMetrics | None = None
        self.last_eval: scheduler_pb2.EvalResult | None = None
        self.evals: dict[int, scheduler_pb2.EvalResult] = {}
        """Every eval seen, by version."""
        self.eta: int | None = None
        """max_head_offpolicyness, from the spec the first snapshot carries."""
        self.total_steps: int | None = None
        """trainer.total_steps, from the same spec."""

    def update(self, event: scheduler_pb2.ProgressEvent) -> None:
        if event.HasField("experiment"):
            self.experiment = event.experiment
            if self.eta is None and event.experiment.spec_json:
                spec = experiment_spec(event.experiment)
                self.eta = spec.rollout.max_head_offpolicyness
                self.total_steps = spec.trainer.total_steps
            p = event.experiment.progress
            if p.HasField("last_step"):
                self.last_step = p.last_step
            for e in p.evals:
                self.evals[e.version] = e
            if p.evals:
                self.last_eval = max(p.evals, key=lambda e: e.version)
        if event.HasField("step"):
            self.last_step = event.step
        if event.HasField("eval"):
            self.last_eval = event.eval
            self.evals[event.eval.version] = event.eval

    @property
    def steps_done(self) -> int:
        return self.last_step.version if self.last_step else 0

    def line(self, kind: str) -> str:
        """A one-line summary (for logs and non-terminal output)."""
        p, step, ev = self.experiment.progress, self.last_step, self.last_eval
        total = "?" if self.total_steps is None else self.total_steps
        return (
            f"[{kind}] {state_name(self.experiment.state)} v{p.version}"
            f" step={self.steps_done}/{total}"
            f" accepted={p.accepted} rejected={p.rejected} failed={p.failed}"
            f" stale_dropped={p.stale_dropped} running={p.running} left_over={p.left_over}"
            f" reward={fmt(step.reward_mean if step else None)}"
            f" loss={fmt(step.loss if step else None, '.4f')}"
            f" eval={fmt(ev.accuracy if ev else None)}"
            f" staleness_max={max(p.staleness_max, step.staleness_max if step else 0)}"
            + (f" failures: {failure_summary(p)}" if p.failure_reasons else "")
        )

    def render(self) -> Table:
        """The status table (`asyncrl status`)."""
        exp, p = self.experiment, self.experiment.progress
        step = self.last_step
        table = Table(
            title=escape(f"experiment {exp.id} {exp.name}"), show_header=False, min_width=60
        )
        table.add_column("field", style="cyan")
        table.add_column("value")
        table.add_row("state", self._state())
        table.add_row(
            "version / step",
            f"{p.version} / {step.step if step else 0}   epoch {p.epoch} cursor {p.cursor}",
        )
        table.add_row("groups", self._groups())
        if p.failure_reasons:
            table.add_row("failure reasons", escape(failure_summary(p)))
        table.add_row("reward mean", fmt(step.reward_mean if step else None))
        table.add_row(
            "eval accuracy",
            "-"
            if self.last_eval is None
            else f"{self.last_eval.accuracy:.3f} (v{self.last_eval.version})",
        )
        table.add_row("staleness", self._staleness())
        table.add_row(
            "tokens/s",
            f"rollout {p.rollout_tokens_per_s:.1f}  trainer "
            f"{fmt(step.tokens_per_s if step else None, '.1f')}",
        )
        return table

    def _state(self) -> str:
        exp = self.experiment
        return state_name(exp.state) + (f"  ({escape(exp.message)})" if exp.message else "")

    def _groups(self) -> str:
        p = self.experiment.progress
        return (
            f"accepted {p.accepted}  rejected {p.rejected}  failed {p.failed}"
            f"  stale_dropped {p.stale_dropped}  running {p.running}"
            f"  trained {p.trained_groups}  left over {p.left_over}"
        )

    def _staleness(self) -> str:
        p, step = self.experiment.progress, self.last_step
        return (
            f"max {max(p.staleness_max, step.staleness_max if step else 0)}"
            f"  mean {fmt(step.staleness_mean if step else None, '.2f')}"
            f"  (η = {'-' if self.eta is None else self.eta})"
        )

    # ---- the live view -----------------------------------------------------------------------

    def live(self, now: float | None = None) -> Group:
        """Progress bar, latest step, evals (`asyncrl watch` on a terminal)."""
        exp = self.experiment
        title = Text.assemble(
            ("experiment ", "bold"), (f"{exp.id} {exp.name}".strip(), "bold cyan")
        )
        return Group(title, self._bar(time.time() if now is None else now), self._step_table())

    def _bar(self, now: float) -> Table:
        done, total = self.steps_done, self.total_steps
        elapsed = (
            now - self.experiment.created_unix_ms / 1000 if self.experiment.created_unix_ms else 0.0
        )
        timing = f"elapsed {duration(elapsed)}"
        if total and 0 < done < total:
            timing += f"  left ~{duration(elapsed / done * (total - done))}"
        grid = Table.grid(padding=(0, 2))
        grid.add_row(
            ProgressBar(total=total, completed=min(done, total or done), width=40),
            Text(f"{done}/{total if total else '?'} steps", style="bold"),
            Text(timing),
        )
        return grid

    def _step_table(self) -> Table:
        p, step = self.experiment.progress, self.last_step
        table = Table(show_header=False, box=None, padding=(0, 1))
        table.add_column("field", style="cyan", no_wrap=True)
        table.add_column("value")
        table.add_row("state", self._state())
        table.add_row(
            "groups",
            f"accepted {p.accepted}  rejected {p.rejected}  failed {p.failed}"
            f"  running {p.running}  trained {p.trained_groups}",
        )
        if p.failure_reasons:
            table.add_row("failure reasons", escape(failure_summary(p)))
        if step is not None:
            table.add_row(
                f"step {step.version}",
                f"loss {step.loss:.4f}  reward {step.reward_mean:.3f}"
                f"  accuracy {step.accuracy:.3f}",
            )
            table.add_row(
                "policy",
                f"kl {step.kl:.4f}  entropy {step.entropy:.3f}  grad norm {step.grad_norm:.3f}"
                f"  clipped {step.clip_fraction:.3f}",
            )
            table.add_row(
                "time",
                f"step {step.step_time_s:.2f}s  waiting {step.wait_s:.2f}s"
                f"  stall {step.stall_s:.2f}s",
            )
            table.add_row(
                "tokens/s",
                f"trainer {step.tokens_per_s:.1f}  rollout {p.rollout_tokens_per_s:.1f}",
            )
            table.add_row(
                "weight update",
                f"serialize {step.serialize_s:.3f}s  write {step.write_s:.3f}s"
                f"  commit {step.commit_s:.3f}s  fleet {step.fleet_update_s:.3f}s"
                f"  lag {step.fleet_lag_s:.3f}s",
            )
        table.add_row("staleness", self._staleness())
        table.add_row("evals", self._evals())
        return table

    def _evals(self) -> Text | Table:
        if not self.evals:
            return Text("-")
        versions = sorted(self.evals)
        shown = (
            versions if len(versions) <= LIVE_EVALS else [versions[0], *versions[1 - LIVE_EVALS :]]
        )
        table = Table(box=None, padding=(0, 1), show_edge=False)
        for col in ("version", "accuracy", "reward mean", "tokens from", "failed"):
            table.add_column(col, justify="right", header_style="dim")
        for v in shown:
            e = self.evals[v]
            table.add_row(
                str(v),
                f"{e.accuracy:.3f}",
                f"{e.reward_mean:.3f}",
                token_versions(e),
                str(e.failed),
            )
        return table


async def follow(
    events: AsyncIterator[scheduler_pb2.ProgressEvent],
    view: ProgressView,
    console: Console,
    plain: bool,
) -> None:
    """Fold `events` into `view`, showing them on `console`: one line per step, eval and
    state change when `plain` (the first snapshot too), else a live view that stays in place."""
    if plain:
        first = True
        async for event in events:
            view.update(event)
            if first or event.kind != "snapshot":
                console.print(view.line(event.kind), soft_wrap=True, markup=False, highlight=False)
            first = False
        return
    with Live(view.live(), console=console, refresh_per_second=4) as live:
        async for event in events:
            view.update(event)
            live.update(view.live())
