"""The scheduler: experiments (one runner each), the worker registry, and who is bound where.

Binding rules (`_reconcile`, run after every registry or experiment change):
- a trainer is bound exclusively to one experiment, oldest waiting experiment first, never to one
  entering its terminal state; a trainer that says (GetStatus) it is already running an
  experiment goes back to that one;
- rollouts go to units (services/scheduler/sharing.py): a full-parameter experiment alone, or
  the pool of LoRA experiments on one base, which share each of its rollouts and divide its
  slots by their spec `share`; an idle rollout goes to the unit with the fewest, a unit with
  none takes one from a unit that has two or more;
- reward workers are shared: every group request carries all their addresses.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from collections.abc import Callable

import grpc

from asyncrl.errors import BadRequest, Conflict, NotFound, PermissionDenied
from asyncrl.ledger import ensure_ledger
from asyncrl.logging import get_logger, keep_running
from asyncrl.net import check_address
from asyncrl.rewards import check_reward_function
from asyncrl.security import Principal
from asyncrl.settings import settings
from asyncrl.spec import (
    ExperimentSpec,
    SpecError,
    check_files,
    check_reward_plugin,
    largest_field,
    spec_from_json,
    validate_spec,
)
from asyncrl.storage import STORAGE_FULL, free_bytes
from asyncrl.types import StepMetrics, TrainerState
from asyncrl.v1 import trainer_pb2, trainer_pb2_grpc
from asyncrl.workflow import check_workflow
from services.scheduler.announce import Announcer
from services.scheduler.config import SchedulerConfig
from services.scheduler.context import (
    ChannelPool,
    RunnerContext,
    fleet_histogram,
)
from services.scheduler.dataset import Prompt, load_prompts
from services.scheduler.experiments import ExperimentRunner
from services.scheduler.history import HistoryLog
from services.scheduler.liveness import Liveness, StallGuard
from services.scheduler.records import RESUMABLE, CommitResult, Event, ExperimentRecord
from services.scheduler.registry import Joined, Registry, Worker, WorkerKind
from services.scheduler.sharing import assign_rewards, bind_rollouts
from services.scheduler.state import StateStore

log = get_logger()

STORAGE_CHECK_S = 2.0
STORAGE_MIN_FREE = 16 * 2**20
"""Free bytes under ASYNCRL_VAR below which the scheduler says storage is full."""
TRAINER_PROBE_TIMEOUT_S = 5.0
MAX_SPEC_BYTES = 256 * 1024
"""Largest spec_json accepted (the spec is part of the experiment's KV record)."""


def new_experiment_id(name: str, tenant: str = "") -> str:
    """slug(name)-<6 hex>, only [a-z0-9-] (the id is a NATS subject token); a tenant's is
    `<tenant>.<slug>-<6 hex>`, so that its subjects sit under the tenant's own prefix
    (asyncrl.nats_tenants)."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:40].strip("-") or "experiment"
    own = f"{slug}-{secrets.token_hex(3)}"
    return f"{tenant}.{own}" if tenant else own


def load_datasets(spec: ExperimentSpec) -> tuple[list[Prompt], list[Prompt]]:
    """The train prompts and the eval prompts (empty without eval.dataset_path)."""
    ds = spec.dataset
    prompts = load_prompts(ds.path, ds.prompt_key, ds.answer_key, ds.max_prompts)
    eval_prompts = []
    if spec.eval.dataset_path:
        eval_prompts = load_prompts(
            spec.eval.dataset_path,
            ds.prompt_key,
            ds.answer_key,
            spec.eval.max_prompts,
            field="eval.dataset_path",
        )
    return prompts, eval_prompts


def _check_resumable(runner: ExperimentRunner) -> None:
    if runner.state not in RESUMABLE:
        raise Conflict(
            f"experiment_id: {runner.id} is {runner.state.value}; only a CANCELLED or FAILED"
            " experiment can be resumed"
        )


async def reopened_runner(
    runner: ExperimentRunner, ctx: RunnerContext, current: Callable[[], ExperimentRunner]
) -> ExperimentRunner:
    """A runner that continues `runner`'s ended run: PENDING, its trainer resumed from its last
    checkpoint (StartExperiment), the groups cancelled in flight dispatched first under their
    own ids (a copy published before the cancel is one message to JetStream), then the prompts
    re-queued and those never dispatched. Accepted groups the trainer did not take are still
    in the stream after its checkpoint's position: it reads them again. The ledger's `resumed`
    event takes back what the end had called left over. `current()` is the experiment's
    runner now: another resume that got there first is refused."""
    spec = validate_spec(runner.record.spec)
    prompts, eval_prompts = await asyncio.to_thread(load_datasets, spec)  # still there?
    _check_resumable(current())
    record = runner.record
    was = record.state
    requeued = len(record.cancelled) + len(record.cursor.get("requeue", []))
    record.reopen(f"resumed from {was.value}")
    record.updated_unix_ms = int(time.time() * 1000)
    resumed = ExperimentRunner(record, spec, prompts, eval_prompts, ctx)
    await resumed.dispatcher.ledger.record(
        "resumed", state=was.value, requeued=requeued, version=record.progress.version
    )
    log.info("experiment_resumed", experiment=record.id, was=was.value, requeued=requeued)
    return resumed


MAX_LABEL = 256
"""The longest name or device string a worker may register."""


def check_registration(address: str, name: str, capacity: int, device: str) -> None:
    """BadRequest naming the field of a registration no worker could have sent."""
    if not address:
        raise BadRequest("address", "required (host:port of the worker's gRPC server)")
    check_address("address", address)
    if capacity < 0:
        raise BadRequest("capacity", f"{capacity} is negative")
    for field, text in (("name", name), ("device", device)):
        if len(text) > MAX_LABEL:
            raise BadRequest(field, f"{len(text)} characters, at most {MAX_LABEL}")


def check_commit(uri: str, broadcast_store: str) -> None:
    """BadRequest naming the field of a CommitWeights no trainer could have sent
    (`broadcast_store`: host:port of the trainer's weight-group store, "" none)."""
    if not uri:
        raise BadRequest("uri", "required")
    if broadcast_store:
        check_address("broadcast_store", broadcast_store)


def check_storage(runners: list[ExperimentRunner]) -> None:
    """Every STORAGE_CHECK_S: with less than STORAGE_MIN_FREE free under ASYNCRL_VAR (in a
    `make up` deployment nats's store, the weights, checkpoints and logs), every live
    experiment's message says storage is full and where, until space returns. Its writes
    fail meanwhile and are retried (nothing is lost); the run goes on by itself after."""
    var = settings().var.resolve()
    free = free_bytes(var)
    full = free is not None and free < STORAGE_MIN_FREE
    reason = f"paused: {STORAGE_FULL}: {free / 2**20:.1f} MiB free at {var}" if full else ""
    for runner in runners:
        record = runner.record
        if runner.terminal or record.message == reason:
            continue
        if full and not record.message.startswith("paused: "):
            log.warning("storage_full", experiment=runner.id, reason=reason)
            record.message = reason
            runner.supervisor.paused = runner.supervisor.paused or reason[len("paused: ") :]
        elif not full and record.message.startswith(f"paused: {STORAGE_FULL}: "):
            log.info("storage_available", experiment=runner.id, free_bytes=free)
            record.message = ""
        else:
            continue
        runner.book.emit(Event("state"))


class Scheduler:
    def __init__(self, js, config: SchedulerConfig | None = None, leadership=None):
        self.js = js  # JetStream context: the KV bucket holding experiment state
        self.config, self.leadership = config or SchedulerConfig(), leadership  # its lease
        self.registry = Registry(self.config.lease_ttl_s, self.config.heartbeat_interval_s)
        self.liveness = Liveness(js._nc, self.registry)
        """Heartbeats on NATS (services/scheduler/liveness.py)."""
        self.announcer = Announcer(js._nc, self.registry)
        self.channels = ChannelPool()
        self.runners: dict[str, ExperimentRunner] = {}
        self.store: StateStore | None = None
        self.history: HistoryLog | None = None
        self._ctx: RunnerContext | None = None
        self.fleet_seconds = fleet_histogram()
        """The runners' fleet updates by phase (rendered by the scheduler's collector)."""
        self._tasks: set[asyncio.Task] = set()
        self._reconcile_scheduled = False

    async def _check_storage(self) -> None:
        await asyncio.sleep(STORAGE_CHECK_S)
        check_storage(list(self.runners.values()))

    # ---- start / stop ------------------------------------------------------------------------

    async def start(self) -> None:
        self.store = await StateStore.open(self.js, self.config.save_interval_s, self.leadership)
        self.history = await HistoryLog.open(self.js, self.store.held)
        await ensure_ledger(self.js)
        self._ctx = RunnerContext(
            self.config,
            self.registry,
            self.channels,
            self.store,
            history=self.history,
            js=self.js,
            workers_changed=self._reconcile_soon,
            fleet_seconds=self.fleet_seconds,
            slot_freed=self._slot_freed,
            announcer=self.announcer,
            held=self.store.held,
        )
        for record in await self.store.load_all():
            try:
                await self.history.load_into(record)
                await self._restore(record)
            except Exception as e:  # one experiment's bad record never stops the scheduler
                log.exception("experiment_restore_failed", experiment=record.id, error=repr(e))
        self.store.start()
        self.history.start()
        await self.liveness.start()
        await self.announcer.start()
        self._spawn(self._sweep_forever())
        self._spawn(keep_running("storage_watch", self._check_storage, log, STORAGE_CHECK_S))
        log.info(
            "scheduler_started",
            experiments=len(self.runners),
            lease_ttl_s=self.config.lease_ttl_s,
        )

    async def close(self) -> None:
        """Stop the runners (their state stays in KV and resumes), flush, close channels. The
        runtime has stopped the gRPC server before and drains NATS after."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.liveness.close()
        await self.announcer.close()
        for runner in self.runners.values():
            await runner.shutdown()
        if self.store is not None:
            await self.store.close()
        if self.history is not None:
            await self.history.close()
        await self.channels.close_all()

    async def _restore(self, record: ExperimentRecord) -> None:
        spec = validate_spec(record.spec)
        prompts: list[Prompt] = []
        eval_prompts: list[Prompt] = []
        error = None
        if not record.state.terminal:
            try:
                prompts, eval_prompts = await asyncio.to_thread(load_datasets, spec)
            except Exception as e:  # SpecError names the field; anything else is the reason too
                error = e if isinstance(e, (SpecError, OSError)) else repr(e)
        runner = ExperimentRunner(record, spec, prompts, eval_prompts, self._ctx)
        self.runners[record.id] = runner
        if error is not None:
            runner.abandon(f"cannot resume: {error}")
            log.error("experiment_resume_failed", experiment=record.id, error=str(error))
            await self.store.save(record)
        elif not record.state.terminal:
            log.info("experiment_resuming", experiment=record.id, version=record.progress.version)
            runner.start()

    # ---- experiments -------------------------------------------------------------------------

    async def submit(self, spec_json: str, tenant: str = "") -> ExperimentRunner:
        """Validate (SpecError names the field), persist, and start waiting for workers; the
        experiment belongs to `tenant` ("": the operator).

        No user code runs here: a plugin (workflow, reward function) is checked by name only;
        the workers that run it load it when the experiment binds, and a refusal fails it."""
        spec = spec_from_json(spec_json)  # first: a too long field is named
        if len(spec_json) > MAX_SPEC_BYTES:
            why = f"the spec is {len(spec_json)} bytes, at most {MAX_SPEC_BYTES}"
            raise BadRequest(largest_field(spec.model_dump()), why)
        check_files(spec)
        check_reward_function(spec.reward.function, spec.reward.kwargs)
        check_reward_plugin(spec)  # docs/rewards.md: a missing module fails the submit
        try:
            check_workflow(spec.rollout.workflow.name, spec.rollout.workflow.args)
        except ValueError as e:
            raise SpecError("rollout.workflow", str(e)) from None
        prompts, eval_prompts = await asyncio.to_thread(load_datasets, spec)
        now_ms = int(time.time() * 1000)
        record = ExperimentRecord(
            id=new_experiment_id(spec.name, tenant),
            name=spec.name,
            tenant=tenant,
            spec=spec.model_dump(),
            created_unix_ms=now_ms,
            updated_unix_ms=now_ms,
            fleet_uri=spec.model.path,
            weight_uris={0: spec.model.path},
        )
        runner = ExperimentRunner(record, spec, prompts, eval_prompts, self._ctx)
        await runner.dispatcher.ledger.record(
            "started", prompts=len(prompts), epochs=spec.dataset.epochs
        )
        await self.store.save(runner.snapshot())
        self.runners[record.id] = runner
        log.info(
            "experiment_submitted",
            experiment=record.id,
            name=spec.name,
            prompts=len(prompts),
            eval_prompts=len(eval_prompts),
            total_steps=spec.trainer.total_steps,
            batch_size=spec.trainer.batch_size,
            eta=spec.rollout.max_head_offpolicyness,
        )
        runner.start()
        self._reconcile()
        return runner

    def get(self, experiment_id: str) -> ExperimentRunner:
        runner = self.runners.get(experiment_id)
        if runner is None:
            raise NotFound(f"experiment_id: no experiment {experiment_id!r}")
        return runner

    def list(self) -> list[ExperimentRunner]:
        return sorted(self.runners.values(), key=lambda r: r.record.created_unix_ms)

    async def cancel(self, experiment_id: str) -> ExperimentRunner:
        runner = self.get(experiment_id)
        await runner.cancel()
        return runner

    async def resume(self, experiment_id: str) -> ExperimentRunner:
        """Continue a CANCELLED or FAILED experiment (Conflict naming any other state) with the
        same ledger, as a new runner over its record (`reopened_runner`)."""
        runner = self.get(experiment_id)
        _check_resumable(runner)
        resumed = await reopened_runner(runner, self._ctx, lambda: self.get(experiment_id))
        self.runners[resumed.id] = resumed
        await self.store.save(resumed.snapshot())
        resumed.start()
        self._reconcile()
        return resumed

    async def commit(
        self,
        experiment_id: str,
        version: int,
        uri: str,
        metrics: StepMetrics,
        trainer_id: str = "",
        caller: Principal | None = None,
        fingerprint: str = "",
        broadcast_store: str = "",
    ) -> CommitResult:
        """Only the experiment's trainer may commit (PermissionDenied otherwise)."""
        runner = self.get(experiment_id)
        await runner.authority.authorize(caller, trainer_id)
        check_commit(uri, broadcast_store)
        return await runner.commits.commit(version, uri, metrics, fingerprint, broadcast_store)

    async def report_dropped(
        self, experiment_id: str, group_ids: list[str], caller: Principal | None = None
    ) -> int:
        """Only the experiment's trainer may report (PermissionDenied otherwise), and only
        groups the scheduler dispatched for it (BadRequest naming `groups` otherwise)."""
        runner = self.get(experiment_id)
        await runner.authority.authorize(caller, "")
        return runner.commits.report_dropped(group_ids)

    # ---- workers -----------------------------------------------------------------------------

    def register(
        self,
        kind: WorkerKind,
        address: str,
        name: str,
        capacity: int,
        caller: Principal | None = None,
        device: str = "",
        incarnation: str = "",
    ) -> Worker:
        """A worker registers itself: the caller's role must be the kind it registers, and an
        address a live worker holds is taken again only by the identity that registered it.
        The same process registering again (`Joined.AGAIN`: its `incarnation`) changes
        nothing; a restarted one loads its experiment again."""
        check_registration(address, name, capacity, device)
        if caller is not None:
            if caller.role != kind.value:
                raise PermissionDenied(
                    f"kind: {caller.subject} (role {caller.role}) may not register a"
                    f" {kind.value} worker"
                )
            held = self.registry.at(kind, address)
            if held is not None and held.principal != caller.subject:
                raise PermissionDenied(
                    f"address: {address} is held by {held.worker_id}, registered by"
                    f" {held.principal}, not {caller.subject}"
                )
        principal = caller.subject if caller is not None else ""
        worker, joined = self.registry.register(
            kind, address, name, capacity, principal, incarnation
        )
        worker.device = device
        log.info(
            "worker_registered",
            worker=worker.worker_id,
            kind=kind.value,
            address=address,
            capacity=capacity,
            principal=principal,
            joined=joined.value,
        )
        runners = self._runners_of(worker)
        if joined is Joined.AGAIN:
            return worker
        if kind == WorkerKind.TRAINER and joined is Joined.NEW:
            self.registry.probing(worker)
            self._spawn(self._probe_trainer(worker))
        elif kind == WorkerKind.TRAINER and runners:
            runners[0].supervisor.check_soon()  # it may have restarted and forgot the experiment
        elif kind == WorkerKind.ROLLOUT:
            for runner in runners:  # it may have restarted: load the weights again
                runner.attach_rollout(worker)
        self._reconcile()
        return worker

    def heartbeat(
        self,
        worker_id: str,
        load: int = 0,
        caller: Principal | None = None,
        leaving: bool = False,
    ) -> bool:
        """Renew a lease; False for an unknown id. Only the identity that registered the
        worker may renew it (PermissionDenied otherwise). `leaving`: the worker is stopping,
        it is gone now (its work handed on as when its lease lapses)."""
        worker = self.registry.get(worker_id)
        if caller is not None and worker is not None and worker.principal != caller.subject:
            raise PermissionDenied(
                f"worker_id: {worker_id} was registered by {worker.principal}, not {caller.subject}"
            )
        if leaving:
            worker = self.registry.remove(worker_id)
            if worker is not None:
                self._spawn(self._worker_left(worker))
            return worker is not None
        return self.registry.heartbeat(worker_id, load)

    def workers(self) -> list[Worker]:
        return self.registry.workers()

    async def _probe_trainer(self, worker: Worker) -> None:
        """Ask a new trainer what it runs: after a scheduler restart it goes back to that."""
        stub = trainer_pb2_grpc.TrainerStub(self.channels.get(worker.address))
        affinity = None
        try:
            status = await stub.GetStatus(
                trainer_pb2.GetTrainerStatusRequest(), timeout=TRAINER_PROBE_TIMEOUT_S
            )
            if status.experiment_id and TrainerState.reported(status.state).active:
                affinity = status.experiment_id
        except grpc.aio.AioRpcError as e:
            log.warning("trainer_probe_failed", worker=worker.worker_id, code=e.code().name)
        self.registry.probed(worker, affinity)
        self._reconcile()

    async def _sweep_forever(self) -> None:
        interval = min(1.0, max(0.05, self.config.lease_ttl_s / 4))
        stalls = StallGuard(interval)

        async def sweep() -> None:
            await asyncio.sleep(interval)
            await self.liveness.apply()  # the beats that came: never expire one of them
            gone = [] if stalls.stalled() else self.registry.expire()
            for worker in gone:
                await self._worker_gone(worker)
            idle = self.registry.idle(WorkerKind.ROLLOUT) or self.registry.idle(WorkerKind.TRAINER)
            if gone or idle:  # idle includes fenced workers whose cooldown just ended
                self._reconcile()

        await keep_running("lease_sweeper", sweep, log, retry_s=interval)

    async def _worker_left(self, worker: Worker) -> None:
        """A stopping worker said it leaves: nothing new goes to it, and a rollout's groups in
        flight are left to finish while it drains (a call that fails then is re-queued as
        always). A trainer is handled as one whose lease lapsed."""
        log.info("worker_left", worker=worker.worker_id, kind=worker.kind.value)
        if worker.kind == WorkerKind.ROLLOUT:
            self.announcer.worker_gone(worker.worker_id, "left")
            for runner in self._runners_of(worker):
                runner.fleet.ready.discard(worker.worker_id)
        elif worker.kind == WorkerKind.TRAINER:
            await self._worker_gone(worker, "left")
        self._reconcile()

    async def _worker_gone(self, worker: Worker, why: str = "expired") -> None:
        log.warning(
            f"worker_{why}",
            worker=worker.worker_id,
            kind=worker.kind.value,
            address=worker.address,
            experiment=worker.experiment_id,
            running=worker.running,
        )
        if worker.kind == WorkerKind.ROLLOUT:
            self.announcer.worker_gone(worker.worker_id, f"is gone ({why})")
        for runner in self._runners_of(worker):
            if worker.kind == WorkerKind.ROLLOUT:
                runner.release_rollout(worker, "lease expired")  # its groups are re-queued
            elif worker.kind == WorkerKind.TRAINER:
                self.registry.unbind(worker)
                runner.trainer_lost(worker)
        if not any(w.address == worker.address for w in self.registry.workers()):
            self.channels.retire(worker.address)  # its calls in flight end by their deadlines

    # ---- binding -----------------------------------------------------------------------------

    def _reconcile_soon(self) -> None:
        if not self._reconcile_scheduled:
            self._reconcile_scheduled = True
            asyncio.get_running_loop().call_soon(self._reconcile)

    def _reconcile(self) -> None:
        self._reconcile_scheduled = False
        live = [r for r in self.list() if not r.terminal]
        self._bind_trainers(live)
        self._bind_rollouts(live)
        assign_rewards(self.registry, live)
        for runner in live:
            runner.wake()

    def _bind_trainers(self, live: list[ExperimentRunner]) -> None:
        # not one entering its terminal state: it freed its trainer and ends without one (a
        # trainer bound to it meanwhile stayed bound to a finished experiment: the next one
        # waited for a trainer for ever, bench system between its eta runs)
        waiting = {r.id: r for r in live if r.trainer() is None and not r.ending}
        idle = [t for t in self.registry.idle(WorkerKind.TRAINER) if t.probed]
        for trainer in sorted(idle, key=lambda t: t.affinity not in waiting):  # affine first
            runner = waiting.pop(trainer.affinity, None) if trainer.affinity else None
            if runner is None and waiting:
                runner = waiting.pop(next(iter(waiting)))
            if runner is None:
                return
            self.registry.bind(trainer, runner.id)
            log.info("worker_bound", worker=trainer.worker_id, kind="trainer", experiment=runner.id)

    def _bind_rollouts(self, live: list[ExperimentRunner]) -> None:
        """Rollouts to the experiments with a trainer (or finishing), and to those sharing
        rollouts already (a pool experiment whose trainer restarts keeps its slots)."""
        eligible = [
            r
            for r in live
            if not r.ending
            and (r.trainer() is not None or r.finishing or any(w.shared for w in r.rollouts()))
        ]
        if eligible:
            bind_rollouts(self.registry, eligible, log)

    def _runners_of(self, worker: Worker) -> list[ExperimentRunner]:
        """The experiments `worker` is bound to or shared with."""
        ids = list(worker.shared) or [worker.experiment_id or ""]
        return [self.runners[i] for i in ids if i in self.runners]

    def _slot_freed(self, worker: Worker) -> None:
        for runner in self._runners_of(worker):
            runner.wake()

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
