"""The ledger: every group's fate, recorded durably, so a run can prove it lost nothing and
trained nothing twice.

Services append small JSON events to the JetStream stream `ASYNCRL_LEDGER` (subject
`asyncrl.ledger.<experiment>`; one message holds one event or a batch of them), stored in the
order they were made; an event whose write was acked survives any crash:

    scheduler  started     {"prompts": N, "epochs": E}           the experiment's dataset
    scheduler  dispatched  {"group", "prompt", "epoch", "index", "attempt", "worker", "version"}
    scheduler  settled     {"group", "status": accepted|rejected|failed, "reason", "duplicate"}
    scheduler  retried     {"group", "reason"}        an infrastructure fault: same id again
    scheduler  dropped     {"group", "reason"}        too stale: the prompt gets a new attempt
    scheduler  left_over   {"groups"|"prompts": [...]} in flight or re-queued when the run ended
    scheduler  resumed     {"state", "requeued", "version"}  a cancelled or failed run goes on:
                                                      what was left over before is dispatched
                                                      or trained again, no longer left over
    trainer    left_over   {"groups": [...]}          published, taken by no step when it ended
    trainer    trained     {"step", "version", "groups": [...], "run", "fingerprint",
                            "samples": {group: [{v: k} per sample]},
                            "fingerprints": [...]}    the weights of each sample's versions:
                                                      fingerprints[k] ("" unverified)
    trainer    rewound     {"to_step", "run"}         a restarted trainer resumed at step k:
                                                      steps > k recorded before are discarded
    trainer    quarantined {"group", "reason"}        a bad message, set aside

`summarize` (pure) turns the events into each prompt's fate and the totals that matter:
trained once, trained twice, lost, filtered, failed, left over. `asyncrl ledger ID` prints them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import nats
import nats.errors
import nats.js.errors

from asyncrl import natsutil
from asyncrl.logging import get_logger, raise_if_cancelled
from asyncrl.natsutil import ensure_file_stream, read_subject
from asyncrl.retry import jetstream_call
from asyncrl.types import GroupId

log = get_logger(component="ledger")

LEDGER_STREAM = "ASYNCRL_LEDGER"
LEDGER_ROOT = "asyncrl.ledger"

FATES = ("trained", "trained_twice", "filtered", "failed", "left_over", "lost", "in_flight")
RETRY_S = 0.5
MAX_BATCH = 1000
"""Events per ledger message at most (a message stays far below NATS's payload limit)."""
LINGER_S = 0.02
"""How long the writer waits for more events before it sends what was emitted. The scheduler
emits two events per group; written as they came (about one JetStream write per group), they
cost the scheduler ~70 and nats-server ~40 CPU-µs per group (bench/control_plane.py). An
emitted event was never stored at once (a crash loses what is still queued): this widens that
window to 20 ms; `record` and `flush` still return only once everything emitted is stored."""


def prompt_of(group_id: str) -> tuple[int, int] | None:
    """(epoch, index) of a training group id (`asyncrl.types.GroupId`)."""
    gid = GroupId.parse(group_id)
    return (gid.epoch, gid.index) if gid else None


def ledger_subject(experiment_id: str) -> str:
    return f"{LEDGER_ROOT}.{experiment_id}"


async def ensure_ledger(js) -> None:
    """Create (or keep) the ledger stream: file storage, kept as long as the trajectories."""
    await ensure_file_stream(js, LEDGER_STREAM, [f"{LEDGER_ROOT}.>"])


class Ledger:
    """Appends one experiment's events, in order. `record` returns once the event is stored;
    `emit` (for synchronous code) queues it for a background writer: `flush` waits for it."""

    def __init__(self, js, experiment_id: str, held: Callable[[], bool] = lambda: True):
        self.js = js
        self.subject = ledger_subject(experiment_id)
        self.held = held
        """Whether the writer may write now (the scheduler: while it holds its lease, so that
        a former scheduler paused and resumed appends nothing): a write waits until it may."""
        self._pending: list[dict] = []
        """Emitted events not yet sent, oldest first (a plain list: `emit` runs twice per
        group, and asyncio.Queue's put/get cost more than the event)."""
        self._writer: asyncio.Task | None = None
        self._writing = 0
        """Events of the message being written now (retried while NATS is away)."""

    @property
    def unstored(self) -> int:
        """Events emitted and not yet stored (queued, or in a write retried while NATS is
        away)."""
        return len(self._pending) + self._writing

    @staticmethod
    def _event(event: str, fields: dict) -> dict:
        return {"event": event, "t": round(time.time(), 3), **fields}

    async def record(self, event: str, **fields) -> None:
        """Append one event and wait until it is stored, riding out NATS being away (a retry
        whose first attempt was stored after all is dropped by JetStream: same message id)."""
        await self.flush()  # keep the order of earlier emits
        body = json.dumps(self._event(event, fields), separators=(",", ":")).encode()
        headers = {"Nats-Msg-Id": f"{self.subject}-{hashlib.sha1(body).hexdigest()}"}
        await self._may_write()
        await jetstream_call(lambda: self.js.publish(self.subject, body, headers=headers))

    async def _may_write(self) -> None:
        while not self.held():
            await asyncio.sleep(RETRY_S)

    def emit(self, event: str, **fields) -> None:
        self._pending.append(self._event(event, fields))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write())

    async def _write(self) -> None:
        """After `LINGER_S`, send what is queued as one message (a JSON array; one connection
        keeps the order), wait for its ack; again while more was emitted meanwhile."""
        while True:
            if len(self._pending) < MAX_BATCH:
                await asyncio.sleep(LINGER_S)
            batch = self._pending[:MAX_BATCH]
            del self._pending[:MAX_BATCH]
            self._writing = len(batch)
            body = json.dumps(batch, separators=(",", ":")).encode()
            # a retry whose first attempt was stored after all (its ack lost in a reconnect) is
            # dropped by JetStream: a `trained` event stored twice would count a step twice
            headers = {"Nats-Msg-Id": f"{self.subject}-{hashlib.sha1(body).hexdigest()}"}
            while True:  # NATS away (restarting): keep the events and try again
                raise_if_cancelled("ledger writer")
                await self._may_write()
                try:
                    await self.js.publish(self.subject, body, headers=headers)
                    break
                except (TimeoutError, nats.errors.Error) as exc:
                    log.warning("ledger_write_failed", events=len(batch), error=repr(exc))
                    await asyncio.sleep(RETRY_S)
            self._writing = 0
            if not self._pending:
                return

    async def flush(self) -> None:
        """Wait until every emitted event is stored (or its write failed)."""
        if self._writer is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._writer)


async def read_events(js, experiment_id: str) -> list[dict]:
    """Every event of the experiment, oldest first."""
    try:
        messages = await read_subject(js, LEDGER_STREAM, ledger_subject(experiment_id))
    except nats.js.errors.NotFoundError:
        return []
    events: list[dict] = []
    malformed, first = 0, None
    for data in messages:
        try:
            body = json.loads(data or b"")  # an empty message reads as None
        except ValueError:
            malformed, first = malformed + 1, first or bytes(data[:200])
            continue
        for e in body if isinstance(body, list) else [body]:
            if well_formed(e):
                events.append(e)
            else:
                malformed, first = malformed + 1, first or repr(e)[:200]
    if malformed:  # a writer's bug: the rest of the ledger still reads
        log.warning(
            "ledger_events_malformed", experiment=experiment_id, events=malformed, first=first
        )
    return events


_INT, _STR, _LIST = (int,), (str,), (list,)
EVENT_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "dispatched": {"group": _STR, "epoch": _INT, "index": _INT, "prompt": _STR},
    "settled": {"group": _STR, "status": _STR},
    "retried": {"group": _STR},
    "dropped": {"group": _STR},
    "quarantined": {"group": _STR},
    "trained": {"step": _INT, "version": _INT, "groups": _LIST},
    "rewound": {"to_step": _INT},
}
"""The fields `summarize` reads of each kind of event, and their types."""


def well_formed(e: object) -> bool:
    """Whether `e` is an event `summarize` can read: a mapping with a str `event` and the
    fields its kind needs (`EVENT_FIELDS`), group lists of strings, a trained step's
    per-sample fingerprints indices into its list."""
    if not isinstance(e, dict) or not isinstance(e.get("event"), str):
        return False
    if not isinstance(e.get("run"), str | int | None):  # a set member (counted_steps)
        return False
    for name, types in EVENT_FIELDS.get(e["event"], {}).items():
        value = e.get(name)
        if not isinstance(value, types) or (types is _INT and isinstance(value, bool)):
            return False
    groups = e.get("groups", [])
    if not isinstance(groups, list) or not all(isinstance(g, str) for g in groups):
        return False
    prompts = e.get("prompts", []) if e["event"] == "left_over" else []  # started's: a count
    if not isinstance(prompts, list) or not all(_pair(k) for k in prompts):
        return False
    return e["event"] != "trained" or _samples_ok(e)


def _pair(key: object) -> bool:
    return isinstance(key, list | tuple) and len(key) == 2 and all(type(x) is int for x in key)


def _samples_ok(e: dict) -> bool:
    fingerprints, samples = e.get("fingerprints", []), e.get("samples", {})
    if not isinstance(fingerprints, list) or not isinstance(samples, dict):
        return False
    n = len(fingerprints)
    return all(
        isinstance(group, list)
        and all(
            isinstance(s, dict) and all(type(k) is int and 0 <= k < n for k in s.values())
            for s in group
        )
        for group in samples.values()
    )


@dataclass
class PromptFate:
    """One dataset prompt of one epoch: every attempt at it and what became of it."""

    prompt: str
    epoch: int
    index: int
    groups: list[str] = field(default_factory=list)
    trained: list[tuple[int, int]] = field(default_factory=list)
    """(step, version) of every counted training of one of its groups."""
    last_status: str = ""
    reason: str = ""
    left_over: bool = False
    open: bool = False
    """A group dispatched and never settled, retried or dropped since."""
    samples: list[dict[str, str]] = field(default_factory=list)
    """Each sample of its trained group: {version: fingerprint} of every version that
    generated its tokens ("" where the engine could not say: unverified)."""

    @property
    def fate(self) -> str:
        if len(self.trained) > 1:
            return "trained_twice"
        if self.trained:
            return "trained"
        if self.left_over:
            return "left_over"
        if self.last_status == "rejected":
            return "filtered"
        if self.last_status == "failed":
            return "failed"
        return "in_flight" if self.open else "lost"


def unaccounted(report: LedgerReport, untrained: int) -> list[str]:
    """Of the `untrained` groups the scheduler saw accepted and no committed step train, those
    nobody wrote as left over (their prompts read `lost`; the trainer that should have said so
    failed, or was frozen past its stop): the latest such groups, as many as are missing.
    Once the run has ended they are its left over."""
    written = sum(p.fate == "left_over" and p.last_status == "accepted" for p in report.prompts)
    missing = untrained - written
    if missing <= 0:
        return []
    lost = [p for p in report.prompts if p.fate == "lost" and p.last_status == "accepted"]
    return [p.groups[-1] for p in lost[-missing:]]


@dataclass
class LedgerReport:
    totals: dict[str, int]
    prompts: list[PromptFate]
    steps: int
    """Training steps counted (discarded ones excluded)."""
    trained_groups: int
    """Groups in the counted steps (steps x B when every step took B)."""
    quarantined: int
    duplicates: int
    """Settled groups JetStream reported as duplicate publishes (not counted twice)."""
    dataset: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        out = asdict(self)
        out["prompts"] = [asdict(p) | {"fate": p.fate} for p in self.prompts]
        return out


def sample_fingerprints(groups: Iterable) -> dict:
    """The `trained` event's fields naming `groups` (TrajectoryGroups) and the weights of each
    of their samples: per sample, each version that generated its tokens and that version's
    fingerprint as its group carries it ("": unverified), each distinct fingerprint written
    once (a step's samples share a few: ~10 bytes a sample, not ~80)."""
    ids, samples, index = [], {}, {}
    for g in groups:
        ids.append(g.group_id)
        samples[g.group_id] = [
            {str(v): index.setdefault(g.fingerprints.get(v, ""), len(index)) for v in _ordered(s)}
            for s in g.samples
        ]
    return {"groups": ids, "samples": samples, "fingerprints": list(index)}


def _ordered(sample) -> list[int]:
    """The distinct versions of a sample's tokens, in order."""
    return sorted(set(sample.versions))


def _sample_weights(step: dict, group: str) -> list[dict[str, str]]:
    """`PromptFate.samples` of `group` trained in `step` (a `trained` event)."""
    fingerprints = step.get("fingerprints", [])
    return [
        {v: fingerprints[k] for v, k in sample.items()}
        for sample in step.get("samples", {}).get(group, [])
    ]


def counted_steps(events: Iterable[dict]) -> list[dict]:
    """The `trained` events that stand: a `rewound` to step k discards the steps > k of every
    run before it (a restarted trainer trains them again from its checkpoint), those recorded
    before it and those of an earlier run stored after it. The last happens when a trainer
    fails while NATS cannot store (a full disk): its ledger writer keeps the steps it trained
    and stores them once NATS is back, after its successor's `rewound`."""
    steps: list[dict] = []
    runs: set = set()
    last_step: dict = {}  # run -> the newest of its steps that can stand (a rewind's to_step)
    for e in events:
        run = e.get("run")
        if e["event"] == "trained" and e["step"] <= last_step.get(run, math.inf):
            steps.append(e)
        elif e["event"] == "rewound":
            for earlier in runs - {run, None}:  # None: events written before run ids
                last_step[earlier] = min(last_step.get(earlier, math.inf), e["to_step"])
            steps = [s for s in steps if s["step"] <= e["to_step"]]
        runs.add(run)
    return steps


def summarize(events: list[dict]) -> LedgerReport:
    """Each prompt's fate from the experiment's events (pure). Events of one writer are in the
    order they were made; between writers, a trainer's `trained`, `left_over` or `quarantined`
    may be stored before the scheduler's `dispatched` or `settled` of the same group (the
    scheduler's writer batches), so those are applied once every event is read."""
    prompts: dict[tuple[int, int], PromptFate] = {}
    by_group: dict[str, PromptFate] = {}
    counts = Counter()
    left_groups: list[str] = []
    left_prompts: list[tuple[int, int]] = []
    quarantined: list[tuple[str, str]] = []
    for e in events:
        kind, group = e["event"], e.get("group", "")
        if kind == "dispatched":
            key = (e["epoch"], e["index"])
            p = prompts.setdefault(key, PromptFate(e["prompt"], e["epoch"], e["index"]))
            if group not in p.groups:
                p.groups.append(group)
            p.open = True
            by_group[group] = p
        elif kind in ("settled", "retried", "dropped") and group in by_group:
            _settle(by_group[group], e)
            counts["duplicates"] += bool(e.get("duplicate"))
        elif kind == "left_over":  # applied below: the trainer's may precede the dispatch
            left_groups.extend(e.get("groups", []))
            left_prompts.extend(tuple(key) for key in e.get("prompts", []))
        elif kind == "resumed":  # the run goes on: what it left over comes again
            left_groups.clear()
            left_prompts.clear()
        elif kind == "quarantined":  # applied below, as left_over
            counts["quarantined"] += 1
            quarantined.append((group, e.get("reason", "")))
    for group, reason in quarantined:
        if group in by_group:  # one of ours, set aside by the trainer: its task failed
            failed = {"event": "settled", "status": "failed", "reason": f"quarantined: {reason}"}
            _settle(by_group[group], failed)
    for g in left_groups:
        p = by_group.get(g) or _undispatched(prompts, by_group, g)
        if p is not None:
            p.left_over = True
    for key in left_prompts:
        if key in prompts:
            prompts[key].left_over = True
    steps = counted_steps(events)
    _apply_trained(steps, prompts, by_group)
    totals = Counter(p.fate for p in prompts.values())
    return LedgerReport(
        totals={f: totals.get(f, 0) for f in FATES},
        prompts=sorted(prompts.values(), key=lambda p: (p.epoch, p.index)),
        steps=len(steps),
        trained_groups=sum(len(s["groups"]) for s in steps),
        quarantined=counts["quarantined"],
        duplicates=counts["duplicates"],
        dataset=next((e for e in events if e["event"] == "started"), {}),
    )


def _apply_trained(
    steps: list[dict], prompts: dict[tuple[int, int], PromptFate], by_group: dict[str, PromptFate]
) -> None:
    """Each counted step's groups: when their prompts were trained, and on which weights."""
    trained_times: dict[str, list[tuple[int, int]]] = defaultdict(list)
    trained_in: dict[str, dict] = {}
    for s in steps:
        for g in s["groups"]:
            trained_times[g].append((s["step"], s["version"]))
            trained_in[g] = s
    for g, times in trained_times.items():
        p = by_group.get(g) or _undispatched(prompts, by_group, g)
        if p is not None:
            p.trained.extend(times)
            p.samples = _sample_weights(trained_in[g], g)


def _undispatched(
    prompts: dict[tuple[int, int], PromptFate], by_group: dict[str, PromptFate], group: str
) -> PromptFate | None:
    """A trained group whose dispatch was not recorded (a scheduler killed before it wrote
    it): its prompt comes from the group id."""
    key = prompt_of(group)
    if key is None:
        return None
    p = prompts.setdefault(key, PromptFate("", *key))
    p.groups.append(group)
    by_group[group] = p
    return p


def _settle(p: PromptFate, e: dict) -> None:
    p.open = False
    if e["event"] == "settled":
        p.last_status, p.reason = e["status"], e.get("reason", "")
    elif e["event"] == "retried":
        p.open = True  # the same group id goes out again


async def fetch_report(experiment_id: str, nats_url: str, timeout_s: float = 10.0) -> LedgerReport:
    """Connect, read the experiment's events and summarize them (the CLI's `ledger`)."""

    async def quiet(exc: Exception) -> None:  # connection errors surface as the raised error
        pass

    nc = await natsutil.connect(
        nats_url, connect_timeout=timeout_s, max_reconnect_attempts=2, error_cb=quiet
    )
    try:
        return summarize(await read_events(nc.jetstream(timeout=timeout_s), experiment_id))
    finally:
        await nc.close()
