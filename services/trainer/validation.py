"""What the trainer admits from its stream, as pure code (no grpc, no nats).

Every pulled group gets one verdict: train it; a replay of a group already trained (acked and
skipped, never reported: its prompt has its fate); too stale to train (reported to the
scheduler, which re-queues the prompt); or bad (dead-lettered with the reason). A bad group
is one the trainer cannot or must not train: another experiment's, misaligned per-token
arrays, token ids outside the vocabulary, versions the trainer has not produced.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Container, Iterable
from dataclasses import dataclass
from enum import StrEnum

from asyncrl.types import Sample, TrajectoryGroup
from services.trainer.metrics import is_too_stale

TRAINED_IDS_KEPT = 100_000


class Verdict(StrEnum):
    TRAIN = "train"
    REPLAY = "replay"
    STALE = "stale"
    BAD = "bad"


@dataclass(frozen=True)
class Admission:
    """What a group is checked against when it is pulled."""

    experiment_id: str
    vocab_size: int
    trainer_version: int
    eta: int


def _tokens_reason(name: str, ids: list[int], vocab_size: int) -> str:
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        return f"{name}: token id {bad} outside [0, {vocab_size})"
    return ""


def _sample_reason(i: int, s: Sample, a: Admission) -> str:
    """Why sample i is bad, "" if it is not. Every sample of every group pulled is checked, so
    the common case is a few C calls: min/max per list, and one float sum of the logprobs (a
    NaN or inf makes it non-finite; only then is each checked, as finite values can overflow
    the sum)."""
    n = len(s.output_ids)
    for name, values in (("logprobs", s.logprobs), ("versions", s.versions)):
        if len(values) != n:
            return f"sample {i}: {len(values)} {name} for {n} output_ids"
    if s.loss_mask and len(s.loss_mask) != n:
        return f"sample {i}: {len(s.loss_mask)} loss_mask for {n} output_ids"
    if n == 0:
        return ""
    if reason := _tokens_reason(f"sample {i} output_ids", s.output_ids, a.vocab_size):
        return reason
    if min(s.versions) < 0 or max(s.versions) > a.trainer_version:
        bad = next(v for v in s.versions if not 0 <= v <= a.trainer_version)
        return f"sample {i}: version {bad} outside [0, trainer version {a.trainer_version}]"
    if not math.isfinite(sum(s.logprobs)) and not all(map(math.isfinite, s.logprobs)):
        return f"sample {i}: a logprob is not finite"
    return ""


def invalid_reason(group: TrajectoryGroup, a: Admission) -> str:
    """Why `group` must not be trained; "" when it is well-formed for this trainer."""
    if group.experiment_id != a.experiment_id:
        return f"experiment {group.experiment_id!r} is not {a.experiment_id!r}"
    if not group.samples:
        return "no samples"
    if not 0 <= group.start_version <= a.trainer_version:
        return (
            f"start_version {group.start_version} outside [0, trainer version {a.trainer_version}]"
        )
    if reason := _tokens_reason("prompt_ids", group.prompt_ids, a.vocab_size):
        return reason
    for i, sample in enumerate(group.samples):
        if reason := _sample_reason(i, sample, a):
            return reason
    return ""


def triage(
    group: TrajectoryGroup,
    a: Admission,
    trained: Container[str],
    taken: Container[str] = frozenset(),
) -> tuple[Verdict, str]:
    """The verdict on a pulled group and, for BAD, the reason. `trained` holds the ids already
    trained, `taken` those already in the batch being collected: a replay is never trained
    twice, and never reported as stale either (its prompt was trained)."""
    if reason := invalid_reason(group, a):
        return Verdict.BAD, reason
    if group.group_id in trained or group.group_id in taken:
        return Verdict.REPLAY, ""
    if is_too_stale(group, a.trainer_version, a.eta):
        return Verdict.STALE, ""
    return Verdict.TRAIN, ""


class RecentIds:
    """The last `capacity` ids added, oldest first, with O(1) membership: the group ids the
    trainer trained, kept in its checkpoint so a replay is recognised after a restart."""

    def __init__(self, ids: Iterable[str] = (), capacity: int = TRAINED_IDS_KEPT):
        self.capacity = capacity
        self._order: deque[str] = deque()
        self._set: set[str] = set()
        self.extend(ids)

    def __contains__(self, group_id: object) -> bool:
        return group_id in self._set

    def __iter__(self):
        """Oldest first."""
        return iter(self._order)

    def __reversed__(self):
        """Newest first."""
        return reversed(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def add(self, group_id: str) -> None:
        if group_id in self._set:
            return
        self._order.append(group_id)
        self._set.add(group_id)
        if len(self._order) > self.capacity:
            self._set.discard(self._order.popleft())

    def extend(self, ids: Iterable[str]) -> None:
        for group_id in ids:
            self.add(group_id)
