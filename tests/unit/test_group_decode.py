"""asyncrl.convert, the from-proto direction: what the trainer decodes from every message."""

from asyncrl.convert import group_from_bytes, group_from_proto, group_to_bytes, sample_from_proto
from asyncrl.types import RewardStatus, Sample, TrajectoryGroup
from asyncrl.v1 import trajectory_pb2


def _group() -> TrajectoryGroup:
    """Every field set, each str field to its own value: a swap of two fields would show."""
    return TrajectoryGroup(
        experiment_id="exp",
        group_id="group",
        prompt_id="prompt-id",
        prompt="prompt text",
        answer="answer",
        prompt_ids=[7, 8, 9],
        samples=[
            Sample(
                output_ids=[1, 2, 3],
                logprobs=[-0.5, 0.0, -1.5],
                versions=[4, 4, 5],
                finish_reason="length",
                reward=0.25,
                reward_status=RewardStatus.FAILED,
                reward_reason="reason",
                text="text",
                loss_mask=[1, 0, 1],
            ),
            Sample(output_ids=[6], logprobs=[-2.0], versions=[5], reward=1.0),
        ],
        start_version=4,
        eval=True,
        created_unix_ms=1_700_000_000_123,
        rollout_worker="worker",
        epoch=2,
    )


def test_group_from_bytes_every_field_set_equals_the_original():
    g = _group()
    assert group_from_bytes(group_to_bytes(g)) == g


def test_group_from_bytes_lists_are_plain_lists_detached_from_the_message():
    m = trajectory_pb2.TrajectoryGroup.FromString(group_to_bytes(_group()))
    g = group_from_proto(m)
    lists = [g.prompt_ids, g.samples]
    lists += [getattr(s, f) for s in g.samples for f in ("output_ids", "logprobs", "versions")]
    lists.append(g.samples[0].loss_mask)
    assert all(type(x) is list for x in lists)
    g.samples[0].output_ids.append(99)
    g.prompt_ids.append(99)
    assert m.samples[0].output_ids == [1, 2, 3] and m.prompt_ids == [7, 8, 9]


def test_sample_from_proto_unknown_status_reads_as_failed():
    s = sample_from_proto(trajectory_pb2.Sample(output_ids=[1], reward_status=99))
    assert s.reward_status is RewardStatus.FAILED
    assert s.turns == 0
