"""An experiment's progress and history: the steps the trainer committed and the evals, kept in
the record (the last ones), appended to the history log (all of them) and the run logs
(TensorBoard, W&B), and told to watchers; and the one place a `Progress` is made, from the
objects that own each of its parts:

    group counters      policy.StalenessManager.counts (admission's own count)
    version             the fleet (`fleet.Fleet.version`)
    epoch, cursor       the dataset cursor
    tokens per second   the dispatcher's throughput window
    trained groups, staleness, left over    this book (from the steps and the finish)
"""

from __future__ import annotations

import asyncio

from asyncrl.runlog import RunLog
from asyncrl.types import EvalResult, StepMetrics
from services.scheduler.dataset import DatasetCursor
from services.scheduler.history import HistoryLog
from services.scheduler.records import Event, ExperimentRecord, GroupCounters, Progress, flat_dict


class ProgressBook:
    def __init__(self, record: ExperimentRecord, history: HistoryLog, runlog: RunLog, log):
        self.record = record
        self.history = history
        self.runlog = runlog
        """TensorBoard / W&B logs of the steps and evals (`trainer.loggers`)."""
        self.log = log
        saved = record.progress  # a resumed record's tallies
        self.trained_groups = saved.trained_groups
        self.staleness_max = saved.staleness_max
        self.stale_groups = saved.stale_groups
        self.left_over = saved.left_over
        """Prompts left over (`Dispatcher.left_over_at_end`; set as the run finishes, ends)."""
        self._subscribers: set[asyncio.Queue] = set()

    def progress(
        self, counts: GroupCounters, version: int, cursor: DatasetCursor, tokens_per_s: float
    ) -> Progress:
        return Progress(
            **flat_dict(counts),
            version=version,
            trained_groups=self.trained_groups,
            epoch=cursor.epoch,
            cursor=cursor.position,
            rollout_tokens_per_s=tokens_per_s,
            staleness_max=self.staleness_max,
            stale_groups=self.stale_groups,
            left_over=self.left_over,
        )

    def add_step(self, metrics: StepMetrics) -> None:
        """Append the step (replacing the steps of a lineage the trainer discarded)."""
        for old in self.record.add_step(metrics):
            self.trained_groups -= old.groups
            self.log.warning("step_discarded", version=old.version, groups=old.groups)
        self.history.append_step(self.record.id, metrics)
        self.runlog.step(metrics)
        self.trained_groups += metrics.groups
        self.staleness_max = max(self.staleness_max, metrics.staleness_max)
        self.stale_groups += metrics.stale_groups
        self.emit(Event("step", step=metrics))

    def add_eval(self, result: EvalResult) -> None:
        self.record.evals.append(result)
        self.history.append_eval(self.record.id, result)
        self.runlog.eval(result)
        self.log.info(
            "eval_done",
            version=result.version,
            accuracy=round(result.accuracy, 4),
            reward_mean=round(result.reward_mean, 4),
            samples=result.n_samples,
            failed=result.failed,
        )
        self.emit(Event("eval", eval=result))

    def stall_mark(self, counts: GroupCounters, fleet, eval_samples: int) -> tuple[tuple, str]:
        """What moves while the run makes progress (a commit, a group settled, an eval group
        scored, an eval, a rollout joining), and what it waits for: the trainer's watchdog acts
        when the mark stands still (`TrainerSupervisor.watch`). `fleet` is the experiment's
        `Fleet`; `eval_samples` the samples scored in the open eval rounds (training waits on
        the first one under `eval.before_training`)."""
        v, ready = fleet.version, len(fleet.ready)
        mark = (v, fleet.committed_version, counts.accepted, counts.rejected, counts.failed)
        mark += (counts.stale_dropped, len(self.record.evals), eval_samples, ready)
        waiting = (
            f"no step committed after v{v} and no group settled ({counts.running} running on"
            f" {ready} ready rollouts)"
        )
        return mark, waiting

    # ---- watchers ----------------------------------------------------------------------------

    def emit(self, event: Event) -> None:
        for q in self._subscribers:
            q.put_nowait(event)

    def subscribe(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self._subscribers.discard(q)

    async def close_logs(self) -> None:
        await asyncio.to_thread(self.runlog.close)

    async def close(self) -> None:
        """The scheduler stops: no more watchers, the run logs closed."""
        self._subscribers.clear()
        await self.close_logs()
