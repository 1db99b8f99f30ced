"""The trainer service: one experiment at a time, B trajectory groups per optimizer step.

Per step: pull groups from the experiment's durable consumer until B trainable ones are in
hand (a group staler than eta is acked and reported to the scheduler as dropped), train them
(the backend computes in a worker thread so the event loop stays responsive), write the
weights of the new version to the weight store, `CommitWeights` to the scheduler, and
checkpoint every `trainer.checkpoint_every` steps. `checkpoint.py` explains how the consumer
position in the checkpoint makes a crash lose nothing and train nothing twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from asyncrl.errors import Conflict, NotFound
from asyncrl.logging import get_logger
from asyncrl.retry import idempotent_rpc
from asyncrl.spec import ExperimentSpec, SpecError, spec_from_json
from asyncrl.types import StepMetrics, TrainerState, TrajectoryGroup
from asyncrl.v1 import scheduler_pb2, trainer_pb2
from asyncrl.weights import copy_tokenizer, path_to_uri, prune, publish_version, version_dir
from services.trainer.backends import make_backend
from services.trainer.checkpoint import (
    BACKEND_DIR,
    CheckpointState,
    checkpoint_root,
    consumer_start_seq,
    latest_checkpoint,
    write_checkpoint,
)
from services.trainer.consumer import GroupConsumer
from services.trainer.metrics import (
    drop_reason,
    partition_by_staleness,
    step_metrics,
)
from services.trainer.weight_sync import WeightBroadcaster

log = get_logger()

KEEP_VERSIONS = 3
COMMIT_TIMEOUT_S = 300.0  # the scheduler answers after the rollout fleet loaded the weights
REPORT_TIMEOUT_S = 10.0
SCHEDULER_RETRY_S = 120.0  # keep retrying UNAVAILABLE this long (a scheduler restart)


@dataclass
class Batch:
    groups: list[TrajectoryGroup]
    last_seq: int
    """Stream sequence of the last message consumed for this batch (trained or dropped)."""
    dropped: int


class TrainerService:
    """State and training loop of one trainer; the gRPC servicer is a thin layer over it."""

    def __init__(
        self,
        js,
        scheduler,
        var_dir: Path,
        weights_root: Path,
        fetch_timeout_s: float = 1.0,
        worker: Callable[[], str] = lambda: "",
    ):
        self.js = js
        self.scheduler = scheduler  # scheduler_pb2_grpc.SchedulerStub
        self.var_dir = Path(var_dir)
        self.weights_root = Path(weights_root)
        self.fetch_timeout_s = fetch_timeout_s
        self._worker = worker
        self.experiment_id = ""
        self.spec: ExperimentSpec | None = None
        self.backend = None
        self.state = TrainerState.IDLE
        self.message = ""
        self.version = 0
        self.step = 0
        self.resumed = False
        self.last_metrics: StepMetrics | None = None
        self.log = log
        self._consumer: GroupConsumer | None = None
        self._broadcaster: WeightBroadcaster | None = None  # trainer.weight_sync nccl
        self._boundary_seq = 0  # last stream seq consumed at the last step boundary
        self._task: asyncio.Task | None = None
        self._stop = asyncio.Event()
        self._lock = asyncio.Lock()  # one of: start, a step, a checkpoint

    # -- RPC-facing operations ------------------------------------------------------------
    async def start_experiment(self, experiment_id: str, spec_json: str) -> tuple[int, bool]:
        """Load (or resume) and start training; returns (start version, resumed)."""
        if not experiment_id:
            raise SpecError("experiment_id", "required")
        spec = spec_from_json(spec_json)
        if not (Path(spec.model.path) / "config.json").is_file():
            raise SpecError("model.path", f"no HuggingFace config.json in {spec.model.path}")
        async with self._lock:
            if self.state.active:
                if self.experiment_id == experiment_id:
                    return self.version, self.resumed
                raise Conflict(f"trainer is busy with experiment {self.experiment_id}")
            await self._release()
            self._reset(experiment_id, spec)
            try:
                await self._load()
            except Exception as exc:
                self._fail(exc, "load")
                raise
            self._task = asyncio.create_task(self._run(), name=f"trainer-{experiment_id}")
        return self.version, self.resumed

    def weights_uri(self, version: int) -> str:
        """Where the rollouts load `version` from: the weight store, "" for the base model."""
        if version == 0:
            return ""
        return path_to_uri(version_dir(self.weights_root, self.experiment_id, version))

    async def stop_experiment(self, experiment_id: str) -> None:
        """Stop the loop at the next step boundary, with a final checkpoint."""
        self._require(experiment_id)
        self._stop.set()
        if self._task is not None:
            await asyncio.shield(self._task)

    async def checkpoint_now(self, experiment_id: str) -> tuple[str, int]:
        """Checkpoint at the next step boundary (at once while waiting for groups)."""
        self._require(experiment_id)
        async with self._lock:
            if self.state == TrainerState.FAILED:
                raise Conflict(f"trainer failed, nothing consistent to save: {self.message}")
            path = await self._checkpoint()
            return str(path), self.step

    def status(self) -> trainer_pb2.TrainerStatus:
        return trainer_pb2.TrainerStatus(
            worker_id=self.worker_id,
            experiment_id=self.experiment_id,
            version=self.version,
            step=self.step,
            backend=self.spec.trainer.backend if self.spec else "",
            last_step=self.last_metrics.to_proto() if self.last_metrics else None,
            state=self.state,
            message=self.message,
        )

    def load(self) -> int:
        """Heartbeat load: 1 while an experiment is active."""
        return int(self.state.active)

    @property
    def worker_id(self) -> str:
        """The id this trainer registered under ("" when it did not register)."""
        return self._worker()

    async def close(self, checkpoint: bool = True) -> None:
        """Shut down (idempotent). checkpoint=False ends the loop without a final checkpoint,
        as a crashed process would leave things (used by the recovery tests)."""
        if self._task is not None and not self._task.done():
            if checkpoint:
                self._stop.set()
                await self._task
            else:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
        if self.backend is not None:
            await asyncio.to_thread(self.backend.close)
        await self._release()

    # -- setup ------------------------------------------------------------------------------
    def _require(self, experiment_id: str) -> None:
        if not self.experiment_id or experiment_id != self.experiment_id:
            raise NotFound(f"experiment {experiment_id!r} is not on this trainer")

    def _reset(self, experiment_id: str, spec: ExperimentSpec) -> None:
        self.experiment_id, self.spec = experiment_id, spec
        self.state, self.message = TrainerState.LOADING, ""
        self.version = self.step = self._boundary_seq = 0
        self.resumed, self.last_metrics = False, None
        self._stop = asyncio.Event()  # a StopExperiment during loading stops the new run
        self.log = log.bind(experiment=experiment_id)

    async def _release(self) -> None:
        if self._consumer is not None:
            await self._consumer.close()
            self._consumer = None
        self.backend = None

    async def _load(self) -> None:
        spec = self.spec
        self.backend = make_backend(spec)
        await asyncio.to_thread(self.backend.load, spec.model.path)
        found = latest_checkpoint(checkpoint_root(self.var_dir, self.experiment_id))
        state = None
        if found is not None:
            path, state = found
            await asyncio.to_thread(self.backend.load_checkpoint, path / BACKEND_DIR)
            self.step, self.version, self._boundary_seq = state.step, state.version, state.last_seq
            self.resumed = True
            if (
                self.version > 0
                and not version_dir(self.weights_root, self.experiment_id, self.version).exists()
            ):
                await asyncio.to_thread(self._publish_weights, self.version)  # pruned meanwhile
        self._consumer = GroupConsumer(self.js, self.experiment_id)
        await self._consumer.open(consumer_start_seq(state))
        self._broadcaster = WeightBroadcaster.from_spec(spec.trainer)  # joins at 1st commit
        self.state = TrainerState.WAITING
        self.log.info(
            "experiment_started",
            backend=spec.trainer.backend,
            version=self.version,
            step=self.step,
            resumed=self.resumed,
            last_seq=self._boundary_seq,
        )

    def _fail(self, exc: BaseException, where: str) -> None:
        self.state = TrainerState.FAILED
        self.message = f"{where}: {type(exc).__name__}: {exc}"
        self.log.error(
            "trainer_failed",
            where=where,
            version=self.version,
            step=self.step,
            error=self.message,
            exc_info=exc,
        )

    # -- the loop -----------------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            while not self._stop.is_set():
                batch = await self._collect()
                if batch is None:
                    break
                async with self._lock:
                    stop = await self._train(batch)
                if stop:
                    break
            async with self._lock:
                await self._checkpoint()
            self.state = TrainerState.STOPPED
            self.log.info("experiment_stopped", version=self.version, step=self.step)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - recorded as the failed state, never hidden
            self._fail(exc, "training")
        finally:
            if self._broadcaster is not None:
                await asyncio.to_thread(self._broadcaster.close)
                self._broadcaster = None

    async def _collect(self) -> Batch | None:
        """Pull until B trainable groups are in hand; None if asked to stop first."""
        b = self.spec.trainer.batch_size
        eta = self.spec.rollout.max_head_offpolicyness
        groups: list[TrajectoryGroup] = []
        dropped, last_seq = 0, self._boundary_seq
        self.state = TrainerState.WAITING
        while len(groups) < b:
            if self._stop.is_set():
                return None
            pulled = await self._consumer.pull(b - len(groups), timeout=self.fetch_timeout_s)
            if not pulled:
                continue
            last_seq = pulled[-1].seq
            fresh, stale = partition_by_staleness(
                [p.group for p in pulled if p.group is not None], self.version, eta
            )
            if stale:
                await self._report_dropped(stale, eta)
                dropped += len(stale)
            groups.extend(fresh)
        return Batch(groups=groups, last_seq=last_seq, dropped=dropped)

    async def _train(self, batch: Batch) -> bool:
        """One optimizer step -> version + 1. Returns True when the scheduler says stop."""
        self.state = TrainerState.TRAINING
        trained_at = self.version
        t0 = time.perf_counter()
        stats = await asyncio.to_thread(self.backend.train_step, batch.groups)
        step_time = time.perf_counter() - t0
        self.version += 1
        self.step += 1
        self._boundary_seq = batch.last_seq
        m = step_metrics(
            step=self.step,
            version=self.version,
            groups=batch.groups,
            trainer_version=trained_at,
            backend_stats=stats,
            step_time_s=step_time,
            stale_dropped=batch.dropped,
        )
        self.last_metrics = m
        slog = self.log.bind(version=self.version)
        slog.info("train_step", **{k: v for k, v in asdict(m).items() if k != "version"})
        uri = await asyncio.to_thread(self._publish_weights, self.version)
        resp = await self._commit_and_send(uri, m)
        if resp.stop:
            slog.info("scheduler_says_stop", fleet_version=resp.fleet_version)
        elif self.step % self.spec.trainer.checkpoint_every == 0:
            await self._checkpoint()
        self.state = TrainerState.WAITING
        return resp.stop

    # -- side effects ---------------------------------------------------------------------------
    def _publish_weights(self, version: int) -> str:
        """Write HF safetensors of `version` into the weight store (atomic); keep the last 3."""
        final = version_dir(self.weights_root, self.experiment_id, version)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir()
            self.backend.save_hf(tmp)
            copy_tokenizer(Path(self.spec.model.tokenizer_path or self.spec.model.path), tmp)
            uri = publish_version(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        prune(self.weights_root, self.experiment_id, keep=KEEP_VERSIONS)
        return uri

    async def _checkpoint(self) -> Path:
        state = CheckpointState(
            experiment_id=self.experiment_id,
            step=self.step,
            version=self.version,
            last_seq=self._boundary_seq,
        )
        root = checkpoint_root(self.var_dir, self.experiment_id)
        path = await asyncio.to_thread(write_checkpoint, root, state, self.backend.save_checkpoint)
        self.log.info(
            "checkpoint_saved",
            path=str(path),
            step=self.step,
            version=self.version,
            last_seq=self._boundary_seq,
        )
        return path

    async def _commit(self, uri: str, m: StepMetrics) -> scheduler_pb2.CommitWeightsResponse:
        """CommitWeights is idempotent per (experiment, version): safe to retry."""
        req = scheduler_pb2.CommitWeightsRequest(
            experiment_id=self.experiment_id,
            version=m.version,
            uri=uri,
            metrics=m.to_proto(),
            trainer_id=self.worker_id,
        )
        async for attempt in idempotent_rpc(attempts=30, max_delay_s=SCHEDULER_RETRY_S):
            with attempt:
                return await self.scheduler.CommitWeights(req, timeout=COMMIT_TIMEOUT_S)

    async def _commit_and_send(
        self, uri: str, m: StepMetrics
    ) -> scheduler_pb2.CommitWeightsResponse:
        """CommitWeights; with trainer.weight_sync nccl, broadcast the version meanwhile (the
        scheduler's UpdateWeights has each engine receive it while the trainer sends). Both
        finish before a failure of either is raised, so no broadcast outlives the step."""
        if self._broadcaster is None:
            return await self._commit(uri, m)
        model_dir = version_dir(self.weights_root, self.experiment_id, m.version)
        sent, resp = await asyncio.gather(
            asyncio.to_thread(self._broadcaster.send_version, model_dir),
            self._commit(uri, m),
            return_exceptions=True,
        )
        for result in (sent, resp):
            if isinstance(result, BaseException):
                raise result
        return resp

    async def _report_dropped(self, stale: list[TrajectoryGroup], eta: int) -> None:
        """ReportDropped is idempotent per group id: safe to retry."""
        req = scheduler_pb2.ReportDroppedRequest(
            experiment_id=self.experiment_id,
            groups=[
                scheduler_pb2.DroppedGroup(
                    group_id=g.group_id,
                    prompt_id=g.prompt_id,
                    start_version=g.start_version,
                    trainer_version=self.version,
                    reason=drop_reason(g, self.version, eta),
                )
                for g in stale
            ],
        )
        async for attempt in idempotent_rpc(attempts=30, max_delay_s=SCHEDULER_RETRY_S):
            with attempt:
                await self.scheduler.ReportDropped(req, timeout=REPORT_TIMEOUT_S)
        self.log.info(
            "groups_dropped_stale",
            version=self.version,
            eta=eta,
            groups=[g.group_id for g in stale],
        )
