"""Run logs in the formats users already read: TensorBoard event files and W&B runs.

The scheduler keeps one `RunLog` per experiment (it sees every step, with the fleet's phases
filled in, and every eval), under `run_dir(experiment_id)` = `<ASYNCRL_VAR>/runs/<id>/`:

- `tensorboard/`: event files (`tensorboard --logdir var/runs` shows every run);
- `wandb/`: a W&B run (`offline-run-*/`), offline unless WANDB_MODE says otherwise or WANDB_API_KEY is set
  (`wandb_mode`); `wandb sync var/runs/<id>/wandb` uploads an offline run later.

Scalars are named `<group>/<field>`, x-axis the version (optimizer step): every field of
StepMetrics under `train/`, except the weight-update phases (`WEIGHT_UPDATE_PHASES`) under
`weight_update/`; every field of EvalResult under `eval/`. A field added to those messages
appears without an edit here.

Writing happens on a thread of its own: `step` and `eval` only queue (the scheduler's commit
path stays as fast), the thread opens the writers on first use. A writer that fails to open or
write is logged and dropped; the run goes on. `close` flushes and ends the run (call it off the
event loop: W&B's finish takes a moment).
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from asyncrl.logging import get_logger
from asyncrl.settings import settings

log = get_logger(component="runlog")

LOGGERS = ("tensorboard", "wandb")
WEIGHT_UPDATE_PHASES = (
    "serialize_s",
    "write_s",
    "commit_s",
    "checkpoint_s",
    "stall_s",
    "fleet_version",
    "fleet_update_s",
    "fleet_lag_s",
    "rollout_read_s",
    "rollout_pause_s",
    "rollout_load_s",
    "rollout_resume_s",
    "scheduler_s",
    "weight_bytes_sent",
    "weight_bytes_full",
)
"""StepMetrics fields of a version's weight update (common.proto documents each)."""
X_AXIS = "version"
WANDB_PROJECT = "asyncrl"
"""The W&B project unless WANDB_PROJECT names another."""


def run_dir(experiment_id: str) -> Path:
    """Where an experiment's run logs live: `<ASYNCRL_VAR>/runs/<id>`."""
    return settings().var.absolute() / "runs" / experiment_id


def run_log_hints(experiment_id: str, loggers: list[str]) -> list[str]:
    """Where each of `loggers` writes the experiment's run logs, and the command that reads
    them (what `asyncrl submit` prints); the directory is on the scheduler's host."""
    root = run_dir(experiment_id)
    hints = {
        "tensorboard": f"TensorBoard: tensorboard --logdir {root / 'tensorboard'}",
        "wandb": f"W&B: {root / 'wandb'} (an offline run uploads with: wandb sync <its dir>)",
    }
    return [hints[name] for name in loggers if name in hints]


def _scalars(record: Any) -> dict[str, float]:
    """A flat dataclass's numeric fields by name (the x-axis left out), as floats."""
    return {
        f.name: float(getattr(record, f.name))
        for f in dataclasses.fields(record)
        if f.name != X_AXIS and isinstance(getattr(record, f.name), int | float)
    }


def step_scalars(metrics: Any) -> dict[str, float]:
    """Every StepMetrics field as `train/<field>` or `weight_update/<field>`."""
    return {
        f"{'weight_update' if name in WEIGHT_UPDATE_PHASES else 'train'}/{name}": value
        for name, value in _scalars(metrics).items()
    }


def eval_scalars(result: Any) -> dict[str, float]:
    """Every EvalResult field as `eval/<field>`."""
    return {f"eval/{name}": value for name, value in _scalars(result).items()}


def wandb_mode(env: Mapping[str, str] | None = None) -> str:
    """WANDB_MODE when set; else `online` with WANDB_API_KEY, `offline` without (no network,
    no account: the run is on disk either way)."""
    env = os.environ if env is None else env
    if env.get("WANDB_MODE"):
        return env["WANDB_MODE"]
    return "online" if env.get("WANDB_API_KEY") else "offline"


class _TensorBoard:
    def __init__(self, directory: Path):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        directory.mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(str(directory))

    def log(self, scalars: dict[str, float], version: int, wall_time: float) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=tag, simple_value=v) for tag, v in scalars.items()]
        event = Event(wall_time=wall_time, step=version, summary=Summary(value=values))
        self._writer.add_event(event)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class _Wandb:
    def __init__(self, directory: Path, experiment_id: str, config: dict):
        """The run lands in `directory / "wandb"` (wandb adds that folder itself)."""
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or WANDB_PROJECT,
            id=experiment_id,
            name=experiment_id,
            resume="allow",  # a restarted scheduler goes on with the same run
            dir=str(directory),
            mode=wandb_mode(),
            config=config,
            reinit="create_new",  # one run per experiment, several at once in a scheduler
            settings=wandb.Settings(
                console="off",  # never capture the scheduler's own output
                x_disable_stats=True,  # no system metrics of the scheduler process
                x_disable_meta=True,
                disable_git=True,
                save_code=False,
                silent=True,
            ),
        )
        self._run.define_metric(X_AXIS)
        for group in ("train", "weight_update", "eval"):
            self._run.define_metric(f"{group}/*", step_metric=X_AXIS)

    def log(self, scalars: dict[str, float], version: int, wall_time: float) -> None:
        # the version is a value, not wandb's own step: an eval of version v may land after
        # step v+1 was logged, and wandb drops what is logged at a step it has passed
        self._run.log({X_AXIS: version, **scalars})

    def flush(self) -> None:
        pass  # wandb-core writes as it receives

    def close(self) -> None:
        self._run.finish()


_CLOSE = object()


class RunLog:
    """One experiment's run logs (see the module doc); thread-safe, never raises."""

    def __init__(
        self, directory: Path, loggers: list[str], experiment_id: str, config: dict | None = None
    ):
        unknown = set(loggers) - set(LOGGERS)
        if unknown:
            raise ValueError(f"unknown loggers {sorted(unknown)} (known: {', '.join(LOGGERS)})")
        self.directory = Path(directory)
        self.loggers = list(loggers)
        self.experiment_id = experiment_id
        self.config = config or {}
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def step(self, metrics: Any) -> None:
        """Queue one StepMetrics (x: its version)."""
        self._put((step_scalars(metrics), metrics.version, time.time()))

    def eval(self, result: Any) -> None:
        """Queue one EvalResult (x: the version it evaluated)."""
        self._put((eval_scalars(result), result.version, time.time()))

    def _put(self, item: tuple) -> None:
        with self._lock:
            if self._closed or not self.loggers:
                return
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._write_forever, name=f"runlog-{self.experiment_id}", daemon=True
                )
                self._thread.start()
            self._queue.put(item)

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued, flush and close the writers (blocks; at most `timeout` s).
        Later records are ignored."""
        with self._lock:
            self._closed = True
            thread = self._thread
            if thread is None:
                return
            self._queue.put(_CLOSE)
        thread.join(timeout)
        if thread.is_alive():
            log.warning("runlog_close_timed_out", experiment=self.experiment_id, timeout=timeout)

    def _open(self) -> dict[str, Any]:
        writers: dict[str, Any] = {}
        for name in self.loggers:
            try:
                if name == "tensorboard":
                    writers[name] = _TensorBoard(self.directory / "tensorboard")
                else:
                    writers[name] = _Wandb(self.directory, self.experiment_id, self.config)
            except Exception as e:  # noqa: BLE001 - a logger must never stop the run
                log.warning("runlog_open_failed", logger=name, error=f"{type(e).__name__}: {e}")
        if writers:
            log.info("runlog_opened", experiment=self.experiment_id, dir=str(self.directory))
        return writers

    def _write_forever(self) -> None:
        writers = self._open()
        while True:
            item = self._queue.get()
            if item is _CLOSE:
                break
            for name, writer in list(writers.items()):
                try:
                    writer.log(*item)
                    if self._queue.empty():
                        writer.flush()  # a reader sees each step soon, not at the end
                except Exception as e:  # noqa: BLE001
                    log.warning("runlog_write_failed", logger=name, error=f"{type(e).__name__}")
                    writers.pop(name)
        for name, writer in writers.items():
            try:
                writer.close()
            except Exception as e:  # noqa: BLE001
                log.warning("runlog_close_failed", logger=name, error=f"{type(e).__name__}: {e}")
