"""Domain dataclasses <-> protobuf messages (the only place the two meet)."""

from __future__ import annotations

from asyncrl.types import RewardStatus, Sample, TrajectoryGroup
from asyncrl.v1 import common_pb2, trajectory_pb2

_STATUS_TO_PB = {
    RewardStatus.OK: common_pb2.REWARD_STATUS_OK,
    RewardStatus.FAILED: common_pb2.REWARD_STATUS_FAILED,
}
_STATUS_FROM_PB = {v: k for k, v in _STATUS_TO_PB.items()}


def sample_to_proto(s: Sample) -> trajectory_pb2.Sample:
    return trajectory_pb2.Sample(
        output_ids=s.output_ids,
        logprobs=s.logprobs,
        versions=s.versions,
        finish_reason=s.finish_reason,
        reward=s.reward,
        reward_status=_STATUS_TO_PB[s.reward_status],
        reward_reason=s.reward_reason,
        text=s.text,
        loss_mask=s.loss_mask if not all(s.loss_mask) else [],
    )


def sample_from_proto(m: trajectory_pb2.Sample) -> Sample:
    return Sample(
        output_ids=list(m.output_ids),
        logprobs=list(m.logprobs),
        versions=list(m.versions),
        finish_reason=m.finish_reason,
        reward=m.reward,
        reward_status=_STATUS_FROM_PB.get(m.reward_status, RewardStatus.FAILED),
        reward_reason=m.reward_reason,
        text=m.text,
        loss_mask=list(m.loss_mask),
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
    )


def group_from_proto(m: trajectory_pb2.TrajectoryGroup) -> TrajectoryGroup:
    return TrajectoryGroup(
        experiment_id=m.experiment_id,
        group_id=m.group_id,
        prompt_id=m.prompt_id,
        prompt=m.prompt,
        answer=m.answer,
        prompt_ids=list(m.prompt_ids),
        samples=[sample_from_proto(s) for s in m.samples],
        start_version=m.start_version,
        eval=m.eval,
        created_unix_ms=m.created_unix_ms,
        rollout_worker=m.rollout_worker,
        epoch=m.epoch,
    )


def group_to_bytes(g: TrajectoryGroup) -> bytes:
    return group_to_proto(g).SerializeToString()


def group_from_bytes(data: bytes) -> TrajectoryGroup:
    return group_from_proto(trajectory_pb2.TrajectoryGroup.FromString(data))
