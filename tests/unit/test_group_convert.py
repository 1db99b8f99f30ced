"""asyncrl.convert: reward statuses to and from the proto enum."""

from asyncrl.convert import status_from_proto, status_to_proto
from asyncrl.types import RewardStatus
from asyncrl.v1 import common_pb2


def test_every_status_round_trips_through_its_proto_value():
    assert status_to_proto(RewardStatus.OK) == common_pb2.REWARD_STATUS_OK
    assert status_to_proto(RewardStatus.FAILED) == common_pb2.REWARD_STATUS_FAILED
    for status in RewardStatus:
        assert status_from_proto(status_to_proto(status)) is status


def test_unset_or_unknown_status_reads_as_failed_never_ok():
    assert status_from_proto(common_pb2.REWARD_STATUS_UNSPECIFIED) is RewardStatus.FAILED
    assert status_from_proto(99) is RewardStatus.FAILED  # a newer peer's value: raised before
