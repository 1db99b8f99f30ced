"""GenerateGroups in terms of one group's coroutine (`answer_groups`): every group answered
once, what finishes together in one message, a group's own failure its summary's error."""

from __future__ import annotations

import asyncio

import grpc

from asyncrl.errors import BadRequest
from asyncrl.v1 import rollout_pb2
from services.rollout.server import GroupCallError, answer_groups


def _request(*ids: str) -> rollout_pb2.GenerateGroupsRequest:
    return rollout_pb2.GenerateGroupsRequest(
        groups=[rollout_pb2.GenerateGroupRequest(group_id=g) for g in ids]
    )


async def test_groups_finishing_together_share_a_message_each_answered_once():
    gate = asyncio.Event()

    async def one(group):
        if group.group_id == "late":
            await gate.wait()
        return rollout_pb2.GroupSummary(group_id=group.group_id)

    messages = []
    async for message in answer_groups(_request("a", "b", "late"), one):
        messages.append([s.group_id for s in message.summaries])
        gate.set()
    assert messages == [["a", "b"], ["late"]]


async def test_a_failing_group_is_answered_with_its_error_others_go_on():
    async def one(group):
        gid = group.group_id
        if gid == "fault":
            raise GroupCallError(grpc.StatusCode.UNAVAILABLE, "reward down", "reward-unavailable")
        if gid == "bad":
            raise BadRequest("group_id", "required")
        if gid == "inner":
            raise asyncio.CancelledError  # cancelled from inside, not by the call
        return rollout_pb2.GroupSummary(group_id=gid)

    got = {}
    async for message in answer_groups(_request("ok", "fault", "bad", "inner"), one):
        got.update({s.group_id: s for s in message.summaries})
    assert not got["ok"].HasField("error")
    errors = {g: (s.error.code, s.error.fault) for g, s in got.items() if g != "ok"}
    assert errors == {
        "fault": (grpc.StatusCode.UNAVAILABLE.value[0], "reward-unavailable"),
        "bad": (grpc.StatusCode.INVALID_ARGUMENT.value[0], ""),
        "inner": (grpc.StatusCode.CANCELLED.value[0], ""),
    }
    assert "group_id" in got["bad"].error.details


async def test_leaving_early_cancels_the_groups_still_running():
    started, cancelled = [], []

    async def one(group):
        started.append(group.group_id)
        if group.group_id == "slow":
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.append(group.group_id)
                raise
        return rollout_pb2.GroupSummary(group_id=group.group_id)

    stream = answer_groups(_request("fast", "slow"), one)
    first = await anext(stream)
    assert [s.group_id for s in first.summaries] == ["fast"]
    await stream.aclose()  # what the call being cancelled does to the handler
    assert started == ["fast", "slow"] and cancelled == ["slow"]
