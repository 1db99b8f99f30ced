"""The rollout service logic: weights, group generation, scoring, filtering, publishing.

A group is the unit of work: the experiment's workflow (asyncrl.workflow) makes n
trajectories for one prompt with `run_group`, one context per sample (by default a run per
sample, concurrently; the built-in `single_turn` makes them in one engine call); the
trajectories the workflow left unscored are scored with one Reward.Score call, the filter
decides, and an accepted group (or any eval group) is published to JetStream with Nats-Msg-Id =
group id *before* the summary goes back to the scheduler. A cancelled GenerateGroup cancels its
engine requests and publishes nothing; so does AbortGroups (the scheduler found the group too
stale) for a group not yet being published, which then answers ABORTED: the scheduler learns
that the trainer cannot have it and samples the prompt again at once.

A rollout serves one experiment, or several LoRA experiments on one base at once (the
scheduler's pool, services/scheduler/sharing.py) on an engine that `shares_adapters`: each is
bound and loaded apart (`Loaded`: its tokenizer, its engine lane, its versions' fingerprints),
its groups run beside the others' in the engine's batch, and its UpdateWeights moves its own
lane only. Binding anything else (a full-parameter experiment, another base) aborts them all.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from prometheus_client import Histogram

from asyncrl.errors import BadRequest, Conflict
from asyncrl.fingerprint import differs, stamp
from asyncrl.logging import Tally, get_logger
from asyncrl.natsutil import publish_group
from asyncrl.runtime import freeze_heap
from asyncrl.settings import settings
from asyncrl.spec import ExperimentSpec, SamplingParams, SpecError, spec_from_json
from asyncrl.throughput import Throughput
from asyncrl.types import RewardStatus, Sample, Score, ScoreItem, TrajectoryGroup
from asyncrl.weights_nats import NatsReceiver, is_nats_uri
from asyncrl.workflow import Workflow, WorkflowContext, make_workflow, resolve_workflow
from services.rollout.adapters import is_adapter_dir
from services.rollout.codec import Codec
from services.rollout.engine import Engine, UpdatePhases
from services.rollout.filters import GroupStatus, decide, failed_samples
from services.rollout.generation import Generation
from services.rollout.openai_api import OpenAIEndpoint
from services.rollout.reward_client import RewardBinding, RewardClient, RewardUnavailable
from services.rollout.running import RunningGroup, RunningGroups

log = get_logger(component="rollout")
SERVED_KEEP = 64
"""Versions behind the served one whose fingerprints are kept to stamp groups with."""


@dataclass
class GroupJob:
    """One GenerateGroup request, decoded; the rest comes from the bound spec."""

    experiment_id: str
    group_id: str
    prompt_id: str
    prompt: str
    answer: str
    reward_addresses: list[str] = field(default_factory=list)
    eval: bool = False
    epoch: int = 0


@dataclass(frozen=True)
class Binding:
    """The experiment this rollout serves, as BindExperiment sent it (once per binding)."""

    experiment_id: str
    spec: ExperimentSpec
    spec_json: str
    """The spec as sent: forwarded to reward workers when they bind."""
    workflow_cls: type[Workflow]

    @classmethod
    def create(cls, experiment_id: str, spec_json: str) -> Binding:
        """Validate the spec and load its workflow (a plugin is imported here, once);
        SpecError names what is wrong."""
        if not experiment_id:
            raise BadRequest("experiment_id", "required")
        spec = spec_from_json(spec_json)
        wf = spec.rollout.workflow
        try:
            make_workflow(wf.name, wf.args)
        except ValueError as e:
            raise SpecError("rollout.workflow", str(e)) from None
        return cls(experiment_id, spec, spec_json, resolve_workflow(wf.name))

    def workflow(self) -> Workflow:
        return self.workflow_cls(**self.spec.rollout.workflow.args)

    def n(self, eval_group: bool) -> int:
        return self.spec.eval.n_samples if eval_group else self.spec.rollout.n_samples

    def params(self, eval_group: bool) -> SamplingParams:
        return self.spec.eval.gconfig if eval_group else self.spec.rollout.gconfig

    def filter(self, eval_group: bool) -> str:
        return "none" if eval_group else self.spec.rollout.filter

    @property
    def rewards(self) -> RewardBinding:
        return RewardBinding(self.experiment_id, self.spec_json, self.spec.reward.timeout_s)


@dataclass
class Loaded:
    """An experiment whose weights this rollout serves."""

    codec: Codec
    lane: str
    """Its adapter lane in the engine (its id), "" when it has the engine to itself."""
    served: dict[int, str] = field(default_factory=dict)
    """Version -> the fingerprint of what the engine held (stamped onto samples)."""

    def serve(self, version: int, fingerprint: str) -> None:
        """The lane serves `version` now, holding weights of `fingerprint`."""
        self.served[version] = fingerprint
        for old in [v for v in self.served if v < version - SERVED_KEEP]:
            del self.served[old]  # a sample this stale is dropped: "" (unverified) at worst


def shares_base(a: ExperimentSpec, b: ExperimentSpec) -> bool:
    """Whether two experiments can share a rollout: both LoRA, on the same base and tokenizer."""
    lora = a.trainer.lora is not None and b.trainer.lora is not None
    return lora and (a.model.path, a.model.tokenizer_path) == (b.model.path, b.model.tokenizer_path)


async def engine_update(engine: Engine, binding: Binding, lane: str, path: Path, version: int):
    """`engine.update_weights` to `version` at `path`, in the experiment's lane when it has one
    (eta + 1 of its adapter versions stay loaded); how many requests it moved."""
    if not lane:
        return await engine.update_weights(str(path), version)
    keep = binding.spec.rollout.max_head_offpolicyness + 1
    return await engine.update_weights(str(path), version, lane=lane, keep=keep)


@dataclass
class GroupSummary:
    group_id: str
    status: GroupStatus
    reason: str = ""
    rewards: list[float] = field(default_factory=list)  # of the samples scored OK
    failed_samples: int = 0
    tokens: int = 0
    start_version: int = 0
    end_version: int = 0
    published: bool = False
    duplicate: bool = False
    """JetStream already held this group id (an earlier call published it): not stored again."""
    duration_s: float = 0.0
    worker: str = ""


WEIGHTS_CACHE = "weights-cache"
"""Where, under `settings().var`, a rollout keeps the versions it fetched from NATS."""
FETCH_RETRY_S = 20.0
"""How long fetching a version rides out NATS being away (this host's node catching up after
it was cut off answers 503 for a few seconds) before UpdateWeights fails."""
UPDATE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


@dataclass
class WeightsResult:
    version: int
    seconds: float
    interrupted: int
    phases: UpdatePhases = field(default_factory=UpdatePhases)
    fingerprint: str = ""
    """Of the weights the experiment's lane holds now (what the scheduler checks)."""
    """Where an interrupting update's time went (zeros for a first load or a retry, but for
    the fetch of a `nats-obj://` version, in `read_s`)."""


@dataclass
class StatusInfo:
    worker_id: str
    experiment_id: str
    version: int
    running_groups: int
    running_samples: int
    tokens_generated: int
    tokens_per_s: float
    engine: str


class RolloutService:
    def __init__(
        self,
        engine: Engine,
        js,
        engine_kind: str | None = None,
        worker: Callable[[], str] = lambda: "",
        openai_port: int = 0,
        weights_cache: Path | None = None,
    ):
        self.engine = engine
        self.js = js
        self.engine_kind = engine_kind or engine.name
        self._worker = worker
        self.bindings: dict[str, Binding] = {}
        """The experiments bound (several: LoRA ones sharing the base), as they were sent."""
        self.loaded: dict[str, Loaded] = {}
        """The bound experiments whose weights are loaded (set by their first UpdateWeights)."""
        self.rewards = RewardClient()
        self.throughput = Throughput()
        self._tally = Tally("groups_done", log)
        """Groups finished, by status, and their tokens: a line per group was ~15 CPU-µs of the
        ~240 a group costs the rollout (bench control_plane). Each group's line is still there
        (a failed group's at WARNING, the others' at DEBUG), and its fate in the ledger."""
        self.groups = RunningGroups()
        self._weights_lock = asyncio.Lock()
        self.weights_cache = weights_cache or settings().var / WEIGHTS_CACHE
        """This host's copies of the `nats-obj://` versions it loaded (a few, the newest)."""
        self.receiver = NatsReceiver(js, self.weights_cache, retry_s=FETCH_RETRY_S)
        """The rollout's side of the weights transport (services/trainer/transport.py)."""
        self.openai = OpenAIEndpoint(port=openai_port)
        self.update_seconds = Histogram(
            "asyncrl_rollout_weight_update_seconds",
            "UpdateWeights by phase: read, pause, load, resume, and the whole call (total)",
            ["experiment", "phase"],
            buckets=UPDATE_BUCKETS,
            registry=None,  # rendered by this service's collector, never the global registry
        )

    @property
    def worker(self) -> str:
        """This worker's registered id (its address until it registers)."""
        return self._worker()

    @property
    def experiment_id(self) -> str:
        """The experiments whose weights are loaded, comma-separated ("" none)."""
        return ",".join(self.loaded)

    async def bind(self, experiment_id: str, spec_json: str) -> None:
        """Serve `experiment_id` from now on (its model loads with the next UpdateWeights):
        beside the bound ones if all are LoRA on its base (`shares_base`) and the engine
        shares adapters; else instead of them, their groups aborted."""
        binding = Binding.create(experiment_id, spec_json)
        if binding.spec.rollout.engine != self.engine_kind:
            raise Conflict(
                f"rollout.engine: this rollout worker runs the {self.engine_kind!r} engine, "
                f"the experiment asks for {binding.spec.rollout.engine!r}"
            )
        async with self._weights_lock:
            others = [e for e in self.bindings if e != experiment_id]
            beside = not others or (
                self.engine.shares_adapters
                and all(shares_base(self.bindings[e].spec, binding.spec) for e in others)
            )
            if not beside:
                previous = ",".join(self.bindings)
                self.bindings.clear()
                self.loaded.clear()  # no groups until loaded
                await self.groups.abort_all(
                    f"aborted: rollout switched from experiment {previous!r} to {experiment_id!r}"
                )
            self.bindings[experiment_id] = binding
        log.info("experiment_bound", experiment=experiment_id, beside=others if beside else [])

    async def update_weights(
        self, experiment_id: str, version: int, uri: str, fp: str = ""
    ) -> WeightsResult:
        """First load of a bound experiment (model + tokenizer, or its lane on the shared
        base), or an interrupting weight update of its lane (again if it holds other weights
        than fingerprint `fp`). Another experiment's requests are not touched."""
        binding = self.bindings.get(experiment_id)
        if binding is None:
            raise Conflict(
                f"experiment_id: this rollout is bound to {','.join(self.bindings) or 'nothing'!r},"
                f" not {experiment_id!r} (BindExperiment first)"
            )
        start = time.perf_counter()
        phases = UpdatePhases()
        async with self._weights_lock:
            path, fetch_s = await self._local_dir(version, uri)
            adapter = is_adapter_dir(path)  # a LoRA version: the base is the spec's model
            if not adapter and not (path / "config.json").is_file():
                raise BadRequest("uri", f"no HuggingFace config.json in {path}")
            loaded = self.loaded.get(experiment_id)
            if loaded is None:
                loaded = await self._load(binding, path, version, adapter)
                interrupted = 0  # nothing of this experiment ran before
            elif version == self.engine.version_of(loaded.lane) and not differs(
                fp, self.engine.fingerprint_of(loaded.lane)
            ):
                interrupted = 0  # a retried UpdateWeights: already served
            else:
                interrupted = await engine_update(self.engine, binding, loaded.lane, path, version)
                phases = self.engine.last_update
            now = self.engine.version_of(loaded.lane)
            loaded.serve(now, self.engine.fingerprint_of(loaded.lane))
            if fetch_s or phases is self.engine.last_update:  # fetched, or an engine update
                phases = replace(phases, read_s=phases.read_s + fetch_s)  # fetched, then read
                self._observe(experiment_id, phases)
        seconds = time.perf_counter() - start
        self.update_seconds.labels(experiment_id, "total").observe(seconds)
        log.info(
            "weights_updated",
            experiment=experiment_id,
            version=version,
            uri=uri,
            interrupted=interrupted,
            seconds=round(seconds, 3),
            **{k: round(v, 4) for k, v in asdict(phases).items()},
        )
        return WeightsResult(now, seconds, interrupted, phases, loaded.served[now])

    async def _local_dir(self, version: int, uri: str) -> tuple[Path, float]:
        """The version's directory on this host (`self.receiver`) and the seconds it took to
        fetch it (0 for a path read in place)."""
        t0 = time.perf_counter()
        path = await self.receiver.receive(version, uri)
        if not is_nats_uri(uri):
            return path, 0.0  # read in place: nothing was fetched
        seconds = time.perf_counter() - t0
        log.info("weights_fetched", uri=uri, path=str(path), seconds=round(seconds, 3))
        return path, seconds

    def _observe(self, experiment_id: str, phases: UpdatePhases) -> None:
        for name, seconds in asdict(phases).items():
            self.update_seconds.labels(experiment_id, name.removesuffix("_s")).observe(seconds)

    async def _load(self, binding: Binding, path: Path, version: int, adapter: bool) -> Loaded:
        """The experiment's first version: the model (a LoRA one: the base from the spec, once
        for every experiment sharing it, then its version in its own lane) and tokenizer."""
        from transformers import AutoTokenizer

        model = binding.spec.model
        tokenizer = await asyncio.to_thread(
            AutoTokenizer.from_pretrained, model.tokenizer_path or model.path
        )
        if binding.spec.rollout.workflow.chat_template and not tokenizer.chat_template:
            raise SpecError("rollout.workflow.chat_template", "the tokenizer has no chat template")
        lora = binding.spec.trainer.lora
        lane = binding.experiment_id if lora is not None and self.engine.shares_adapters else ""
        if not lane or not any(other.lane for other in self.loaded.values()):
            keep = binding.spec.rollout.max_head_offpolicyness + 1  # adapter versions kept
            self.engine.serve_lora(lora, keep)
            base = Path(model.path) if adapter else path  # no lane holds the base yet
            await self.engine.load(str(base), 0 if adapter else version)
        if lane or adapter:
            await engine_update(self.engine, binding, lane, path, version)
        loaded = self.loaded[binding.experiment_id] = Loaded(Codec(tokenizer), lane)
        freeze_heap()  # the model and tokenizer: never scanned by the collector again
        log.info("experiment_loaded", experiment=binding.experiment_id, version=version, lane=lane)
        return loaded

    @property
    def tokenizer(self):
        """The loaded model's tokenizer (None until one is loaded; the experiments sharing the
        base share it)."""
        return next(iter(self.loaded.values())).codec.tokenizer if self.loaded else None

    # ---------------------------------------------------------------- groups
    @property
    def running_groups(self) -> int:
        return len(self.groups)

    async def generate_group(self, job: GroupJob) -> GroupSummary:
        if not job.group_id:
            raise BadRequest("group_id", "required")
        binding = self.bindings.get(job.experiment_id)
        if binding is None or job.experiment_id not in self.loaded:
            raise Conflict(
                f"experiment_id: this rollout serves {self.experiment_id or 'nothing'!r},"
                f" not {job.experiment_id!r} (BindExperiment and UpdateWeights first)"
            )
        running = await self.groups.start(job)
        try:
            return await self._run_group(job, binding, running)
        finally:
            self.groups.finish(running)

    def abort_unpublished(self, experiment_id: str, group_ids: list[str], reason: str) -> list[str]:
        """Abort the named groups of `experiment_id` that have not begun publishing (AbortGroups:
        the scheduler found them too stale to train); each answers ABORTED with `reason` and
        publishes nothing. Returns the ids aborted; the others go on as they would."""
        if experiment_id not in self.loaded:
            return []
        return self.groups.abort_unpublished(group_ids, reason, experiment_id)

    async def _run_group(
        self, job: GroupJob, binding: Binding, running: RunningGroup
    ) -> GroupSummary:
        t0 = time.perf_counter()
        version_at_start = self.engine.version_of(self.loaded[job.experiment_id].lane)
        prompt_ids, chat_prompt = self._prompt(job, binding)
        running.task = asyncio.create_task(self._samples(job, binding, prompt_ids, chat_prompt))
        try:
            samples = await running.task
        except asyncio.CancelledError:
            if running.aborted and not asyncio.current_task().cancelling():
                return self._summary(
                    job, running.abort_status, running.aborted, [], version_at_start, t0
                )
            log.info("group_cancelled", group=job.group_id)
            raise
        except RewardUnavailable:
            raise  # an infrastructure fault: the scheduler retries the group
        except Exception as exc:  # noqa: BLE001 - reported as a FAILED group with the reason
            log.exception("generation_failed", group=job.group_id)
            return self._summary(
                job, GroupStatus.FAILED, f"generation failed: {exc}", [], version_at_start, t0
            )
        self._generation(job.experiment_id).fill_text(samples)
        await self._score(job, binding, [s for s in samples if s.reward is None])
        if running.aborted:  # while it was being scored: nothing is published
            return self._summary(
                job, running.abort_status, running.aborted, samples, version_at_start, t0
            )
        running.publishing = True  # no await since the check above: an abort sees it
        decision = decide(samples, binding.filter(job.eval), job.eval)
        summary = self._summary(
            job, decision.status, decision.reason, samples, version_at_start, t0
        )
        if decision.publish or job.eval:
            await self._publish(job, prompt_ids, samples, summary)
            summary.duration_s = time.perf_counter() - t0
        self._tally.add(time.perf_counter(), tokens=summary.tokens, **{summary.status.value: 1})
        (log.warning if summary.status is GroupStatus.FAILED else log.debug)(
            "group_done",
            group=job.group_id,
            status=summary.status.value,
            reason=summary.reason,
            rewards=summary.rewards,
            tokens=summary.tokens,
            versions=(summary.start_version, summary.end_version),
            published=summary.published,
            duplicate=summary.duplicate,
        )
        return summary

    def _prompt(self, job: GroupJob, binding: Binding) -> tuple[list[int], str | None]:
        """The group's prompt tokens, and the chat-templated text when the spec asks for it."""
        chat_prompt = None
        codec = self.loaded[job.experiment_id].codec
        if binding.spec.rollout.workflow.chat_template:
            chat_prompt = codec.tokenizer.apply_chat_template(
                [{"role": "user", "content": job.prompt}],
                add_generation_prompt=True,
                tokenize=False,
            )
        return codec.encode(chat_prompt or job.prompt), chat_prompt

    async def _samples(
        self, job: GroupJob, binding: Binding, prompt_ids: list[int], chat_prompt: str | None
    ) -> list[Sample]:
        """The group's n trajectories: the workflow's `run_group` with one context per sample
        (by default a run per sample, concurrently; one failure cancels the others)."""
        generation = self._generation(job.experiment_id)
        contexts = [
            self._context(job, binding, generation, prompt_ids, i, chat_prompt)
            for i in range(binding.n(job.eval))
        ]
        return await binding.workflow().run_group(contexts)

    def _context(
        self,
        job: GroupJob,
        binding: Binding,
        generation: Generation,
        prompt_ids: list[int],
        index: int,
        chat_prompt: str | None = None,
    ) -> WorkflowContext:
        """Sample `index`'s view of the system: the engine (interruptible, per-token
        versions) and the experiment's reward function."""

        async def score(prompt: str, text: str) -> Score:
            item = ScoreItem(
                id=f"{job.group_id}:{index}", prompt=prompt, completion=text, answer=job.answer
            )
            [got] = await self.rewards.score(job.reward_addresses, binding.rewards, [item])
            return got

        return WorkflowContext(
            prompt=job.prompt,
            answer=job.answer,
            prompt_ids=prompt_ids,
            index=index,
            is_eval=job.eval,
            params=binding.params(job.eval),
            tokenizer=generation.tokenizer,
            generate=generation.generate,
            generate_many=generation.generate_many,
            score=score,
            version=lambda: self.engine.version_of(generation.lane),
            request_id=f"{job.group_id}:{index}",
            chat_prompt=chat_prompt,
            openai_session=self.openai.session,
        )

    def _generation(self, experiment_id: str = "") -> Generation:
        """How `experiment_id`'s samples are generated (its codec, its engine lane); by default
        the first loaded experiment's."""
        loaded = self.loaded[experiment_id] if experiment_id else next(iter(self.loaded.values()))
        return Generation(
            engine=self.engine,
            codec=loaded.codec,
            throughput=self.throughput,
            lane=loaded.lane,
        )

    async def _publish(
        self, job: GroupJob, prompt_ids: list[int], samples: list[Sample], summary: GroupSummary
    ) -> None:
        """To JetStream with Nats-Msg-Id = group id, before the summary goes back."""
        served = self.loaded[job.experiment_id].served
        group = TrajectoryGroup(
            experiment_id=job.experiment_id,
            group_id=job.group_id,
            prompt_id=job.prompt_id,
            prompt=job.prompt,
            answer=job.answer,
            prompt_ids=prompt_ids,
            samples=samples,
            start_version=summary.start_version,
            eval=job.eval,
            created_unix_ms=int(time.time() * 1000),
            rollout_worker=self.worker,
            epoch=job.epoch,
            fingerprints=stamp((v for s in samples for v in s.versions), served),
        )
        _, summary.duplicate = await publish_group(self.js, group)
        summary.published = True

    async def _score(self, job: GroupJob, binding: Binding, samples: list[Sample]) -> None:
        """Score the samples the workflow left unscored (one Score call). An unreachable reward
        service raises RewardUnavailable: the group is not theirs to fail."""
        if not samples:
            return
        items = [
            ScoreItem(
                id=f"{job.group_id}:{i}", prompt=job.prompt, completion=s.text, answer=job.answer
            )
            for i, s in enumerate(samples)
        ]
        scores = await self.rewards.score(job.reward_addresses, binding.rewards, items)
        for sample, score in zip(samples, scores, strict=True):
            sample.score(score)

    def _summary(
        self,
        job: GroupJob,
        status: GroupStatus,
        reason: str,
        samples: list[Sample],
        version_at_start: int,
        t0: float,
    ) -> GroupSummary:
        versions = [v for s in samples for v in s.versions]
        return GroupSummary(
            group_id=job.group_id,
            status=status,
            reason=reason,
            rewards=[s.reward for s in samples if s.reward_status is RewardStatus.OK],
            failed_samples=failed_samples(samples),
            tokens=sum(len(s.output_ids) for s in samples),
            start_version=min(versions, default=version_at_start),
            end_version=max(versions, default=version_at_start),
            duration_s=time.perf_counter() - t0,
            worker=self.worker,
        )

    # ---------------------------------------------------------------- status, lifecycle
    def status(self) -> StatusInfo:
        return StatusInfo(
            worker_id=self.worker,
            experiment_id=self.experiment_id,
            version=self.engine.version_of(self._generation().lane) if self.loaded else 0,
            running_groups=self.running_groups,
            running_samples=self.engine.running,
            tokens_generated=self.throughput.total,
            tokens_per_s=self.throughput.rate(),
            engine=self.engine_kind,
        )

    async def close(self) -> None:
        """Abort what still runs (the gRPC server has stopped), then release the engine, the
        OpenAI endpoint and the reward channels."""
        await self.groups.abort_all("aborted: rollout stopping")
        await self.engine.stop()
        await self.openai.stop()
        await self.rewards.close()
