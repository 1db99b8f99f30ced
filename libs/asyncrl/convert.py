"""Domain dataclasses <-> protobuf messages (the only place the two meet for trajectories)."""

from __future__ import annotations

from asyncrl.types import RewardStatus, Sample, TrajectoryGroup
from asyncrl.v1 import common_pb2, trajectory_pb2

_STATUS_PREFIX = "REWARD_STATUS_"


_TO_PROTO = {s: common_pb2.RewardStatus.Value(_STATUS_PREFIX + s.name) for s in RewardStatus}
_FROM_PROTO = {value: status for status, value in _TO_PROTO.items()}


def status_to_proto(status: RewardStatus) -> int:
    return _TO_PROTO[status]


def status_from_proto(value: int) -> RewardStatus:
    """An unset or unknown status reads as FAILED: never a silent OK."""
    return _FROM_PROTO.get(value, RewardStatus.FAILED)


def sample_to_proto(s: Sample) -> trajectory_pb2.Sample:
    all_policy = not s.loss_mask or all(s.loss_mask)
    return trajectory_pb2.Sample(
        output_ids=s.output_ids,
        logprobs=s.logprobs,
        versions=s.versions,
        finish_reason=s.finish_reason,
        reward=s.reward or 0.0,
        reward_status=status_to_proto(s.reward_status),
        reward_reason=s.reward_reason,
        text=s.text,
        loss_mask=[] if all_policy else s.loss_mask,  # empty: all the policy's
    )


def sample_from_proto(m: trajectory_pb2.Sample) -> Sample:
    """Repeated fields copied to lists by slicing: list() iterates them element by element,
    twice the time (the trainer decodes every sample it pulls)."""
    return Sample(
        output_ids=m.output_ids[:],
        logprobs=m.logprobs[:],
        versions=m.versions[:],
        finish_reason=m.finish_reason,
        reward=m.reward,
        reward_status=status_from_proto(m.reward_status),
        reward_reason=m.reward_reason,
        text=m.text,
        loss_mask=m.loss_mask[:],
    )


def group_to_proto(g: TrajectoryGroup) -> trajectory_pb2.TrajectoryGroup:
    return trajectory_pb2.TrajectoryGroup(
        experiment_id=g.experiment_id,
        group_id=g.group_id,
        prompt_id=g.prompt_id,
        prompt=g.prompt,
        answer=g.answer,
        prompt_ids=g.prompt_ids,
        samples=[sample_to_proto(s) for s in g.samples],
        start_version=g.start_version,
        eval=g.eval,
        created_unix_ms=g.created_unix_ms,
        rollout_worker=g.rollout_worker,
        epoch=g.epoch,
        fingerprints=g.fingerprints,
    )


def group_from_proto(m: trajectory_pb2.TrajectoryGroup) -> TrajectoryGroup:
    return TrajectoryGroup(
        experiment_id=m.experiment_id,
        group_id=m.group_id,
        prompt_id=m.prompt_id,
        prompt=m.prompt,
        answer=m.answer,
        prompt_ids=m.prompt_ids[:],
        samples=[sample_from_proto(s) for s in m.samples],
        start_version=m.start_version,
        eval=m.eval,
        created_unix_ms=m.created_unix_ms,
        rollout_worker=m.rollout_worker,
        epoch=m.epoch,
        fingerprints=dict(m.fingerprints),
    )


def group_to_bytes(g: TrajectoryGroup) -> bytes:
    return group_to_proto(g).SerializeToString()


def group_from_bytes(data: bytes) -> TrajectoryGroup:
    return group_from_proto(trajectory_pb2.TrajectoryGroup.FromString(data))
