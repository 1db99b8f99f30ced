"""The fleet: an experiment's bound rollouts and the weights they serve.

`Fleet.version` is the fleet version (what admission uses): the weights the ready rollouts
serve. `target` is the trainer's newest commit, where the fleet is being taken. A commit is
answered as soon as it is recorded: `update` (one background task at a time) brings the ready
rollouts to the newest target; commits that land meanwhile coalesce into the next update. The
fleet version moves only once an update is done, and a rollout that fails it is fenced. A
rollout that joins loads the fleet's weights first (`join`), and is ready then.

A rollout serves a version only once it proved it: its UpdateWeights answer carries the
fingerprint of the weights it holds (`asyncrl.fingerprint`), which must be the one the trainer
committed; a rollout whose fingerprint differs is fenced (it reloads when bound again). Either
side "" (an older trainer or rollout, an engine that cannot tell) is unverified: counted, not
fenced. `WEIGHTS_CHECKED` counts the outcomes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from prometheus_client import Counter, Histogram

from asyncrl.phases import WeightPhase
from asyncrl.spec import RolloutSpec
from asyncrl.types import StepMetrics
from asyncrl.v1 import rollout_pb2
from services.scheduler.calls import BindRefused, WorkerCalls
from services.scheduler.lifecycle import Lifecycle
from services.scheduler.records import ExperimentRecord
from services.scheduler.registry import Registry, Worker, WorkerKind

FLEET_LAG_MAX = 1
"""How many versions the fleet may serve behind the trainer's newest commit: CommitWeights(v)
is answered once the fleet serves v - lag, lag = min(FLEET_LAG_MAX, eta - 1) (`fleet_lag`). At
lag 1 it is answered at once (unless the fleet's update to the previous version is still under
way): the trainer trains on while the fleet loads the version it just committed. The trainer
then consumes groups up to one version staler than when the fleet keeps up, so the lag comes
out of eta: at eta <= 1 it is 0 (answered once the fleet serves v; the trainer still trains its
next step meanwhile, but what it consumes stays as fresh as before)."""


WEIGHTS_CHECKED = Counter(
    "asyncrl_scheduler_weights_checked",
    "Rollouts' UpdateWeights answers by fingerprint check: match, mismatch (fenced),"
    " unverified (no fingerprint on one side)",
    ["experiment", "result"],
    registry=None,
)
"""Rendered by the scheduler's collector (never prometheus' global registry)."""


def fleet_lag(rollout: RolloutSpec) -> int:
    """Versions the fleet may serve behind the trainer's newest commit (see FLEET_LAG_MAX)."""
    return max(0, min(FLEET_LAG_MAX, rollout.max_head_offpolicyness - 1))


def rpc_reason(exc: BaseException) -> str:
    """Why a call failed, as a fence reason: a gRPC error's code and the worker's own words
    (e.g. `INVALID_ARGUMENT: uri: no HuggingFace config.json in ...`), else the exception."""
    if isinstance(exc, grpc.aio.AioRpcError):
        details = exc.details()
        return f"{exc.code().name}: {details}" if details else exc.code().name
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


@dataclass
class FleetUpdate:
    """One update of the ready rollouts to `version` (what `Fleet.broadcast` did)."""

    version: int
    seconds: float = 0.0
    """UpdateWeights to every ready rollout, in parallel."""
    updated: int = 0
    failed: list[tuple[Worker, str]] = field(default_factory=list)
    """The rollouts that failed or lagged past the deadline, with the reason."""
    slowest: rollout_pb2.UpdateWeightsResponse | None = None
    """The answer of the rollout that took longest: where its time went."""
    previous: int = 0
    """The fleet version before (versions in between were coalesced)."""
    lag_s: float = 0.0
    """From the version's commit until the fleet served it."""

    def phases(self) -> dict[WeightPhase, float]:
        """The slowest rollout's phases, seconds by name (zeros when none answered)."""
        s = self.slowest or rollout_pb2.UpdateWeightsResponse()
        return {
            WeightPhase.READ: s.read_s,
            WeightPhase.PAUSE: s.pause_s,
            WeightPhase.LOAD: s.load_s,
            WeightPhase.RESUME: s.resume_s,
        }


@dataclass
class FleetHooks:
    """What the fleet tells its experiment runner."""

    fence: Callable[[Worker, str], None]
    """A rollout failed an update: unbind it (its groups are re-queued)."""
    refused: Callable[[str], Awaitable[None]]
    """A rollout refused the experiment itself: the run fails with this reason."""
    moved: Callable[[FleetUpdate | None], None]
    """A rollout became ready (None), or the fleet serves `update.version`."""


class Fleet:
    """Which bound rollouts serve the fleet version, and taking them to the newest commit.
    `lock` is held across an update (broadcast, then the version change), so a rollout being
    synced sees an update fully done or not started."""

    def __init__(
        self,
        calls: WorkerCalls,
        record: ExperimentRecord,
        registry: Registry,
        lifecycle: Lifecycle,
        hooks: FleetHooks,
        seconds: Histogram,
        log,
    ):
        self.calls = calls
        self.record = record
        """Its `weight_uris` (this fleet is their only writer)."""
        self.registry = registry
        self.lifecycle = lifecycle
        self.hooks = hooks
        self.log = log
        self.version = record.progress.version
        """The fleet version: the weights the ready rollouts serve (admission uses it)."""
        self.uri = record.fleet_uri
        self.ready: set[str] = set()
        self.lock = asyncio.Lock()
        self.target: tuple[int, str] = (self.version, self.uri)
        """The trainer's newest committed (version, uri): where the fleet is being taken."""
        self.target_at = time.monotonic()
        self.fingerprints: dict[int, str] = {}
        """Version -> the fingerprint the trainer committed with it (this process's commits)."""
        self.broadcast_store = ""
        """host:port of the trainer's weight-group store, as its last commit said ("" none:
        the spec's `trainer.nccl_master`, or the rollouts load from the weight store)."""
        self.task: asyncio.Task | None = None
        """The update under way (one at a time)."""
        self.last: FleetUpdate | None = None
        """The newest update done (reported with the next step's metrics)."""
        self.held: Callable[[], bool] = lambda: False
        """While true the fleet takes no new version (an eval round measures one version);
        `catch_up` takes it to the newest commit after."""
        self.announcer = None
        """Announces versions on NATS (services/scheduler/announce.py; None: RPCs only)."""
        self.commit_s = 0.0
        """The last commit's bookkeeping time (reported with the next step's metrics)."""
        self._moved = asyncio.Event()
        self._histogram = seconds
        self._seconds: dict[WeightPhase, Histogram] = {}
        """The histogram's children of this experiment, by phase (`_observe`)."""

    @property
    def committed_version(self) -> int:
        return self.target[0]

    def rollouts(self) -> list[Worker]:
        return self.registry.bound(self.record.id, WorkerKind.ROLLOUT)

    def ready_rollouts(self) -> list[Worker]:
        return [w for w in self.rollouts() if w.worker_id in self.ready]

    # ---- where the fleet goes ----------------------------------------------------------------

    async def resume_at(self, version: int, uri: str) -> None:
        """The trainer (re)started at `version` (its checkpoint; `uri` its word on where that
        version lives, or ""): the fleet goes back to it; a later version is not trained."""
        async with self.lock:
            if uri:
                self.record.weight_uris[version] = uri
            if version != self.version:
                self.version, self.uri = version, self._uri_for(version)
                self.ready.clear()
            self.set_target(version, self.uri)

    def _uri_for(self, version: int) -> str:
        if version in self.record.weight_uris:
            return self.record.weight_uris[version]
        return self.calls.spec.model.path if version == 0 else self.uri

    def commit(self, version: int, uri: str, spawn: Callable, fingerprint: str = "") -> None:
        """The trainer committed `version` (durable at `uri`, its weights' `fingerprint`):
        update the fleet to it, in the background (`spawn` runs `update` unless one is under
        way)."""
        self.record_commit(version, uri, fingerprint)
        self.catch_up(spawn)

    def record_commit(self, version: int, uri: str, fingerprint: str = "") -> None:
        """`version` is the newest committed, at `uri` (no rollout is updated to it yet)."""
        if fingerprint:
            self.fingerprints[version] = fingerprint
        self.set_target(version, uri)
        self.record.add_weights(version, uri)

    def catch_up(self, spawn: Callable) -> None:
        """Take the fleet to the newest commit in the background (`spawn` runs `update`),
        unless an update is under way: after a commit, or when a hold (`held`) ends."""
        if self.task is None or self.task.done():
            self.task = spawn(self.update())

    def commit_took(self, seconds: float) -> None:
        self.commit_s = seconds
        self._observe(WeightPhase.COMMIT, seconds)

    def set_target(self, version: int, uri: str) -> None:
        self.target, self.target_at = (version, uri), time.monotonic()
        self.notify()

    def notify(self) -> None:
        """The fleet version, the target or the run changed: wake whoever waits in `reaches`."""
        self._moved.set()
        self._moved = asyncio.Event()

    async def reaches(self, target: int, committed: int) -> None:
        """Return once the fleet serves `target`, or once waiting makes no sense any more (the
        run ends, or the trainer was started again from an older version than `committed`)."""
        while self.version < target and self.committed_version >= committed:
            if not self.lifecycle.live:
                return
            await self._moved.wait()

    # ---- updates -----------------------------------------------------------------------------

    async def update(self) -> None:
        """Bring the ready rollouts to the newest committed version, one update at a time
        (commits that land meanwhile coalesce into the next), fencing those that fail; the
        fleet version moves on regardless, as the staleness rule needs."""
        while not self.lifecycle.terminal:
            async with self.lock:
                (version, uri), committed_at = self.target, self.target_at
                previous = self.version
                if version <= previous:  # up to date (or the trainer was started again)
                    return
                if self.held():  # `catch_up` starts the update again
                    return
                update = await self.broadcast(self.ready_rollouts(), version, uri)
                for w, reason in update.failed:
                    self.hooks.fence(w, f"UpdateWeights v{version} failed: {reason}")
                self.version, self.uri = version, uri
            update.previous, update.lag_s = previous, time.monotonic() - committed_at
            self._updated(update)

    def _updated(self, update: FleetUpdate) -> None:
        """The fleet serves `update.version`: time it, tell the runner."""
        self.last = update
        self.notify()
        seconds = {WeightPhase.UPDATE: update.seconds, WeightPhase.LAG: update.lag_s}
        seconds |= update.phases()
        for phase, value in seconds.items():
            self._observe(phase, value)
        self.log.info(
            "fleet_updated",
            version=update.version,
            coalesced=max(0, update.version - update.previous - 1),
            updated=update.updated,
            fenced=len(update.failed),
            **{f"{k}_s": round(v, 4) for k, v in seconds.items()},
        )
        self.hooks.moved(update)

    def _observe(self, phase: WeightPhase, seconds: float) -> None:
        child = self._seconds.get(phase)
        if child is None:  # made on first use: a scrape shows only the phases observed
            child = self._seconds[phase] = self._histogram.labels(self.record.id, phase)
        child.observe(seconds)

    async def broadcast(self, workers: list[Worker], version: int, uri: str) -> FleetUpdate:
        """`version` to all `workers` at once (call with `lock` held): one announcement on NATS
        to those whose heartbeats come on NATS (`announcer`), UpdateWeights to the others;
        the update names the ones that failed or lagged past the spec's
        `rollout.weight_update_timeout_s`, with the reason. That deadline, not a frozen
        worker's lease, bounds how long it waits."""
        timeout = self.calls.spec.rollout.weight_update_timeout_s
        expected = self.fingerprints.get(version, "")
        ranked = sorted(workers, key=lambda w: w.worker_id)  # a broadcast's ranks 1..n
        group = self.calls.spec.trainer.weight_sync == "broadcast"
        store = self.broadcast_store if group else ""
        ranks = {
            w.worker_id: (r, len(ranked)) if group else (0, 0) for r, w in enumerate(ranked, 1)
        }
        # a broadcast's rollouts each take their own rank in the weight group: called, not
        # announced
        heard = [] if group else [w for w in ranked if w.on_nats and self.announcer is not None]
        called = [w for w in ranked if w not in heard]
        t0 = time.perf_counter()
        announced = self._announce(heard, version, uri, expected, timeout)
        results, answers = await asyncio.gather(
            asyncio.gather(
                *(
                    self.calls.update_weights(
                        w, version, uri, timeout, expected, ranks[w.worker_id], store
                    )
                    for w in called
                ),
                return_exceptions=True,
            ),
            announced,
        )
        update = FleetUpdate(version, seconds=time.perf_counter() - t0)
        silent = f"no answer to the announcement within {timeout:g} s"
        answered = [(w, answers.get(w.worker_id, silent)) for w in heard]
        for w, result in [*zip(called, results, strict=True), *answered]:
            if isinstance(result, BaseException):
                update.failed.append((w, rpc_reason(result)))
            elif isinstance(result, str):
                update.failed.append((w, result))
            elif reason := self.unproven(w, version, result.fingerprint):
                update.failed.append((w, reason))
            else:
                self.registry.weights_loaded(w, version)
                update.updated += 1
                if update.slowest is None or result.seconds > update.slowest.seconds:
                    update.slowest = result
        return update

    def fenced(self, worker_id: str, reason: str) -> None:
        """`worker_id` no longer serves this experiment: not ready, and no announcement round
        waits for it (if it cannot be reached, none of any experiment's)."""
        self.ready.discard(worker_id)
        if self.announcer is not None:
            unreachable = "UNAVAILABLE" in reason
            self.announcer.worker_gone(
                worker_id,
                "is unreachable" if unreachable else f"was fenced ({reason})",
                None if unreachable else self.record.id,
            )

    async def _announce(
        self, workers: list[Worker], version: int, uri: str, fingerprint: str, timeout: float
    ) -> dict:
        if not workers:
            return {}
        return await self.announcer.announce(
            self.record.id, version, uri, fingerprint, workers, timeout
        )

    def unproven(self, worker: Worker, version: int, fingerprint: str) -> str:
        """Why `worker`'s answer to UpdateWeights(`version`) does not prove it serves the
        committed weights ("" if it does, or if either fingerprint is unknown: unverified)."""
        committed = self.fingerprints.get(version, "")
        if not committed or not fingerprint:
            WEIGHTS_CHECKED.labels(self.record.id, "unverified").inc()
            return ""
        if fingerprint == committed:
            WEIGHTS_CHECKED.labels(self.record.id, "match").inc()
            return ""
        WEIGHTS_CHECKED.labels(self.record.id, "mismatch").inc()
        self.log.warning(
            "weights_fingerprint_mismatch",
            worker=worker.worker_id,
            version=version,
            fingerprint=fingerprint,
            committed=committed,
        )
        return f"weights fingerprint {fingerprint} is not the committed {committed}"

    def into_metrics(self, metrics: StepMetrics) -> None:
        """The newest update and the last commit's bookkeeping, into a step's metrics."""
        metrics.scheduler_s = self.commit_s
        update = self.last
        if update is None:
            return
        phases = update.phases()
        metrics.fleet_version = update.version
        metrics.fleet_update_s, metrics.fleet_lag_s = update.seconds, update.lag_s
        metrics.rollout_read_s = phases[WeightPhase.READ]
        metrics.rollout_pause_s = phases[WeightPhase.PAUSE]
        metrics.rollout_load_s = phases[WeightPhase.LOAD]
        metrics.rollout_resume_s = phases[WeightPhase.RESUME]

    # ---- rollouts joining --------------------------------------------------------------------

    async def join(self, worker: Worker, timeout: float) -> None:
        """`worker` was bound (or registered again): it loads the fleet's weights and is ready
        then. A refusal of the experiment fails the run; any other error fences the worker."""
        try:
            version = await self._sync(worker, timeout)
        except BindRefused as e:
            await self.hooks.refused(f"rollout {worker.worker_id} {e}")
            return
        except grpc.aio.AioRpcError as e:
            self.hooks.fence(worker, f"UpdateWeights failed: {rpc_reason(e)}")
            return
        if version is not None:
            self.log.info(
                "rollout_bound", worker=worker.worker_id, address=worker.address, version=version
            )
            self.hooks.moved(None)

    async def _sync(self, worker: Worker, timeout: float) -> int | None:
        """Load the fleet's weights into `worker` (again if a commit lands meanwhile); returns
        the version, or None if it was unbound meanwhile. Raises BindRefused if the worker
        refuses the experiment, AioRpcError on any other failure."""
        await self.calls.bind(worker, timeout)
        while True:
            version, uri = self.version, self.uri
            expected = self.fingerprints.get(version, "")
            answer = await self.calls.update_weights(worker, version, uri, timeout, expected)
            async with self.lock:
                if not self.registry.serves(worker, self.record.id):
                    return None
                if reason := self.unproven(worker, version, answer.fingerprint):
                    self.hooks.fence(worker, f"UpdateWeights v{version}: {reason}")
                    return None
                if version == self.version:
                    self.registry.weights_loaded(worker, version)
                    self.ready.add(worker.worker_id)
                    return version
