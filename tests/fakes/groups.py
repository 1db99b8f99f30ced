"""A one-token trajectory group, for the tests of what carries groups (JetStream, the ledger,
the trainer's consumer) rather than what is in them."""

from __future__ import annotations

from asyncrl.types import Sample, TrajectoryGroup

EXP = "exp1"


def tiny_group(group_id: str, experiment_id: str = EXP) -> TrajectoryGroup:
    """One sample of one token (id 2, logprob -1, version 0) for prompt token 1."""
    return TrajectoryGroup(
        experiment_id=experiment_id,
        group_id=group_id,
        prompt_id="p",
        prompt="q",
        answer="a",
        prompt_ids=[1],
        samples=[Sample(output_ids=[2], logprobs=[-1.0], versions=[0])],
    )
