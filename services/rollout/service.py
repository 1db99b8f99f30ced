"""The rollout service logic: group generation, scoring, filtering, publishing (the weights it
serves them from: `serving.py`).

A group is the unit of work: the experiment's workflow (asyncrl.workflow) makes n
trajectories for one prompt with `run_group`, one context per sample (by default a run per
sample, concurrently; the built-in `single_turn` makes them in one engine call); the
trajectories the workflow left unscored are scored with one Reward.Score call, the filter
decides, and an accepted group (or any eval group) is published to JetStream with Nats-Msg-Id =
group id *before* the summary goes back to the scheduler. A cancelled GenerateGroup cancels its
engine requests and publishes nothing; so does AbortGroups (the scheduler found the group too
stale) for a group not yet being published, which then answers ABORTED: the scheduler learns
that the trainer cannot have it and samples the prompt again at once.

Several LoRA experiments bound at once (`serving.py`) run their groups beside each other in the
engine's batch, each with its own tokenizer and engine lane (`Loaded`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.errors import BadRequest, Conflict
from asyncrl.fingerprint import stamp
from asyncrl.logging import Tally, get_logger
from asyncrl.natsutil import publish_group
from asyncrl.throughput import Throughput
from asyncrl.types import RewardStatus, Sample, Score, ScoreItem, TrajectoryGroup
from asyncrl.workflow import WorkflowContext
from services.rollout.engine import Engine
from services.rollout.filters import GroupStatus, decide, failed_samples
from services.rollout.generation import Generation
from services.rollout.openai_api import OpenAIEndpoint
from services.rollout.reward_client import RewardClient, RewardUnavailable
from services.rollout.running import RunningGroup, RunningGroups
from services.rollout.serving import Binding, Loaded, Serving, WeightsResult

log = get_logger(component="rollout")


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
        self.groups = RunningGroups()
        self.serving = Serving(engine, self.engine_kind, js, self.groups, weights_cache)
        """The experiments bound and the weights loaded for them (BindExperiment,
        UpdateWeights)."""
        self.rewards = RewardClient()
        self.throughput = Throughput()
        self._tally = Tally("groups_done", log)
        """Groups finished, by status, and their tokens: a line per group was ~15 CPU-µs of the
        ~240 a group costs the rollout (bench control_plane). Each group's line is still there
        (a failed group's at WARNING, the others' at DEBUG), and its fate in the ledger."""
        self.openai = OpenAIEndpoint(port=openai_port)

    @property
    def worker(self) -> str:
        """This worker's registered id (its address until it registers)."""
        return self._worker()

    @property
    def bindings(self) -> dict[str, Binding]:
        return self.serving.bindings

    @property
    def loaded(self) -> dict[str, Loaded]:
        return self.serving.loaded

    @property
    def experiment_id(self) -> str:
        """The experiments whose weights are loaded, comma-separated ("" none)."""
        return self.serving.experiment_ids

    async def bind(self, experiment_id: str, spec_json: str) -> None:
        """BindExperiment (`Serving.bind`)."""
        await self.serving.bind(experiment_id, spec_json)

    async def update_weights(
        self, experiment_id: str, version: int, uri: str, fp: str = "", group=(0, 0), store=""
    ) -> WeightsResult:
        """UpdateWeights (`Serving.update_weights`)."""
        return await self.serving.update_weights(experiment_id, version, uri, fp, group, store)

    @property
    def tokenizer(self):
        return self.serving.tokenizer

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
        running = self.groups.adopt(job)  # still going: its call ended, or is still open
        if running is None:
            running = await self.groups.start(job)
            running.work = asyncio.create_task(self._run_group(job, binding, running))
            running.work.add_done_callback(lambda work: self._finished(running, work))
        return await self.groups.attend(running)

    def _finished(self, running: RunningGroup, work: asyncio.Task) -> None:
        self.groups.finish(running)
        if not work.cancelled() and work.exception() is not None and not running.callers:
            log.info(
                "group_orphan_failed", group=running.job.group_id, error=repr(work.exception())
            )

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
        await running.until_attended()  # an orphan is published for a call that adopts it
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
