"""asyncrl.convert: reward statuses to and from the proto enum; groups to the wire."""

from asyncrl.convert import (
    group_from_bytes,
    group_to_bytes,
    sample_to_proto,
    status_from_proto,
    status_to_proto,
)
from asyncrl.types import RewardStatus, Sample, TrajectoryGroup
from asyncrl.v1 import common_pb2, trajectory_pb2


def test_every_status_round_trips_through_its_proto_value():
    assert status_to_proto(RewardStatus.OK) == common_pb2.REWARD_STATUS_OK
    assert status_to_proto(RewardStatus.FAILED) == common_pb2.REWARD_STATUS_FAILED
    for status in RewardStatus:
        assert status_from_proto(status_to_proto(status)) is status


def test_unset_or_unknown_status_reads_as_failed_never_ok():
    assert status_from_proto(common_pb2.REWARD_STATUS_UNSPECIFIED) is RewardStatus.FAILED
    assert status_from_proto(99) is RewardStatus.FAILED  # a newer peer's value: raised before


def _reference(s: Sample) -> trajectory_pb2.Sample:
    """The sample as the keyword constructor encodes it (what group_to_proto did before)."""
    return trajectory_pb2.Sample(
        output_ids=s.output_ids,
        logprobs=s.logprobs,
        versions=s.versions,
        finish_reason=s.finish_reason,
        reward=s.reward or 0.0,
        reward_status=status_to_proto(s.reward_status),
        reward_reason=s.reward_reason,
        text=s.text,
        loss_mask=[] if all(s.trained_mask()) else s.loss_mask,
    )


def test_group_to_bytes_every_kind_of_sample_same_bytes_as_the_constructors():
    samples = [
        Sample([1, 2, 3], [-0.5, 0.0, -1.5], [4, 4, 300], "length", 0.25, RewardStatus.FAILED),
        Sample([5, 6], [-1.0, -2.0], [5, 5], "stop", 1.0, text="ok", loss_mask=[1, 1]),
        Sample([7, 8], [-3.0, 0.0], [6, 6], reward=None, reward_reason="r", loss_mask=[1, 0]),
        Sample(),
    ]
    header = dict(
        experiment_id="exp",
        group_id="exp-g1-a0",
        prompt_id="p1",
        prompt="1+1=",
        answer="2",
        prompt_ids=[9, 10],
        start_version=4,
        eval=True,
        created_unix_ms=1_700_000_000_123,
        rollout_worker="worker",
        epoch=3,
    )
    reference = trajectory_pb2.TrajectoryGroup(samples=[_reference(s) for s in samples], **header)
    assert group_to_bytes(TrajectoryGroup(samples=samples, **header)) == (
        reference.SerializeToString()
    )
    for s in samples:
        assert sample_to_proto(s) == _reference(s)
    decoded = group_from_bytes(group_to_bytes(TrajectoryGroup(samples=samples, **header)))
    assert [s.loss_mask for s in decoded.samples] == [[], [], [1, 0], []]
    assert decoded.samples[2].reward == 0.0 and decoded.samples[2].reward_reason == "r"
