"""The trainer service: one experiment at a time, exactly B trajectory groups per optimizer step.

Per step: pull groups from the experiment's durable consumer until B trainable ones are in
hand, triaging each (`validation.py`): a malformed or foreign message is dead-lettered with its
reason, a replay of a group already trained is skipped, a group staler than eta is reported to
the scheduler as dropped; all of them are acked and counted. Then train them
(the backend computes in a worker thread so the event loop stays responsive), take the new
version's weights as bytes, and go on with the next step while they are written to the weight
store and sent the way `trainer.weight_sync` says (`transport.py`: disk, the NATS object store,
or an NCCL broadcast) and committed
(`CommitWeights`) in the background (`publish.py`: one version in flight,
commits in order; the scheduler answers once it has recorded the version and updates the
rollouts afterwards). The version at `trainer.total_steps` is committed before anything else
happens (its answer says stop); a stop answered earlier ends the run at the next step
boundary, so at most one more step is trained, and committed. Checkpoint every
`trainer.checkpoint_every` steps, once every version trained is committed. `checkpoint.py`
explains how the consumer position in the checkpoint makes a crash lose nothing and train
nothing twice.

A failure (loading, consuming, training, publishing weights, committing, checkpointing) leaves
the trainer in state `failed` with a message naming the stage and the cause, which GetStatus
reports; the worker keeps heartbeating so the scheduler can ask.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc

from asyncrl.errors import Conflict, NotFound
from asyncrl.ledger import Ledger, ensure_ledger
from asyncrl.logging import get_logger, raise_if_cancelled
from asyncrl.natsutil import check_experiment_id
from asyncrl.runtime import freeze_heap
from asyncrl.settings import settings
from asyncrl.spec import ExperimentSpec, SpecError, spec_from_json
from asyncrl.storage import storage_error, storage_message
from asyncrl.types import StepMetrics, TrainerState, TrajectoryGroup
from services.trainer.backends import make_backend
from services.trainer.backends.base import Diverged, check_finite_step
from services.trainer.checkpoint import (
    BACKEND_DIR,
    CheckpointState,
    checkpoint_root,
    consumer_start_seq,
    resume_point,
    write_checkpoint,
)
from services.trainer.consumer import GroupConsumer, Pulled, unconsumed_group_ids
from services.trainer.metrics import (
    StepTimes,
    phase_histogram,
    stall_seconds,
    step_metrics,
)
from services.trainer.publish import Publisher
from services.trainer.scheduler_calls import SchedulerCalls
from services.trainer.transport import Store, WeightSender, sender_for
from services.trainer.validation import (
    Admission,
    RecentIds,
    Verdict,
    fingerprint_tally,
    triage,
)

log = get_logger()

KEEP_VERSIONS = 3
"""Versions kept in the weight store at least; `keep_versions` keeps what the fleet may need."""


@dataclass
class Batch:
    last_seq: int
    """Stream sequence of the last message consumed for this batch (trained or not)."""
    groups: list[TrajectoryGroup] = field(default_factory=list)
    taken: set[str] = field(default_factory=set)
    """Ids of `groups`: a second copy within the batch is a replay too."""
    dropped: int = 0
    quarantined: int = 0
    replayed: int = 0
    wait_s: float = 0.0
    """Seconds spent collecting it (pulling, triaging, waiting for groups)."""


def keep_versions(eta: int) -> int:
    """How many of the newest versions the weight store keeps. The fleet loads a version after
    its commit, so it may serve one up to eta + 1 behind the trainer's newest (admission lets
    the trainer get no further ahead), and a rollout that joins loads the fleet's: keep those,
    and one more for the version an update is reading while the next is written."""
    return max(KEEP_VERSIONS, eta + 3)


def model_vocab_size(model_dir: str | Path) -> int:
    """`vocab_size` of a HuggingFace config.json (top level, or its text_config)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    vocab = cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size")
    if not vocab:
        raise ValueError(f"no vocab_size in {model_dir}/config.json")
    return int(vocab)


def describe(exc: BaseException, var_dir: Path | None = None) -> str:
    """An exception as one line: its type and message (a gRPC error's code and details); a
    full disk as `storage full: ... at <file, else var_dir>`, the words the scheduler pauses
    the run on."""
    if storage_error(exc) is not None:
        return storage_message(exc, var_dir or "")
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{type(exc).__name__}: {exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


RUNNING = (TrainerState.WAITING, TrainerState.TRAINING)
"""Started and loaded: StartExperiment for its own experiment answers without the lock (a
restarted scheduler holds the trainer's commit until it answers) with the newest version whose
weights are written (its fleet loads them; the commits in flight follow)."""


LEDGER_WAIT_S = 2.0
"""How long a periodic checkpoint waits for the ledger to store the steps trained."""


async def ledger_behind(ledger: Ledger, step: int, log) -> bool:
    """Whether the ledger has still not stored every step trained after `LEDGER_WAIT_S` (NATS
    away): a periodic checkpoint is skipped then. One ahead of the ledger, then a crash, and
    the steps it holds would never be recorded trained (the ledger would say their groups
    were lost)."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(ledger.flush(), LEDGER_WAIT_S)  # the writer itself goes on
    if not ledger.unstored:
        return False
    log.warning(
        "checkpoint_skipped",
        step=step,
        reason=f"ledger events not stored after {LEDGER_WAIT_S:g}s (NATS away?)",
        unstored=ledger.unstored,
    )
    return True


async def left_over_after(service: TrainerService, exc: Diverged) -> None:
    """Before a diverged run's failure is reported (the scheduler then ends the run): the
    groups no committed step took, the diverged step's included, recorded as left over."""
    try:
        await service._record_left_over()
        await service.ledger.flush()
    except Exception:  # noqa: BLE001 - the failure is reported either way
        service.log.exception("left_over_not_recorded", error=str(exc))


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
        self.fatal = False
        """The failure is the run's own (a diverged model): started again, it would repeat it."""
        self.version = 0
        self.step = 0
        self.resumed = False
        self.last_metrics: StepMetrics | None = None
        self.log = log
        self._consumer: GroupConsumer | None = None
        self.sender: WeightSender | None = None  # how versions reach the rollouts
        self._scheduler: SchedulerCalls | None = None  # CommitWeights, ReportDropped
        self._boundary_seq = 0  # last stream seq consumed at the last step boundary
        self._trained = RecentIds()  # group ids trained up to the last step boundary
        self.samples_checked: Counter[str] = Counter()  # by weights check (`_reset`)
        self._vocab_size = 0
        self._stage = ""  # what the loop is doing: names the cause of a failure
        self._task: asyncio.Task | None = None
        self._stop = asyncio.Event()
        self._lock = asyncio.Lock()  # one of: start, a step, a checkpoint
        self.phases = phase_histogram()
        self._train_end: float | None = None  # when the last train_step of this run ended
        self._after = StepTimes()  # checkpoint_s of the last version, sent with the next
        self.publisher: Publisher | None = None  # the run's versions on their way out
        self.min_step_s = settings().bench_min_step_s

    # -- RPC-facing operations ------------------------------------------------------------
    async def start_experiment(self, experiment_id: str, spec_json: str) -> tuple[int, bool]:
        """Load (or resume) and start training; returns (start version, resumed)."""
        check_experiment_id(experiment_id)  # a consumer name and a directory
        spec = spec_from_json(spec_json)
        if not (Path(spec.model.path) / "config.json").is_file():
            raise SpecError("model.path", f"no HuggingFace config.json in {spec.model.path}")
        if self.state in RUNNING and self.experiment_id == experiment_id:  # not behind a step
            newest = max(self.publisher.fingerprints, default=0)  # the newest one written
            return newest, self.resumed
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
        """Where the rollouts load `version` from ("" for the base model)."""
        return self.sender.uri(version) if version else ""

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
        self.state, self.message, self.fatal = TrainerState.LOADING, "", False
        self.version = self.step = self._boundary_seq = 0
        self.resumed, self.last_metrics = False, None
        self._trained = RecentIds()
        self.samples_checked = Counter()  # trained samples: verified / unverified weights
        self._train_end, self._after = None, StepTimes()
        self._stop = asyncio.Event()  # a StopExperiment during loading stops the new run
        self.log = log.bind(experiment=experiment_id)
        self.ledger = Ledger(self.js, experiment_id)
        self.run_id = uuid.uuid4().hex[:8]
        """This process's run of the experiment, in its ledger events."""
        store = Store(
            root=self.weights_root,
            experiment_id=experiment_id,
            tokenizer_dir=Path(spec.model.tokenizer_path or spec.model.path),
            keep=keep_versions(spec.rollout.max_head_offpolicyness),
            final=spec.trainer.total_steps,
        )
        self._scheduler = SchedulerCalls(self.scheduler, experiment_id, self._worker, self.log)
        timeout = spec.rollout.weight_update_timeout_s
        self.sender = sender_for(spec.trainer, store, self.js, self._observe, self.log, timeout)
        self.publisher = Publisher(
            sender=self.sender,
            commit=self._scheduler.commit,
            ledger=self.ledger,
            run_id=self.run_id,
            observe=self._observe,
            log=self.log,
            on_stop=self._stop.set,
        )

    async def _release(self) -> None:
        if self._consumer is not None:
            await self._consumer.close()
            self._consumer = None
        self.backend = None

    async def _load(self) -> None:
        spec = self.spec
        self._vocab_size = model_vocab_size(spec.model.path)
        self.backend = make_backend(spec)
        await asyncio.to_thread(self.backend.load, spec.model.path)
        found = resume_point(checkpoint_root(self.var_dir, self.experiment_id), self.log)
        state = None
        if found is not None:
            path, state = found
            await asyncio.to_thread(self.backend.load_checkpoint, path / BACKEND_DIR)
            self.step, self.version, self._boundary_seq = state.step, state.version, state.last_seq
            self._trained = RecentIds(state.trained_ids)
            self.resumed = True
            if self.version > 0:
                await self.sender.restore(self.version, self.backend.hf_files)
                self.publisher.fingerprints[self.version] = self.sender.fingerprint(self.version)
        self._consumer = GroupConsumer(self.js, self.experiment_id)
        await self._consumer.open(consumer_start_seq(state))
        await ensure_ledger(self.js)
        # steps recorded after the checkpoint this run resumes from were lost with the process
        # that trained them: their groups come again and are trained by this run
        await self.ledger.record("rewound", to_step=self.step, run=self.run_id)
        freeze_heap()  # the model and optimizer: never scanned by the collector again
        self.state = TrainerState.WAITING
        self.log.info(
            "experiment_started",
            backend=spec.trainer.backend,
            version=self.version,
            step=self.step,
            resumed=self.resumed,
            last_seq=self._boundary_seq,
            trained_ids=len(self._trained),
        )

    def _fail(self, exc: BaseException, where: str) -> None:
        self.state = TrainerState.FAILED
        self.fatal = isinstance(exc, Diverged)  # its message is the run's reason as it stands
        self.message = str(exc) if self.fatal else f"{where}: {describe(exc, self.var_dir)}"
        at = {"where": where, "version": self.version, "step": self.step}
        self.log.error("trainer_failed", **at, error=self.message, exc_info=exc)

    # -- the loop -----------------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            while not self._stop.is_set():
                batch = await self._collect()
                if batch is None:
                    break
                async with self._lock:
                    await self._train(batch)
            await self._wait_published()  # every version trained is committed
            self._stage = "left over"
            await self._record_left_over()
            async with self._lock:
                self._stage = "final checkpoint"
                await self._checkpoint()
            await self._close_sender()  # before STOPPED: a stopped trainer holds no group
            self.state = TrainerState.STOPPED
            self.log.info("experiment_stopped", version=self.version, step=self.step)
        except asyncio.CancelledError:
            raise
        except Diverged as exc:  # the run ends here: what no step took is left over
            await left_over_after(self, exc)
            self._fail(exc, self._stage)
        except Exception as exc:  # noqa: BLE001 - recorded as the failed state, never hidden
            self._fail(exc, self._stage)
        finally:
            self.publisher.cancel()
            await self._close_sender()

    async def _record_left_over(self) -> None:
        """The training groups no step took when the run ended: reported, never silent."""
        ids = await unconsumed_group_ids(self.js, self.experiment_id, self._boundary_seq)
        if ids := [i for i in ids if i not in self._trained]:
            await self.ledger.record("left_over", groups=ids, reason="not trained when it ended")
            self.log.info("left_over", groups=len(ids))

    async def _close_sender(self) -> None:
        try:
            await self.sender.close()
        except Exception as exc:  # noqa: BLE001 - the run's outcome is already recorded
            self.log.warning("weight_sender_close_failed", error=describe(exc))

    def _admission(self) -> Admission:
        return Admission(
            experiment_id=self.experiment_id,
            vocab_size=self._vocab_size,
            trainer_version=self.version,
            eta=self.spec.rollout.max_head_offpolicyness,
            fingerprints=self.publisher.fingerprints,
        )

    async def _collect(self) -> Batch | None:
        """Pull until exactly B trainable groups are in hand; None if asked to stop first."""
        b = self.spec.trainer.batch_size
        batch = Batch(last_seq=self._boundary_seq)
        self.state = TrainerState.WAITING
        t0 = time.perf_counter()
        while len(batch.groups) < b:
            raise_if_cancelled("trainer loop")  # a pull's wait_for may swallow close()'s cancel
            if self._stop.is_set():
                return None
            if self.publisher.done:  # raise a failure now, not after the next step
                await self._wait_published()
            self._stage = "consume"
            pulled = await self._consumer.pull(b - len(batch.groups), timeout=self.fetch_timeout_s)
            stale = [g for p in pulled for g in await self._admit(p, batch)]
            if stale:
                self._stage = "report dropped"
                eta = self.spec.rollout.max_head_offpolicyness
                await self._scheduler.report_dropped(stale, self.version, eta)
            if pulled:
                batch.last_seq = pulled[-1].seq
        batch.wait_s = time.perf_counter() - t0
        self._observe("wait", batch.wait_s)
        return batch

    async def _admit(self, p: Pulled, batch: Batch) -> list[TrajectoryGroup]:
        """Triage one pulled message into `batch`; returns its group when it is too stale."""
        if p.group is None:
            verdict, reason = Verdict.BAD, f"undecodable: {p.error}"
        else:
            verdict, reason = triage(p.group, self._admission(), self._trained, batch.taken)
        if verdict == Verdict.TRAIN:
            batch.groups.append(p.group)
            batch.taken.add(p.group.group_id)
            self.samples_checked.update(fingerprint_tally(p.group, self.publisher.fingerprints))
        elif verdict == Verdict.STALE:
            batch.dropped += 1
            return [p.group]
        elif verdict == Verdict.REPLAY:
            batch.replayed += 1
            self.log.info("group_replay_skipped", group=p.group.group_id, seq=p.seq)
        else:
            batch.quarantined += 1
            self._stage = "quarantine"
            await self._consumer.dead_letter(p, reason)
            group = p.group.group_id if p.group else ""
            self.ledger.emit("quarantined", group=group, seq=p.seq, reason=reason)
            self.log.warning("group_quarantined", seq=p.seq, group=group, reason=reason)
        return []

    async def _train(self, batch: Batch) -> None:
        """One optimizer step -> version + 1, handed over to be published (`_publish`)."""
        self.state, self._stage = TrainerState.TRAINING, "training"
        trained_at = self.version
        t0 = time.perf_counter()
        stall_s = stall_seconds(self._train_end, t0, batch.wait_s)
        stats, self._train_end, files = await asyncio.to_thread(self._step, batch.groups)
        serialize_s = time.perf_counter() - self._train_end
        self.version += 1
        self.step += 1
        self._boundary_seq = batch.last_seq
        self._trained.extend(g.group_id for g in batch.groups)
        await self._wait_published()  # the previous version: commits go in order
        m = step_metrics(
            step=self.step,
            version=self.version,
            groups=batch.groups,
            trainer_version=trained_at,
            backend_stats=stats,
            step_time_s=self._train_end - t0,
            stale_dropped=batch.dropped,
            quarantined=batch.quarantined,
            replayed=batch.replayed,
            times=replace(
                self._after,
                commit_s=self.publisher.commit_s,
                weight_bytes_sent=self.publisher.moved[0],
                weight_bytes_full=self.publisher.moved[1],
                wait_s=batch.wait_s,
                serialize_s=serialize_s,
                stall_s=stall_s,
            ),
        )
        self.last_metrics, self._after = m, StepTimes()
        self._observe("train_step", m.step_time_s)
        self._observe("serialize", serialize_s)
        self._observe("stall", stall_s)
        self.log.info("train_step", **vars(m))  # its fields (scalars): asdict deep-copies
        self.publisher.start(m, files, batch.groups)
        if self.version >= self.spec.trainer.total_steps:
            await self._wait_published()  # the last version: its answer says stop
        if not self._stop.is_set() and self.step % self.spec.trainer.checkpoint_every == 0:
            self._stage = "checkpoint"
            await self._checkpoint(periodic=True)
        self.state = TrainerState.WAITING

    def _step(self, groups: list[TrajectoryGroup]) -> tuple[dict[str, float], float, dict]:
        """(In a worker thread) train on `groups`; the stats, when it ended, the new weights."""
        began = time.perf_counter()
        stats = self.backend.train_step(groups)
        check_finite_step(self.backend, stats, self.version + 1)  # before a version exists
        ended = time.perf_counter()
        time.sleep(max(0.0, self.min_step_s - (ended - began)))  # a bench knob; 0 in use
        self._stage = "serialize weights"
        return stats, ended, self.sender.snapshot(self.backend)

    async def _wait_published(self) -> None:
        """Wait for the version in flight to be committed; its failure is raised, named by the
        stage it failed in."""
        try:
            await self.publisher.wait()
        except asyncio.CancelledError:
            raise
        except Exception:
            self._stage = self.publisher.stage
            raise

    def _observe(self, phase: str, seconds: float) -> None:
        self.phases.labels(self.experiment_id, phase).observe(seconds)

    # -- side effects ---------------------------------------------------------------------------
    async def _checkpoint(self, periodic: bool = False) -> Path | None:
        """Checkpoint the step boundary once every version is committed and in the ledger."""
        await self._wait_published()
        if periodic and await ledger_behind(self.ledger, self.step, self.log):
            return None  # skipped: the next one is `checkpoint_every` steps on
        await self.ledger.flush()
        state = CheckpointState(
            experiment_id=self.experiment_id,
            step=self.step,
            version=self.version,
            last_seq=self._boundary_seq,
            trained_ids=self._trained,  # not copied: nothing trains while it is written
        )
        root = checkpoint_root(self.var_dir, self.experiment_id)
        t0 = time.perf_counter()
        path = await asyncio.to_thread(write_checkpoint, root, state, self.backend.save_checkpoint)
        seconds = time.perf_counter() - t0
        self._observe("checkpoint", seconds)
        self._after = replace(self._after, checkpoint_s=self._after.checkpoint_s + seconds)
        self.log.info(
            "checkpoint_saved",
            path=str(path),
            step=self.step,
            version=self.version,
            last_seq=self._boundary_seq,
        )
        return path
