"""The NATS subject a service consumes: the trainer's train subject
(`asyncrl.traj.<experiment>.train`, TrajectoryGroup bytes that rollouts publish). Cases are
published as the rollout's NATS user on the subject of the experiment the fuzz trainer
consumes, then taken the trainer's own way: its JetStream consumer (services/trainer/consumer.py)
pulls them, each is decoded and triaged against the trainer's admission
(services/trainer/validation.py), and a bad one is dead-lettered with its reason.

Properties: nothing raises; a message that did not decode, or that another experiment's id,
misaligned arrays, a non-finite value, a token outside the vocabulary or a version the
trainer never made mark, is dead-lettered with a reason, never admitted for training (checked
here independently of validation.py)."""

from __future__ import annotations

import math
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.natsutil import STREAM, connect, train_subject
from asyncrl.types import TrajectoryGroup
from asyncrl.v1 import trajectory_pb2
from services.trainer.consumer import GroupConsumer
from services.trainer.validation import Admission, Verdict, triage
from tests.fuzz.cluster import BOUND, FuzzCluster
from tests.fuzz.run import Finding, Tally
from tests.fuzz.values import messages, raw_bytes

VOCAB = 100
TRAINER_VERSION = 3


def trainable_problem(group: TrajectoryGroup) -> str:
    """Why `group` cannot be trained by the fuzz trainer ("" if it can): the independent
    reading of what validation.py must refuse."""
    if group.experiment_id != BOUND or not group.samples:
        return "another experiment's, or empty"
    if not 0 <= group.start_version <= TRAINER_VERSION:
        return "start_version out of range"
    if any(not 0 <= t < VOCAB for t in group.prompt_ids):
        return "prompt token out of vocabulary"
    for s in group.samples:
        n = len(s.output_ids)
        if len(s.logprobs) != n or len(s.versions) != n or (s.loss_mask and len(s.loss_mask) != n):
            return "misaligned per-token arrays"
        if any(not 0 <= t < VOCAB for t in s.output_ids):
            return "output token out of vocabulary"
        if any(not 0 <= v <= TRAINER_VERSION for v in s.versions):
            return "version out of range"
        if not all(map(math.isfinite, s.logprobs)):
            return "non-finite logprob"
        if s.reward is not None and not math.isfinite(s.reward):
            return "non-finite reward"
    return ""


class NatsFuzz:
    NAME = "nats:asyncrl.traj.<experiment>.train"

    def __init__(self, cluster: FuzzCluster):
        self.cluster = cluster
        self.loop = cluster.loop
        self.loop.run(self._open(), timeout=60)

    async def _open(self) -> None:
        url = self.cluster.nats.url
        self.rollout = await connect(url, identity="rollout")
        self.trainer = await connect(url, identity="trainer")
        self.consumer = GroupConsumer(self.trainer.jetstream(), BOUND)
        info = await self.trainer.jetstream().stream_info(STREAM)
        await self.consumer.open(info.state.last_seq + 1)

    def close(self) -> None:
        self.loop.run(self._close(), timeout=60)

    async def _close(self) -> None:
        await self.consumer.close()
        for nc in (self.rollout, self.trainer):
            await nc.drain()

    def cases(self) -> st.SearchStrategy[bytes]:
        ids = (*self.cluster.experiments.values(), BOUND)
        overrides = {
            "experiment_id": st.one_of(st.just(BOUND), st.just(BOUND), st.sampled_from(ids))
        }
        valid = messages(trajectory_pb2.TrajectoryGroup.DESCRIPTOR, ids, overrides=overrides)
        wellformed = valid.map(lambda m: m.SerializeToString())
        return st.one_of(wellformed, wellformed, raw_bytes(valid))

    async def _one(self, data: bytes) -> tuple[str, list[str]]:
        """Publish, pull it back as the trainer does, triage, dead-letter a bad one."""
        js = self.rollout.jetstream()
        await js.publish(train_subject(BOUND), data, timeout=10)
        pulled = await self.consumer.pull(1, timeout=10)
        if len(pulled) != 1:
            return "lost", [f"published 1, the consumer took {len(pulled)}"]
        p = pulled[0]
        admission = Admission(BOUND, VOCAB, TRAINER_VERSION, eta=2)
        if p.group is None:
            verdict, reason = Verdict.BAD, f"undecodable: {p.error}"
        else:
            verdict, reason = triage(p.group, admission, trained=set())
        problems = []
        if verdict == Verdict.BAD:
            if not reason:
                problems.append("dead-lettered without a reason")
            await self.consumer.dead_letter(p, reason)
        elif (why := trainable_problem(p.group)) and verdict in (Verdict.TRAIN, Verdict.STALE):
            problems.append(f"admitted ({verdict}) though {why}")
        return str(verdict), problems

    def fuzz(self, examples: int, derandomize: bool, tally: Tally, stop_at=None) -> None:
        @settings(
            max_examples=examples,
            derandomize=derandomize,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(self.cases())
        def one(data):
            if stop_at is not None and time.monotonic() > stop_at:
                return
            try:
                verdict, problems = self.loop.run(self._one(data), timeout=60)
            except Exception as exc:  # noqa: BLE001 - the finding itself
                verdict, problems = "raised", [f"{type(exc).__name__}: {exc}"[:300]]
            tally.cases += 1
            tally.codes[verdict] = tally.codes.get(verdict, 0) + 1
            health = self.cluster.health()
            if set(health.values()) != {"SERVING"}:
                problems.append(f"a service stopped serving: {health}")
            known = {f.problem[:60] for f in tally.findings}
            for problem in problems:
                if problem[:60] not in known:
                    tally.findings.append(Finding(self.NAME, "rollout", problem, data[:2000].hex()))

        one()
