"""Poison on an experiment's trajectory stream, published with a plain NATS client that holds
the scheduler's credentials: the harness plays an attacker who has credentials, and the
scheduler's may both read a stored group back and publish on the train subject.

Four kinds, each built from a real group the rollout published (read back from the stream):
garbage bytes, a group of a foreign experiment, a group whose arrays do not line up (logprobs
shorter than output_ids), and a replay of a group already trained (under a new message id, so
JetStream's dedup does not catch it and the trainer has to).
"""

from __future__ import annotations

import random

from asyncrl.natsutil import STREAM, connect, train_subject
from asyncrl.v1 import trajectory_pb2

KINDS = ("garbage", "foreign", "misaligned", "replay")


async def _group(js, subject: str, first: bool) -> tuple[bytes, trajectory_pb2.TrajectoryGroup]:
    """The first (oldest) or the last group published on `subject`."""
    if first:
        msg = await js.get_msg(STREAM, seq=1, subject=subject, next=True)
    else:
        msg = await js.get_last_msg(STREAM, subject)
    group = trajectory_pb2.TrajectoryGroup()
    group.ParseFromString(msg.data)
    return msg.data, group


def garbage(rng: random.Random) -> bytes:
    return b"\xff\xfechaos" + rng.randbytes(64)


def foreign(group: trajectory_pb2.TrajectoryGroup) -> bytes:
    group.experiment_id = "chaos-foreign"
    group.group_id = f"chaos-foreign-{group.group_id}"
    return group.SerializeToString()


def misaligned(group: trajectory_pb2.TrajectoryGroup) -> bytes:
    group.group_id = f"{group.group_id}-misaligned"
    del group.samples[0].logprobs[len(group.samples[0].logprobs) // 2 :]
    return group.SerializeToString()


async def publish(nats_url: str, experiment_id: str, kind: str, rng: random.Random) -> str:
    """Publish one poison message of `kind` on the experiment's train subject; returns what was
    sent (for the run's record)."""
    nc = await connect(nats_url, identity="scheduler", connect_timeout=5, max_reconnect_attempts=5)
    try:
        js = nc.jetstream(timeout=10)
        subject = train_subject(experiment_id)
        raw, group = await _group(js, subject, first=kind == "replay")
        if kind == "garbage":
            data, what = garbage(rng), "garbage bytes"
        elif kind == "foreign":
            data, what = foreign(group), f"group {group.group_id} of chaos-foreign"
        elif kind == "misaligned":
            data, what = misaligned(group), f"group {group.group_id}, logprobs cut"
        else:
            data, what = raw, f"replay of {group.group_id}"
        msg_id = f"chaos-{kind}-{rng.getrandbits(48):x}"
        await js.publish(subject, data, headers={"Nats-Msg-Id": msg_id})
        return what
    finally:
        await nc.close()
