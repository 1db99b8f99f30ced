"""Domain dataclasses <-> protobuf messages (the only place the two meet for trajectories)."""

from __future__ import annotations

from asyncrl.types import RewardStatus, Sample, TrajectoryGroup
from asyncrl.v1 import common_pb2, trajectory_pb2

_STATUS_PREFIX = "REWARD_STATUS_"


_TO_PROTO = {s: common_pb2.RewardStatus.Value(_STATUS_PREFIX + s.name) for s in RewardStatus}
_FROM_PROTO = {value: status for status, value in _TO_PROTO.items()}
"""Precomputed: the enum wrapper's Name/Value lookups cost ~1 µs each, 2n per group."""
_FAILED = RewardStatus.FAILED


def status_to_proto(status: RewardStatus) -> int:
    return _TO_PROTO[status]


def status_from_proto(value: int) -> RewardStatus:
    """An unset or unknown status reads as FAILED: never a silent OK."""
    return _FROM_PROTO.get(value, _FAILED)


def sample_to_proto(s: Sample) -> trajectory_pb2.Sample:
    m = trajectory_pb2.Sample()
    _fill_sample(m, s)
    return m


def _fill_sample(m: trajectory_pb2.Sample, s: Sample) -> None:
    """`s` into the empty message `m`, field by field: extending a repeated field of a message
    in place costs ~30 % less than the keyword constructor's conversion of the same lists."""
    m.output_ids.extend(s.output_ids)
    m.logprobs.extend(s.logprobs)
    m.versions.extend(s.versions)
    m.finish_reason = s.finish_reason
    m.reward = s.reward or 0.0
    m.reward_status = _TO_PROTO[s.reward_status]
    m.reward_reason = s.reward_reason
    m.text = s.text
    mask = s.loss_mask
    if mask and not all(mask):  # empty: all the policy's
        m.loss_mask.extend(mask)


def sample_from_proto(m: trajectory_pb2.Sample) -> Sample:
    """Repeated fields copied by slicing (a new list; ~40 % cheaper than list()); the dataclass
    built with positional arguments in its field order (~0.4 µs a sample less than keywords:
    the trainer decodes every sample it pulls; tests/unit/test_group_decode.py round-trips
    distinct values through every field, so a reordered dataclass fails there)."""
    return Sample(
        m.output_ids[:],
        m.logprobs[:],
        m.versions[:],
        m.finish_reason,
        m.reward,
        _FROM_PROTO.get(m.reward_status, _FAILED),  # status_from_proto, inlined
        m.reward_reason,
        m.text,
        m.loss_mask[:],
    )


def group_to_proto(g: TrajectoryGroup) -> trajectory_pb2.TrajectoryGroup:
    m = trajectory_pb2.TrajectoryGroup(
        experiment_id=g.experiment_id,
        group_id=g.group_id,
        prompt_id=g.prompt_id,
        prompt=g.prompt,
        answer=g.answer,
        prompt_ids=g.prompt_ids,
        start_version=g.start_version,
        eval=g.eval,
        created_unix_ms=g.created_unix_ms,
        rollout_worker=g.rollout_worker,
        epoch=g.epoch,
    )
    add = m.samples.add  # built in place: a Sample passed in would be copied (~4 µs a group)
    for s in g.samples:
        _fill_sample(add(), s)
    return m


def group_from_proto(m: trajectory_pb2.TrajectoryGroup) -> TrajectoryGroup:
    """Positional, in the dataclass's field order, as `sample_from_proto`."""
    return TrajectoryGroup(
        m.experiment_id,
        m.group_id,
        m.prompt_id,
        m.prompt,
        m.answer,
        m.prompt_ids[:],
        list(map(sample_from_proto, m.samples)),
        m.start_version,
        m.eval,
        m.created_unix_ms,
        m.rollout_worker,
        m.epoch,
    )


def group_to_bytes(g: TrajectoryGroup) -> bytes:
    return group_to_proto(g).SerializeToString()


def group_from_bytes(data: bytes) -> TrajectoryGroup:
    return group_from_proto(trajectory_pb2.TrajectoryGroup.FromString(data))
