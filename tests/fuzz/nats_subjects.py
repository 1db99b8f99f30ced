"""The NATS subjects services consume. The trainer's train subject
(`asyncrl.traj.<experiment>.train`, TrajectoryGroup bytes that rollouts publish). Cases are
published as the rollout's NATS user on the subject of the experiment the fuzz trainer
consumes, then taken the trainer's own way: its JetStream consumer (services/trainer/consumer.py)
pulls them, each is decoded and triaged against the trainer's admission
(services/trainer/validation.py), and a bad one is dead-lettered with its reason.

Properties: nothing raises; a message that did not decode, or that another experiment's id,
misaligned arrays, a non-finite value, a token outside the vocabulary or a version the
trainer never made mark, is dead-lettered with a reason, never admitted for training (checked
here independently of validation.py). And the ledger
(`asyncrl.ledger.<experiment>`, JSON events the trainer and the scheduler append), which the
scheduler reads as a run ends and `asyncrl ledger` reads: events of every kind with fields of
any type, and bytes that are no JSON, published as the trainer; the ledger must still read."""

from __future__ import annotations

import json
import math
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.ledger import ensure_ledger, ledger_subject, read_events, summarize
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


KINDS = ("dispatched", "settled", "retried", "dropped", "quarantined", "trained", "rewound")
_ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=8),
    st.lists(st.integers(), max_size=3),
    st.lists(st.text(max_size=4), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
LEDGER_FIELDS = (
    "group",
    "epoch",
    "index",
    "prompt",
    "status",
    "step",
    "version",
    "groups",
    "run",
    "to_step",
    "prompts",
    "fingerprints",
    "samples",
    "reason",
)


def ledger_messages() -> st.SearchStrategy[bytes]:
    """Ledger messages: events of every kind with fields of any type, batches of them, and
    bytes that are no JSON."""
    event = st.fixed_dictionaries(
        {"event": st.one_of(st.sampled_from(KINDS), _ANY)},
        optional={name: _ANY for name in LEDGER_FIELDS},
    )
    body = st.one_of(event, st.lists(event, max_size=4), _ANY)
    return st.one_of(body.map(lambda b: json.dumps(b).encode()), st.binary(max_size=64))


class NatsFuzz:
    NAME = "nats:asyncrl.traj.<experiment>.train"
    LEDGER = "nats:asyncrl.ledger.<experiment>"

    def __init__(self, cluster: FuzzCluster):
        self.cluster = cluster
        self.loop = cluster.loop
        self.loop.run(self._open(), timeout=60)

    async def _open(self) -> None:
        url = self.cluster.nats.url
        self.rollout = await connect(url, identity="rollout")
        self.trainer = await connect(url, identity="trainer")
        self.scheduler = await connect(url, identity="scheduler")
        await ensure_ledger(self.scheduler.jetstream())
        self.consumer = GroupConsumer(self.trainer.jetstream(), BOUND)
        info = await self.trainer.jetstream().stream_info(STREAM)
        await self.consumer.open(info.state.last_seq + 1)

    def close(self) -> None:
        self.loop.run(self._close(), timeout=60)

    async def _close(self) -> None:
        await self.consumer.close()
        for nc in (self.rollout, self.trainer, self.scheduler):
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

    async def _ledger_one(self, data: bytes) -> tuple[str, list[str]]:
        """Publish on the ledger subject as the trainer, then read the ledger as the scheduler
        does at a run's end (`read_events`, `summarize`)."""
        await self.trainer.jetstream().publish(ledger_subject(BOUND), data, timeout=10)
        try:
            report = summarize(await read_events(self.scheduler.jetstream(), BOUND))
        except Exception as exc:  # noqa: BLE001 - the finding itself
            return "raised", [f"ledger unreadable: {type(exc).__name__}: {exc}"[:300]]
        return f"{report.steps} steps", []

    def fuzz_ledger(self, examples: int, derandomize: bool, tally: Tally, stop_at=None) -> None:
        @settings(
            max_examples=examples,
            derandomize=derandomize,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(ledger_messages())
        def one(data):
            if stop_at is not None and time.monotonic() > stop_at:
                return
            _, problems = self.loop.run(self._ledger_one(data), timeout=60)
            tally.cases += 1
            tally.codes["read"] = tally.codes.get("read", 0) + 1
            known = {f.problem[:60] for f in tally.findings}
            for problem in problems:
                if problem[:60] not in known:
                    tally.findings.append(Finding(self.LEDGER, "trainer", problem, data.hex()))

        one()

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
